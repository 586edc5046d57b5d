"""The ops of the compiled extension ampfused._C, pass by pass, against ampfused.reference.

CPU tests run wherever the extension is built (skipped with the reason where it is not); the CUDA
ones are marked ``gpu``. The semantic suite also runs whole steps on the "cpu"/"cuda" backends;
these tests pin down each pass at odd sizes, mixed dtypes, many tiny tensors, misaligned views,
and check the op registrations with torch.library.opcheck.
"""
import copy

import pytest
import torch

from ampfused import _compiled, reference
from ampfused.functional import Hyper

_CPU_BACKEND, _CPU_REASON = _compiled.get_backend("cpu")
pytestmark = pytest.mark.skipif(_CPU_BACKEND is None, reason=f"compiled backend unavailable: {_CPU_REASON}")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SIZES = (1, 97, 1025, 65537)
LOW = (torch.float16, torch.bfloat16)
# (param dtype, grad dtype, master copy)
DTYPE_CASES = [
    (torch.float32, torch.float32, False),
    (torch.bfloat16, torch.float32, True),
    (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float16, torch.float16, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float16, torch.bfloat16, True),
]


def backend_for(device):
    backend, why = _compiled.get_backend(device)
    if backend is None:
        pytest.fail(f"the {device} kernels of ampfused._C are unavailable on a machine with a {device} device: {why}")
    return backend


def ids(case):
    pd, gd, master = case
    return f"{str(pd)[6:]}-{str(gd)[6:]}-{'master' if master else 'nomaster'}"


def make_tensors(sizes, param_dtype, grad_dtype, master, amsgrad, device, seed=0, misalign=False):
    """Lists (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters) with varied contents."""
    gen = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(7)]
    for i, n in enumerate(sizes):
        w = torch.randn(n, generator=gen)
        if misalign:  # a view one element into a larger tensor: no 16-byte vector access possible
            base = torch.zeros(n + 1, dtype=param_dtype)
            param = base[1:]
            param.copy_(w)
        else:
            param = w.to(param_dtype)
        grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
        exp_avg = torch.randn(n, generator=gen) * 0.1
        exp_avg_sq = torch.rand(n, generator=gen) * 0.01
        vmax = exp_avg_sq + torch.rand(n, generator=gen) * 0.01 * (torch.rand(n, generator=gen) < 0.5) if amsgrad else None
        step = torch.tensor(float(i % 4))
        master_t = None
        if master:
            master_t = param.float() + torch.randn(n, generator=gen) * 1e-3
            param.copy_(master_t.to(param_dtype))
        for lst, t in zip(out, (param, grad, exp_avg, exp_avg_sq, vmax, step, master_t)):
            lst.append(None if t is None else t.to(device))
    return out


def run_both(backend, tensors, hypers, factor=0.5, skip=0.0):
    device = tensors[0][0].device
    expected = copy.deepcopy(tensors)
    f = torch.tensor(factor, device=device)
    s = torch.tensor(skip, device=device)
    backend.adamw_update_(*tensors, hypers, f, s)
    reference.adamw_update_(*expected, hypers, f.clone(), s.clone())
    return tensors, expected


def assert_update_close(actual, expected):
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps", "masters")
    for name, got_list, want_list in zip(names, actual, expected):
        for i, (got, want) in enumerate(zip(got_list, want_list)):
            if want is None:
                assert got is None
                continue
            msg = f"{name}[{i}] (numel {want.numel()}, {want.dtype})"
            if name in ("grads", "steps"):
                assert torch.equal(got, want), msg
            elif got.dtype in LOW:
                # low-precision params: the rounding of an fp32 value within 1e-6 of the reference's
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5, msg=msg)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=msg)


# ----------------------------------------------------------------------------- update pass


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DTYPE_CASES, ids=ids)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_update_matches_reference(device, case, amsgrad):
    backend = backend_for(device)
    param_dtype, grad_dtype, master = case
    tensors = make_tensors(SIZES, param_dtype, grad_dtype, master, amsgrad, device, seed=1)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, amsgrad, False)
    actual, expected = run_both(backend, tensors, [hyper] * len(SIZES))
    assert_update_close(actual, expected)
    for param, master_t in zip(actual[0], actual[6]):
        if master_t is not None:  # the param is the round-to-nearest-even of its new master
            assert torch.equal(param, master_t.to(param.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_update_fp32_bitwise_on_cpu_small(device):
    """fp32 without clipping matches the reference bitwise in m and v (same op order and fmas)."""
    backend = backend_for(device)
    tensors = make_tensors((97, 1025), torch.float32, torch.float32, False, False, device, seed=2)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    actual, expected = run_both(backend, tensors, [hyper, hyper], factor=1.0)
    if device == "cpu":
        for got, want in zip(actual[2] + actual[3], expected[2] + expected[3]):
            assert torch.equal(got, want)
    assert_update_close(actual, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_update_maximize_tensor_lr_and_groups(device):
    backend = backend_for(device)
    sizes = (5, 300, 7, 4099, 64, 1)
    tensors = make_tensors(sizes, torch.bfloat16, torch.float32, True, True, device, seed=3)
    lr_cpu = torch.tensor(3e-3)
    lr_dev = torch.tensor(2e-3, device=device, dtype=torch.float64)
    hypers = [
        Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True),
        Hyper(lr_cpu, 0.8, 0.99, 1e-6, 0.1, True, False),
        Hyper(lr_dev, 0.95, 0.9999, 1e-8, 0.01, True, True),
        Hyper(1e-2, 0.6, 0.95, 1e-8, 0.5, True, False),  # 1 - beta1 >= 0.5: the other lerp form
        Hyper(lr_cpu, 0.8, 0.99, 1e-6, 0.1, True, False),
        Hyper(1e-3, 0.0, 0.0, 1e-8, 0.0, True, False),
    ]
    actual, expected = run_both(backend, tensors, hypers, factor=0.25)
    assert_update_close(actual, expected)
    # a scheduler changes a tensor lr in place: the next step must see it
    lr_cpu.fill_(1e-4)
    lr_dev.fill_(5e-4)
    actual, expected = run_both(backend, actual, hypers, factor=1.0)
    assert_update_close(actual, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_update_many_tiny_tensors_and_many_groups(device):
    backend = backend_for(device)
    sizes = [1 + (i * 7) % 13 for i in range(400)] + [0, 3]
    tensors = make_tensors(sizes, torch.float16, torch.float16, True, False, device, seed=4)
    # 40 distinct groups: more than the CUDA kernel takes by value
    hypers = [Hyper(1e-3 * (1 + i % 40), 0.9, 0.999, 1e-8, 0.01, False, i % 3 == 0) for i in range(len(sizes))]
    actual, expected = run_both(backend, tensors, hypers)
    assert_update_close(actual, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_update_misaligned_views(device):
    backend = backend_for(device)
    tensors = make_tensors((1, 97, 1025, 65537), torch.bfloat16, torch.bfloat16, False, True, device, seed=5, misalign=True)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    actual, expected = run_both(backend, tensors, [hyper] * 4)
    assert_update_close(actual, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_skip_leaves_everything_bitwise_unchanged(device, amsgrad):
    backend = backend_for(device)
    tensors = make_tensors(SIZES, torch.bfloat16, torch.float32, True, amsgrad, device, seed=6)
    before = copy.deepcopy(tensors)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, amsgrad, False)
    backend.adamw_update_(*tensors, [hyper] * len(SIZES), torch.tensor(0.5, device=device), torch.tensor(1.0, device=device))
    for got_list, want_list in zip(tensors, before):
        for got, want in zip(got_list, want_list):
            assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_steps_and_reallocated_tensors(device):
    """The CUDA table cache: same pointers reused over steps, new pointers get a new table."""
    backend = backend_for(device)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    tensors = make_tensors((1025, 33), torch.float32, torch.float32, False, False, device, seed=7)
    expected = copy.deepcopy(tensors)
    for k in range(3):
        for g, g_ref in zip(tensors[1], expected[1]):
            g.normal_()
            g_ref.copy_(g)
        f = torch.tensor(1.0, device=device)
        s = torch.tensor(0.0, device=device)
        backend.adamw_update_(*tensors, [hyper] * 2, f, s)
        reference.adamw_update_(*expected, [hyper] * 2, f, s)
    assert_update_close(tensors, expected)
    assert [t.item() for t in tensors[5]] == [3.0, 4.0]
    fresh = copy.deepcopy(tensors)  # same values, new storage
    expected = copy.deepcopy(tensors)
    backend.adamw_update_(*fresh, [hyper] * 2, torch.tensor(1.0, device=device), torch.tensor(0.0, device=device))
    reference.adamw_update_(*expected, [hyper] * 2, torch.tensor(1.0, device=device), torch.tensor(0.0, device=device))
    assert_update_close(fresh, expected)


# ------------------------------------------------------------------------------ stats pass


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_scale", [False, True], ids=["noscale", "scale"])
def test_stats_matches_reference(device, dtype, with_scale):
    backend = backend_for(device)
    gen = torch.Generator().manual_seed(8)
    grads = [(torch.randn(n, generator=gen) * 4).to(dtype).to(device) for n in SIZES + (3, 0, 200001)]
    inv_scale = torch.tensor(1 / 1024, device=device) if with_scale else None
    got = torch.zeros((), device=device)
    want = torch.zeros((), device=device)
    backend.grad_stats_(grads, inv_scale, got)
    reference.grad_stats_(grads, inv_scale, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_many_tiny_tensors_deterministic(device):
    backend = backend_for(device)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(1 + i % 17, generator=gen).to(device) for i in range(1000)]
    results = []
    for _ in range(2):
        out = torch.zeros((), device=device)
        backend.grad_stats_(grads, None, out)
        results.append(out)
    want = torch.zeros((), device=device)
    reference.grad_stats_(grads, None, want)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_stats_non_finite_is_non_finite(device, bad, dtype):
    backend = backend_for(device)
    grads = [torch.ones(n, dtype=dtype, device=device) for n in (97, 65537, 5)]
    grads[1][40000] = bad
    out = torch.zeros((), device=device)
    backend.grad_stats_(grads, torch.tensor(0.5, device=device), out)
    assert not torch.isfinite(out)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_overflow_of_squares_is_non_finite(device):
    """Finite fp32 grads whose squares overflow fp32 skip the step, as in the reference."""
    backend = backend_for(device)
    out = torch.zeros((), device=device)
    backend.grad_stats_([torch.full((10,), 1e30, device=device)], None, out)
    assert torch.isinf(out)


# ------------------------------------------------------------------------------ accumulate


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_accumulate_bitwise(device, dtype, n):
    backend = backend_for(device)
    gen = torch.Generator().manual_seed(10)
    main = (torch.randn(n, generator=gen)).to(device)
    grad = (torch.randn(n, generator=gen)).to(dtype).to(device)
    want = main.clone()
    reference.accumulate_(want, grad)
    backend.accumulate_(main, grad)
    assert torch.equal(main, want)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_misaligned_and_strided(device):
    backend = backend_for(device)
    main = torch.randn(1026, device=device)[1:]
    grad = torch.randn(2050, device=device, dtype=torch.bfloat16)[::2]  # non-contiguous: copied first
    want = main.clone()
    reference.accumulate_(want, grad)
    backend.accumulate_(main, grad)
    assert torch.equal(main, want)


# ------------------------------------------------------------------------- op registration


def update_args(device, dtype=torch.bfloat16, amsgrad=True):
    t = make_tensors((33, 4), dtype, torch.float32, dtype != torch.float32, amsgrad, device, seed=11)
    lr_tensor = torch.tensor(1e-3, device=device)
    none = torch.empty(0, device=device)  # the op's stand-in for None
    vmaxs = [none if x is None else x for x in t[4]]
    masters = [none if x is None else x for x in t[6]]
    return (t[0], t[1], t[2], t[3], vmaxs, t[5], masters, [0, 1], [1e-3, 0.0], [None, lr_tensor], [0.9, 0.8], [0.999, 0.99],
            [1e-8, 1e-6], [0.01, 0.0], [1 if amsgrad else 0, 3 if amsgrad else 2],
            torch.tensor(0.5, device=device), torch.tensor(0.0, device=device))


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
    for inv_scale in (None, torch.tensor(0.25, device=device)):
        torch.library.opcheck(torch.ops.ampfused.grad_stats.default, (grads, inv_scale, torch.zeros((), device=device)),
                              test_utils=test_utils)


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
        torch.ops.ampfused.grad_stats([torch.zeros(3, dtype=torch.float64)], None, torch.zeros(()))


def test_extension_reports_itself():
    module, why = _compiled.load()
    assert module is not None, why
    assert module.CPU_ISA in ("default", "avx2", "avx512")
    assert module.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
    assert _compiled.has_kernel("adamw_update", "CPU")
    cuda_backend, why = _compiled.get_backend("cuda")
    if cuda_backend is None:
        assert why  # a reason is always given


@pytest.mark.gpu
def test_cuda_graph_capture_of_both_passes():
    """Stats + update replayed from a CUDA graph equal eager reference steps (no host sync inside)."""
    backend = backend_for("cuda")
    tensors = make_tensors((1025, 65537, 3), torch.bfloat16, torch.float32, True, False, "cuda", seed=12)
    expected = copy.deepcopy(tensors)
    lr = torch.tensor(1e-3, device="cuda")
    hypers = [Hyper(lr, 0.9, 0.999, 1e-8, 0.01, False, False)] * 3
    sumsq = torch.zeros((), device="cuda")
    factor = torch.tensor(0.5, device="cuda")
    skip = torch.zeros((), device="cuda")

    def step(b, ts):
        sumsq.zero_()
        b.grad_stats_(ts[1], None, sumsq)
        b.adamw_update_(*ts, hypers, factor, skip)

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
    backend.adamw_update_([params], [zeros[0]], [zeros[1]], [zeros[2]], [None], [torch.zeros((), device=device)],
                          [masters], [no_change], torch.ones((), device=device), torch.zeros((), device=device))
    assert torch.equal(masters, weights)
    assert torch.equal(params.view(torch.int16), weights.to(torch.float16).view(torch.int16))
