"""Two optimizers on one bf16 model (README "Two optimizers on one bf16 model"): while a FusedAmpAdamW
with fp32 gradient accumulation is alive, ``p.grad`` is fp32, which stock torch.optim.AdamW cannot
step on a bf16 param; the two ways round that README gives both work (issue 36 item 7)."""
import pytest
import torch

import ampfused
from helpers import DEVICE

BF16 = torch.bfloat16


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).to(DEVICE, BF16)


def _backward(model):
    model(torch.randn(2, 8, device=DEVICE, dtype=BF16)).sum().backward()


def _stock_step(model):
    stock = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    assert all(p.grad.dtype == BF16 for p in model.parameters())
    stock.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "the stock step changed nothing"


def test_a_stock_adamw_beside_a_live_one_with_fp32_accumulation_fails(backend):
    """The problem the README note is about: this is what a user meets without it."""
    model = _model()
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)  # noqa: F841 -- alive beside the stock one
    stock = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _backward(model)
    assert model.weight.grad.dtype == torch.float32
    with pytest.raises(RuntimeError, match="expected dtype"):
        stock.step()


def test_without_fp32_accumulation_both_optimizers_step_the_same_model(backend):
    model = _model()
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend, fp32_grad_accumulation=False)
    _stock_step(model)
    model.zero_grad()
    _backward(model)
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight)


def test_after_zero_grad_and_del_the_stock_optimizer_steps_bf16_grads(backend):
    """Deleting the optimizer releases its gradient hooks (a finalizer); p.grad must be cleared first,
    as the fp32 gradient it left is still there otherwise."""
    model = _model()
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    _backward(model)
    opt.step()
    opt.zero_grad()
    del opt
    _stock_step(model)
    assert not hasattr(model.weight, "main_grad")
