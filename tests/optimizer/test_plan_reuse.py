"""The step plan, kept while params, grads and state are unchanged: it holds no grad between steps
(zero_grad(set_to_none=True) frees them, as with torch's optimizers), a later step still takes new
grads and refuses bad ones, a changed layout or state rebuilds it, and a warm step costs no Python call
per tensor."""
import contextlib
import gc
import math
import sys
import weakref

import pytest
import torch

import ampfused
from helpers import DEVICE, assert_params_close, assert_states_close, available_backends, tol

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
        if k == 2:  # the same grad tensors twice in a row
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
    def float64_grad(opt, params):
        opt.zero_grad()
        params[0].grad_dtype = None  # torch refuses the assignment otherwise
        params[0].grad = torch.zeros_like(params[0], dtype=torch.float64)
        params[1].grad = torch.zeros_like(params[1])

    _refused_after_a_warm_step(backend, float64_grad, errors=(RuntimeError, TypeError, ValueError))


def _transposed_memory(t):
    """``t``'s values in column-major memory: same shape, other strides."""
    return t.t().contiguous().t()


def _steps_as_reference(backend, shape, set_grad, before_step=lambda step, p: None):
    """Three steps of one param of ``shape`` on ``backend`` and on ``reference``, ``set_grad(step, p,
    grad)`` giving each step's gradient and ``before_step`` changing the param first; states compared."""
    runs = []
    for name in ("reference", backend):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(*shape, device=DEVICE))
        opt = ampfused.FusedAmpAdamW([p], lr=1e-2, backend=name)
        for step in range(3):
            before_step(step, p)
            set_grad(step, p, torch.arange(p.numel(), dtype=torch.float32, device=DEVICE).view(shape) * (step + 1) / p.numel())
            opt.step()
        runs.append((opt, [p]))
    (ref, ref_params), (opt, params) = runs
    assert_states_close(ref, ref_params, opt, params, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grad_given_other_strides_in_place_steps_as_reference(backend):
    """``p.grad.data = ...`` keeps the grad tensor but may change its strides: the plan reads its
    layout again, the step re-lays it out, and the kernels never read it as flat memory in the old order."""
    def set_grad(step, p, grad):
        if step == 0:
            p.grad = grad
        else:  # the same grad tensor, new values in column-major memory
            p.grad.data = _transposed_memory(grad)

    _steps_as_reference(backend, (4, 6), set_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_transposed_in_place_at_the_same_address_steps_as_reference(backend):
    """``p.data = p.data.t()`` on a square param keeps its address but changes its strides: the plan
    is rebuilt (the state follows the new layout) instead of reading it as flat memory in the old order."""
    def transpose_once(step, p):
        if step == 1:
            address = p.data_ptr()
            p.data = p.data.t()
            assert p.data_ptr() == address

    def set_grad(step, p, grad):
        p.grad = grad

    _steps_as_reference(backend, (5, 5), set_grad, transpose_once)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kept_scratch_reads_a_strided_grad_through_a_copy_at_every_step(backend):
    """The functional core with one Scratch over several steps (what the optimizer does) and a grad
    whose strides differ from its param's: each step reads it through a laid-out copy and writes the
    unscaled gradient back into it, as the reference passes do."""
    from ampfused import _backends, functional, reference
    from ampfused._batch import Batch, Hyper

    results = []
    for module in (reference, _backends.resolve(backend, DEVICE)[0]):
        torch.manual_seed(0)
        params = [torch.randn(4, 6, device=DEVICE), torch.randn(7, device=DEVICE)]
        state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        steps = [torch.zeros((), device=DEVICE) for _ in params]
        scratch = functional.Scratch()
        batch = Batch(params, [], state[0], state[1], [None, None], steps, [None, None], [0, 0],
                      [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False, False)])  # the grads come per step
        grads_seen = []
        for step in range(3):
            scale = torch.tensor(8.0, device=DEVICE)
            batch.grads = [_transposed_memory(torch.arange(24.0, device=DEVICE).view(4, 6) * (step + 1)),
                           torch.arange(7.0, device=DEVICE) * 8]
            functional.run_step(module, batch, functional.StepOptions(grad_scale=scale, max_grad_norm=1.0,
                                                                       scratch=scratch))
            grads_seen.append([g.clone() for g in batch.grads])
        results.append((params, state, grads_seen))
    (p_ref, s_ref, g_ref), (p, s, g) = results
    for a, b in zip(p_ref + s_ref[0] + s_ref[1], p + s[0] + s[1]):
        torch.testing.assert_close(b, a, **tol(backend))
    for step, (ga, gb) in enumerate(zip(g_ref, g)):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(b, a, msg=f"step {step}: the unscaled gradient")
    assert not g[-1][0].is_contiguous(), "the caller's strided grad stays the caller's tensor"


@pytest.mark.parametrize("backend", BACKENDS)
def test_states_swapped_between_params_step_as_torch(backend):
    """Two same-shaped params trade their ``opt.state`` entries mid-training (the keys stay, the values
    move): the plan sees the new values and steps each param on the state opt.state now gives it."""
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: ampfused.FusedAmpAdamW(ps, lr=1e-2, backend=backend)):
        params = [torch.nn.Parameter(p.detach().clone()) for p in _params()[:1] * 3]
        opt = make(params)
        for k in range(4):
            if k == 2:
                opt.state[params[0]], opt.state[params[2]] = opt.state[params[2]], opt.state[params[0]]
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.01 * (k + 1) * (i + 1) * (1 if i != 1 else -1))
            opt.step()
        runs.append((opt, params))
    (ref, ref_params), (opt, params) = runs
    assert_states_close(ref, ref_params, opt, params, backend)


def _python_calls_of_a_warm_step(backend, n_tensors):
    params = [torch.nn.Parameter(torch.randn(16, device=DEVICE)) for _ in range(n_tensors)]
    opt = ampfused.FusedAmpAdamW(params, backend=backend, max_grad_norm=1.0)
    quiet = contextlib.nullcontext
    if backend == "triton":  # the interpreter's own calls are not the host's: time the host side alone
        from ampfused import kernels

        quiet = kernels.host_only
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    for step in range(3):  # state, plan and tables built; the third step is a warm one
        for p in params:
            p.grad = torch.randn_like(p)  # new grad tensors, as zero_grad(set_to_none=True) + backward give
        opt.grad_scale = torch.ones((), device=DEVICE)  # a GradScaler's step: the scale handed over
        with quiet():
            if step == 2:
                sys.setprofile(count)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
    return calls


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_a_warm_step_makes_no_python_call_per_tensor(backend):
    """docs/design.md §5: a warm step re-reads grads, addresses and layouts with C-level maps; a Python
    call per tensor (a ``Tensor.__hash__``, a helper mapped over the params) would show as calls that
    grow with the tensor count. (The reference backend is the per-tensor oracle, not a fast path.)"""
    few, many = (_python_calls_of_a_warm_step(backend, n) for n in (8, 64))
    assert few == many, f"a warm step made {few} Python calls at 8 tensors and {many} at 64"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grad_moved_to_another_same_shaped_param_steps_as_torch(backend):
    """The grads' dtypes, shapes and strides alone cannot tell which param has the grad: with one grad
    that moves from the first of two same-shaped params to the second, each step updates the param
    that has it (the plan reads which params have a grad, not only how many)."""
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: ampfused.FusedAmpAdamW(ps, lr=1e-2, backend=backend)):
        params = [torch.nn.Parameter(p.detach().clone()) for p in _params()[:1] * 2]
        opt = make(params)
        for k in range(4):
            params[k % 2].grad = torch.full_like(params[0], 0.01 * (k + 1))
            opt.step()
            opt.zero_grad()
        runs.append((opt, params))
    (ref, ref_params), (opt, params) = runs
    assert_states_close(ref, ref_params, opt, params, backend)


def _refused_after_a_warm_step(backend, change, match=None, errors=(RuntimeError, ValueError)):
    """Two steps, then ``change(opt, params)`` and a step that must raise ``errors`` (matching ``match``)
    and write nothing."""
    params = _params()
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    for k in range(2):
        _set_grads(params, k)
        opt.step()
    change(opt, params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(errors, match=match):
        opt.step()
    for b, p in zip(before, params):
        assert torch.equal(b, p), "a refused step wrote a param"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grad_given_another_shape_in_place_is_refused(backend):
    """``p.grad.data = <fewer elements>`` passes no setter check; the plan reads the grads' shapes, so
    the step refuses it, as torch's AdamW does, instead of reading past the grad's memory."""
    def shrink_grad(opt, params):
        params[0].grad.data = torch.randn(8, device=DEVICE)

    _refused_after_a_warm_step(backend, shrink_grad, match="shape|elements")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_given_another_shape_at_the_same_address_is_refused(backend):
    """``p.data = p.data[:8]`` keeps the address; the plan reads the params' shapes, so the step
    refuses state of the old size, as torch's AdamW does, instead of stepping the old length."""
    def shrink_param(opt, params):
        params[0].data = params[0].data[:8]
        params[0].grad = torch.randn(8, device=DEVICE)

    _refused_after_a_warm_step(backend, shrink_param, match="shape|elements")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_given_another_shape_that_keeps_its_old_grad_is_refused(backend):
    """The same, the grad left as it was: the grads' layouts are unchanged, so only the params' shapes,
    re-read by the plan, show that the step would run over the old length."""
    def shrink_param_only(opt, params):
        params[0].data = params[0].data[:8]

    _refused_after_a_warm_step(backend, shrink_param_only, match="shape|elements")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_torch_key_assigned_under_int8_moments_is_refused_before_any_write(backend):
    """With int8 moments the entry holds ``exp_avg_codes``/``exp_avg_scales``: a torch-style reset
    ``state["exp_avg"] = zeros_like(p)`` is refused, naming the keys to assign, and nothing is written
    (the step count included)."""
    p = torch.nn.Parameter(torch.randn(16, 256, device=DEVICE))  # 2-D: 1-D tensors keep fp32 moments
    opt = ampfused.FusedAmpAdamW([p], backend=backend, state_dtype="int8")
    for k in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    opt.state[p]["exp_avg"] = torch.zeros_like(p)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"opt.state\[p\]\['exp_avg'\]: this optimizer keeps .*'exp_avg_codes'"):
        opt.step()
    assert torch.equal(before, p), "a refused step wrote the param"
    assert opt.state[p]["step"].item() == 2, "a refused step counted a step"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_given_another_shape_steps_as_torch_once_its_state_is_reset(backend):
    """What the refusal above advises: ``del opt.state[p]`` after ``p.data = ...`` of another shape
    starts ``p`` afresh in its new shape (the flat state is laid out again), as torch's AdamW does."""
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: ampfused.FusedAmpAdamW(ps, lr=1e-2, backend=backend)):
        params = [torch.nn.Parameter(p.detach().clone()) for p in _params()]
        opt = make(params)
        for k in range(4):
            if k == 2:
                params[0].data = params[0].data[:8].clone()
                del opt.state[params[0]]
            _set_grads(params, k)
            opt.step()
        runs.append((opt, params))
    (ref, ref_params), (opt, params) = runs
    assert opt.state[params[0]]["exp_avg"].shape == (8,)
    assert_states_close(ref, ref_params, opt, params, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_tensor_assigned_in_another_shape_is_refused(backend):
    """An assigned moment of the wrong shape, or not a tensor, is refused, naming the key, before
    anything is written."""
    def assign(value):
        def change(opt, params):
            opt.state[params[0]]["exp_avg_sq"] = value
        return change

    _refused_after_a_warm_step(backend, assign(torch.zeros(3, device=DEVICE)),
                               match=r"opt.state\[p\]\['exp_avg_sq'\] has shape \(3,\) for a parameter of shape \(64,\)")
    _refused_after_a_warm_step(backend, assign(0.0), match=r"opt.state\[p\]\['exp_avg_sq'\] is a float, not a tensor",
                               errors=TypeError)
    _refused_after_a_warm_step(backend, lambda opt, params: opt.state[params[0]].pop("step"),
                               match=r"opt.state\[p\] has no 'step'")


def _python_calls_of_a_warm_unscale(backend, n_tensors):
    params = [torch.nn.Parameter(torch.randn(16, device=DEVICE)) for _ in range(n_tensors)]
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    scaler = ampfused.GradScaler(DEVICE.type)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    for step in range(3):  # the third unscale_ is a warm one: the plan of the step before serves it
        scaler.scale(torch.ones((), device=DEVICE))
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 2:
            sys.setprofile(count)
        try:
            scaler.unscale_(opt)  # (the tutorial loop's, before clip_grad_norm_)
        finally:
            sys.setprofile(None)
        scaler.step(opt)
        scaler.update()
    return calls


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_a_warm_gradscaler_unscale_makes_no_python_call_per_tensor(backend):
    """``scaler.unscale_(opt)`` reads the grads the next step reads through the step plan when it still
    serves, instead of validating every grad again in Python."""
    few, many = (_python_calls_of_a_warm_unscale(backend, n) for n in (8, 64))
    assert few == many, f"a warm unscale_ made {few} Python calls at 8 tensors and {many} at 64"


@pytest.mark.parametrize("grow", [True, False], ids=["grows past the int8 cut", "shrinks below it"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_crossing_the_int8_cut_steps_as_reference_once_its_state_is_reset(backend, grow):
    """Under state_dtype="int8" a tensor's moments are int8 from SMALL_TENSOR_NUMEL elements up, fp32
    below: after ``p.data`` of a size on the other side and ``del opt.state[p]``, the state is laid
    out again under the new size's keys."""
    from ampfused._contract import SMALL_TENSOR_NUMEL

    sizes = ((10, 10), (32, SMALL_TENSOR_NUMEL // 16)) if grow else ((32, SMALL_TENSOR_NUMEL // 16), (10, 10))
    runs = []
    for name in ("reference", backend):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(sizes[0], device=DEVICE)), torch.nn.Parameter(torch.randn(64, device=DEVICE))]
        opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=name, state_dtype="int8")
        for k in range(4):
            if k == 2:
                params[0].data = torch.linspace(-1, 1, math.prod(sizes[1]), device=DEVICE).view(sizes[1])
                del opt.state[params[0]]
            for p in params:
                p.grad = torch.linspace(-0.1, 0.1 * (k + 1), p.numel(), device=DEVICE).view(p.shape)
            opt.step()
        runs.append((opt, params))
    (ref, ref_params), (opt, params) = runs
    assert set(opt.state[params[0]]) == set(ref.state[ref_params[0]])
    assert ("exp_avg_codes" in opt.state[params[0]]) == grow
    assert_params_close(ref_params, params, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unscale_not_followed_by_a_step_frees_the_grads_at_zero_grad(backend):
    """``scaler.unscale_(opt)``, a non-finite norm, ``opt.zero_grad()`` and no step (a loop that skips
    the step itself): the plan that served the unscale holds no grad afterwards."""
    params = _params()
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    scaler = ampfused.GradScaler(DEVICE.type)
    for k in range(2):
        scaler.scale(torch.ones((), device=DEVICE))
        _set_grads(params, k)
        scaler.step(opt)
        scaler.update()
    scaler.scale(torch.ones((), device=DEVICE))
    _set_grads(params, 2)
    refs = [weakref.ref(p.grad) for p in params]
    scaler.unscale_(opt)
    opt.zero_grad()
    gc.collect()
    assert all(r() is None for r in refs), "the optimizer kept a gradient alive after unscale_ and zero_grad()"
