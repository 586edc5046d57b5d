"""A replay of PyTorch's optimizer checks with FusedAmpAdamW in AdamW's place, on each backend.

PyTorch's real ``test/test_optim.py`` runs through ``benchmarks/torch_test_optim.py`` (given a copy
of the file); this replay needs none and compares every result with ``torch.optim.AdamW``.
torch's ``test/test_optim.py`` is not shipped in the wheel; ``torch.testing._internal.common_optimizers``
is (it needs the ``expecttest`` package). This runner takes AdamW's ``OptimizerInfo`` from ``optim_db``
and replays the generic checks test_optim.py runs for it, over every kwargs combination of its
``optim_inputs_func``, with ``torch.optim.AdamW`` as the oracle of each result. A check that fails
for a documented, deliberate difference (README "Known limitations") is reported as such.

    python -m benchmarks.torch_optim_suite [--backends reference,cpu,triton] [--markdown FILE]

Not collected by pytest (the checks take ~1 minute on the Triton interpreter).
"""
from __future__ import annotations

import argparse
import copy
import io
import pickle
import traceback
import warnings

import torch

import ampfused
from ampfused import _backends

DELIBERATE = {  # check -> why ampfused differs on purpose (README, Known limitations)
    "duplicate_params_in_one_param_group": "a param listed twice in a group is refused (torch warns and steps it twice)",
    "fused_matches_forloop_fp16_bf16": "fp16/bf16 params keep fp32 moments and an fp32 master (values within tolerance, dtype differs)",
}


def adamw_info():
    from torch.testing._internal.common_optimizers import optim_db

    return next(info for info in optim_db if info.optim_cls is torch.optim.AdamW)


def _params(dtype=torch.float32, seed=0, shapes=((10, 5), (10,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _twin(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _train(opt, params, steps=5, seed=1, closure=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, generator=g, dtype=params[0].dtype)
    for _ in range(steps):
        def fn():
            opt.zero_grad()
            w, b = params[0], params[1]
            loss = (w @ x.to(w.dtype) + b).abs().pow(2).sum()
            loss.backward()
            return loss
        opt.step(fn) if closure else (fn(), opt.step())


def _close(ours, theirs, dtype=torch.float32):
    rtol, atol = (1e-12, 1e-14) if dtype in (torch.float64, torch.complex128) else (2e-5, 2e-6)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)


def make_checks(ours_cls, inputs):
    """name -> callable(); each raises on failure. ``ours_cls(params, **kw)`` builds FusedAmpAdamW on one backend."""
    ref = torch.optim.AdamW
    checks = {}

    def check(fn):
        checks[fn.__name__] = fn
        return fn

    @check
    def optimizer_can_be_printed():
        for oi in inputs:
            assert "lr" in repr(ours_cls(_params(), **oi.kwargs))

    def _matches(dtype, closure=False, shapes=((10, 5), (10,))):
        for oi in inputs:
            a, b = _params(dtype, shapes=shapes), None
            b = _twin(a)
            oa, ob = ours_cls(a, **oi.kwargs), ref(b, foreach=False, **oi.kwargs)
            _train(oa, a, closure=closure)
            _train(ob, b, closure=closure)
            _close(a, b, dtype)
            for p, q in zip(a, b):
                for k, v in ob.state[q].items():
                    # (step: fp32 always here; torch's is fp64 under set_default_dtype(torch.float64))
                    assert k == "step" or oa.state[p][k].dtype == v.dtype, k
                    _close([oa.state[p][k].to(v.dtype).reshape(v.shape)], [v], dtype)

    checks["forloop_goes_right_direction_fp32"] = lambda: _matches(torch.float32)
    checks["forloop_goes_right_direction_fp64"] = lambda: _matches(torch.float64)
    checks["step_with_closure"] = lambda: _matches(torch.float32, closure=True)
    checks["complex_params"] = lambda: _matches(torch.complex64)
    checks["complex128_params"] = lambda: _matches(torch.complex128)

    @check
    def complex_matches_view_as_real():
        for oi in inputs:
            c = torch.randn(5, 5, dtype=torch.complex64, requires_grad=True)
            r = torch.view_as_real(c).detach().clone().requires_grad_()
            oc, orr = ours_cls([c], **oi.kwargs), ref([r], foreach=False, **oi.kwargs)
            for _ in range(3):
                c.grad = torch.randn_like(c)
                r.grad = torch.view_as_real(c.grad).clone()
                oc.step(); orr.step()
            _close([torch.view_as_real(c)], [r])

    @check
    def complex_2d():
        for oi in inputs:
            a1 = torch.randn(2, dtype=torch.complex64, requires_grad=True)
            re, im = a1.real.detach().clone().requires_grad_(), a1.imag.detach().clone().requires_grad_()
            o1, o2 = ours_cls([a1], **oi.kwargs), ref([re, im], foreach=False, **oi.kwargs)
            for _ in range(5):
                o1.zero_grad(); o2.zero_grad()
                (a1.abs() ** 2).sum().backward(); (torch.complex(re, im).abs() ** 2).sum().backward()
                o1.step(); o2.step()
            _close([a1.real, a1.imag], [re, im])

    @check
    def step_is_noop_when_params_have_no_grad():
        for oi in inputs:
            ps = _params(); before = [p.detach().clone() for p in ps]
            opt = ours_cls(ps, **oi.kwargs)
            opt.step()
            assert all(torch.equal(p, q) for p, q in zip(ps, before)) and not opt.state

    @check
    def step_is_noop_for_zero_grads():
        for oi in inputs:
            if oi.kwargs.get("weight_decay", 0.01) != 0:
                continue  # decay moves params with zero grads, in torch as here
        ps = _params(); before = [p.detach().clone() for p in ps]
        opt = ours_cls(ps, weight_decay=0.0)
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, before))

    @check
    def param_groups_lr_and_weight_decay():
        a = _params(); b = _twin(a)
        groups = lambda ps: [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.1, "weight_decay": 0.5}]  # noqa: E731
        oa, ob = ours_cls(groups(a), lr=1e-2), ref(groups(b), lr=1e-2, foreach=False)
        _train(oa, a); _train(ob, b); _close(a, b)

    @check
    def tensor_lr():
        a = _params(); b = _twin(a)
        oa, ob = ours_cls(a, lr=torch.tensor(0.01)), ref(b, lr=torch.tensor(0.01), foreach=False)
        _train(oa, a); _train(ob, b); _close(a, b)

    @check
    def state_dict_round_trip_and_deterministic():
        for oi in inputs:
            a = _params(); opt = ours_cls(a, **oi.kwargs); _train(opt, a)
            b = _twin(a); opt2 = ours_cls(b, **oi.kwargs)
            sd = copy.deepcopy(opt.state_dict())
            opt2.load_state_dict(sd)
            _train(opt, a, seed=3); _train(opt2, b, seed=3)
            assert all(torch.equal(p, q) for p, q in zip(a, b))
            torch.testing.assert_close(opt.state_dict()["state"], opt2.state_dict()["state"])

    @check
    def state_dict_loads_into_and_from_torch():
        for oi in inputs:
            a = _params(); ours = ours_cls(a, **oi.kwargs); _train(ours, a)
            b = _twin(a); theirs = ref(b, foreach=False, **oi.kwargs); theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # (torch aliases a live dict's tensors)
            c = _twin(a); back = ours_cls(c, **oi.kwargs); back.load_state_dict(copy.deepcopy(theirs.state_dict()))
            _train(ours, a, seed=4); _train(theirs, b, seed=4); _train(back, c, seed=4)
            _close(a, b); _close(c, b)

    @check
    def load_nontensor_step():
        a = _params(); opt = ours_cls(a); _train(opt, a)
        sd = opt.state_dict()
        for s in sd["state"].values():
            s["step"] = float(s["step"])
        opt.load_state_dict(sd); _train(opt, a)

    @check
    def can_load_older_state_dict():
        a = _params(); opt = ours_cls(a); _train(opt, a)
        sd = opt.state_dict()
        for g in sd["param_groups"]:
            for key in ("maximize", "foreach", "capturable", "differentiable", "fused"):
                g.pop(key, None)
        opt.load_state_dict(sd); _train(opt, a)

    @check
    def deepcopy_copies_all_public_attrs():
        a = _params(); opt = ours_cls(a); _train(opt, a)
        public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731
        for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
            assert public(clone) == public(opt), public(opt) ^ public(clone)

    @check
    def save_load_equality_with_weights_only():
        a = _params(); opt = ours_cls(a); _train(opt, a)
        buf = io.BytesIO(); torch.save(opt.state_dict(), buf); buf.seek(0)
        sd = torch.load(buf, weights_only=True)
        b = _twin(a); opt2 = ours_cls(b); opt2.load_state_dict(sd)
        _train(opt, a, seed=5); _train(opt2, b, seed=5)
        assert all(torch.equal(p, q) for p, q in zip(a, b))

    @check
    def step_and_state_dict_hooks():
        a = _params(); opt = ours_cls(a); calls = []
        opt.register_step_pre_hook(lambda o, args, kw: calls.append("pre"))
        opt.register_step_post_hook(lambda o, args, kw: calls.append("post"))
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
        opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post"))
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
        _train(opt, a, steps=1)
        opt.load_state_dict(opt.state_dict())
        assert calls == ["pre", "post", "sd_pre", "sd_post", "load_pre", "load_post"], calls

    @check
    def default_dtype_float64():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            _matches(torch.float64)
        finally:
            torch.set_default_dtype(old)

    @check
    def duplicate_params_in_one_param_group():
        p = _params()[0]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ours_cls([p, p])
        assert any("duplicate" in str(x.message) for x in w)

    @check
    def non_contiguous_params():
        a = [torch.randn(10, 5, 2)[..., 0].requires_grad_(), torch.randn(10, 2)[..., 0].requires_grad_()]
        b = [p.detach().clone().requires_grad_() for p in a]
        oa, ob = ours_cls(a), ref(b, foreach=False)
        _train(oa, a); _train(ob, b); _close(a, b)

    @check
    def meta_params_error_before_any_write():
        p = torch.nn.Parameter(torch.empty(4, device="meta"))
        opt = ours_cls([p]); p.grad = torch.empty(4, device="meta")
        try:
            opt.step()
        except RuntimeError as exc:
            assert "meta device" in str(exc) and not opt.state, exc
        else:
            raise AssertionError("no error for meta params")

    @check
    def fused_matches_forloop_fp16_bf16():
        for dtype in (torch.float16, torch.bfloat16):
            a = _params(dtype); b = _twin(a)
            oa, ob = ours_cls(a), ref(b, fused=True)
            _train(oa, a, steps=2); _train(ob, b, steps=2)
            for p, q in zip(a, b):
                for k in ("exp_avg", "exp_avg_sq"):
                    assert oa.state[p][k].dtype == ob.state[q][k].dtype, f"{k}: {oa.state[p][k].dtype} vs {ob.state[q][k].dtype}"

    return checks


def error_inputs_check(ours_cls, info):
    """torch's error inputs: (desc, outcome) -- 'same' when ours raises/warns what torch expects."""
    out = []
    for ei in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        oi = ei.optimizer_error_input
        params = oi.params if oi.params is not None else [torch.randn(3, requires_grad=True)]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                ours_cls(params, **oi.kwargs)
                outcome = "warned" if any(issubclass(x.category, ei.error_type) for x in w) else "accepted"
            except Exception as exc:  # noqa: BLE001
                outcome = "same error type" if isinstance(exc, ei.error_type) else f"{type(exc).__name__}: {exc}"
        if outcome == "warned" and issubclass(ei.error_type, Warning):
            outcome = "same error type"
        out.append((oi.desc, ei.error_type.__name__, outcome))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=None, help="comma-separated backends (default: every available one)")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    info = adamw_info()
    inputs = info.optim_inputs_func(device="cpu")
    names = args.backends.split(",") if args.backends else [n for n, ok, _ in _backends.report() if ok and n != "cuda"]
    rows, summary = [], []
    for backend in names:
        make = lambda params, **kw: ampfused.FusedAmpAdamW(params, backend=backend, **kw)  # noqa: E731
        results = {}
        for name, fn in make_checks(make, inputs).items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fn()
                results[name] = "pass"
            except Exception as exc:  # noqa: BLE001
                results[name] = "deliberate" if name in DELIBERATE else f"FAIL {type(exc).__name__}: {str(exc)[:100]}"
                if name not in DELIBERATE:
                    traceback.print_exc()
        rows.append((backend, results))
        passed = sum(v == "pass" for v in results.values())
        deliberate = sum(v == "deliberate" for v in results.values())
        errors = error_inputs_check(make, info)
        same = sum(o == "same error type" for _, _, o in errors)
        summary.append(f"{backend}: {passed} of {len(results)} checks pass, {deliberate} differ deliberately, "
                       f"{len(results) - passed - deliberate} fail; torch's error inputs: {same} of {len(errors)} give torch's error")
    lines = ["| check | " + " | ".join(b for b, _ in rows) + " |", "|---|" + "---|" * len(rows)]
    for name in rows[0][1]:
        lines.append(f"| {name} | " + " | ".join(r[name] for _, r in rows) + " |")
    lines += ["", *summary, "", "Deliberate differences: " + "; ".join(f"{k}: {v}" for k, v in DELIBERATE.items()), "",
              "torch's error inputs (last backend): " + "; ".join(f"{d or '-'} ({t}): {o}" for d, t, o in errors)]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# PyTorch's optimizer checks with FusedAmpAdamW (torch {torch.__version__})\n\n"
                    f"`python -m benchmarks.torch_optim_suite --markdown {args.markdown}`\n\n" + text + "\n")


if __name__ == "__main__":
    main()
