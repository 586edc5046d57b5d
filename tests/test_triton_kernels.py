"""Pass-level checks of the Triton kernels against ampfused.reference.

On a CPU machine these run in the Triton interpreter (conftest sets TRITON_INTERPRET=1); on a GPU
machine, compiled. Sizes cross the kernels' block and chunk boundaries (see kernels/_runtime.py).
"""
import math
import os

import pytest
import torch

from ampfused import _backends, reference
from ampfused.functional import Hyper

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as conftest picks it
kernels, _reason = _backends.probe("triton")
if kernels is None or kernels.supports(DEVICE):
    pytest.skip(f"triton backend unavailable on {DEVICE}: {_reason or kernels.supports(DEVICE)}", allow_module_level=True)

from ampfused.kernels import _runtime, _tables  # noqa: E402

FP32_TOL = dict(rtol=1e-6, atol=1e-7)
LOW = (torch.float16, torch.bfloat16)
ODD_SIZES = (1, 97, 1025, 65537)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def case(sizes, param_dtypes, grad_dtypes=None, *, masters=None, amsgrad=None, seed=0, step=3.0):
    """Parallel lists for adamw_update_ (on DEVICE); masters default to one per fp16/bf16 param."""
    g = gen(seed)
    n = len(sizes)
    grad_dtypes = grad_dtypes or param_dtypes
    masters = masters if masters is not None else [d in LOW for d in param_dtypes]
    amsgrad = amsgrad or [False] * n

    def rnd(size, scale=1.0, positive=False):
        x = torch.rand(size, generator=g) if positive else torch.randn(size, generator=g)
        return (x * scale).to(DEVICE)

    params = [rnd(s).to(d) for s, d in zip(sizes, param_dtypes)]
    return dict(
        params=params,
        grads=[rnd(s).to(d) for s, d in zip(sizes, grad_dtypes)],
        exp_avgs=[rnd(s, 0.1) for s in sizes],
        exp_avg_sqs=[rnd(s, 0.01, positive=True) for s in sizes],
        max_exp_avg_sqs=[rnd(s, 0.02, positive=True) if a else None for s, a in zip(sizes, amsgrad)],
        steps=list(torch.full((n,), step, device=DEVICE).unbind()),
        masters=[p.float() + rnd(p.numel()).mul_(1e-3) if m else None for p, m in zip(params, masters)],
    )


def clone(c):
    return {k: [None if t is None else t.clone() for t in v] for k, v in c.items()}


def update(module, c, hypers, factor=1.0, skip=0.0):
    module.adamw_update_(c["params"], c["grads"], c["exp_avgs"], c["exp_avg_sqs"], c["max_exp_avg_sqs"], c["steps"],
                         c["masters"], hypers, torch.tensor(factor, device=DEVICE), torch.tensor(skip, device=DEVICE))


def assert_matches_reference(got, want):
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps"):
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            if b is not None:
                torch.testing.assert_close(a, b, **FP32_TOL, msg=f"{key}[{i}]")
    for i, (p, q, master) in enumerate(zip(got["params"], want["params"], got["masters"])):
        assert p.dtype == q.dtype
        if master is not None:  # the param is exactly the RNE rounding of the kernel's own master
            assert torch.equal(p, master.to(p.dtype)), f"params[{i}] is not round-to-nearest-even of its master"
        elif p.dtype == torch.float32:
            torch.testing.assert_close(p, q, **FP32_TOL, msg=f"params[{i}]")
        else:  # low precision without master: at most one ulp of the param's dtype apart
            torch.testing.assert_close(p.float(), q.float(), rtol=2 ** -7, atol=1e-6, msg=f"params[{i}]")


def run_both(c, hypers, **kw):
    want = clone(c)
    update(kernels, c, hypers, **kw)
    update(reference, want, hypers, **kw)
    assert_matches_reference(c, want)
    return c, want


# ------------------------------------------------------------------------------------------ update

@pytest.mark.parametrize("size", ODD_SIZES)
def test_update_odd_sizes_fp32(size):
    hyper = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False, False)
    run_both(case([size], [torch.float32]), [hyper], factor=0.5)


def test_update_mixed_dtypes_one_call():
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.float32]
    grad_dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float16]
    sizes = [1025, 97, 1, 2049, 300, 0]
    masters = [False, True, True, False, False, False]  # low-precision params without master: fp32 math, rounded back
    hyper = Hyper(3e-3, 0.9, 0.999, 1e-8, 0.1, False, False)
    c, _ = run_both(case(sizes, dtypes, grad_dtypes, masters=masters), [hyper] * len(sizes), factor=0.25)
    assert all(float(s) == 4.0 for s in c["steps"])  # advanced once, zero-size tensor included


def test_update_many_tiny_tensors_several_groups():
    n = 300
    sizes = [1 + (i * 7) % 23 for i in range(n)]
    dtypes = [(torch.float32, torch.bfloat16, torch.float16)[i % 3] for i in range(n)]
    groups = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False), Hyper(5e-3, 0.8, 0.99, 1e-6, 0.0, True, False),
              Hyper(2e-3, 0.95, 0.9, 1e-7, 0.2, False, True)]
    hypers = [groups[i % 3] for i in range(n)]
    c = case(sizes, dtypes, amsgrad=[h.amsgrad for h in hypers], seed=1)
    c["steps"] = list(torch.arange(n, dtype=torch.float32, device=DEVICE).unbind())  # every tensor its own step
    c, _ = run_both(c, hypers, factor=0.7)
    assert [float(s) for s in c["steps"]] == [float(i + 1) for i in range(n)]


@pytest.mark.parametrize("amsgrad,maximize", [(True, False), (False, True), (True, True)])
def test_update_amsgrad_maximize(amsgrad, maximize):
    hyper = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, amsgrad, maximize)
    sizes = [1025, 97]
    run_both(case(sizes, [torch.float32, torch.bfloat16], amsgrad=[amsgrad] * 2, seed=2), [hyper] * 2)


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
def test_update_tensor_lr_is_read_at_each_launch(lr_dtype):
    lr = torch.tensor(1e-2, dtype=lr_dtype, device=DEVICE)
    hyper = Hyper(lr, 0.9, 0.999, 1e-8, 0.01, False, False)
    c = case([1025, 97], [torch.float32, torch.float16], seed=3)
    want = clone(c)
    for value in (1e-2, 3e-3, 0.0):
        lr.fill_(value)  # in place, as LR schedulers do: the cached group table points at it
        update(kernels, c, [hyper, hyper])
        update(reference, want, [hyper, hyper])
        assert_matches_reference(c, want)


def test_update_float_lr_change_and_large_step():
    c = case([97], [torch.float32], step=12345.0)
    want = clone(c)
    for lr in (1e-3, 2e-3):
        hypers = [Hyper(lr, 0.9, 0.999, 1e-8, 0.01, False, False)]
        update(kernels, c, hypers)
        update(reference, want, hypers)
        assert_matches_reference(c, want)


@pytest.mark.parametrize("skip", [1.0, math.nan])
def test_skip_leaves_everything_bitwise_unchanged(skip):
    hyper = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False)
    sizes = [1025, 97, 1]
    c = case(sizes, [torch.float32, torch.bfloat16, torch.float16], amsgrad=[True] * 3)
    before = clone(c)
    update(kernels, c, [hyper] * 3, skip=skip)
    for key, tensors in before.items():
        for a, b in zip(c[key], tensors):
            if b is not None:
                assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), key


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy fp16 cast, on purpose
@pytest.mark.parametrize("dtype", LOW)
def test_param_write_back_rounds_to_nearest_even(dtype):
    # lr = 0 and no decay: the master is unchanged and the param must be exactly master.to(dtype),
    # for ties, values that round to inf, subnormals, signed zeros and NaN.
    info = torch.finfo(dtype)
    ties = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(1.0 + 2.0 ** -8)])
    special = torch.tensor([0.0, -0.0, info.max, -info.max, info.max * (1 + 2.0 ** -9), info.tiny / 3, -info.tiny / 5,
                            math.nan, math.inf, -math.inf, 3.14159265, -2.71828, 1e-30, 65519.0, 65521.0])
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=gen(4), dtype=torch.int64).to(torch.int32)
    randoms = bits.view(torch.float32)
    randoms = randoms[torch.isfinite(randoms)]
    master = torch.cat([ties, special, randoms]).to(DEVICE)
    n = master.numel()
    c = dict(params=[torch.zeros(n, dtype=dtype, device=DEVICE)], grads=[torch.zeros(n, device=DEVICE)],
             exp_avgs=[torch.zeros(n, device=DEVICE)], exp_avg_sqs=[torch.zeros(n, device=DEVICE)],
             max_exp_avg_sqs=[None], steps=[torch.zeros((), device=DEVICE)], masters=[master.clone()])
    update(kernels, c, [Hyper(0.0, 0.9, 0.999, 1e-8, 0.0, False, False)])
    assert torch.equal(c["masters"][0].view(torch.int32), master.view(torch.int32))
    want = master.to(dtype)
    got = c["params"][0]
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {n} roundings differ"


# ------------------------------------------------------------------------------------------- stats

@pytest.mark.parametrize("with_scale", [False, True])
def test_stats_mixed_dtypes_and_sizes(with_scale):
    g = gen(5)
    grads = [(torch.randn(s, generator=g) * 100).to(DEVICE, d) for s, d in
             zip(ODD_SIZES + (0, 3), (torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32, torch.bfloat16))]
    inv_scale = torch.tensor(1 / 1024, device=DEVICE) if with_scale else None
    got = torch.full((), 2.0, device=DEVICE)  # the pass adds into sumsq
    want = torch.full((), 2.0, device=DEVICE)
    kernels.grad_stats_(grads, inv_scale, got)
    reference.grad_stats_(grads, inv_scale, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_stats_many_tiny_tensors_and_determinism():
    grads = [torch.randn(1 + i % 5, generator=gen(i)).to(DEVICE) for i in range(300)]
    sums = []
    for _ in range(2):
        sumsq = torch.zeros((), device=DEVICE)
        kernels.grad_stats_(grads, None, sumsq)
        sums.append(sumsq)
    want = torch.zeros((), device=DEVICE)
    reference.grad_stats_(grads, None, want)
    torch.testing.assert_close(sums[0], want, rtol=1e-5, atol=0)
    assert torch.equal(sums[0], sums[1])  # fixed reduction order: bitwise reproducible


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stats_non_finite_makes_sumsq_non_finite(bad, dtype):
    grads = [torch.randn(1025).to(DEVICE), torch.randn(97).to(DEVICE, dtype)]
    grads[1][50] = bad
    sumsq = torch.zeros((), device=DEVICE)
    kernels.grad_stats_(grads, torch.tensor(0.5, device=DEVICE), sumsq)
    assert not bool(torch.isfinite(sumsq))


# -------------------------------------------------------------------------------------- accumulate

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", (1, 97, 4097))
def test_accumulate_is_exact(dtype, size):
    main_grad = torch.randn(size, generator=gen(6)).to(DEVICE)
    grad = torch.randn(size, generator=gen(7)).to(DEVICE, dtype)
    want = main_grad.clone()
    reference.accumulate_(want, grad)
    kernels.accumulate_(main_grad, grad)
    assert torch.equal(main_grad, want)


def test_accumulate_non_contiguous_grad():
    main_grad = torch.zeros(6, 4, device=DEVICE)
    grad = torch.randn(4, 6, generator=gen(8)).to(DEVICE, torch.bfloat16).t()
    kernels.accumulate_(main_grad, grad)
    assert torch.equal(main_grad, grad.float())


# ---------------------------------------------------------------------------------- pointer tables

def test_tables_rebuilt_when_a_pointer_changes_and_cache_stays_small():
    hyper = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.0, False, False)
    c = case([97, 33], [torch.float32, torch.float32], seed=9)
    want = clone(c)
    for i in range(_tables.CACHE_SIZE + 3):
        fresh = [torch.randn(t.shape, generator=gen(100 + i)).to(DEVICE) for t in c["grads"]]
        c["grads"], want["grads"] = fresh, [t.clone() for t in fresh]  # new addresses: new tables
        update(kernels, c, [hyper] * 2)
        update(reference, want, [hyper] * 2)
        assert_matches_reference(c, want)
    assert all(len(lru) <= _tables.CACHE_SIZE for lru in _tables._cache.values())


def test_chunk_layout():
    layout = _tables.chunk_layout([0, 3, _runtime.CHUNK * 2 + 1], _runtime.CHUNK).tolist()
    assert layout == [[1, 0], [2, 0], [2, _runtime.CHUNK], [2, 2 * _runtime.CHUNK]]
    assert _tables.chunk_layout([0, 0], 8).tolist() == [[0, 0]]  # one empty program still runs the epilogue


def test_update_rejects_non_contiguous_param():
    param = torch.zeros(4, 6, device=DEVICE).t()
    c = dict(params=[param], grads=[torch.zeros(6, 4, device=DEVICE)], exp_avgs=[torch.zeros(6, 4, device=DEVICE)],
             exp_avg_sqs=[torch.zeros(6, 4, device=DEVICE)], max_exp_avg_sqs=[None],
             steps=[torch.zeros((), device=DEVICE)], masters=[None])
    with pytest.raises(ValueError, match="not contiguous"):
        update(kernels, c, [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)])


# ------------------------------------------------------------------------------ compiled for a GPU

COMPILE_FOR_SM90 = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ampfused.kernels import accumulate, adamw, stats

def compile_ptx(fn, signature, constexprs, **options):
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

sizes = dict(BLOCK=1024, CHUNK=8192, TABLE_BLOCK=1024)
for aligned in (True, False):
    ptx = compile_ptx(adamw._adamw_update_kernel,
                      dict(rows="*i64", chunks="*i64", groups="*i64", factor_ptr="*fp32", skip_ptr="*fp32",
                           retired_ptr="*i32", n_tensors="i32", n_programs="i32"),
                      dict(sizes, ALIGNED=aligned, EMULATE_FMA=False), num_warps=4, enable_fp_fusion=False)
    assert "approx" not in ptx and "__nv_" not in ptx, "update: approximate math or libdevice"
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert ("ld.global.v4" in ptx) == aligned, "update: 16-byte vector loads exactly when aligned"
    for has_scale in (True, False):
        ptx = compile_ptx(stats._grad_stats_kernel,
                          dict(rows="*i64", chunks="*i64", inv_scale_ptr="*fp32", sumsq_ptr="*fp32",
                               partials_ptr="*fp32", retired_ptr="*i32", n_programs="i32"),
                          dict(sizes, HAS_INV_SCALE=has_scale, ALIGNED=aligned), num_warps=4)
        assert "__nv_" not in ptx and "atom.global.gpu.acq_rel.add" in ptx
# Triton turns an int argument equal to 1 into a constant: one tensor, one program
compile_ptx(adamw._adamw_update_kernel,
            dict(rows="*i64", chunks="*i64", groups="*i64", factor_ptr="*fp32", skip_ptr="*fp32", retired_ptr="*i32"),
            dict(sizes, n_tensors=1, n_programs=1, ALIGNED=True, EMULATE_FMA=False), num_warps=4, enable_fp_fusion=False)
compile_ptx(stats._grad_stats_kernel,
            dict(rows="*i64", chunks="*i64", inv_scale_ptr="*fp32", sumsq_ptr="*fp32", partials_ptr="*fp32", retired_ptr="*i32"),
            dict(sizes, n_programs=1, HAS_INV_SCALE=False, ALIGNED=True), num_warps=4)
for bf16 in (True, False):
    compile_ptx(accumulate._accumulate_kernel, dict(main_grad_ptr="*fp32", grad_ptr="*i16" if bf16 else "*fp16", numel="i32"),
                dict(GRAD_IS_BF16=bf16, BLOCK=2048), num_warps=4)
print("compiled")
"""


def test_kernels_compile_for_a_gpu_without_one():
    """The GPU code path, compiled for sm_90 on any machine (Triton ships ptxas): CI without a GPU
    still catches what the interpreter accepts but the compiler refuses."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # cwd outside the checkout: `python -c` would import the source tree, which has no ampfused.kernels
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=600, cwd="/")
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


def test_tables_built_during_capture_are_kept_and_never_served_eagerly(monkeypatch):
    """A table built while a stream captures is only filled when the graph replays: eager calls must
    build their own, captures must keep getting (and never free) the captured one."""
    capturing = {"now": True}
    monkeypatch.setattr(_tables, "capturing", lambda device: capturing["now"])
    built = []

    def build():
        built.append(object())
        return built[-1]

    key = ("test-capture", len(built), id(build))
    cpu = torch.device("cpu")
    captured = _tables.cached("test", key, cpu, build)
    capturing["now"] = False
    eager = _tables.cached("test", key, cpu, build)
    assert eager is not captured and len(built) == 2
    assert _tables.cached("test", key, cpu, build) is eager
    capturing["now"] = True
    assert _tables.cached("test", key, cpu, build) is captured and len(built) == 2
    capturing["now"] = False
    for _ in range(3 * _tables.CACHE_SIZE):  # eager LRU churn never frees the captured entry
        _tables.cached("test", object(), cpu, build)
    assert _tables._kept[key] is captured
