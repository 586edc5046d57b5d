"""The step plan holds the grads it checked only weakly between steps: zero_grad(set_to_none=True)
frees them, as with torch's optimizers, and a later step still takes new grads and refuses bad ones."""
import gc
import weakref

import pytest
import torch

import ampfused
from helpers import DEVICE, assert_states_close, available_backends

BACKENDS = available_backends()


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, device=DEVICE)) for n in (64, 33)]


def _set_grads(params, k):
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.01 * (k + 1) * (i + 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_grad_frees_the_last_steps_grads(backend):
    params = _params()
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    _set_grads(params, 0)
    refs = [weakref.ref(p.grad) for p in params]
    opt.step()
    opt.zero_grad()
    gc.collect()
    assert all(r() is None for r in refs), "the optimizer kept a gradient alive after zero_grad()"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_grads_after_release_train_as_reference(backend):
    params, ref_params = _params(), _params()
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    ref = ampfused.FusedAmpAdamW(ref_params, backend="reference")
    for k in range(4):
        _set_grads(params, k)
        _set_grads(ref_params, k)
        if k == 2:  # the same grad tensors twice in a row (the identity path after a release)
            opt.step()
            ref.step()
        opt.step()
        ref.step()
        if k != 1:  # one step keeps its grads: the plan then sees the same tensors again
            opt.zero_grad()
            ref.zero_grad()
    assert_states_close(ref, ref_params, opt, params, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fresh_grad_of_another_dtype_is_still_refused(backend):
    params = _params()
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    _set_grads(params, 0)
    opt.step()
    opt.zero_grad()
    params[0].grad_dtype = None  # torch refuses the assignment otherwise
    params[0].grad = torch.zeros_like(params[0], dtype=torch.float64)
    params[1].grad = torch.zeros_like(params[1])
    before = [p.detach().clone() for p in params]
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        opt.step()
    for b, p in zip(before, params):
        assert torch.equal(b, p), "a refused step wrote a param"
