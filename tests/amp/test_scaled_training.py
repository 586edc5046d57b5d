"""Scaled training with injected overflows and clipping vs the stock torch.amp path (DESIGN §2.1-§2.3)."""
import math

import pytest
import torch

import ampfused
from helpers import assert_states_close, mlp

STEPS = 24
OVERFLOW_STEPS = {3: math.inf, 7: math.nan, 8: -math.inf, 15: math.inf}
GROWTH_INTERVAL = 3
TRAINING_TOL = dict(rtol=1e-5, atol=1e-6)


WIDTHS = (16, 32, 8)


def overflowing_backward(model, scaler, step, device):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(12, 16, generator=g).to(device), torch.randn(12, 8, generator=g).to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if step in OVERFLOW_STEPS:
        with torch.no_grad():
            model[0].weight.grad[1, 2] = OVERFLOW_STEPS[step]


def train_scaled(mode, backend, device, clip):
    """mode: stock | ours | ours_unscale | torch_scaler_ours | torch_scaler_unscale_ours.

    Returns (model, opt, scales, norms, scaler)."""
    model = mlp(*WIDTHS, device=device)
    kw = dict(init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    if mode == "stock":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler(device.type, **kw)
    else:
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=clip, backend=backend)
        scaler = (torch.amp.GradScaler if mode.startswith("torch_scaler") else ampfused.GradScaler)(device.type, **kw)
    scales, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        overflowing_backward(model, scaler, step, device)
        if mode == "stock":
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf))
        elif mode in ("ours_unscale", "torch_scaler_unscale_ours"):
            scaler.unscale_(opt)  # afterwards the scaler hands the optimizer grad_scale=None
        scaler.step(opt)
        scaler.update()
        if mode != "stock":
            norms.append(opt.grad_norm.clone())
        scales.append(scaler.get_scale())
    return model, opt, scales, norms, scaler


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("mode", ["ours", "ours_unscale", "torch_scaler_ours", "torch_scaler_unscale_ours"])
def test_matches_stock_gradscaler_path(backend, device, mode, clip):
    ref_model, ref_opt, ref_scales, ref_norms, _ = train_scaled("stock", backend, device, clip)
    model, opt, scales, norms, scaler = train_scaled(mode, backend, device, clip)
    assert scales == ref_scales, "scale trajectory differs"
    ref_params, params = list(ref_model.parameters()), list(model.parameters())
    for pr, pa in zip(ref_params, params):
        assert ref_opt.state[pr]["step"].item() == opt.state[pa]["step"].item() == STEPS - len(OVERFLOW_STEPS)
    assert_states_close(ref_opt, ref_params, opt, params, backend="training", keys=("exp_avg", "exp_avg_sq"))
    for step, (rn, n) in enumerate(zip(ref_norms, norms)):
        if step in OVERFLOW_STEPS:
            assert not torch.isfinite(n), f"step {step}: grad_norm must be non-finite on a skipped step"
        else:
            torch.testing.assert_close(n.cpu(), rn.cpu(), rtol=1e-5, atol=0, msg=f"grad_norm at step {step}")
    if isinstance(scaler, ampfused.GradScaler):
        assert scaler.skipped_steps == len(OVERFLOW_STEPS)


def test_fused_optimizer_runs_no_extra_inf_check(backend, device, monkeypatch):
    """With FusedAmpAdamW, ampfused.GradScaler leaves inf detection to the optimizer's stats pass."""
    def forbidden(*args, **kwargs):
        raise AssertionError("an extra inf-check pass over the grads ran")

    monkeypatch.setattr(torch.amp.GradScaler, "_check_inf_per_device", forbidden)
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", forbidden)
    model = mlp(*WIDTHS, device=device)
    opt = ampfused.FusedAmpAdamW(model.parameters(), backend=backend)
    scaler = ampfused.GradScaler(device.type, init_scale=4.0)
    for step in (0, 3):  # a clean step, then an overflow
        opt.zero_grad()
        overflowing_backward(model, scaler, step, device)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 and scaler.skipped_steps == 1


def test_with_other_optimizers_it_is_torchs_scaler(device):
    results = []
    for cls in (torch.amp.GradScaler, ampfused.GradScaler):
        model = mlp(*WIDTHS, device=device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls(device.type, init_scale=2.0**8, growth_interval=2)
        for step in range(10):
            opt.zero_grad()
            overflowing_backward(model, scaler, step, device)
            scaler.step(opt)
            scaler.update()
            results.append(scaler.get_scale())
        results.append([p.detach().clone() for p in model.parameters()])
    half = len(results) // 2
    assert results[: half - 1] == results[half:-1]
    for a, b in zip(results[half - 1], results[-1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_accepts_low_precision_grads(dtype):
    p = torch.nn.Parameter(torch.zeros(5, dtype=dtype))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ampfused.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.float().sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(5, dtype=dtype))
    p.grad[0] = math.inf
    scaler2 = ampfused.GradScaler("cpu", init_scale=8.0)
    scaler2.scale(torch.ones(()))
    found = scaler2._unscale_grads_(opt, torch.full((), 0.125), torch.zeros(()), False)
    assert found[p.device].item() == 1.0


def test_unscale_covers_the_fp32_grad_of_low_precision_params(device):
    model = mlp(*WIDTHS, device=device).to(torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(model.parameters())
    scaler = ampfused.GradScaler(device.type, init_scale=16.0)
    x = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
    scaler.scale(model(x).float().sum()).backward()
    before = model[0].weight.grad.clone()
    scaler.unscale_(opt)
    assert model[0].weight.grad is model[0].weight.main_grad and model[0].weight.grad.dtype == torch.float32
    torch.testing.assert_close(model[0].weight.grad, before / 16.0, rtol=0, atol=0)
