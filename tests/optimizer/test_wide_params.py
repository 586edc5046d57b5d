"""float64 and complex params ([note: wide params] in ampfused/_args.py), meta-device params, the
copies' public attributes, and the bitwise claims of README ("What is bitwise to what")."""
import copy
import pickle

import pytest
import torch

import ampfused
from helpers import DEVICE, available_backends, snapshot, assert_bitwise_equal

WIDE = (torch.float64, torch.complex64, torch.complex128)


def _tol(dtype, backend):
    if dtype in (torch.float64, torch.complex128):
        return dict(rtol=1e-12, atol=1e-15)
    return dict(rtol=1e-6, atol=1e-7) if backend == "reference" else dict(rtol=2e-5, atol=2e-6)


def _pair(dtype, backend, seed=0, **kwargs):
    """A wide param and an fp32 one (kernel path) in ours and in torch.optim.AdamW (for-loop)."""
    g = torch.Generator().manual_seed(seed)
    ours = [torch.randn(9, 5, generator=g, dtype=dtype).to(DEVICE).requires_grad_(),
            torch.randn(70, generator=g).to(DEVICE).requires_grad_()]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt = ampfused.FusedAmpAdamW(ours, backend=backend, **kwargs)
    kwargs.pop("max_grad_norm", None)
    ref = torch.optim.AdamW(theirs, foreach=False, **kwargs)
    return ours, theirs, opt, ref


def _assert_matches(ours, theirs, opt, ref, backend):
    for p, q in zip(ours, theirs):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p.detach(), q.detach(), **_tol(q.dtype, backend))
        assert opt.state[p].keys() >= ref.state[q].keys()
        for key, value in ref.state[q].items():
            mine = opt.state[p][key]
            if key == "step":
                assert float(mine) == float(value)
            else:
                assert mine.dtype == value.dtype and mine.shape == value.shape, key
                torch.testing.assert_close(mine, value, **_tol(q.dtype, backend))


@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_wide_params_train_as_torch(backend, dtype, amsgrad, maximize):
    ours, theirs, opt, ref = _pair(dtype, backend, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, q in zip(ours, theirs):
            grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(DEVICE)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    _assert_matches(ours, theirs, opt, ref, backend)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_wide_model_with_autograd_tensor_lr_and_state_dict(backend, dtype):
    """A whole float64 / complex model through autograd; tensor lr; the state dict loads into torch."""
    # (torch's tensor-lr path rounds its scalars through fp32: 1e-7 off its own float-lr fp64 result)
    lr = torch.tensor(3e-3) if dtype == torch.complex64 else 3e-3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8, dtype=dtype), torch.nn.Linear(8, 3, dtype=dtype)).to(DEVICE)
    twin = copy.deepcopy(model)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=lr, backend=backend)
    ref = torch.optim.AdamW(twin.parameters(), lr=lr, foreach=False)
    x = torch.randn(16, 6, dtype=dtype, device=DEVICE)
    for _ in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).abs().pow(2).sum().backward()
            o.step()
    _assert_matches(list(model.parameters()), list(twin.parameters()), opt, ref, backend)
    loaded = torch.optim.AdamW(copy.deepcopy(twin).parameters(), foreach=False)
    loaded.load_state_dict(opt.state_dict())
    assert all(s["exp_avg"].dtype == dtype for s in loaded.state.values())
    again = ampfused.FusedAmpAdamW(copy.deepcopy(model).parameters(), backend=backend)
    again.load_state_dict(ref.state_dict())
    for s, r in zip(again.state.values(), ref.state.values()):
        assert torch.equal(s["exp_avg_sq"], r["exp_avg_sq"]) and s["exp_avg_sq"].dtype == dtype


def test_wide_and_fp32_share_one_norm_and_one_scale(backend):
    """Clipping and unscaling cover the wide params and the kernels' params together."""
    ours, theirs, opt, ref = _pair(torch.float64, backend, lr=1e-2, max_grad_norm=0.5)
    scale = torch.tensor(256.0, device=DEVICE)
    opt.grad_scale = scale  # what a GradScaler hands a _step_supports_amp_scaling optimizer
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=g, dtype=p.dtype).to(DEVICE) * 3 for p in ours]
    for p, q, grad in zip(ours, theirs, grads):
        p.grad, q.grad = grad * 256, grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    opt.step()
    ref.step()
    torch.testing.assert_close(opt.grad_norm.double(), expected_norm.double(), rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):  # the clip factor is fp32 (torch's is fp64 for fp64 grads)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bad", [0, 1])  # an inf in the wide grad, or in the kernels' grad
def test_a_nonfinite_grad_anywhere_skips_every_param(backend, bad):
    ours, _, opt, _ = _pair(torch.complex64, backend, lr=1e-2)
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.step()
    before = snapshot(opt, ours)
    for p in ours:
        p.grad = torch.ones_like(p)
    ours[bad].grad.view(-1)[3] = float("inf")
    opt.step()
    assert not torch.isfinite(opt.grad_norm)
    assert_bitwise_equal(before, snapshot(opt, ours))


def test_backend_reason_survives_deepcopy_and_pickle(backend):
    param = torch.nn.Parameter(torch.randn(4, device=DEVICE))
    opt = ampfused.FusedAmpAdamW([param], backend=backend)
    assert opt.backend_reason is None  # resolved at the first use
    param.grad = torch.ones_like(param)
    opt.step()
    assert opt.backend_reason
    public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731  (torch's test_optim check)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert public(clone) == public(opt)
        assert clone.backend_reason == opt.backend_reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_meta_params_get_one_clear_error_on_every_backend(backend, dtype):
    params = [torch.nn.Parameter(torch.empty(5, 3, device="meta", dtype=dtype)) for _ in range(2)]
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    for p in params:
        p.grad = torch.empty(p.shape, device="meta", dtype=torch.float32 if hasattr(p, "main_grad") else dtype)
    with pytest.raises(RuntimeError, match="meta device .* materialize"):
        opt.step()
    assert not opt.state and opt.grad_norm is None  # nothing was created or written


# ------------------------------------------------------------------ what is bitwise to what (README)

CONFIGS = [dict(), dict(amsgrad=True, maximize=True, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)]


def _run(make, sizes, steps=3):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g).requires_grad_() for n in sizes]
    grads = [[torch.randn(n, generator=g) * s for n, s in zip(sizes, (1, 1e-3, 10, 1e3))] for _ in range(steps)]
    opt = make(params)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()
    return params, opt


def _assert_bitwise(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        for key in ob.state[y]:
            assert torch.equal(oa.state[x][key].reshape(()) if key == "step" else oa.state[x][key], ob.state[y][key]), key


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", CONFIGS)
def test_reference_is_bitwise_torch_for_loop_and_foreach(kwargs, foreach):
    """fp32 params, float lr: the reference backend is torch.optim.AdamW's for-loop/foreach math, bit for bit."""
    sizes = (1, 7, 1000, 4099)
    ours = _run(lambda ps: ampfused.FusedAmpAdamW(ps, backend="reference", **kwargs), sizes)
    _assert_bitwise(ours, _run(lambda ps: torch.optim.AdamW(ps, foreach=foreach, **kwargs), sizes))


@pytest.mark.skipif("cpu" not in available_backends(torch.device("cpu")), reason="ampfused._C is not built")
@pytest.mark.parametrize("kwargs", CONFIGS + [dict(lr=torch.tensor(0.01))])
def test_cpu_backend_is_bitwise_torch_fused_cpu(kwargs):
    """fp32 params whose sizes are multiples of 64: the cpu backend equals torch.optim.AdamW(fused=True)
    on CPU bit for bit (torch's fused kernel rounds its scalar tail differently from its vector body)."""
    sizes = (64, 192, 1024, 4096)
    ours = _run(lambda ps: ampfused.FusedAmpAdamW(ps, backend="cpu", **kwargs), sizes)
    _assert_bitwise(ours, _run(lambda ps: torch.optim.AdamW(ps, fused=True, **kwargs), sizes))
