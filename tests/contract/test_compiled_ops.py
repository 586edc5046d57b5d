"""What only the compiled extension ampfused._C has: op registrations (torch.library.opcheck),
argument validation, the build (OpenMP threads), the ops a step dispatches, CUDA graph capture,
and exact fp16 conversions under flush-to-zero. The passes themselves are checked on every
backend in tests/contract/test_passes.py.
"""
import copy
import os

import pytest
import torch

import ampfused
from ampfused import _compiled, reference
from ampfused._batch import Batch, Hyper
import testing_extension
from test_passes import assert_update_close, make_tensors

_CPU_BACKEND, _CPU_REASON = _compiled.get_backend("cpu")
pytestmark = pytest.mark.skipif(_CPU_BACKEND is None, reason=f"compiled backend unavailable: {_CPU_REASON}")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def backend_for(device):
    backend, why = _compiled.get_backend(device)
    if backend is None:
        pytest.fail(f"the {device} kernels of ampfused._C are unavailable on a machine with a {device} device: {why}")
    return backend


# ------------------------------------------------------------------------- op registration


def update_args(device, dtype=torch.bfloat16, amsgrad=True):
    t = make_tensors((33, 4), dtype, torch.float32, dtype != torch.float32, amsgrad, seed=11, device=device)
    lr_tensor = torch.tensor(1e-3, device=device)
    none = torch.empty(0, device=device)  # the op's stand-in for None
    vmaxs = [none if x is None else x for x in t[4]]
    masters = [none if x is None else x for x in t[6]]
    return (t[0], t[1], t[2], t[3], vmaxs, t[5], masters, [0, 1], [1e-3, 0.0], [None, lr_tensor], [0.9, 0.8], [0.999, 0.99],
            [1e-8, 1e-6], [0.01, 0.0], [1 if amsgrad else 0, 3 if amsgrad else 2],
            torch.tensor([0.0, 0.0, 0.5, 0.0], device=device))


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("test_utils", OPCHECK_TESTS)
def test_opcheck_adamw_update(device, test_utils):
    backend_for(device)
    for dtype, amsgrad in ((torch.bfloat16, True), (torch.float32, False)):
        torch.library.opcheck(torch.ops.ampfused.adamw_update.default, update_args(device, dtype, amsgrad), test_utils=test_utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("test_utils", OPCHECK_TESTS)
def test_opcheck_grad_stats(device, test_utils):
    backend_for(device)
    grads = [torch.randn(n, device=device).to(dtype) for n, dtype in ((33, torch.float32), (7, torch.bfloat16))]
    for scale, found_inf, clip in ((None, None, None), (torch.tensor([4.0], device=device), torch.zeros(1, device=device), 1.0)):
        torch.library.opcheck(torch.ops.ampfused.grad_stats.default, (grads, scale, found_inf, clip, torch.zeros(4, device=device)),
                              test_utils=test_utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("test_utils", OPCHECK_TESTS)
def test_opcheck_scaler_update(device, test_utils):
    backend_for(device)
    args = (torch.ones(1, device=device), torch.full((1,), 8.0, device=device), torch.zeros(1, dtype=torch.int32, device=device),
            torch.ones(1, dtype=torch.int32, device=device), torch.zeros((), dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.float64, device=device),
            2.0, 0.5, 3, 1, None)
    torch.library.opcheck(torch.ops.ampfused.scaler_update.default, args, test_utils=test_utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("test_utils", OPCHECK_TESTS)
def test_opcheck_accumulate(device, test_utils):
    backend_for(device)
    for dtype in (torch.float32, torch.float16):
        args = (torch.randn(2, 33, device=device), torch.randn(2, 33, device=device).to(dtype))
        torch.library.opcheck(torch.ops.ampfused.accumulate.default, args, test_utils=test_utils)


def test_ops_validate_inputs():
    good = update_args("cpu", torch.float32, False)
    bad_lengths = list(good)
    bad_lengths[1] = good[1] + good[1]
    with pytest.raises(RuntimeError, match="equal lengths"):
        torch.ops.ampfused.adamw_update(*bad_lengths)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.ampfused.accumulate(torch.zeros(3, dtype=torch.float16), torch.zeros(3))
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.ampfused.accumulate(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        torch.ops.ampfused.grad_stats([torch.zeros(3, dtype=torch.float64)], None, None, None, torch.zeros(4))
    with pytest.raises(RuntimeError, match="stats must be"):
        torch.ops.ampfused.grad_stats([torch.zeros(3)], None, None, None, torch.zeros(()))
    bad_layout = list(update_args("cpu", torch.float32, False))
    bad_layout[0] = [bad_layout[0][0].view(3, 11), bad_layout[0][1]]
    bad_layout[1] = [bad_layout[1][0].view(3, 11), bad_layout[1][1]]
    bad_layout[2] = [torch.zeros(11, 3).t(), bad_layout[2][1]]  # dense, but not the param's element order
    with pytest.raises(RuntimeError, match="laid out in memory"):
        torch.ops.ampfused.adamw_update(*bad_layout)


@pytest.mark.parametrize("device", DEVICES)
def test_moment_scales_are_checked_before_anything_is_written(device):
    """moment_scales: three entries per tensor, fp32 scales of ceil(n / 256) elements for int8 / int4
    codes, empty for the others; a kernel without int8 (int4) moments refuses the codes themselves. int4
    codes (a uint8 exp_avg) are n / 2 bytes of a contiguous param whose last dimension is even."""
    backend = backend_for(device)
    args = list(update_args(device, torch.float32, True))
    none = torch.empty(0, device=device)
    before = [t.clone() for t in args[0]]
    with pytest.raises(RuntimeError, match="three entries per tensor"):
        torch.ops.ampfused.adamw_update(*args, None, None, None, [none] * 5)
    with pytest.raises(RuntimeError, match="not int8 or int4 codes"):
        torch.ops.ampfused.adamw_update(*args, None, None, None, [torch.ones(1, device=device)] + [none] * 5)
    codes = list(args)
    n = args[0][0].numel()
    codes[2] = [torch.zeros(n, dtype=torch.int8, device=device), args[2][1]]
    codes[3] = [torch.zeros(n, dtype=torch.uint8, device=device), args[3][1]]
    codes[4] = [torch.zeros(n, dtype=torch.uint8, device=device), args[4][1]]
    one = torch.ones(1, device=device)  # ceil(33 / 256) scales
    if "int8" not in backend.COMPACT_MODES:
        with pytest.raises(RuntimeError, match="int8 moments are not served"):
            torch.ops.ampfused.adamw_update(*codes, None, None, None, [one, one, one] + [none] * 3)
    else:
        with pytest.raises(RuntimeError, match="moment_scales is None"):
            torch.ops.ampfused.adamw_update(*codes)
        with pytest.raises(RuntimeError, match="must be a contiguous float32 tensor of 1 elements"):
            torch.ops.ampfused.adamw_update(*codes, None, None, None, [one, torch.ones(2, device=device), one] + [none] * 3)
        mixed = list(codes)
        mixed[3] = [args[3][0], args[3][1]]  # fp32 exp_avg_sq with int8 exp_avg
        with pytest.raises(RuntimeError, match="share one dtype"):
            torch.ops.ampfused.adamw_update(*mixed, None, None, None, [one, one, one] + [none] * 3)
    int4 = list(args)  # tensor 1 has 4 elements: 2 bytes of codes; tensor 0's 33 cannot pack in pairs
    for slot in (2, 3, 4):
        int4[slot] = [args[slot][0], torch.zeros(2, dtype=torch.uint8, device=device)]
    int4_scales = [none] * 3 + [one, one, one]
    if "int4" not in backend.COMPACT_MODES:
        with pytest.raises(RuntimeError, match="int4 moments are not served"):
            torch.ops.ampfused.adamw_update(*int4, None, None, None, int4_scales)
    else:
        with pytest.raises(RuntimeError, match="holds int4 codes but moment_scales is None"):
            torch.ops.ampfused.adamw_update(*int4)
        wide = list(int4)
        wide[3] = [args[3][0], torch.zeros(4, dtype=torch.uint8, device=device)]
        with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[1\] holds int4 codes and must be a contiguous uint8 tensor of 2 bytes"):
            torch.ops.ampfused.adamw_update(*wide, None, None, None, int4_scales)
        odd = list(int4)
        for slot in (2, 3, 4):
            odd[slot] = [torch.zeros(16, dtype=torch.uint8, device=device), args[slot][1]]
        with pytest.raises(RuntimeError, match="whose last dimension is even"):
            torch.ops.ampfused.adamw_update(*odd, None, None, None, [one, one, one] + [none] * 3)
    for t, b in zip(args[0], before):
        assert torch.equal(t, b)


def test_extension_reports_itself():
    module, why = _compiled.load()
    assert module is not None, why
    assert module.CPU_ISA in ("default", "avx2", "avx2-div", "avx512", "avx512-div")
    assert module.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
    assert _compiled.has_kernel("adamw_update", "CPU")
    cuda_backend, why = _compiled.get_backend("cuda")
    if cuda_backend is None:
        assert why  # a reason is always given


def test_extension_registers_no_test_only_op():
    """ampfused._C holds the production ops only: what only tests call is built on demand from
    csrc/testing/ (tests/testing_extension.py, torch.ops.ampfused_testing)."""
    _compiled.load()
    names = {s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("ampfused::")}
    hooks = {"_hook_accumulation", "_unhook_accumulation"}  # ampfused/_main_grad.py's CPU accumulation hook
    assert names == {f"ampfused::{op}" for op in (*_compiled.OPS, *hooks)}


@pytest.mark.gpu
def test_cuda_graph_capture_of_both_passes():
    """Stats + update replayed from a CUDA graph equal eager reference steps (no host sync inside)."""
    backend = backend_for("cuda")
    tensors = make_tensors((1025, 65537, 3), torch.bfloat16, torch.float32, True, False, seed=12, device="cuda")
    expected = copy.deepcopy(tensors)
    lr = torch.tensor(1e-3, device="cuda")
    hypers = [Hyper(lr, 0.9, 0.999, 1e-8, 0.01, False, False)] * 3
    stats = torch.zeros(4, device="cuda")
    scale = torch.tensor([2.0], device="cuda")

    def step(b, ts):
        b.grad_stats_(Batch.of_grads(ts[1]), scale, None, 1.0, stats)
        b.adamw_update_(Batch(*ts, [0, 0, 0], hypers[:1]), stats)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(backend, tensors)  # warm-up: builds and caches the device tables
    torch.cuda.current_stream().wait_stream(side)
    step(reference, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(backend, tensors)
    for k in range(2):
        lr.fill_(1e-3 * (k + 2))  # a tensor lr is read at replay time
        graph.replay()
        step(reference, expected)
    torch.cuda.synchronize()
    assert_update_close(tensors, expected)
    assert [t.item() for t in tensors[5]] == [t.item() for t in expected[5]]


@pytest.fixture(params=[False, True], ids=["denormals", "flush-denormal"])
def flush_denormal(request):
    """Run with and without torch.set_flush_denormal(True) (FTZ/DAZ on the CPU), then restore."""
    if request.param and not torch.set_flush_denormal(True):
        pytest.fail("this x86 CPU does not support flush-to-zero")  # every x86-64 CPU with SSE3 does
    yield request.param
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_conversions_are_exact_for_every_bit_pattern(device, flush_denormal):
    """fp16 -> fp32 for all 65536 patterns, and fp32 -> fp16 round-to-nearest-even (ties, overflow,
    subnormals, signed zero) exactly as Tensor.to, through accumulate and the master write-back --
    also under flush-to-zero, where fp16 subnormals (normal fp32 values) must survive."""
    backend = backend_for(device)
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).to(device)
    widened = torch.zeros(halves.numel(), device=device)
    backend.accumulate_(widened, halves)
    expected = halves.float()
    nan = expected.isnan()
    assert torch.equal(widened[~nan], expected[~nan]) and widened[nan].isnan().all()

    finite = expected[~nan & expected.isfinite()].sort().values
    gen = torch.Generator().manual_seed(0)
    masters = torch.cat([
        (finite[:-1] + finite[1:]) / 2,  # exact ties between neighbouring halves
        torch.randn(50000, generator=gen).to(device) * 7e4, torch.randn(50000, generator=gen).to(device) * 1e-6,
        torch.tensor([65504.0, 65519.0, 65520.0, 1e9, -1e9, 2.98e-8, 3e-8, -0.0, 0.0], device=device)])
    weights = masters.clone()
    params = torch.zeros(masters.numel(), dtype=torch.float16, device=device)
    zeros = [torch.zeros_like(masters) for _ in range(3)]
    no_change = Hyper(0.0, 0.9, 0.999, 1e-8, 0.0, False, False)  # lr 0, zero grads: the master stays put
    backend.adamw_update_(Batch([params], [zeros[0]], [zeros[1]], [zeros[2]], [None], [torch.zeros((), device=device)],
                                [masters], [0], [no_change]), torch.tensor([0.0, 0.0, 1.0, 0.0], device=device))
    assert torch.equal(masters, weights)
    assert torch.equal(params.view(torch.int16), weights.to(torch.float16).view(torch.int16))


# ------------------------------------------------------------------------------ the build


def test_cpu_kernels_use_torchs_threads():
    """_C is built with OpenMP (torch's runtime): at::parallel_for in the passes runs on
    torch.get_num_threads() threads (an extension built without -fopenmp runs them on one).
    The test-only extension, built with the flags build_extension.py gives _C, counts the threads;
    _C itself must carry what those flags leave in a binary."""
    compile_flags, link_flags = testing_extension.build_extension().openmp_flags(torch)
    with open(_compiled.load()[0].__file__, "rb") as f:
        binary = f.read()
    # -fopenmp inlines ATen's `#pragma omp parallel` into the caller as a call to GOMP_parallel
    assert (b"GOMP_parallel" in binary) == ("-fopenmp" in compile_flags), compile_flags
    for lib in link_flags:
        if lib.endswith(".so") or ".so." in lib:  # torch's own libgomp, by its soname
            assert os.path.basename(lib).encode() in binary, lib
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("torch runs on one thread here")
    testing = testing_extension.ops()
    try:
        assert testing.parallel_threads(64 * threads) == threads
        torch.set_num_threads(1)
        assert testing.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(threads)


def ops_per_step(n_tensors, clip):
    from torch.profiler import ProfilerActivity, profile

    params = [torch.nn.Parameter(torch.randn(33)) for _ in range(n_tensors)]
    opt = ampfused.FusedAmpAdamW(params, backend="cpu", max_grad_norm=clip)
    scaler = ampfused.GradScaler("cpu")
    for p in params:
        p.grad = torch.randn(33)
    for k in range(3):  # the last one is measured: lazy state and tables are built by then
        scaler.scale(torch.ones(()))
        if k == 2:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                scaler.step(opt)
                scaler.update()
            return [e.name for e in prof.events() if "::" in e.name]
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_cpu_step_dispatches_a_small_fixed_number_of_ops(clip):
    """The compiled cpu backend: a step and a scaler update are a handful of ops, whatever the tensor count."""
    few, many = ops_per_step(4, clip), ops_per_step(120, clip)
    assert sorted(few) == sorted(many), (few, many)
    kernels = [n for n in few if n.startswith("ampfused::")]
    assert sorted(kernels) == ["ampfused::adamw_update", "ampfused::grad_stats", "ampfused::scaler_update"], few
    assert len(few) <= 20, few  # today 16 with nested ones (stats vector + 2 views, scaler.step flag plumbing, watch read)
