"""A skipped step (stats[SKIP] set: a non-finite gradient) writes nothing: every compact buffer
(param, master, moments, int8 / int4 codes and scales, step) and the grad keep their bits, on every backend's
update (with a grad scale and a rounding seed given) and through the optimizer."""
import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused._batch import Hyper
from helpers import BLOCKWISE, OPT_MODES, UPDATE_MODES, assert_bitwise_equal, assert_same_state, clone_compact, feed, opt_params
from helpers import run_steps, same_bits, snapshot

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,size", UPDATE_MODES)
def test_skipped_step_writes_nothing(kernel, param_dtype, master_weights, state_dtype, size):
    entry = kernel.entry(kernel.size(size, state_dtype), param_dtype, master_weights, state_dtype, amsgrad=True)
    before = clone_compact(entry)
    kernel.step([entry], amsgrad=True, skip=1.0, grad_scale=torch.tensor(8.0, device=kernel.device), rounding_seed=5)
    kernel.sync()
    assert_same_state(entry, before, "skipped")
    same_bits(entry[1], before[1], "grad")


def test_skipped_step_leaves_every_buffer_of_a_mixed_launch(kernel):
    """Every mode in one call: nothing of any tensor is written."""
    modes = [m.values[:3] for m in UPDATE_MODES if m.values[3] == "n"]
    entries = [kernel.entry(C.SMALL_TENSOR_NUMEL + 300 if sd in BLOCKWISE else 5000, dt, mw, sd, amsgrad=True, seed=20 + i)
               for i, (dt, mw, sd) in enumerate(modes)]
    before = [clone_compact(e) for e in entries]
    kernel.step(entries, hypers=[Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)], skip=1.0,
                grad_scale=torch.tensor([8.0], device=kernel.device), rounding_seed=123)
    kernel.sync()
    for i, (entry, old) in enumerate(zip(entries, before)):
        assert_same_state(entry, old, f"tensor {i}")
        same_bits(entry[1], old[1], f"tensor {i} grad")


# ------------------------------------------------------------------ through the optimizer


@pytest.mark.parametrize("master_weights,state_dtype", OPT_MODES)
def test_skipped_step_keeps_every_compact_buffer_bitwise(backend, master_weights, state_dtype):
    params = opt_params()
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, amsgrad=True, max_grad_norm=1.0, master_weights=master_weights,
                                 state_dtype=state_dtype, stochastic_rounding=state_dtype is torch.bfloat16,
                                 backend=backend)
    run_steps(opt, params, 2, bad_steps=())
    before = snapshot(opt, params)
    feed(opt, params, 99, bad=True)
    grads = [p.grad.clone() for p in params]
    opt.step()
    assert opt.step_skipped.item() == 1.0
    assert_bitwise_equal(before, snapshot(opt, params))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # still scaled, as torch leaves them

