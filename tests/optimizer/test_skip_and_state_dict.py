"""Skipped steps leave everything bitwise unchanged; checkpoints round-trip and interoperate."""
import copy
import math

import pytest
import torch

import ampfused
from helpers import (assert_bitwise_equal, assert_states_close, clone_params, make_params, random_grads, snapshot,
                     through_disk)

SHAPES = [(33, 5), (1025,), (1,)]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_grad_skips_the_whole_step_bitwise(backend, device, bad, dtype):
    params = make_params(SHAPES, dtype=dtype, device=device)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, amsgrad=True, max_grad_norm=1.0, backend=backend)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step)):
            p.grad = g.to(dtype)
        opt.step()
        opt.zero_grad()
    before = snapshot(opt, params)
    for p, g in zip(params, random_grads(params, 99)):
        p.grad = g.to(dtype)
    params[1].grad[517] = bad  # one element of one param, no scaler involved
    opt.step()
    assert not torch.isfinite(opt.grad_norm)
    if dtype != torch.float32:
        params[1].main_grad.zero_()  # the poisoned accumulator itself is not state; compare the rest
    assert_bitwise_equal(before, snapshot(opt, params))
    opt.zero_grad()
    for p, g in zip(params, random_grads(params, 100)):
        p.grad = g.to(dtype)
    opt.step()
    assert torch.isfinite(opt.grad_norm) and opt.state[params[0]]["step"].item() == 4


def _train(opt, params, steps, seed0=0):
    for step in range(steps):
        for p, g in zip(params, random_grads(params, seed0 + step)):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_through_torch_save(backend, device, dtype):
    params = make_params(SHAPES, dtype=dtype, device=device)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, amsgrad=True, backend=backend)
    _train(opt, params, 4)
    saved = through_disk({"params": [p.detach() for p in params], "opt": opt.state_dict()})

    restored_params = [p.clone().requires_grad_() for p in saved["params"]]
    restored = ampfused.FusedAmpAdamW(restored_params, lr=0.5, backend=backend)
    restored.load_state_dict(saved["opt"])
    assert restored.param_groups[0]["lr"] == 1e-2 and restored.param_groups[0]["amsgrad"] is True
    for p in restored_params:
        for key, value in restored.state[p].items():
            assert value.dtype == torch.float32, f"{key} must stay fp32 for {dtype} params"
    _train(opt, params, 3, seed0=10)
    _train(restored, restored_params, 3, seed0=10)
    assert_states_close(opt, params, restored, restored_params, backend, keys=("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"))
    for p, q in zip(params, restored_params):
        assert torch.equal(p, q) or backend != "reference"


def test_torch_adamw_state_dict_loads_into_fused(backend, device):
    base = make_params(SHAPES, device=device)
    torch_params, amp_params = clone_params(base), clone_params(base)
    ref = torch.optim.AdamW(torch_params, lr=1e-2)
    _train(ref, torch_params, 3)
    amp_params = clone_params(torch_params)
    amp = ampfused.FusedAmpAdamW(amp_params, backend=backend)
    amp.load_state_dict(ref.state_dict())
    _train(ref, torch_params, 3, seed0=5)
    _train(amp, amp_params, 3, seed0=5)
    assert_states_close(ref, torch_params, amp, amp_params, backend)


def test_torch_adamw_state_dict_creates_master_weights(backend, device):
    params = make_params(SHAPES, dtype=torch.bfloat16, device=device)
    ref = torch.optim.AdamW(clone_params(params), lr=1e-2)
    _train(ref, ref.param_groups[0]["params"], 2)
    amp = ampfused.FusedAmpAdamW(params, backend=backend)
    amp.load_state_dict(ref.state_dict())
    for p in params:
        assert torch.equal(amp.state[p]["master_param"], p.detach().float())
        assert amp.state[p]["exp_avg"].dtype == torch.float32 and amp.state[p]["step"].item() == 2


def test_fused_state_dict_loads_into_torch_adamw(backend, device):
    base = make_params(SHAPES, device=device)
    amp_params = clone_params(base)
    amp = ampfused.FusedAmpAdamW(amp_params, lr=1e-2, backend=backend)
    _train(amp, amp_params, 3)
    torch_params = clone_params(amp_params)
    ref = torch.optim.AdamW(torch_params)
    # deepcopy: torch's load_state_dict keeps tensors that need no cast by reference
    ref.load_state_dict(copy.deepcopy(amp.state_dict()))
    assert ref.param_groups[0]["lr"] == 1e-2
    _train(ref, torch_params, 3, seed0=5)
    _train(amp, amp_params, 3, seed0=5)
    assert_states_close(ref, torch_params, amp, amp_params, backend)


def test_load_state_dict_validates_before_writing(backend, device):
    params = make_params(SHAPES, device=device)
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    _train(opt, params, 2)
    before = snapshot(opt, params)
    other = make_params([(33, 5), (1024,), (1,)], device=device)
    other_opt = ampfused.FusedAmpAdamW(other, backend=backend)
    _train(other_opt, other, 1)
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(other_opt.state_dict())
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    sgd = torch.optim.SGD(clone_params(params), momentum=0.9)
    _train(sgd, sgd.param_groups[0]["params"], 1)
    with pytest.raises(ValueError, match="not an AdamW state"):
        opt.load_state_dict(sgd.state_dict())
    assert_bitwise_equal(before, snapshot(opt, params))
    assert opt.param_groups[0]["lr"] == 1e-3


def test_schedulers_including_one_cycle_betas(backend, device):
    base = make_params(SHAPES, device=device)
    runs = []
    for cls in (torch.optim.AdamW, ampfused.FusedAmpAdamW):
        params = clone_params(base)
        kwargs = {} if cls is torch.optim.AdamW else {"backend": backend}
        opt = cls(params, lr=1e-2, **kwargs)
        one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=30)
        for step in range(20):
            for p, g in zip(params, random_grads(params, step)):
                p.grad = g
            opt.step()
            one_cycle.step()
        runs.append((opt, params))
        assert opt.param_groups[0]["betas"][0] != 0.9 or step == 0
    assert_states_close(runs[0][0], runs[0][1], runs[1][0], runs[1][1], backend)
    assert runs[0][0].param_groups[0]["betas"] == runs[1][0].param_groups[0]["betas"]
