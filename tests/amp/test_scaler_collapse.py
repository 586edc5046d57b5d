"""Loss-scale collapse is never silent: consecutive skipped steps warn, or raise on request."""
import copy
import math
import pickle
import warnings

import pytest
import torch

import ampfused
from ampfused.scaler import LossScaleCollapseError, LossScaleCollapseWarning
from helpers import scaler_steps


def test_repeated_overflows_at_min_scale_warn_with_the_count(backend, device):
    scaler = ampfused.GradScaler(device.type, init_scale=16.0, min_scale=1.0, collapse_threshold=10)
    _, per_step, opt, p = scaler_steps(scaler, [1] * 25, backend, device)
    warned_at = [i + 1 for i, ws in enumerate(per_step) if ws]
    if device.type == "cpu":
        assert warned_at == [10, 20]
    else:  # [note: lazy collapse check]: the host sees the counter one or two updates late
        assert len(warned_at) == 2 and 10 <= warned_at[0] <= 12
    message = str(per_step[warned_at[0] - 1][0].message)
    assert "were all skipped" in message and "min_scale=1, reached" in message and "raise_on_collapse" in message
    count = int(message.split("the last ")[1].split()[0])
    assert 10 <= count <= warned_at[0]
    assert scaler.get_scale() == 1.0 and scaler.consecutive_skipped_steps == 25 == scaler.skipped_steps
    assert opt.state[p]["step"].item() == 0 if opt.state[p] else True


def test_raise_on_collapse_is_opt_in(backend, device):
    scaler = ampfused.GradScaler(device.type, init_scale=4.0, min_scale=1.0, collapse_threshold=5, raise_on_collapse=True)
    with pytest.raises(LossScaleCollapseError, match=r"the last \d+ optimizer steps were all skipped"):
        scaler_steps(scaler, [1] * 10, backend, device)
    assert scaler.consecutive_skipped_steps >= 5


def test_a_good_step_resets_the_count(backend, device):
    scaler = ampfused.GradScaler(device.type, init_scale=2.0**8, min_scale=1.0, collapse_threshold=6)
    per_step = scaler_steps(scaler, ([1] * 5 + [0]) * 4, backend, device).collapse_warnings
    assert not any(per_step)
    assert scaler.consecutive_skipped_steps == 0 and scaler.skipped_steps == 20


def test_nan_loss_without_min_scale_is_not_silent(backend, device):
    """No floor: the scale halves towards 0 while a NaN loss defeats every scale."""
    scaler = ampfused.GradScaler(device.type, collapse_threshold=50)
    per_step = scaler_steps(scaler, [1] * 60, backend, device, nan_loss=True).collapse_warnings
    assert sum(map(len, per_step)) == 1
    assert "loss scale is" in str(next(w for ws in per_step for w in ws).message)


def test_collapse_check_can_be_turned_off(backend, device):
    scaler = ampfused.GradScaler(device.type, init_scale=4.0, min_scale=1.0, collapse_threshold=None, raise_on_collapse=True)
    per_step = scaler_steps(scaler, [1] * 12, backend, device).collapse_warnings
    assert not any(per_step)


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_invalid_collapse_threshold(value):
    with pytest.raises(ValueError, match="collapse_threshold"):
        ampfused.GradScaler("cpu", collapse_threshold=value)


def test_count_survives_state_dict_pickle_and_deepcopy(backend, device):
    scaler = ampfused.GradScaler(device.type, init_scale=8.0, min_scale=1.0, collapse_threshold=8)
    scaler_steps(scaler, [1] * 6, backend, device)
    state = scaler.state_dict()
    assert state["consecutive_skipped_steps"] == 6
    from_state_dict = ampfused.GradScaler(device.type, collapse_threshold=8)
    from_state_dict.load_state_dict(state)
    # each copy must carry the count by itself (only the fresh scaler gets load_state_dict)
    for resumed in (from_state_dict, pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert resumed.consecutive_skipped_steps == 6
        per_step = scaler_steps(resumed, [1] * 3, backend, device).collapse_warnings
        warned_at = [i for i, ws in enumerate(per_step) if ws]
        assert warned_at and warned_at[0] >= 1  # 6 + 2 = 8 consecutive skips
    torch.amp.GradScaler(device.type).load_state_dict(state)  # torch ignores the extra key


@pytest.mark.gpu
def test_collapse_check_never_synchronizes(backend):
    """update() with the collapse watch on must not sync: CUDA's sync debug mode turns any sync into an error."""
    device = torch.device("cuda")
    scaler = ampfused.GradScaler("cuda", init_scale=8.0, min_scale=1.0, collapse_threshold=5)
    p = torch.nn.Parameter(torch.ones(1024, device=device))
    opt = ampfused.FusedAmpAdamW([p], lr=0.1, backend=backend)
    bad = torch.tensor(math.inf, device=device)
    warned = []
    for _ in range(3):  # warm up lazy allocations (pinned buffer, event)
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            scaler.scale(p.sum() * bad).backward()
            scaler.step(opt)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scaler.update()
            warned += [step for w in caught if issubclass(w.category, LossScaleCollapseWarning)]
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert warned, "the collapse warning never came"
