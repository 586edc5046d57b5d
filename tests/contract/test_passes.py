"""The passes of every backend (ampfused._backends' contract), pass by pass, against ampfused.reference.

One suite for all kernel backends: the ``backend`` fixture runs each test on every backend that
serves the test device (the Triton kernels through the interpreter on a CPU machine). Sizes cross
block and chunk boundaries, dtypes mix, tensors are tiny and many, views misaligned.
"""
import copy
import math

import pytest
import torch

import ampfused
from ampfused import _backends, _compiled, reference
from ampfused._batch import Batch, Hyper
from ampfused._contract import FACTOR, NORM, SKIP, STATS_SIZE, SUMSQ
from ampfused.functional import group_hypers
import testing_extension
from helpers import DEVICE, stats_vector

SIZES = (1, 97, 1025, 65537)
LOW = (torch.float16, torch.bfloat16)
# (param dtype, grad dtype, master copy)
DTYPE_CASES = [
    (torch.float32, torch.float32, False),
    (torch.bfloat16, torch.float32, True),
    (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float16, torch.float16, False),
    (torch.float16, torch.bfloat16, True),
]


def module(name):
    return _backends.resolve(name, DEVICE)[0]


def ids(case):
    pd, gd, master = case
    return f"{str(pd)[6:]}-{str(gd)[6:]}-{'master' if master else 'nomaster'}"


def make_tensors(sizes, param_dtype, grad_dtype, master, amsgrad, seed=0, misalign=False, device=DEVICE):
    """Lists (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters) with varied contents."""
    gen = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(7)]
    for i, n in enumerate(sizes):
        w = torch.randn(n, generator=gen)
        if misalign:  # a view one element into a larger tensor: no vector access possible
            param = torch.zeros(n + 1, dtype=param_dtype)[1:]
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


def run_both(name, tensors, hypers, factor=0.5, skip=0.0):
    expected = copy.deepcopy(tensors)
    module(name).adamw_update_(Batch(*tensors, *group_hypers(hypers)), stats_vector(factor, skip))
    reference.adamw_update_(Batch(*expected, *group_hypers(hypers)), stats_vector(factor, skip))
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
            elif got.dtype in LOW:  # the rounding of an fp32 value within 1e-6 of the reference's
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5, msg=msg)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=msg)


# ----------------------------------------------------------------------------- update pass


@pytest.mark.parametrize("case", DTYPE_CASES, ids=ids)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_update_matches_reference(backend, case, amsgrad):
    param_dtype, grad_dtype, master = case
    tensors = make_tensors(SIZES, param_dtype, grad_dtype, master, amsgrad, seed=1)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, amsgrad, False)
    actual, expected = run_both(backend, tensors, [hyper] * len(SIZES))
    assert_update_close(actual, expected)
    for param, master_t in zip(actual[0], actual[6]):
        if master_t is not None:  # the param is the round-to-nearest-even of its new master
            assert torch.equal(param, master_t.to(param.dtype))


def test_update_maximize_tensor_lr_and_groups(backend):
    sizes = (5, 300, 7, 4099, 64, 1)
    tensors = make_tensors(sizes, torch.bfloat16, torch.float32, True, True, seed=3)
    lr_cpu = torch.tensor(3e-3)
    lr_dev = torch.tensor(2e-3, device=DEVICE, dtype=torch.float64)
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
    lr_cpu.fill_(1e-4)  # a scheduler changes a tensor lr in place: the next step must see it
    lr_dev.fill_(5e-4)
    actual, expected = run_both(backend, actual, hypers, factor=1.0)
    assert_update_close(actual, expected)


def test_update_float_lrs_change_every_step(backend):
    """More distinct float lrs than the Triton kernel's argument slots, changing every step."""
    sizes = (33, 7, 1025, 5, 64, 2)
    tensors = make_tensors(sizes, torch.float32, torch.float32, False, False, seed=13)
    expected = copy.deepcopy(tensors)
    for k in range(3):
        hypers = [Hyper(1e-3 * (1 + i) / (k + 1) + 1e-9 * k, 0.9, 0.999, 1e-8, 0.01, False, False) for i in range(len(sizes))]
        module(backend).adamw_update_(Batch(*tensors, *group_hypers(hypers)), stats_vector())
        reference.adamw_update_(Batch(*expected, *group_hypers(hypers)), stats_vector())
    assert_update_close(tensors, expected)


def test_update_many_tiny_tensors_and_many_groups(backend):
    sizes = [1 + (i * 7) % 13 for i in range(300)] + [0, 3]
    tensors = make_tensors(sizes, torch.float16, torch.float16, True, False, seed=4)
    # 40 distinct groups: more than the CUDA kernel takes by value
    hypers = [Hyper(1e-3 * (1 + i % 40), 0.9, 0.999, 1e-8, 0.01, False, i % 3 == 0) for i in range(len(sizes))]
    actual, expected = run_both(backend, tensors, hypers)
    assert_update_close(actual, expected)


def test_update_misaligned_views_next_to_aligned_ones(backend):
    """Alignment is decided per tensor: a misaligned view does not change the others' results."""
    misaligned = make_tensors((1, 97, 1025), torch.bfloat16, torch.bfloat16, False, True, seed=5, misalign=True)
    aligned = make_tensors((65537, 33), torch.bfloat16, torch.bfloat16, False, True, seed=6)
    tensors = [a + b for a, b in zip(misaligned, aligned)]
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    actual, expected = run_both(backend, tensors, [hyper] * 5)
    assert_update_close(actual, expected)


def test_update_channels_last_param_keeps_memory_order(backend):
    """Dense params of any memory format: state and grad with the param's strides, flat element-wise math."""
    gen = torch.Generator().manual_seed(14)
    shape = (2, 3, 5, 7)
    param = torch.randn(shape, generator=gen).to(DEVICE).contiguous(memory_format=torch.channels_last)
    like = lambda t: t.to(DEVICE).contiguous(memory_format=torch.channels_last)  # noqa: E731
    grad_cl = like(torch.randn(shape, generator=gen))
    tensors = [[param], [grad_cl], [like(torch.randn(shape, generator=gen) * 0.1)], [like(torch.rand(shape, generator=gen) * 0.01)],
               [None], [torch.tensor(2.0, device=DEVICE)], [None]]
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    actual, expected = run_both(backend, copy.deepcopy(tensors), [hyper])
    assert_update_close(actual, expected)
    assert actual[0][0].is_contiguous(memory_format=torch.channels_last)
    # a contiguous grad for the channels_last param: the same values, so the same result
    tensors[1] = [grad_cl.contiguous()]
    got, _ = run_both(backend, tensors, [hyper])
    assert_update_close(got[:1] + got[2:], actual[:1] + actual[2:])


@pytest.mark.parametrize("skip", [1.0, math.nan])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_skip_leaves_everything_bitwise_unchanged(backend, amsgrad, skip):
    tensors = make_tensors(SIZES, torch.bfloat16, torch.float32, True, amsgrad, seed=6)
    before = copy.deepcopy(tensors)
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, amsgrad, False)
    module(backend).adamw_update_(Batch(*tensors, [0] * len(SIZES), [hyper]), stats_vector(0.5, skip))
    for got_list, want_list in zip(tensors, before):
        for got, want in zip(got_list, want_list):
            assert (got is None and want is None) or torch.equal(got, want)


def test_repeated_steps_and_reallocated_tensors(backend):
    """Table caches: same pointers reused over steps, a new grad address rewrites only pointers."""
    hyper = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    tensors = make_tensors((1025, 33), torch.float32, torch.float32, False, False, seed=7)
    expected = copy.deepcopy(tensors)
    for k in range(4):
        if k % 2:  # new grad storage, as zero_grad(set_to_none=True) and a busy allocator give
            tensors[1] = [g.clone() for g in tensors[1]]
        for g, g_ref in zip(tensors[1], expected[1]):
            g.normal_()
            g_ref.copy_(g)
        module(backend).adamw_update_(Batch(*tensors, [0, 0], [hyper]), stats_vector())
        reference.adamw_update_(Batch(*expected, [0, 0], [hyper]), stats_vector())
    assert_update_close(tensors, expected)
    assert [t.item() for t in tensors[5]] == [4.0, 5.0]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy fp16 cast, on purpose
@pytest.mark.parametrize("dtype", LOW)
def test_param_write_back_rounds_to_nearest_even(backend, dtype):
    """lr 0, no decay: the master stays and the param is exactly master.to(dtype): ties, values that
    round to inf, subnormals, signed zeros, NaN, random bit patterns."""
    info = torch.finfo(dtype)
    ties = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(1.0 + 2.0 ** -8)])
    special = torch.tensor([0.0, -0.0, info.max, -info.max, info.max * (1 + 2.0 ** -9), info.tiny / 3, -info.tiny / 5,
                            math.nan, math.inf, -math.inf, 3.14159265, -2.71828, 1e-30, 65519.0, 65521.0])
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=torch.Generator().manual_seed(4), dtype=torch.int64).to(torch.int32)
    randoms = bits.view(torch.float32)
    master = torch.cat([ties, special, randoms[torch.isfinite(randoms)]]).to(DEVICE)
    n = master.numel()
    masters = [master.clone()]
    params = [torch.zeros(n, dtype=dtype, device=DEVICE)]
    zeros = [torch.zeros(n, device=DEVICE) for _ in range(3)]
    module(backend).adamw_update_(Batch(params, [zeros[0]], [zeros[1]], [zeros[2]], [None], [torch.zeros((), device=DEVICE)],
                                        masters, [0], [Hyper(0.0, 0.9, 0.999, 1e-8, 0.0, False, False)]), stats_vector())
    assert torch.equal(masters[0].view(torch.int32), master.view(torch.int32))
    want = master.to(dtype)
    same = (params[0].view(torch.int16) == want.view(torch.int16)) | (params[0].isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {n} roundings differ"


# ------------------------------------------------------------------------------ stats pass


def stats_of(name, grads, grad_scale=None, found_inf=None, max_grad_norm=None):
    stats = torch.full((STATS_SIZE,), 7.0, device=DEVICE)  # every slot is overwritten
    module(name).grad_stats_(Batch.of_grads(grads), grad_scale, found_inf, max_grad_norm, stats)
    return stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_scale", [False, True], ids=["noscale", "scale"])
@pytest.mark.parametrize("clip", [None, 1.0, 1e6], ids=["noclip", "clip", "noop-clip"])
def test_stats_and_finish_match_reference(backend, dtype, with_scale, clip):
    gen = torch.Generator().manual_seed(8)
    grads = [(torch.randn(n, generator=gen) * 4).to(dtype).to(DEVICE) for n in SIZES + (3, 0, 200001)]
    scale = torch.tensor([1024.0], device=DEVICE) if with_scale else None
    got = stats_of(backend, grads, scale, None, clip)
    want = stats_of("reference", grads, scale, None, clip)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert got[SKIP] == 0
    if clip == 1e6:
        assert got[FACTOR] == (1 / 1024 if with_scale else 1.0)


def test_stats_many_tiny_tensors_deterministic(backend):
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(1 + i % 17, generator=gen).to(DEVICE) for i in range(1000)]
    first, second = stats_of(backend, grads), stats_of(backend, grads)
    assert torch.equal(first, second)  # fixed reduction order: bitwise reproducible
    torch.testing.assert_close(first, stats_of("reference", grads), rtol=1e-5, atol=0)


def test_stats_empty_list(backend):
    got = stats_of(backend, [], torch.tensor([4.0], device=DEVICE), None, 1.0)
    assert got.tolist() == [0.0, 0.0, 0.25, 0.0]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_stats_non_finite_element_skips(backend, bad, dtype):
    grads = [torch.ones(n, dtype=dtype, device=DEVICE) for n in (97, 65537, 5)]
    grads[1][40000] = bad
    got = stats_of(backend, grads, torch.tensor([2.0], device=DEVICE), None, 1.0)
    assert got[SKIP] == 1 and not torch.isfinite(got[NORM])


@pytest.mark.filterwarnings("ignore:overflow encountered in reduce")  # the interpreter's numpy sum of squares, on purpose
@pytest.mark.parametrize("grads", [[1e30, 1.0], [1e18] * 1000], ids=["one-huge", "all-large"])
def test_stats_overflowing_sum_of_finite_grads_does_not_skip(backend, grads):
    g = [torch.tensor(grads, device=DEVICE)]
    no_clip = stats_of(backend, g)
    assert no_clip[SKIP] == 0 and torch.isinf(no_clip[NORM]) and torch.isinf(no_clip[SUMSQ]) and no_clip[FACTOR] == 1
    clip = stats_of(backend, g, None, None, 1.0)
    assert clip[SKIP] == 0 and torch.isinf(clip[NORM]) and clip[FACTOR] == 0  # clip_grad_norm_'s coef


def test_stats_found_inf_skips_with_a_finite_norm_reported_inf(backend):
    grads = [torch.ones(10, device=DEVICE)]
    got = stats_of(backend, grads, None, torch.ones(1, device=DEVICE))
    assert got[SKIP] == 1 and torch.isinf(got[NORM]) and got[SUMSQ] == 10
    assert stats_of(backend, grads, None, torch.zeros(1, device=DEVICE))[SKIP] == 0


@pytest.mark.filterwarnings("ignore:overflow encountered in reduce")  # the interpreter's numpy sum of squares, on purpose
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("values", [[1e30, 1.0, -2.0], [1e18] * 1000], ids=["one-huge", "all-large"])
def test_overflowing_norm_steps_like_torch(backend, clip, values):
    """DESIGN §2.2: a finite grad whose sum of squares overflows steps exactly like torch.optim.AdamW
    (+ clip_grad_norm_: coef 0, weights and moments still decay), and the scaler keeps its scale."""
    ours = torch.nn.Parameter(torch.linspace(-1, 1, len(values), device=DEVICE))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt = ampfused.FusedAmpAdamW([ours], lr=0.1, weight_decay=0.1, max_grad_norm=clip, backend=backend)
    stock = torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.1)
    scaler = ampfused.GradScaler(DEVICE.type, init_scale=1.0)
    for _ in range(2):
        ours.grad = torch.tensor(values, device=DEVICE)
        theirs.grad = ours.grad.clone()
        scaler.scale(torch.ones((), device=DEVICE))  # scale 1: the grads stand as they are
        scaler.step(opt)
        scaler.update()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([theirs], clip)
            assert torch.isinf(norm) and torch.isinf(opt.grad_norm)
        stock.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[ours][key], stock.state[theirs][key], rtol=1e-6, atol=0)
    assert float(opt.state[ours]["step"]) == 2.0 and scaler.get_scale() == 1.0 and scaler.skipped_steps == 0


def _bias_correction_divisors():
    """sqrt(1 - beta2^t) as the update rounds it, for common beta2 over early steps, and random ones in (0, 1]."""
    divisors = {float(torch.tensor(math.sqrt(1 - b2 ** t), dtype=torch.float32))
                for b2 in (0.999, 0.99, 0.98, 0.95, 0.9, 0.5, 0.9999) for t in (*range(1, 21), 50, 100, 1000, 10 ** 5)}
    divisors |= set(torch.rand(40, generator=torch.Generator().manual_seed(12)).clamp_min(1e-4).tolist())
    return sorted(divisors | {1.0})


@pytest.mark.slow
@pytest.mark.skipif(_compiled.load()[0] is None, reason="the compiled cpu backend (ampfused._C) is not built")
def test_cpu_update_divides_by_its_bias_correction_exactly():
    """The FMA builds of the CPU update (avx2, avx512) divide sqrt(v) by sqrt(1 - beta2^t) without the
    divider (csrc/adamw_math.h, [note: division by a constant]); it must equal `a / c` for every fp32
    mantissa of a, over the binades sqrt(v) can take (2^-75 .. 2^64), for every divisor a run meets.
    Every such variant this CPU runs is checked, whichever was dispatched (the -div twins divide)."""
    dispatched = _compiled.load()[0].CPU_ISA
    runs = {"default": ["default"]}.get(dispatched, ["default", "avx2"] if dispatched.startswith("avx2") else
                                        ["default", "avx2", "avx512"])
    testing = testing_extension.ops()
    for isa in runs:  # the check is compiled for each variant's target
        for c in _bias_correction_divisors():
            for exponent in (-75, -40, -1, 0, 1, 30, 63):
                assert testing.division_mismatches(c, exponent, isa) == 0, (c, exponent, isa)


# ------------------------------------------------------------------------------ accumulate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", (1, 97, 4097))
def test_accumulate_bitwise(backend, dtype, n):
    gen = torch.Generator().manual_seed(10)
    main = torch.randn(n, generator=gen).to(DEVICE)
    grad = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    want = main.clone()
    reference.accumulate_(want, grad)
    module(backend).accumulate_(main, grad)
    assert torch.equal(main, want)


def test_accumulate_strided_grad(backend):
    main = torch.zeros(6, 4, device=DEVICE)
    grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.bfloat16).t()
    module(backend).accumulate_(main, grad)
    assert torch.equal(main, grad.float())


# --------------------------------------------------------------------------- scaler update


@pytest.mark.parametrize("min_scale", [None, 8.0])
def test_scaler_update_matches_reference(backend, min_scale):
    def state():
        return [torch.tensor([16.0], device=DEVICE), torch.tensor([1], dtype=torch.int32, device=DEVICE),
                torch.tensor([2], dtype=torch.int32, device=DEVICE), torch.tensor(3, device=DEVICE),
                torch.tensor(1, device=DEVICE), torch.zeros(2, dtype=torch.float64, device=DEVICE)]

    ours, want = state(), state()
    rules = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=2, min_scale=min_scale)
    impl = module(backend)
    if not hasattr(impl, "scaler_update_"):
        pytest.skip(f"{backend} has no scaler_update_ (the scaler uses the reference)")
    for found in (0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, math.nan):
        flag = torch.tensor([found], device=DEVICE)
        impl.scaler_update_(flag, *ours, **rules)
        reference.scaler_update_(flag.clone(), *want, **rules)
        for a, b in zip(ours, want):
            assert torch.equal(a, b), (found, ours, want)


# ------------------------------------------------------------------------ launches (GPU only)


def _kernels_launched(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # every device activity counts: kernels, memsets and copies (a steady-state step copies nothing:
    # tables are uploaded only when an address changes)
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda", "triton"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_at_most_three_launches_per_step(name, clip):
    """DESIGN §4: stats (finish included) and update are one launch each whatever the tensor count,
    GradScaler.update one more; nothing else launches on the steady-state path."""
    try:
        _backends.resolve(name, torch.device("cuda"))
    except RuntimeError as exc:
        pytest.skip(str(exc))
    gen = torch.Generator().manual_seed(15)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).cuda()) for n in [1 + 97 * i for i in range(150)]]
    opt = ampfused.FusedAmpAdamW(params, backend=name, max_grad_norm=clip)
    scaler = ampfused.GradScaler("cuda")
    for p in params:
        p.grad = torch.randn_like(p)
    for _ in range(2):  # lazy state, tables, Triton compilation
        scaler.scale(torch.ones((), device="cuda"))
        scaler.step(opt)
        scaler.update()
    step = _kernels_launched(opt.step)
    assert len(step) == 2 and not any(n.startswith("Memcpy") for n in step), step
    scaler.scale(torch.ones((), device="cuda"))
    full = _kernels_launched(lambda: (scaler.step(opt), scaler.update()))
    assert len(full) <= 3 and not any(n.startswith("Memcpy") for n in full), full
