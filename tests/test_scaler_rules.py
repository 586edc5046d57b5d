"""ampfused.GradScaler's device-side update: torch's trajectory, hysteresis, min_scale, checkpoints."""
import math

import pytest
import torch

import ampfused

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


def drive(scaler, pattern, backend, device, optimizer_cls=None):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = optimizer_cls([p], lr=0.1) if optimizer_cls else ampfused.FusedAmpAdamW([p], lr=0.1, backend=backend)
    scales = []
    for found in pattern:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if found:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


KW = dict(init_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def test_default_rules_are_torchs(backend, device):
    stock = drive(torch.amp.GradScaler(device.type, **KW), PATTERN, backend, device, optimizer_cls=torch.optim.AdamW)
    ours = drive(ampfused.GradScaler(device.type, **KW), PATTERN, backend, device)
    assert ours == stock == expected_trajectory(PATTERN, 2.0**6, 2.0, 0.5, 3, 1, None)


@pytest.mark.parametrize("hysteresis,min_scale", [(2, None), (3, None), (1, 8.0), (2, 16.0)])
def test_hysteresis_and_min_scale(backend, device, hysteresis, min_scale):
    scaler = ampfused.GradScaler(device.type, **KW, hysteresis=hysteresis, min_scale=min_scale)
    scales = drive(scaler, PATTERN, backend, device)
    assert scales == expected_trajectory(PATTERN, 2.0**6, 2.0, 0.5, 3, hysteresis, min_scale)
    assert scaler.skipped_steps == sum(PATTERN)
    if min_scale:
        assert min(scales) == min_scale


def test_state_dict_round_trip_and_torch_interop(backend, device):
    scaler = ampfused.GradScaler(device.type, **KW, hysteresis=3, min_scale=4.0)
    drive(scaler, PATTERN[:8], backend, device)
    state = scaler.state_dict()
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
                "hysteresis", "min_scale", "_hysteresis_tracker", "skipped_steps"):
        assert key in state
    resumed = ampfused.GradScaler(device.type)
    resumed.load_state_dict(state)
    assert drive(resumed, PATTERN[8:], backend, device) == drive(scaler, PATTERN[8:], backend, device)
    assert resumed.skipped_steps == scaler.skipped_steps

    stock = torch.amp.GradScaler(device.type, **KW)
    drive(stock, PATTERN[:5], backend, device, optimizer_cls=torch.optim.AdamW)
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
