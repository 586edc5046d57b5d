"""Params with gaps (strided slices: [note: non-dense params] in ampfused/_args.py) train as
torch.optim.AdamW trains them, in the same step as the dense ones: one global norm for clipping,
one skip for an inf/NaN anywhere; fp16/bf16 ones as their dense twins. A param whose elements
share memory (an expand) is refused, as no step can write it."""
import copy

import pytest
import torch

import ampfused
from helpers import DEVICE, assert_bitwise_equal, snapshot, tol


def _gapped(seed=0, dtype=torch.float32):
    """A strided slice, a slice of a channel, a transposed slice, and a dense param beside them."""
    g = torch.Generator().manual_seed(seed)
    base = lambda *shape: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)  # noqa: E731
    return [base(10, 10)[:, ::2].requires_grad_(), base(6, 5, 2)[..., 0].requires_grad_(),
            base(8, 9)[::2, 1:].t().requires_grad_(), base(33).requires_grad_()]


def _twins(params):
    return [p.detach().clone().requires_grad_() for p in params]  # (dense copies)


def _grads(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(device=DEVICE, dtype=p.dtype) * scale for p in params]


def _snapshot(opt, params):
    snap = snapshot(opt, params)
    snap["params"] = [p.detach().contiguous().clone() for p in params]  # bitwise views need unit stride
    return snap


def _assert_states(opt, params, ref, twins, backend):
    for i, (p, q) in enumerate(zip(params, twins)):
        assert p.stride() == params[i].stride()  # still the user's views, written in place
        torch.testing.assert_close(p.detach(), q.detach(), **tol(backend), msg=f"param {i}")
        for key, value in ref.state[q].items():
            mine = opt.state[p][key]
            if key == "step":
                assert float(mine) == float(value), f"param {i} step"
            else:
                assert mine.shape == value.shape, key
                torch.testing.assert_close(mine, value, **tol(backend), msg=f"param {i} {key}")


def test_gapped_params_are_accepted_and_overlapping_ones_refused():
    assert not _gapped()[0].is_contiguous()
    ampfused.FusedAmpAdamW(_gapped())
    with pytest.raises(ValueError, match="share memory"):
        ampfused.FusedAmpAdamW([torch.randn(1, 6).expand(4, 6).requires_grad_()])


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_gapped_params_train_as_torch(backend, amsgrad, maximize):
    params = _gapped()
    twins = _twins(params)
    views = [p.data_ptr() for p in params]
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize, backend=backend)
    ref = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize, foreach=False)
    for step in range(4):
        for p, q, grad in zip(params, twins, _grads(params, step)):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(params, twins):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # (an unscaled step leaves grads alone)
    assert [p.data_ptr() for p in params] == views
    _assert_states(opt, params, ref, twins, backend)


def test_gapped_params_through_autograd(backend):
    """A model whose weight is a strided slice of a bigger tensor: autograd's (contiguous) grads."""
    params = _gapped()[:2]
    twins = _twins(params)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    x = torch.randn(5, device=DEVICE)
    for _ in range(3):
        for ps, o in ((params, opt), (twins, ref)):
            o.zero_grad()
            ((ps[0] @ x).pow(2).sum() + ps[1].sum()).backward()
            o.step()
    _assert_states(opt, params, ref, twins, backend)


def test_one_norm_clips_gapped_and_dense_params_together(backend):
    params = _gapped()
    twins = _twins(params)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, max_grad_norm=0.5, backend=backend)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    for step in range(3):
        for p, q, grad in zip(params, twins, _grads(params, step, scale=3.0)):
            p.grad, q.grad = grad.clone(), grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(twins, 0.5)
        opt.step()
        ref.step()
        torch.testing.assert_close(opt.grad_norm, expected, rtol=1e-6, atol=0)
    # (the clip factor differs in the last bits from torch's: the kernels' tolerance)
    _assert_states(opt, params, ref, twins, "cpu" if backend == "reference" else backend)


@pytest.mark.parametrize("bad", [0, 3])  # an inf in a gapped grad, or in the dense one
def test_a_scaler_skip_covers_gapped_and_dense_params(backend, bad):
    params = _gapped()
    twins = _twins(params)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    scaler = ampfused.GradScaler(DEVICE.type, init_scale=256.0)
    for step in range(2):
        for p, q, grad in zip(params, twins, _grads(params, step)):
            p.grad, q.grad = grad * 256, grad.clone()
        scaler.scale(torch.ones((), device=DEVICE))  # (the grads above are what a scaled loss gives)
        scaler.step(opt)
        scaler.update()
        ref.step()
    _assert_states(opt, params, ref, twins, "cpu" if backend == "reference" else backend)
    before = _snapshot(opt, params)
    for p, grad in zip(params, _grads(params, 9)):
        p.grad = grad * 128
    scaler.scale(torch.ones((), device=DEVICE))
    params[bad].grad.view(-1)[5] = float("inf") if bad == 0 else float("nan")
    scaler.step(opt)
    scaler.update()
    assert float(opt.step_skipped) != 0 and scaler.get_scale() == 128.0  # backed off once
    assert_bitwise_equal(before, _snapshot(opt, params))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gapped_params_train_as_their_dense_twins(backend, dtype):
    """fp16/bf16 slices: fp32 masters and moments, the same values as dense copies of them."""
    params = _gapped(dtype=dtype)
    twins = _twins(params)
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
    ref = ampfused.FusedAmpAdamW(twins, lr=1e-2, max_grad_norm=1.0, backend="reference")
    for step in range(3):
        weights = [w.float() for w in _grads(params, step)]
        for ps, o in ((params, opt), (twins, ref)):  # through autograd: fp32 accumulation in both
            o.zero_grad()
            sum((p.float() * w).sum() for p, w in zip(ps, weights)).backward()
            o.step()
    for i, (p, q) in enumerate(zip(params, twins)):
        assert p.grad.dtype == torch.float32  # fp32 grad accumulation, into optimizer-owned storage
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=1e-2, atol=1e-2, msg=f"param {i}")
        for key in ("exp_avg", "exp_avg_sq", "master_param", "step"):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], **tol("cpu"), msg=f"param {i} {key}")


def test_param_made_gapped_after_construction_keeps_training(backend):
    params = _gapped()[3:] + [torch.randn(6, 5, device=DEVICE).requires_grad_()]
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend)
    for p, grad in zip(params, _grads(params, 0)):
        p.grad = grad
    opt.step()
    params[1].data = torch.randn(6, 10, device=DEVICE)[:, ::2]  # same shape, gaps
    twins = _twins(params)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch would alias our state tensors)
    for p, q, grad in zip(params, twins, _grads(params, 1)):
        p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    ref.step()
    _assert_states(opt, params, ref, twins, backend)


def test_functional_api_serves_gapped_params_beside_dense_ones(backend):
    from ampfused.functional import fused_amp_adamw

    def run(which, params):
        grads = _grads(params, 3)
        grads[-1].view(-1)[0] *= 50  # one global norm: the dense grad's spike clips the gapped ones too
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        steps = [torch.zeros((), device=DEVICE) for _ in params]
        norm, skipped = fused_amp_adamw([p.detach() for p in params], grads, m, v, [None] * len(params), steps,
                                        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                        max_grad_norm=1.0, backend=which)
        return norm, skipped, m, v, steps

    params = _gapped()
    twins = _twins(params)  # dense copies on the reference backend: the oracle
    ours, theirs = run(backend, params), run("reference", twins)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    assert float(ours[1]) == 0
    for i, (p, q) in enumerate(zip(params, twins)):
        torch.testing.assert_close(p.detach(), q.detach(), **tol(backend), msg=f"param {i}")
    for a, b in zip(ours[2] + ours[3] + ours[4], theirs[2] + theirs[3] + theirs[4]):
        torch.testing.assert_close(a, b, **tol(backend))
