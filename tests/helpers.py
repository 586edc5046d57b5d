"""Helpers shared by the semantic tests: tolerances per backend, state comparison, models and loops."""
import io
import math
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

import ampfused
from ampfused import _backends
from ampfused.check import KERNEL_TOLERANCE, TOLERANCES  # one table for the tests and `python -m ampfused check`

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[1]  # the checkout


def available_backends(device=DEVICE):
    """Names of the backends that can serve tensors on ``device`` in this process."""
    names = []
    for name in _backends.BACKEND_NAMES:
        try:
            _backends.resolve(name, device)
        except RuntimeError:
            continue
        names.append(name)
    return names


def backends_among(*names, device=DEVICE):
    """Those of ``names`` that can serve ``device`` here, in the order given."""
    have = available_backends(device)
    return [n for n in names if n in have]


STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def tol(backend):
    return TOLERANCES.get(backend, KERNEL_TOLERANCE)


def assert_params_close(expected, actual, backend, msg=""):
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        torch.testing.assert_close(a.detach().float().cpu(), e.detach().float().cpu(), **tol(backend), msg=f"{msg} param {i}")


def assert_states_close(expected_opt, expected_params, actual_opt, actual_params, backend, keys=STATE_KEYS):
    """Params and every AdamW state tensor of two optimizers over the same parameter structure."""
    assert_params_close(expected_params, actual_params, backend, "params:")
    for i, (pe, pa) in enumerate(zip(expected_params, actual_params, strict=True)):
        se, sa = expected_opt.state[pe], actual_opt.state[pa]
        assert (not se) == (not sa), f"param {i}: state presence differs"
        for key in keys:
            assert (key in se) == (key in sa), f"param {i}: key {key!r} present in one state only"
            if key in se:
                torch.testing.assert_close(sa[key].float().cpu(), se[key].float().cpu(), **tol(backend), msg=f"param {i} state {key}")


def snapshot(opt, params):
    """Bitwise copies of params, main grads and every state tensor, for skip checks."""
    snap = {"params": [p.detach().clone() for p in params]}
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            snap[(i, key)] = value.clone()
    return snap


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        xs, ys = (a[key], b[key]) if key == "params" else ([a[key]], [b[key]])
        for x, y in zip(xs, ys, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                                                       y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8)), f"{key} changed"


def param(*shape, dtype=torch.float32):
    """A fresh random Parameter of ``shape``."""
    return torch.nn.Parameter(torch.randn(*shape).to(dtype))


def make_params(shapes, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def mlp(*widths, activation=torch.nn.Tanh, dtype=None, device=None, seed=0):
    """``Linear(widths[0], widths[1]), activation, Linear(...), ...``, initialised after ``manual_seed(seed)``."""
    torch.manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(fan_in, fan_out)] + ([activation()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


class ScalerRun(NamedTuple):
    scales: list  # the scale after each update
    collapse_warnings: list  # per update: the LossScaleCollapseWarnings it raised
    opt: object
    param: torch.nn.Parameter


def scaler_steps(scaler, pattern, backend, device, optimizer_cls=None, nan_loss=False) -> ScalerRun:
    """One ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` on a 3-element param per
    entry of ``pattern``; an entry of 1 overflows (an inf gradient, or with ``nan_loss`` a NaN loss).
    ``opt`` is ``FusedAmpAdamW`` on ``backend``, or ``optimizer_cls`` (torch's, for the stock trajectory)."""
    from ampfused.scaler import LossScaleCollapseWarning

    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = optimizer_cls([p], lr=0.1) if optimizer_cls else ampfused.FusedAmpAdamW([p], lr=0.1, backend=backend)
    scales, collapse = [], []
    for found in pattern:
        opt.zero_grad()
        loss = p.sum() * (math.nan if (found and nan_loss) else 1.0)
        scaler.scale(loss).backward()
        if found and not nan_loss:
            p.grad[1] = math.inf
        scaler.step(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.update()
        for w in caught:  # the others go on to pytest, as without the recording
            if not issubclass(w.category, LossScaleCollapseWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        collapse.append([w for w in caught if issubclass(w.category, LossScaleCollapseWarning)])
        scales.append(scaler.get_scale())
    return ScalerRun(scales, collapse, opt, p)


def clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def random_grads(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=g) * scale).to(device=p.device) for p in params]


# ------------------------------------------------------------------ compact state: (param, grad, state) entries


def clone_compact(entry):
    param, grad, state = entry
    return param.clone(), grad.clone(), {k: t.clone() for k, t in state.items()}


def through_disk(obj):
    """``obj`` after ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint file gives it back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def load_in_order(model, opt, model_sd, opt_sd, order):
    """A resumed script's loads: ``order`` "model first" or "optimizer first" (torch allows either)."""
    if order == "model first":
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
    else:
        opt.load_state_dict(opt_sd)
        model.load_state_dict(model_sd)


def bits(t):
    """``t``'s bits as integers of its element width (a float tensor may hold bit patterns that read
    as NaN: split16's low halves); a DTensor's local shard."""
    t = (t.to_local() if hasattr(t, "to_local") else t).detach()
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def equal_bits(a, b) -> bool:
    """Whether two tensors hold the same bits (dtype and shape included): ``torch.equal`` for state
    tensors whose bits are not numbers (split16's low halves read as bf16 may be NaN patterns)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.reshape(-1).view(width), b.reshape(-1).view(width)) if a.numel() else True


def same_bits(actual, expected, what):
    """Bitwise equality of two tensors (or arrays) of one dtype and shape, NaN == NaN whatever the payload."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    actual, expected = actual.reshape(-1), expected.reshape(-1)
    if actual.is_floating_point():
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
        actual, expected = actual[~nan].view(width), expected[~nan].view(width)
    bad = (actual != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {expected.numel()} differ, first at {bad[:4].tolist()}"


def assert_same_state(actual, expected, what=""):
    a_param, _, a_state = actual
    e_param, _, e_state = expected
    same_bits(a_param, e_param, f"{what} param")
    assert set(a_state) == set(e_state)
    for key in e_state:
        same_bits(a_state[key], e_state[key], f"{what} {key}")


COMPACT_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
MASTER_KEYS = ("master_param", "master_low16", "master_residual8")


def compact_hyper(amsgrad=False, maximize=False):
    from ampfused._batch import Hyper

    h = COMPACT_HYPER
    return Hyper(h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], amsgrad, maximize)


def shifted(t, offset):
    """t copied into a view that starts ``offset`` elements into its storage (0: t itself)."""
    if offset == 0:
        return t
    storage = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = storage[offset:].view(t.shape)
    view.copy_(t)
    return view


BLOCKWISE = ("int8", "int4")  # the state_dtypes of blockwise codes and scales


def compact_entry(n, param_dtype, master_weights, state_dtype, device, amsgrad=False, seed=0, offset=0):
    """(param, grad, compact state) on ``device`` with non-trivial moments and master; ``offset`` > 0
    makes every tensor a view that starts ``offset`` elements into its storage (no vector access).
    ``n``: a shape, or a number of elements: int8 / int4 moments then take a ``[1, n]`` param, one row,
    whose blocks are those of the flat vector (1-D params keep fp32 moments: [note: blocks in rows];
    int4 takes ``n`` rounded up to even: [note: int4 packing])."""
    from ampfused import _compact

    if isinstance(n, int):
        n = (1, n + n % 2 if state_dtype == "int4" else n) if state_dtype in BLOCKWISE else (n,)
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    fp32_state = {"step": torch.tensor(float(seed % 5 + 2)), "exp_avg": torch.randn(n, generator=gen) * 0.1,
                  "exp_avg_sq": torch.rand(n, generator=gen) * 0.01, "master_param": master}
    if amsgrad:
        fp32_state["max_exp_avg_sq"] = fp32_state["exp_avg_sq"] + torch.rand(n, generator=gen) * 0.01
    param = shifted(master.to(param_dtype).to(device), offset)
    grad = shifted(torch.randn(n, generator=gen).to(device), offset)
    state = _compact.encode_state(param, {k: t.to(device) for k, t in fp32_state.items()}, master_weights, state_dtype)
    state = {k: t if t.dim() == 0 or k.endswith("_scales") else shifted(t, offset) for k, t in state.items()}
    return param, grad, state


def update_lists(entries):
    """The backend update's per-tensor lists from [(param, grad, compact state)]."""
    out = dict(params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], max_exp_avg_sqs=[], steps=[], masters=[], moment_scales=[])
    for param, grad, state in entries:
        out["params"].append(param)
        out["grads"].append(grad)
        out["steps"].append(state["step"])
        out["masters"].append(next((state[k] for k in MASTER_KEYS if k in state), None))
        if "exp_avg_codes" in state:
            out["exp_avgs"].append(state["exp_avg_codes"])
            out["exp_avg_sqs"].append(state["exp_avg_sq_codes"])
            out["max_exp_avg_sqs"].append(state.get("max_exp_avg_sq_codes"))
            out["moment_scales"].append((state["exp_avg_scales"], state["exp_avg_sq_scales"], state.get("max_exp_avg_sq_scales")))
        else:
            out["exp_avgs"].append(state["exp_avg"])
            out["exp_avg_sqs"].append(state["exp_avg_sq"])
            out["max_exp_avg_sqs"].append(state.get("max_exp_avg_sq"))
            out["moment_scales"].append(None)
    return out


def stats_vector(factor=1.0, skip=0.0, device=DEVICE):
    """The stats slots grad_stats_ would have left: FACTOR and SKIP set, the rest zero."""
    from ampfused._contract import FACTOR, SKIP

    stats = torch.zeros(4, device=device)
    stats[FACTOR], stats[SKIP] = factor, skip
    return stats


def update_(backend, lists, group_ids, groups, stats, *, grad_scale=None, moment_scales=..., rounding_seed=None,
            element_base=None):
    """The one place tests/compact calls a backend's ``adamw_update_`` (over a ``_batch.Batch``):
    ``lists`` as ``update_lists`` builds them; ``moment_scales`` defaults to theirs."""
    if moment_scales is ...:
        moment_scales = lists.get("moment_scales")
    batch = batch_of(lists, group_ids, groups, moment_scales)
    batch.element_base = element_base
    backend.adamw_update_(batch, stats, grad_scale=grad_scale, rounding_seed=rounding_seed)


def batch_of(lists, group_ids, groups, moment_scales=...):
    """The ``_batch.Batch`` the backends' passes take, from ``update_lists``' dict."""
    from ampfused._batch import Batch

    if moment_scales is ...:
        moment_scales = lists.get("moment_scales")
    return Batch(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"], lists["max_exp_avg_sqs"],
                 lists["steps"], lists["masters"], group_ids, groups, moment_scales)


def compact_update(backend, entries, amsgrad=False, maximize=False, factor=1.0, skip=0.0, grad_scale=None,
                   rounding_seed=None, hypers=None, group_ids=None, element_base=None):
    """One ``backend.adamw_update_`` of ``entries``: one group of COMPACT_HYPER unless ``hypers`` (a list of
    ``Hyper``) and ``group_ids`` say otherwise; the stats slots set; ``element_base``: each entry's
    first element's index in its whole tensor (a shard's offset; None: 0)."""
    hypers = hypers or [compact_hyper(amsgrad, maximize)]
    group_ids = [0] * len(entries) if group_ids is None else list(group_ids)
    update_(backend, update_lists(entries), group_ids, hypers, stats_vector(factor, skip, entries[0][0].device),
            grad_scale=grad_scale, rounding_seed=rounding_seed, element_base=element_base)


def decoded_twin(entry):
    """The same state in the plain layout: fp32 moments and fp32 master (decoded), which the fp32 paths step."""
    from ampfused import _compact

    param, grad, state = entry
    return param.clone(), grad.clone(), {k: t.clone() for k, t in _compact.decode_state(state, param).items()}


# ------------------------------------------------------------------ compact update harness (tests/compact)


class Kernel:
    """One backend's update pass under test in tests/compact (tests/compact/conftest.py builds them):
    the module with ``adamw_update_``, the device of its tensors, and the sizes its geometry needs.

    ``unit``: the elements one work unit takes (65536-element CPU ranges and CUDA chunks, a Triton
    chunk); ``n``: a size with a ragged tail past the first unit; ``sr_n``: enough elements for the
    stochastic-rounding statistics. ``spec_bitwise``: the moments (int8 codes and scales too) and
    step equal the spec's torch-op step bit for bit, not only within a grid step. ``master_rtol``:
    how far a decoded split master may sit from the spec's. ``checks``: the op validates its inputs
    (the CUDA host emulation only runs the device code)."""

    def __init__(self, name, backend, device, n, sr_n, unit, spec_bitwise=False, master_rtol=None, checks=True):
        self.name, self.backend, self.device, self.n, self.sr_n = name, backend, torch.device(device), n, sr_n
        self.unit = unit
        self.spec_bitwise, self.checks = spec_bitwise, checks
        self.master_rtol = master_rtol or {"master_low16": 1e-6, "master_residual8": 1e-6}

    def __repr__(self):
        return self.name

    def size(self, size, state_dtype):
        """A mode's size: "n" (int8 / int4 moments need SMALL_TENSOR_NUMEL elements; int4 an even count), or an int."""
        from ampfused import _compact as C

        if size != "n":
            return size
        n = max(self.n, C.SMALL_TENSOR_NUMEL + 300) if state_dtype in BLOCKWISE else self.n
        return n + n % 2 if state_dtype == "int4" else n

    def entry(self, n, param_dtype, master_weights, state_dtype, amsgrad=False, seed=0, offset=0):
        return compact_entry(n, param_dtype, master_weights, state_dtype, self.device, amsgrad, seed, offset)

    def step(self, entries, **kwargs):
        compact_update(self.backend, entries, **kwargs)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# (param dtype, master_weights, state_dtype, size): every pair the compact kernels serve, at the
# kernel's size ("n") and at the int8 threshold's edges (int8 moments from SMALL_TENSOR_NUMEL on)
def _modes():
    import pytest
    from ampfused import _compact as C

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    rows = [
        (bf16, "split16", fp32, "n", "split16"), (bf16, "split16", bf16, "n", "split16-bf16-moments"),
        (bf16, "split8", fp32, "n", "split8-bf16"), (bf16, "split8", bf16, "n", "split8-bf16-bf16-moments"),
        (fp16, "split8", fp32, "n", "split8-fp16"), (fp16, "split8", bf16, "n", "split8-fp16-bf16-moments"),
        (bf16, "fp32", bf16, "n", "bf16-moments"), (fp16, "fp32", bf16, "n", "fp16-param-bf16-moments"),
        (bf16, "none", bf16, "n", "no-master-bf16-moments"), (fp16, "none", bf16, "n", "no-master-fp16-bf16-moments"),
        (fp32, "fp32", bf16, "n", "fp32-param-bf16-moments"),
        (bf16, "split16", "int8", "n", "split16-int8"), (bf16, "split8", "int8", "n", "split8-int8"),
        (fp16, "split8", "int8", "n", "split8-fp16-int8"), (bf16, "fp32", "int8", "n", "fp32-master-int8"),
        (bf16, "none", "int8", "n", "no-master-int8"), (fp32, "fp32", "int8", "n", "fp32-int8"),
        (fp32, "fp32", "int8", C.SMALL_TENSOR_NUMEL, "fp32-int8-one-block-row"),
        (bf16, "split8", "int8", C.SMALL_TENSOR_NUMEL - 1, "below-int8-threshold"),
        (bf16, "split16", "int4", "n", "split16-int4"), (bf16, "split8", "int4", "n", "split8-int4"),
        (fp16, "split8", "int4", "n", "split8-fp16-int4"), (bf16, "fp32", "int4", "n", "fp32-master-int4"),
        (bf16, "none", "int4", "n", "no-master-int4"), (fp32, "fp32", "int4", "n", "fp32-int4"),
        (fp32, "fp32", "int4", C.SMALL_TENSOR_NUMEL, "fp32-int4-one-block-row"),
        (bf16, "split8", "int4", C.SMALL_TENSOR_NUMEL - 2, "below-int4-threshold"),
    ]
    return [pytest.param(*row[:4], id=row[4]) for row in rows]


UPDATE_MODES = _modes()


def spec_step(param, grad, state, hyper, factor=1.0, skip=0.0, stochastic=False):
    """``_compact.compact_adamw_step_`` (the specification) of one entry under ``hyper`` (a ``Hyper``)."""
    from ampfused import _compact as C

    C.compact_adamw_step_(param, grad, state, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
                          weight_decay=hyper.weight_decay, amsgrad=hyper.amsgrad, maximize=hyper.maximize,
                          factor=torch.tensor(float(factor), device=param.device),
                          skip=torch.tensor(float(skip), device=param.device), stochastic_rounding=stochastic,
                          generator=torch.Generator(param.device).manual_seed(1) if stochastic else None)


def encoded(twin, master_weights, state_dtype, like=()):
    """The fp32 path's results (a decoded twin after its step) encoded by the specification; int8 codes
    too for the moments ``like`` (a state's keys) holds as codes under SMALL_TENSOR_NUMEL. The int8
    scales of ``quantize(.., "sqrt")`` take a correctly rounded sqrt, as the kernels' sqrt_rn."""
    from ampfused import _compact as C

    param, grad, state = twin
    param = param.clone()
    out = C.encode_state(param, state, master_weights, state_dtype)
    for key in C.MOMENTS:
        if key + "_codes" in like and key in out:
            del out[key]
            quantize = C.quantize4 if state_dtype == "int4" else C.quantize
            out[key + "_codes"], out[key + "_scales"] = quantize(state[key], "signed" if key == "exp_avg" else "sqrt")
    return param, grad, out


def assert_close_to_spec(kernel, actual, expected, what):
    """A kernel's compact step against ``compact_adamw_step_`` (torch ops, whose fp32 division and sqrt
    may round an ulp differently): the param within its rounding, a decoded master within
    ``kernel.master_rtol``; the moments and step bitwise where ``kernel.spec_bitwise``, else an
    encoding at most one grid step off."""
    from ampfused import _compact as C

    (a_param, _, a_state), (e_param, _, e_state) = actual, expected
    assert a_state.keys() == e_state.keys(), what
    torch.testing.assert_close(a_param.float(), e_param.float(), rtol=2 ** -7, atol=1e-5, msg=f"{what} param")
    for key in e_state:
        got, want = a_state[key], e_state[key]
        if key in ("master_low16", "master_residual8"):
            torch.testing.assert_close(C.decode_state(a_state, a_param)["master_param"],
                                       C.decode_state(e_state, e_param)["master_param"],
                                       rtol=kernel.master_rtol[key], atol=1e-7, msg=f"{what} master")
        elif kernel.spec_bitwise and key != "master_param":
            same_bits(got, want, f"{what} {key}")
        elif key.endswith("_codes"):
            if C.moment_encoding(a_state["exp_avg_codes"]) == "int4":
                got, want = C.unpack4(got), C.unpack4(want)
            assert (got.int() - want.int()).abs().max().item() <= 1, f"{what} {key}: a code more than one grid step off"
        elif got.dtype == torch.bfloat16:
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0, msg=f"{what} {key}")
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{what} {key}")


def check_step(kernel, entries, modes, hypers=None, group_ids=None, against_spec=True, **kwargs):
    """One ``kernel`` step of ``entries`` (compact; ``modes``: their (master_weights, state_dtype)),
    each held bit for bit to the kernel's fp32 path on its decoded state (the "twin") with the results
    encoded by the specification, and close to the spec's own step (``against_spec=False``: int8
    states under SMALL_TENSOR_NUMEL, which the spec would re-encode as fp32). Returns the twins."""
    amsgrad, maximize = kwargs.pop("amsgrad", False), kwargs.pop("maximize", False)
    hypers = hypers or [compact_hyper(amsgrad, maximize)]
    group_ids = [0] * len(entries) if group_ids is None else list(group_ids)
    twins = [decoded_twin(e) for e in entries]
    spec = [clone_compact(e) for e in entries]
    kernel.step(entries, hypers=hypers, group_ids=group_ids, **kwargs)
    kernel.step(twins, hypers=hypers, group_ids=group_ids, **kwargs)
    for i, (entry, twin, ref, (master_weights, state_dtype)) in enumerate(zip(entries, twins, spec, modes, strict=True)):
        what = f"{kernel.name} tensor {i} ({master_weights}/{state_dtype})"
        assert_same_state(entry, encoded(twin, master_weights, state_dtype, like=set(entry[2])), what)
        if against_spec:
            spec_step(*ref, hypers[group_ids[i]], factor=kwargs.get("factor", 1.0))
            assert_close_to_spec(kernel, entry, ref, what)
    return twins


def constant_entry(n, state_dtype, device, amsgrad=True):
    """Every element alike, zero grads: each write is one fp32 value strictly between two bf16 values
    (exp_avg 0.9: 0.4 of a bf16 ulp above the lower one, exp_avg_sq 0.999: 0.75), so round to nearest
    is biased and stochastic rounding must average to the fp32 value. The AMSGrad buffer starts below
    the new exp_avg_sq."""
    param = torch.ones(n, dtype=torch.bfloat16, device=device)
    state = {"step": torch.tensor(4.0, device=device), "exp_avg": torch.ones(n, device=device).to(state_dtype),
             "exp_avg_sq": torch.ones(n, device=device).to(state_dtype)}
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros(n, device=device).to(state_dtype)
    return param, torch.zeros(n, device=device), state


# ------------------------------------------------------------------ compact modes through the optimizer (tests/compact)


# one tensor with int8 moments (2-D, >= SMALL_TENSOR_NUMEL; rows of 100: no whole number of blocks), two small ones
OPT_SIZES = ((43, 100), (1000,), (17,))


OPT_SCALE = 1024.0  # a power of two: unscaling is exact on every backend


OPT_MODES = [("fp32", None), ("split16", None), ("split8", None), (False, None), ("fp32", torch.bfloat16),
             ("fp32", "int8"), ("split16", torch.bfloat16), ("split8", "int8"), (False, "int8"), (False, torch.bfloat16),
             ("fp32", "int4"), ("split16", "int4"), (False, "int4")]


OPT_LOSSY = [m for m in OPT_MODES if m not in (("fp32", None), ("split16", None))]


def modes_needed(master_weights, state_dtype, stochastic=False):
    modes = {"split16": {"split16"}, "split8": {"split8"}}.get(master_weights, set())
    modes |= {torch.bfloat16: {"bf16"}, "int8": {"int8"}, "int4": {"int4"}}.get(state_dtype, set())
    if stochastic:
        modes.add("sr")
    return modes


def serves_natively(backend, modes) -> bool:
    return set(modes) <= getattr(_backends.resolve(backend, DEVICE)[0], "COMPACT_MODES", frozenset())


def opt_params(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(n, generator=g) / 4).to(dtype).to(DEVICE)) for n in OPT_SIZES]


def clone_parameters(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def feed(opt, params, step, bad=False):
    """Scaled gradients (as a GradScaler leaves them) for ``step``; ``bad`` poisons one element."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * OPT_SCALE
        if bad and i == 0:
            grad.view(-1)[123] = float("inf")
        p.grad = grad.to(p.dtype).to(DEVICE)
    opt.grad_scale = torch.tensor(OPT_SCALE, device=DEVICE)  # torch's scaler protocol (_step_supports_amp_scaling)


def run_steps(opt, params, steps, bad_steps=(4,), first=0):
    for step in range(first, first + steps):
        feed(opt, params, step, bad=step in bad_steps)
        opt.step()
        opt.zero_grad()


def full_state(opt, params):
    """Every param's state decoded to fp32 (and its master), through the public converter."""
    from ampfused.checkpoint import to_torch_state_dict

    sd = to_torch_state_dict(opt.state_dict(), params)
    return [sd["state"][i] for i in range(len(params))]

