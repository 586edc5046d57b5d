"""model.to(memory_format=torch.channels_last) mid-run: the fp32 gradient storage follows at the first
gradient (no "gradient layout contract" warning on the next micro-batches) and the results equal
torch.optim.AdamW on fp32 masters fed the same fp32-summed bf16 gradients."""
import warnings

import pytest
import torch

import ampfused
from helpers import tol


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2)).to(torch.bfloat16)


def micro_batches(step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(2, 3, 6, 6, generator=g).to(torch.bfloat16) for _ in range(3)]


@pytest.mark.parametrize("clear", ["none", "zeros"])
def test_channels_last_mid_run_no_layout_warning_and_torch_results(backend, clear):
    model, twin = make_model(), make_model()
    masters = [p.detach().float().clone() for p in twin.parameters()]
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
    ref = torch.optim.AdamW(masters, lr=1e-2)
    for step in range(4):
        if step == 2:
            model.to(memory_format=torch.channels_last)
            twin.to(memory_format=torch.channels_last)
        sums = [torch.zeros_like(q) for q in masters]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in micro_batches(step):
                model(x).float().square().sum().backward()
                twin(x).float().square().sum().backward()
                for total, p in zip(sums, twin.parameters()):
                    total += p.grad.float()
                twin.zero_grad()
        layout = [str(w.message) for w in caught if "layout contract" in str(w.message)]
        assert not layout, f"step {step}: {layout[0]}"
        for p, total in zip(model.parameters(), sums):
            assert p.grad.stride() == p.stride(), "the fp32 gradient must have the param's memory format"
            torch.testing.assert_close(p.grad, total, rtol=0, atol=0)
        for q, total in zip(masters, sums):
            q.grad = total
        opt.step(), ref.step()
        opt.zero_grad(set_to_none=clear == "none"), ref.zero_grad()
        with torch.no_grad():
            for p, q in zip(twin.parameters(), masters):
                p.copy_(q)
    for p, q in zip(model.parameters(), masters):
        state, expected = opt.state[p], ref.state[q]
        torch.testing.assert_close(state["master_param"], q, **tol(backend))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(state[key], expected[key], **tol(backend))
