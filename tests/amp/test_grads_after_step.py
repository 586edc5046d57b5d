"""What a step leaves in p.grad (DESIGN §2.7) and skip_nonfinite=False (DESIGN §2.2), against stock torch.

Oracle: ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)`` on fp32 copies of the params,
given the very gradients ampfused saw (for fp16/bf16 params: our fp32 accumulated ``p.grad``).
"""
import copy
import math
import pickle

import pytest
import torch

import ampfused
from ampfused import _backends
from helpers import DEVICE, assert_bitwise_equal, make_params, snapshot, tol

SHAPES = [(7, 5), (33,), (4, 3, 2)]
STEPS = 6
OVERFLOW_STEP = 2  # an inf gradient: the scaler skips the step and backs off
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def weights(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(DEVICE) for s in SHAPES]


def close(actual, expected, backend, msg):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tol(backend), equal_nan=True, msg=msg)


def scaled_backward(params, scaler, step):
    loss = sum((p.float() * w).sum() for p, w in zip(params, weights(step)))
    scaler.scale(loss).backward()
    if step == OVERFLOW_STEP:
        with torch.no_grad():
            params[1].grad[3] = math.inf


def run_scaled(backend, dtype, scaler_cls, clip=None, keep_scaled_grads=False):
    """Steps ours and the oracle side by side; checks p.grad, params and state after every step."""
    params = make_params(SHAPES, dtype, DEVICE)
    oracle = [p.detach().float().clone().requires_grad_() for p in params]
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, max_grad_norm=clip, keep_scaled_grads=keep_scaled_grads,
                                 backend=backend)
    oracle_opt = torch.optim.AdamW(oracle, lr=1e-2, fused=True)
    kw = dict(init_scale=2.0**10, growth_interval=2)
    scaler, oracle_scaler = scaler_cls(DEVICE.type, **kw), torch.amp.GradScaler(DEVICE.type, **kw)
    for step in range(STEPS):
        opt.zero_grad()
        oracle_opt.zero_grad()
        scaled_backward(params, scaler, step)
        seen = [p.grad.clone() for p in params]
        assert all(g.dtype == torch.float32 for g in seen)  # fp16/bf16: our fp32 accumulation buffer
        for o, g in zip(oracle, seen):
            o.grad = g.clone()
        oracle_scaler.scale(torch.ones((), device=DEVICE))  # (lazily creates the oracle's scale)
        if clip is not None:
            oracle_scaler.unscale_(oracle_opt)
            torch.nn.utils.clip_grad_norm_(oracle, clip)
        scale = scaler.get_scale()
        scaler.step(opt)
        oracle_scaler.step(oracle_opt)
        scaler.update()
        oracle_scaler.update()
        assert scaler.get_scale() == oracle_scaler.get_scale(), f"step {step}: scale trajectory"
        skipped = step == OVERFLOW_STEP
        for i, (p, o, g) in enumerate(zip(params, oracle, seen)):
            msg = f"step {step} param {i}"
            if keep_scaled_grads or skipped:
                # torch's fused kernel returns before writing anything on a skipped step: the scaled grads stay
                assert torch.equal(p.grad, g), f"{msg}: p.grad must keep the scaled gradient"
            elif clip is None:
                close(p.grad, o.grad, backend, f"{msg}: p.grad")  # torch's fused kernel wrote g / S there
                assert torch.equal(p.grad, g * (1.0 / scale)), f"{msg}: p.grad is exactly g / S"
            else:  # the fused clip does not touch p.grad: only the unscale is written
                assert torch.equal(p.grad, g * (1.0 / scale)), f"{msg}: p.grad is g / S, unclipped"
            weights_ = opt.state[p].get("master_param", p)
            close(weights_, o, backend, f"{msg}: params")
            if dtype != torch.float32:
                assert torch.equal(p, opt.state[p]["master_param"].to(dtype)), f"{msg}: p = RNE(master)"
            for key in ("exp_avg", "exp_avg_sq", "step"):
                close(opt.state[p][key], oracle_opt.state[o][key], backend, f"{msg}: state {key}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaler_cls", [ampfused.GradScaler, torch.amp.GradScaler], ids=["ampfused", "torch"])
def test_grad_after_scaled_step_is_unscaled_as_torch_fused(backend, dtype, scaler_cls):
    run_scaled(backend, dtype, scaler_cls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_clip_writes_only_the_unscale(backend, dtype):
    run_scaled(backend, dtype, ampfused.GradScaler, clip=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("scaler_cls", [ampfused.GradScaler, torch.amp.GradScaler], ids=["ampfused", "torch"])
def test_keep_scaled_grads_skips_the_write(backend, dtype, scaler_cls):
    run_scaled(backend, dtype, scaler_cls, keep_scaled_grads=True)


def test_low_precision_grads_get_the_unscale_rounded(backend):
    """fp32_grad_accumulation=False: p.grad is bf16 and holds RNE(g / S), as torch's fused kernel stores it."""
    params = make_params(SHAPES, torch.bfloat16, DEVICE)
    oracle = [p.detach().clone().requires_grad_() for p in params]
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, fp32_grad_accumulation=False, backend=backend)
    oracle_opt = torch.optim.AdamW(oracle, lr=1e-2, fused=True)
    scaler, oracle_scaler = ampfused.GradScaler(DEVICE.type, init_scale=3.0), torch.amp.GradScaler(DEVICE.type, init_scale=3.0)
    scaled_backward(params, scaler, 0)
    seen = [p.grad.clone() for p in params]
    for o, g in zip(oracle, seen):
        o.grad = g.clone()
    oracle_scaler.scale(torch.ones((), device=DEVICE))
    scaler.step(opt)
    oracle_scaler.step(oracle_opt)
    for p, o, g in zip(params, oracle, seen):
        assert p.grad.dtype == torch.bfloat16
        assert torch.equal(p.grad, (g.float() * (1.0 / 3.0)).to(torch.bfloat16))  # our unscale: g * fp32(1/S)
        torch.testing.assert_close(p.grad, o.grad, rtol=8e-3, atol=0)  # torch divides: within one bf16 ulp


@pytest.mark.parametrize("clip", [None, 0.1])
def test_no_scaler_leaves_grads_untouched(backend, clip):
    for skip_nonfinite in (True, False):
        params = make_params(SHAPES, torch.float32, DEVICE)
        opt = ampfused.FusedAmpAdamW(params, max_grad_norm=clip, skip_nonfinite=skip_nonfinite, backend=backend)
        for p, w in zip(params, weights(0)):
            p.grad = w * 3.0
        before = [p.grad.clone() for p in params]
        opt.step()
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_unscale_first_leaves_the_unscaled_grads(backend):
    """scaler.unscale_(opt) then scaler.step(opt): the grads are already unscaled and stay so (no second unscale)."""
    params = make_params(SHAPES, torch.float32, DEVICE)
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    scaler = ampfused.GradScaler(DEVICE.type, init_scale=2.0**8)
    scaled_backward(params, scaler, 0)
    seen = [p.grad.clone() for p in params]
    scaler.unscale_(opt)
    scaler.step(opt)
    assert all(torch.equal(p.grad, g / 2.0**8) for p, g in zip(params, seen))


# ---------------------------------------------------------------- skip_nonfinite=False


def nonfinite_grads(kind):
    grads = [w.clone() for w in weights(0)]
    grads[0][2, 1] = kind
    grads[2][1, 1, 0] = -kind if kind == math.inf else kind
    return grads


@pytest.mark.parametrize("kind", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_nonfinite_flows_through_as_in_torch(backend, kind, clip):
    params = make_params(SHAPES, torch.float32, DEVICE)
    oracle = [p.detach().clone().requires_grad_() for p in params]
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, max_grad_norm=clip, skip_nonfinite=False, backend=backend)
    oracle_opt = torch.optim.AdamW(oracle, lr=1e-2, fused=True)
    for step in range(3):  # finite, non-finite, finite again: the NaNs stay where torch leaves them
        grads = nonfinite_grads(kind) if step == 1 else weights(step)
        for p, o, g in zip(params, oracle, grads):
            p.grad, o.grad = g.clone(), g.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(oracle, clip) if clip is not None else None
        opt.step()
        oracle_opt.step()
        if clip is None:
            assert opt.grad_norm is None  # no stats pass: nothing computed a norm
        else:
            close(opt.grad_norm, expected_norm, backend, f"step {step}: grad_norm")
        for i, (p, o) in enumerate(zip(params, oracle)):
            close(p, o, backend, f"step {step} param {i}")
            for key in ("exp_avg", "exp_avg_sq", "step"):
                close(opt.state[p][key], oracle_opt.state[o][key], backend, f"step {step} param {i} {key}")
    assert any(not torch.isfinite(p).all() for p in params)  # the test did let non-finite values through


def test_default_guard_still_skips(backend):
    params = make_params(SHAPES, torch.float32, DEVICE)
    opt = ampfused.FusedAmpAdamW(params, backend=backend)
    for p, g in zip(params, nonfinite_grads(math.nan)):
        p.grad = g
    opt.step()
    assert not opt.state[params[0]] or int(opt.state[params[0]]["step"]) == 0
    assert all(torch.isfinite(p).all() for p in params)


def test_plain_step_runs_no_stats_pass(backend, monkeypatch):
    module = _backends.resolve(backend, DEVICE)[0]
    calls = []
    original = module.grad_stats_
    monkeypatch.setattr(module, "grad_stats_", lambda *a, **k: calls.append(1) or original(*a, **k))
    params = make_params(SHAPES, torch.float32, DEVICE)
    for p, w in zip(params, weights(0)):
        p.grad = w
    ampfused.FusedAmpAdamW(params, skip_nonfinite=False, backend=backend).step()
    assert calls == []
    ampfused.FusedAmpAdamW(params, skip_nonfinite=False, max_grad_norm=1.0, backend=backend).step()
    ampfused.FusedAmpAdamW(params, backend=backend).step()
    assert calls == [1, 1]  # clipping and the default guard need it


@pytest.mark.parametrize("scaler_cls", [ampfused.GradScaler, torch.amp.GradScaler], ids=["ampfused", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_scaler_always_skips(backend, scaler_cls, dtype):
    params = make_params(SHAPES, dtype, DEVICE)
    opt = ampfused.FusedAmpAdamW(params, skip_nonfinite=False, backend=backend)
    scaler = scaler_cls(DEVICE.type, init_scale=2.0**10)
    scaled_backward(params, scaler, 0)
    scaler.step(opt)  # a normal step first: state exists
    scaler.update()
    opt.zero_grad()
    scaled_backward(params, scaler, OVERFLOW_STEP)
    before = snapshot(opt, params)
    scaler.step(opt)
    scaler.update()
    assert_bitwise_equal(snapshot(opt, params), before)
    assert scaler.get_scale() == 2.0**9


# ---------------------------------------------------------------- the options themselves


@pytest.mark.parametrize("name", ["skip_nonfinite", "keep_scaled_grads"])
@pytest.mark.parametrize("bad", [None, 1, "no", torch.tensor(True)], ids=["None", "int", "str", "tensor"])
def test_flags_must_be_bool(name, bad):
    with pytest.raises(TypeError, match=name):
        ampfused.FusedAmpAdamW([torch.zeros(2, requires_grad=True)], **{name: bad})
    p = torch.zeros(2)
    z = torch.zeros(2)
    with pytest.raises(TypeError, match=name):
        ampfused.functional.fused_amp_adamw([p], [z], [z.clone()], [z.clone()], [None], [torch.zeros(())], lr=1e-3,
                                            beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, **{name: bad})


def test_flags_survive_copies_and_checkpoints():
    params = make_params(SHAPES, torch.float32, DEVICE)
    opt = ampfused.FusedAmpAdamW(params, skip_nonfinite=False, keep_scaled_grads=True, backend="reference")
    for p, w in zip(params, weights(0)):
        p.grad = w
    opt.step()
    assert "skip_nonfinite: False, keep_scaled_grads: True" in repr(opt)
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.skip_nonfinite is False and copied.keep_scaled_grads is True
    fresh = ampfused.FusedAmpAdamW(params, skip_nonfinite=False, keep_scaled_grads=True, backend="reference")
    sd = opt.state_dict()
    assert "skip_nonfinite" not in sd["param_groups"][0]  # optimizer-wide, as max_grad_norm: loads into torch.optim.AdamW
    torch.optim.AdamW(params).load_state_dict(sd)
    fresh.load_state_dict(sd)
    assert fresh.skip_nonfinite is False and fresh.keep_scaled_grads is True


def test_functional_keywords(backend):
    params = make_params(SHAPES, torch.float32, DEVICE)
    p = [x.detach().clone() for x in params]
    grads = nonfinite_grads(math.nan)
    zeros = lambda: [torch.zeros_like(x) for x in p]  # noqa: E731
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, backend=backend)
    steps = [torch.zeros((), device=DEVICE) for _ in p]
    norm, skipped = ampfused.functional.fused_amp_adamw(p, grads, zeros(), zeros(), [None] * 3, steps,
                                                         skip_nonfinite=False, **kw)
    assert norm is None and float(skipped) == 0.0 and not torch.isfinite(p[0]).all()
    scaled = [w * 4.0 for w in weights(0)]
    p = [x.detach().clone() for x in params]
    ampfused.functional.fused_amp_adamw(p, scaled, zeros(), zeros(), [None] * 3, [torch.zeros((), device=DEVICE) for _ in p],
                                        grad_scale=torch.tensor([4.0], device=DEVICE), **kw)
    assert all(torch.equal(g, w) for g, w in zip(scaled, weights(0)))
