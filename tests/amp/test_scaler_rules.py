"""ampfused.GradScaler's device-side update: torch's trajectory, hysteresis, min_scale, checkpoints."""
import math

import pytest
import torch

import ampfused
from helpers import scaler_steps

PATTERN = [0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def expected_trajectory(pattern, init, growth, backoff, interval, hysteresis, min_scale):
    """The rules of the class docstring, in plain Python."""
    scale, good, left, out = init, 0, hysteresis, []
    for found in pattern:
        if found:
            good, left = 0, left - 1
            if left <= 0:
                scale = max(scale * backoff, min_scale or 0.0)
        else:
            good += 1
            if good == interval:
                good, left, scale = 0, hysteresis, scale * growth
        out.append(scale)
    return out


KW = dict(init_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def test_default_rules_are_torchs(backend, device):
    stock = scaler_steps(torch.amp.GradScaler(device.type, **KW), PATTERN, backend, device, optimizer_cls=torch.optim.AdamW).scales
    ours = scaler_steps(ampfused.GradScaler(device.type, **KW), PATTERN, backend, device).scales
    assert ours == stock == expected_trajectory(PATTERN, 2.0**6, 2.0, 0.5, 3, 1, None)


@pytest.mark.parametrize("hysteresis,min_scale", [(2, None), (3, None), (1, 8.0), (2, 16.0)])
def test_hysteresis_and_min_scale(backend, device, hysteresis, min_scale):
    scaler = ampfused.GradScaler(device.type, **KW, hysteresis=hysteresis, min_scale=min_scale)
    scales = scaler_steps(scaler, PATTERN, backend, device).scales
    assert scales == expected_trajectory(PATTERN, 2.0**6, 2.0, 0.5, 3, hysteresis, min_scale)
    assert scaler.skipped_steps == sum(PATTERN)
    if min_scale:
        assert min(scales) == min_scale


def test_state_dict_round_trip_and_torch_interop(backend, device):
    scaler = ampfused.GradScaler(device.type, **KW, hysteresis=3, min_scale=4.0)
    scaler_steps(scaler, PATTERN[:8], backend, device)
    state = scaler.state_dict()
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
                "hysteresis", "min_scale", "_hysteresis_tracker", "skipped_steps"):
        assert key in state
    resumed = ampfused.GradScaler(device.type)
    resumed.load_state_dict(state)
    assert scaler_steps(resumed, PATTERN[8:], backend, device).scales == scaler_steps(scaler, PATTERN[8:], backend, device).scales
    assert resumed.skipped_steps == scaler.skipped_steps

    stock = torch.amp.GradScaler(device.type, **KW)
    scaler_steps(stock, PATTERN[:5], backend, device, optimizer_cls=torch.optim.AdamW)
    from_torch = ampfused.GradScaler(device.type)
    from_torch.load_state_dict(stock.state_dict())
    assert from_torch.get_scale() == stock.get_scale() and from_torch._hysteresis == 1
    torch.amp.GradScaler(device.type).load_state_dict(state)  # torch reads its own keys and ignores ours


def test_disabled_scaler_is_a_pass_through(backend, device):
    scaler = ampfused.GradScaler(device.type, enabled=False)
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = ampfused.FusedAmpAdamW([p], backend=backend)
    loss = p.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert opt.state[p]["step"].item() == 1 and scaler.state_dict() == {}


@pytest.mark.parametrize("kwargs,match", [
    (dict(hysteresis=0), "hysteresis"), (dict(hysteresis=1.5), "hysteresis"),
    (dict(min_scale=-1.0), "min_scale"), (dict(min_scale=2.0**20), "min_scale"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ampfused.GradScaler("cpu", **kwargs)


def drive_random(scaler, pattern, make_opt, device, new_scale_at=None):
    """Like helpers.scaler_steps, with gradients whose unscaled values are inexact products (x * (1/S) rounds),
    and a user-set scale (update(new_scale)) at step new_scale_at. Returns the scales, the steps
    taken per step and the final param."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(257, generator=gen).to(device))
    weights = torch.randn(8, 257, generator=gen).to(device)
    opt = make_opt([p])
    scales, taken = [], []
    for i, found in enumerate(pattern):
        opt.zero_grad()
        scaler.scale((p * weights[i % 8]).sum() * 1.37).backward()
        if found:
            p.grad[5] = math.nan if i % 2 else math.inf
        before = p.detach().clone()
        scaler.step(opt)
        if new_scale_at is not None and i == new_scale_at:
            scaler.update(new_scale=777.7)
        else:
            scaler.update()
        scales.append(scaler.get_scale())
        taken.append(not torch.equal(before, p.detach()))
    return scales, taken, p.detach().cpu()


@pytest.mark.parametrize("kwargs", [
    dict(init_scale=1000.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2),
    dict(init_scale=2.0**10, growth_factor=1.5, backoff_factor=0.3, growth_interval=2),
    dict(init_scale=1000.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=1),
])
@pytest.mark.parametrize("new_scale_at", [None, 3])
def test_non_power_of_two_scales_take_every_finite_step(backend, device, kwargs, new_scale_at):
    """A scale whose reciprocal is inexact must not flag finite grads (a contracted `u - u`
    did, on the GPU) and must keep growing after an inexact product (`grown - grown == 0` did not):
    the trajectory is torch.amp.GradScaler's exactly, every finite step is taken, as stock AdamW."""
    stock = drive_random(torch.amp.GradScaler(device.type, **kwargs), PATTERN, torch.optim.AdamW, device, new_scale_at)
    ours_scaler = ampfused.GradScaler(device.type, **kwargs)
    ours = drive_random(ours_scaler, PATTERN, lambda ps: ampfused.FusedAmpAdamW(ps, backend=backend), device, new_scale_at)
    reference = drive_random(ampfused.GradScaler(device.type, **kwargs), PATTERN,
                             lambda ps: ampfused.FusedAmpAdamW(ps, backend="reference"), device, new_scale_at)
    assert ours[0] == stock[0] == reference[0]
    assert ours[1] == stock[1] == [not found for found in PATTERN]
    assert ours_scaler.skipped_steps == sum(PATTERN)
    assert len(set(ours[0])) > 3  # the scale did move: grown, backed off, set by the user
    torch.testing.assert_close(ours[2], stock[2], rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[2], reference[2]) or backend != "reference"
