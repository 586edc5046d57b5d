"""The CUDA update kernel on compact state (csrc/cuda/compact_update.cuh) against the specification
``ampfused._compact.compact_adamw_step_`` and the reference backend. GPU only.

The backend's ``adamw_update_`` is called with hand-built lists (the tensors of ``_compact``'s state
dicts). Round-to-nearest modes are held bit for bit to the CUDA fp32 path's step on the decoded
state with its results encoded by the specification (the "twin"; split16 also to the fp32-master
path outright), and close to the specification's own step (torch ops: its fp32 arithmetic may round
an ulp differently). Stochastic rounding: the CPU kernel's bits exactly (one counter-based hash,
csrc/compact_random.h), unbiased, seeded. A skipped step writes nothing; compact and fp32 tensors
share the update launch; tails, unaligned views, several chunks and int8 blocks cut by the end.
"""
import math

import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused import _compiled, functional, reference
from helpers import assert_same_state, same_bits
from helpers import clone_compact as clone, decoded_twin as fp32_twin
from helpers import COMPACT_HYPER, MASTER_KEYS, batch_of, compact_entry, compact_hyper, compact_update, update_lists

if not torch.cuda.is_available():
    BACKEND, WHY = None, "needs a CUDA GPU; this machine has none"
else:
    BACKEND, WHY = _compiled.get_backend("cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(BACKEND is None, reason=f"CUDA backend unavailable: {WHY}")]

DEVICE = "cuda"
N = 70_001  # two 65536-element chunks, a ragged tail (not a multiple of 4 or of an int8 block)
SMALL = C.SMALL_TENSOR_NUMEL - 1  # int8 mode keeps fp32 moments below the threshold
HYPER = COMPACT_HYPER
hyper, lists_of = compact_hyper, update_lists


def make(n, param_dtype, master_weights, state_dtype, amsgrad=False, seed=0, offset=0):
    return compact_entry(n, param_dtype, master_weights, state_dtype, DEVICE, amsgrad, seed, offset)


def cuda_step(entries, amsgrad=False, maximize=False, factor=1.0, skip=0.0, grad_scale=None, rounding_seed=None,
              backend=None):
    compact_update(backend or BACKEND, entries, amsgrad, maximize, factor, skip, grad_scale, rounding_seed)


def spec_step(param, grad, state, amsgrad=False, maximize=False, factor=1.0):
    C.compact_adamw_step_(param, grad, state, **HYPER, amsgrad=amsgrad, maximize=maximize,
                          factor=torch.tensor(factor, device=DEVICE), skip=torch.tensor(0.0, device=DEVICE))


def sync():
    if DEVICE == "cuda":  # (tests/compact/test_cuda_emulation.py runs these tests on the CPU)
        torch.cuda.synchronize()


def encoded(twin, master_weights, state_dtype):
    """The fp32 path's results encoded by the specification. torch's CUDA sqrt is correctly rounded,
    as the kernels' sqrt_rn, so the int8 scales of ``quantize(.., "sqrt")`` are the kernel's."""
    param, grad, state = twin
    param = param.clone()
    return param, grad, C.encode_state(param, state, master_weights, state_dtype)


def assert_close_to_spec(actual, expected, what):
    """Against ``compact_adamw_step_`` (torch ops): the fp32 math may differ by an ulp, so an
    encoding may be one grid step off."""
    (a_param, _, a_state), (e_param, _, e_state) = actual, expected
    torch.testing.assert_close(a_param.float(), e_param.float(), rtol=2 ** -7, atol=1e-5, msg=f"{what} param")
    for key in e_state:
        got, want = a_state[key], e_state[key]
        if key.endswith("_codes"):
            assert (got.int() - want.int()).abs().max().item() <= 1, f"{what} {key}: a code more than one grid step off"
        elif key in ("master_low16", "master_residual8"):
            # split8: an ulp of the fp32 math may move a residual by its unit, ulp(p)/256 (2^-15 relative for bf16)
            rtol = 1e-6 if key == "master_low16" else 2 ** -14
            torch.testing.assert_close(C.decode_state(a_state, a_param)["master_param"],
                                       C.decode_state(e_state, e_param)["master_param"], rtol=rtol, atol=1e-7)
        elif got.dtype == torch.bfloat16:
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0, msg=f"{what} {key}")
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{what} {key}")


def check_step(entries, modes, **kwargs):
    """One CUDA step of ``entries`` (compact), held bitwise to its twin and close to the spec."""
    twins = [fp32_twin(e) for e in entries]
    spec = [clone(e) for e in entries]
    cuda_step(entries, **kwargs)
    cuda_step(twins, **kwargs)
    for i, (entry, twin, ref, (master_weights, state_dtype)) in enumerate(zip(entries, twins, spec, modes)):
        what = f"tensor {i} ({master_weights}/{state_dtype})"
        assert_same_state(entry, encoded(twin, master_weights, state_dtype), what)
        spec_step(*ref, amsgrad=kwargs.get("amsgrad", False), maximize=kwargs.get("maximize", False),
                  factor=kwargs.get("factor", 1.0))
        assert_close_to_spec(entry, ref, what)
    return twins


MODES = [  # (param dtype, master_weights, state_dtype, n)
    pytest.param(torch.bfloat16, "split16", torch.float32, N, id="split16"),
    pytest.param(torch.bfloat16, "split16", torch.bfloat16, N, id="split16-bf16-moments"),
    pytest.param(torch.bfloat16, "split8", torch.float32, N, id="split8-bf16"),
    pytest.param(torch.float16, "split8", torch.float32, N, id="split8-fp16"),
    pytest.param(torch.float16, "split8", torch.bfloat16, N, id="split8-fp16-bf16-moments"),
    pytest.param(torch.bfloat16, "fp32", torch.bfloat16, N, id="bf16-moments"),
    pytest.param(torch.float16, "fp32", torch.bfloat16, N, id="fp16-param-bf16-moments"),
    pytest.param(torch.float32, "fp32", torch.bfloat16, N, id="fp32-param-bf16-moments"),
    pytest.param(torch.bfloat16, "none", torch.bfloat16, N, id="no-master-bf16-moments"),
    pytest.param(torch.float16, "none", torch.bfloat16, N, id="no-master-fp16-bf16-moments"),
    pytest.param(torch.bfloat16, "split16", "int8", N, id="split16-int8"),
    pytest.param(torch.bfloat16, "split8", "int8", N, id="split8-int8"),
    pytest.param(torch.bfloat16, "fp32", "int8", N, id="fp32-master-int8"),
    pytest.param(torch.bfloat16, "none", "int8", N, id="no-master-int8"),
    pytest.param(torch.float32, "fp32", "int8", N, id="fp32-int8"),
    pytest.param(torch.float32, "fp32", "int8", C.SMALL_TENSOR_NUMEL, id="fp32-int8-one-block-row"),
    pytest.param(torch.bfloat16, "split8", "int8", SMALL, id="below-int8-threshold"),
]


def test_compact_modes_declared():
    assert BACKEND.COMPACT_MODES == frozenset({"split16", "split8", "bf16", "int8", "sr"})


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_round_to_nearest_modes(param_dtype, master_weights, state_dtype, n, amsgrad):
    entry = make(n, param_dtype, master_weights, state_dtype, amsgrad)
    if n < C.SMALL_TENSOR_NUMEL:
        assert "exp_avg_codes" not in entry[2] and entry[2]["exp_avg"].dtype == torch.float32
    check_step([entry], [(master_weights, state_dtype)], amsgrad=amsgrad, maximize=amsgrad, factor=0.5)


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_several_steps(param_dtype, master_weights, state_dtype, n):
    """Each step starts from the last one's compact state: errors never compound differently."""
    entry = make(n, param_dtype, master_weights, state_dtype, amsgrad=True, seed=3)
    for step in range(4):
        gen = torch.Generator().manual_seed(50 + step)
        entry[1].copy_(torch.randn(n, generator=gen).to(DEVICE))
        check_step([entry], [(master_weights, state_dtype)], amsgrad=True, factor=0.25 * (step + 1))
    assert float(entry[2]["step"]) == float(3 % 5 + 2) + 4


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype", [
    (torch.bfloat16, "split16", torch.bfloat16), (torch.float16, "split8", torch.float32),
    (torch.bfloat16, "split16", "int8"), (torch.bfloat16, "none", torch.bfloat16)])
def test_unaligned_views_take_the_element_path(param_dtype, master_weights, state_dtype):
    entry = make(N, param_dtype, master_weights, state_dtype, amsgrad=True, offset=1)
    check_step([entry], [(master_weights, state_dtype)], amsgrad=True)


@pytest.mark.parametrize("param_dtype,master_weights,state_dtype,n", MODES)
def test_skipped_step_writes_nothing(param_dtype, master_weights, state_dtype, n):
    entry = make(n, param_dtype, master_weights, state_dtype, amsgrad=True)
    before = clone(entry)
    cuda_step([entry], amsgrad=True, skip=1.0, grad_scale=torch.tensor(8.0, device=DEVICE), rounding_seed=5)
    sync()
    assert_same_state(entry, before, "skipped")
    same_bits(entry[1], before[1], "grad")


def test_mixed_launch_with_grad_scale_write_back():
    """fp32, split16, bf16-moment, split8, int8, below-threshold and plain bf16 tensors in one
    launch, each as the fp32 path steps it; the unscaled grads are written back."""
    configs = [(torch.float32, "fp32", torch.float32, 700), (torch.bfloat16, "split16", torch.float32, N),
               (torch.bfloat16, "fp32", torch.bfloat16, 300), (torch.float16, "split8", torch.bfloat16, 900),
               (torch.bfloat16, "split16", "int8", N), (torch.bfloat16, "split8", "int8", SMALL),
               (torch.bfloat16, "none", torch.float32, 257), (torch.float32, "fp32", "int8", 4096 + 255)]
    entries = [make(n, dt, mw, sd, seed=i) for i, (dt, mw, sd, n) in enumerate(configs)]
    grads = [e[1].clone() for e in entries]
    scale = torch.tensor(1000.0, device=DEVICE)  # not a power of two: the unscale rounds
    inv_scale = float(1 / torch.tensor(1000.0, dtype=torch.float64))
    twins = check_step(entries, [(mw, sd) for _, mw, sd, _ in configs], factor=inv_scale, grad_scale=scale)
    for i, (entry, twin, grad) in enumerate(zip(entries, twins, grads)):
        same_bits(entry[1], twin[1], f"grad {i} written back")
        same_bits(entry[1], grad * torch.tensor(inv_scale, dtype=torch.float32), f"grad {i} unscaled")


@pytest.mark.parametrize("amsgrad", [False, True])
def test_split16_equals_the_fp32_master_path(amsgrad):
    """Each step from the same master (the split one, decoded): params, moments and step bitwise; the
    master too but at ties, where the split master sits one fp32 ulp toward the param."""
    split = make(3 * N, torch.bfloat16, "split16", torch.float32, amsgrad=amsgrad, seed=3)
    for step in range(3):
        fp32 = (split[0].clone(), split[1].clone(), {k: t.clone() for k, t in C.decode_state(split[2], split[0]).items()})
        gen = torch.Generator().manual_seed(step)
        grad = torch.randn(3 * N, generator=gen).to(DEVICE)
        split[1].copy_(grad)
        fp32[1].copy_(grad)
        cuda_step([split], amsgrad=amsgrad, maximize=True)
        cuda_step([fp32], amsgrad=amsgrad, maximize=True)
        same_bits(split[0], fp32[0], "param")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            if key in fp32[2]:
                same_bits(split[2][key], fp32[2][key], key)
        joined = C.join16(split[0], split[2]["master_low16"])
        master = fp32[2]["master_param"]
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        same_bits(joined[~tie], master[~tie], "master (no tie)")
        ulps = (joined[tie].view(torch.int32).long() - master[tie].view(torch.int32).long()).abs()
        assert bool((ulps == 1).all()), "a tie's master moves by exactly one fp32 ulp"


def test_split16_tie_rule():
    """New masters with the low half 0x8000 (weight decay alone: zero grads and exp_avg) are stored
    one fp32 ulp toward the param; the param is the fp32 path's."""
    decay = torch.tensor(1 - HYPER["lr"] * HYPER["weight_decay"], dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    targets = ((torch.randint(0x3C00, 0x4200, (4096,), generator=gen) << 16) | 0x8000).to(torch.int32).view(torch.float32)
    targets = targets * torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    masters = targets / decay
    hit = (masters * decay == targets) & ((masters.view(torch.int32) & 0xFFFF) != 0x8000)
    masters = masters[hit][:512]
    n = masters.numel()
    assert n > 100
    param = masters.to(torch.bfloat16).to(DEVICE)
    zeros = torch.zeros(n, device=DEVICE)
    state = C.encode_state(param, {"step": torch.tensor(3.0, device=DEVICE), "exp_avg": zeros,
                                   "exp_avg_sq": torch.full((n,), 1e-4, device=DEVICE),
                                   "master_param": masters.to(DEVICE)}, "split16")
    entry = (param, zeros.clone(), state)
    twins = check_step([entry], [("split16", torch.float32)])
    new_master = twins[0][2]["master_param"]
    assert torch.all((new_master.view(torch.int32) & 0xFFFF) == 0x8000), "every new master is a tie"
    joined = C.join16(entry[0], state["master_low16"])
    ulps = joined.view(torch.int32).long() - new_master.view(torch.int32).long()
    assert torch.all(ulps.abs() == 1), "a tie moves by one fp32 ulp"
    toward = (entry[0].float() - new_master).sign() * new_master.sign()
    assert torch.equal(ulps.sign().float(), toward), "toward the param"


def test_int8_scales_are_block_maxima_and_nan_blocks_stay_nan():
    """A block whose new moment is NaN (skip_nonfinite=False lets a NaN grad through) gets a NaN
    scale and decodes to NaN, as the specification's amax; the other blocks are untouched by it."""
    entry = make(4096 + 300, torch.float32, "fp32", "int8", seed=4)
    entry[1][300] = math.nan  # block 1
    cuda_step([entry])
    scales = entry[2]["exp_avg_scales"]
    assert torch.isnan(scales[1]) and torch.isfinite(scales[torch.arange(scales.numel(), device=DEVICE) != 1]).all()
    decoded = C.decode_state(entry[2])["exp_avg"]
    assert torch.isnan(decoded[256:512]).all() and torch.isfinite(decoded[:256]).all()


# ------------------------------------------------------------------ stochastic rounding

def constant_entry(n, state_dtype, device=None):
    """Every element alike, zero grads: each write lies strictly between two bf16 values."""
    device = device or DEVICE
    param = torch.ones(n, dtype=torch.bfloat16, device=device)
    state = {"step": torch.tensor(4.0, device=device), "exp_avg": torch.ones(n, device=device).to(state_dtype),
             "exp_avg_sq": torch.ones(n, device=device).to(state_dtype),
             "max_exp_avg_sq": torch.zeros(n, device=device).to(state_dtype)}  # below the new exp_avg_sq
    return param, torch.zeros(n, device=device), state


def test_stochastic_rounding_is_unbiased_and_seeded():
    n = 1 << 16
    exact = constant_entry(n, torch.float32)
    exact = (exact[0].float(), exact[1], exact[2])
    spec_step(*exact, amsgrad=True)
    runs = []
    for seed in (11, 11, 12):
        entry = constant_entry(n, torch.bfloat16)
        cuda_step([entry], amsgrad=True, rounding_seed=seed)
        runs.append(entry)
    for what, pick in (("exp_avg", lambda e: e[2]["exp_avg"]), ("exp_avg_sq", lambda e: e[2]["exp_avg_sq"]),
                       ("max_exp_avg_sq", lambda e: e[2]["max_exp_avg_sq"]), ("param", lambda e: e[0])):
        same_bits(pick(runs[0]), pick(runs[1]), f"{what}: the same seed, the same bits")
        assert not torch.equal(pick(runs[0]), pick(runs[2])), f"{what}: another seed gave the same bits"
        target = pick(exact)[0].item()
        low = torch.tensor(target).to(torch.bfloat16)
        low = low.float().item() if low.float().item() <= target else (low.view(torch.int16) - 1).view(torch.bfloat16).float().item()
        high = (torch.tensor(low).to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float().item()
        values = pick(runs[0]).float()
        assert torch.all((values == low) | (values == high)), f"{what}: SR gives one of the two neighbours"
        up = (values == high).double().mean().item()
        fraction = (target - low) / (high - low)
        assert 0.02 < fraction < 0.98, f"{what}: the test value should not be (nearly) representable"
        assert abs(up - fraction) < 4 * (fraction * (1 - fraction) / n) ** 0.5, (what, up, fraction)


def test_stochastic_rounding_draws_the_cpu_kernels_bits():
    """One hash of (seed, tensor index, element index) on both devices: the CUDA and CPU kernels
    round every bf16 write the same way (their fp32 math is the same too: correctly rounded
    division and sqrt, the same fmas; a CPU build without FMA rounds differently)."""
    cpu, why = _compiled.get_backend("cpu")
    if cpu is None:
        pytest.skip(f"compiled CPU backend unavailable: {why}")
    if cpu.cpu_isa == "default":
        pytest.skip("the CPU kernels' baseline build has no fma: its fp32 math differs from the GPU's")
    configs = [(torch.bfloat16, "none", torch.bfloat16, 1000), (torch.bfloat16, "fp32", torch.bfloat16, N),
               (torch.float32, "fp32", torch.bfloat16, 333), (torch.bfloat16, "split8", torch.bfloat16, 4097)]
    gpu = [make(n, dt, mw, sd, amsgrad=True, seed=20 + i) for i, (dt, mw, sd, n) in enumerate(configs)]
    host = [(p.cpu(), g.cpu(), {k: t.cpu() for k, t in s.items()}) for p, g, s in gpu]
    cuda_step(gpu, amsgrad=True, factor=0.5, rounding_seed=1234567)
    cuda_step(host, amsgrad=True, factor=0.5, rounding_seed=1234567, backend=cpu)
    for i, (a, b) in enumerate(zip(gpu, host)):
        assert_same_state((a[0].cpu(), None, {k: t.cpu() for k, t in a[2].items()}), b, f"tensor {i}")


def test_stochastic_rounding_leaves_exact_masters_exact():
    entry = make(N, torch.bfloat16, "split16", torch.float32)
    other = clone(entry)
    cuda_step([entry], rounding_seed=3)
    cuda_step([other])
    assert_same_state(entry, other, "split16 under SR")


# ------------------------------------------------------------------ the op's checks

def test_bad_compact_state_is_refused_before_writing():
    param, grad, state = make(N, torch.bfloat16, "fp32", "int8")
    before = clone((param, grad, state))
    lists = lists_of([(param, grad, state)])
    stats = torch.tensor([0.0, 0.0, 1.0, 0.0], device=DEVICE)
    with pytest.raises(RuntimeError, match="moment_scales"):
        BACKEND.adamw_update_(batch_of({**lists, "moment_scales": None}, [0], [hyper()]), stats)
    short = [(s[0][:-1], s[1], s[2]) for s in lists["moment_scales"]]
    with pytest.raises(RuntimeError, match="scales"):
        BACKEND.adamw_update_(batch_of({**lists, "moment_scales": short}, [0], [hyper()]), stats)
    sync()
    assert_same_state((param, grad, state), before, "refused")


# ------------------------------------------------------------------ through the optimizer

OPT_MODES = [("split16", None), ("split8", "int8"), ("split16", torch.bfloat16), (False, torch.bfloat16),
             ("fp32", "int8"), (False, "int8")]


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = (N, 4096, SMALL, 17)  # int8 moments, one whole int8 row, and two below the threshold
    return [torch.nn.Parameter((torch.randn(n, generator=g) / 4).to(torch.bfloat16).to(DEVICE)) for n in sizes]


def train(params, backend, steps=6, **options):
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, backend=backend, **options)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 1024.0
            if step == 3 and p is params[0]:
                grad[5] = math.inf  # a skipped step
            p.grad = grad.to(p.dtype).to(DEVICE)
        opt.grad_scale = torch.tensor(1024.0, device=DEVICE)
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("master_weights,state_dtype", OPT_MODES)
def test_optimizer_runs_compact_modes_natively_and_near_the_reference(master_weights, state_dtype):
    """Every tensor of these modes is stepped by the CUDA kernel (none goes to the reference passes),
    and the run stays within the encodings' resolution of the reference backend's run (tests/compact/
    test_compact_optimizer.py holds every backend to the same, with tighter per-mode rules)."""
    options = dict(master_weights=master_weights, state_dtype=state_dtype)
    native_params, ref_params = make_params(), make_params()
    opt = train(native_params, "cuda", **options)
    train(ref_params, "reference", **options)
    exp_avgs = [opt.state[p].get("exp_avg_codes", opt.state[p].get("exp_avg")) for p in native_params]
    masters = [next((opt.state[p][k] for k in MASTER_KEYS if k in opt.state[p]), None) for p in native_params]
    assert functional.fallback_indices(BACKEND, native_params, exp_avgs, masters) == []
    assert any(e.dtype != torch.float32 for e in exp_avgs) or master_weights == "split16"
    for a, b in zip(native_params, ref_params):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)
    if (master_weights, state_dtype) == ("split16", None):  # exact: the fp32-master run of the same kernel
        fp32_params = make_params()
        train(fp32_params, "cuda", master_weights="fp32")
        for a, b in zip(native_params, fp32_params):
            same_bits(a.detach(), b.detach(), "split16 vs fp32 masters")


def test_compact_step_is_two_launches_and_never_syncs():
    params = make_params()
    opt = train(params, "cuda", steps=1, master_weights="split8", state_dtype="int8", stochastic_rounding=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # (torch.cuda.synchronize itself counts as a sync)
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # one update launch per variant ([note: a launch per variant] in csrc/cuda/ops_cuda.cpp): the two
    # int8-moment tensors, and the two below the int8 threshold (split8 masters, fp32 moments)
    assert sum("update_kernel" in n for n in names) == 2, names
    assert sum("stats_kernel" in n for n in names) == 1, names


def test_stochastic_rounding_is_refused_under_graph_capture():
    params = make_params()
    opt = train(params, "cuda", steps=1, state_dtype=torch.bfloat16, stochastic_rounding=True)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            opt.step()
    torch.cuda.synchronize()
    for a, b in zip(params, before):
        same_bits(a.detach(), b, "param")


def test_rounding_seed_is_refused_by_the_op_under_capture():
    entry = make(1000, torch.bfloat16, "none", torch.bfloat16)
    cuda_step([entry], rounding_seed=1)  # tables built outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            cuda_step([entry], rounding_seed=2)


def test_reference_is_the_oracle_of_the_lossy_modes_through_the_functional_api():
    """The functional core on CUDA tensors, native, against the reference passes on copies."""
    entries = [make(N, torch.bfloat16, "split8", "int8", amsgrad=True, seed=8),
               make(900, torch.float16, "split8", torch.bfloat16, amsgrad=True, seed=9)]
    copies = [clone(e) for e in entries]
    for batch, backend in ((entries, BACKEND), (copies, reference)):
        cuda_step(batch, amsgrad=True, factor=0.5, backend=backend)
    for i, (a, b) in enumerate(zip(entries, copies)):
        assert_close_to_spec(a, b, f"tensor {i}")
