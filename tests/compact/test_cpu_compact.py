"""The CPU update kernel on compact state (split16 / split8 masters, bf16 and int8 moments,
stochastic rounding) against the specification ``ampfused._compact.compact_adamw_step_``.

Round-to-nearest modes are compared bit for bit with the spec's encodings of the CPU kernel's own
fp32 step (its "twin": the same step on the decoded master and moments), and split16 with the
fp32-master path outright. Against the spec's whole step (torch ops), moments (int8 codes and
scales too) and step are bitwise
and the weights within a few fp32 ulps, as the fp32 kernel is against ampfused.reference
(tests/contract/test_passes.py: torch's division by a scalar is not correctly rounded). Stochastic rounding (the spec's bits exactly:
tests/compact/test_rounding_bits.py) is checked here by what SR promises: each value is one of its two bf16 neighbours, unbiased, reproducible
per seed, and different between seeds and tensors.
"""
import pytest
import torch

from ampfused import _compact as C
from ampfused import _compiled
from ampfused._contract import FACTOR, SKIP, Batch, Hyper

BACKEND, WHY = _compiled.get_backend("cpu")
pytestmark = pytest.mark.skipif(BACKEND is None, reason=f"compiled backend unavailable: {WHY}")

MASTER_KEY = {"fp32": "master_param", "split16": "master_low16", "split8": "master_residual8", "none": None}
N = 70_001  # more than one 65536-element work range, and a ragged tail


def same_bits(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.is_floating_point():
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
        actual, expected = actual[~nan], expected[~nan]
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
        actual, expected = actual.view(width), expected.view(width)
    bad = (actual != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {expected.numel()} differ, first at {bad[:3].tolist()}"


def make_state(n, param_dtype, master_weights, state_dtype, amsgrad, seed):
    """(param, compact state) from random fp32 values, as the optimizer would hold them after a few steps."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 0.5
    exp_avg = torch.randn(n, generator=gen) * 1e-2
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-4
    fp32_state = {"step": torch.tensor(3.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "master_param": master}
    if amsgrad:
        fp32_state["max_exp_avg_sq"] = exp_avg_sq + torch.rand(n, generator=gen) * 1e-4
    param = master.to(param_dtype)
    return param, C.encode_state(param, fp32_state, master_weights, state_dtype)


def make_grad(n, dtype, seed):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed + 100)) * 1e-2).to(dtype)


def clone_state(state):
    return {k: v.clone() for k, v in state.items()}


def stats(factor=1.0, skip=0.0):
    return torch.tensor([0.0, skip, factor, 0.0])


def run_native(cases, hypers, st, *, grad_scale=None, rounding_seed=None, master_weights=None):
    """cases: (param, grad, state, group index, master_weights). Calls the backend once for the list."""
    masters = [s.get(MASTER_KEY[mw]) if MASTER_KEY[mw] else None for _, _, s, _, mw in cases]
    scales = [moment_scales(c[2]) for c in cases]
    BACKEND.adamw_update_(Batch(
        [c[0] for c in cases], [c[1] for c in cases], [moment(c[2], "exp_avg") for c in cases],
        [moment(c[2], "exp_avg_sq") for c in cases], [moment(c[2], "max_exp_avg_sq") for c in cases],
        [c[2]["step"] for c in cases], masters, [c[3] for c in cases], hypers,
        scales if any(s is not None for s in scales) else None), st,
        grad_scale=grad_scale, rounding_seed=rounding_seed)


def moment(state, key):
    """What the op's moment list holds for ``key``: the fp32/bf16 moment or its int8 codes (None if absent)."""
    return state.get(key + "_codes", state.get(key))


def moment_scales(state):
    """The (exp_avg, exp_avg_sq, max_exp_avg_sq) block scales of an int8 state, None otherwise."""
    if "exp_avg_codes" not in state:
        return None
    return tuple(state.get(key + "_scales") for key in C.MOMENTS)


def run_spec(cases, hypers, st):
    for param, grad, state, gi, _ in cases:
        h = hypers[gi]
        C.compact_adamw_step_(param, grad, state, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                              weight_decay=h.weight_decay, amsgrad=h.amsgrad, maximize=h.maximize,
                              factor=st[FACTOR], skip=st[SKIP])


def assert_same_case(native, spec, what):
    (p1, _, s1, _, _), (p2, _, s2, _, _) = native, spec
    same_bits(p1, p2, f"{what}: param")
    assert s1.keys() == s2.keys()
    for key in s1:
        same_bits(s1[key], s2[key], f"{what}: {key}")


def twin_of(case):
    """The same step on fp32 state (decoded master for 16-bit params, decoded moments): the fp32 path's values."""
    param, grad, state, group, _ = case
    twin = {"step": state["step"].clone()}
    for key in C.MOMENTS:
        value = C._decode_moment(state, key)
        if value is not None:
            twin[key] = value.clone()
    if param.dtype != torch.float32:
        twin["master_param"] = C._decode_master(state, param).clone()
    return (param.clone(), grad.clone(), twin, group, "fp32")


def encode_twin(case, twin):
    """What the compact case must hold after the step: the spec's encodings of the twin's fp32 results."""
    param, _, state, _, mw = case
    _, _, t, _, _ = twin
    want = {"step": t["step"]}
    for key in C.MOMENTS:
        if key + "_codes" in state:
            want[key + "_codes"], want[key + "_scales"] = C.quantize(t[key], "signed" if key == "exp_avg" else "sqrt")
        elif key in state:
            want[key] = C.round_bf16(t[key]) if state[key].dtype == torch.bfloat16 else t[key]
    if param.dtype == torch.float32:
        return twin[0], want
    w = t["master_param"]
    if mw == "split16":
        p, want["master_low16"] = C.split16(w)
    elif mw == "split8":
        p, want["master_residual8"] = C.split8(w, param.dtype)
    elif mw == "fp32":
        p, want["master_param"] = w.to(param.dtype), w
    else:
        p = C.round_bf16(w) if param.dtype == torch.bfloat16 else w.to(param.dtype)
    return p, want


def assert_like_spec(native, spec, what):
    """Moments and step bitwise; weights (decoded) within a few fp32 ulps, the param within its rounding."""
    (p1, _, s1, _, _), (p2, _, s2, _, _) = native, spec
    assert s1.keys() == s2.keys()
    for key in s1:
        if key not in MASTER_KEY.values():  # step, moments, int8 codes and scales
            same_bits(s1[key], s2[key], f"{what}: {key}")
    torch.testing.assert_close(p1.float(), p2.float(), rtol=2 ** -7, atol=1e-5, msg=f"{what}: param")
    if p1.dtype != torch.float32:
        torch.testing.assert_close(C._decode_master(s1, p1), C._decode_master(s2, p2), rtol=2 ** -13, atol=1e-7,
                                   msg=f"{what}: master")


def run_checked(cases, hypers, st, *, grad_scale=None, against_spec=True):
    """One native call over `cases`, each checked bitwise against its twin's encoding and closely against the spec
    (``against_spec=False``: int8 states under SMALL_TENSOR_NUMEL, which the spec would re-encode as fp32)."""
    twins = [twin_of(c) for c in cases]
    specs = [(c[0].clone(), c[1].clone(), clone_state(c[2]), c[3], c[4]) for c in cases]
    run_native(cases, hypers, st, grad_scale=grad_scale)
    run_native(twins, hypers, st)
    if against_spec:
        run_spec(specs, hypers, st)
    for i, (case, twin, spec) in enumerate(zip(cases, twins, specs)):
        p, want = encode_twin(case, twin)
        same_bits(case[0], p, f"tensor {i}: param vs twin")
        for key in want:
            same_bits(case[2][key], want[key], f"tensor {i}: {key} vs twin")
        if against_spec:
            assert_like_spec(case, spec, f"tensor {i}")


# param dtype, master_weights, state_dtype: every pair the kernel serves natively
RNE_MODES = [
    (torch.bfloat16, "split16", torch.float32), (torch.bfloat16, "split16", torch.bfloat16),
    (torch.bfloat16, "split8", torch.float32), (torch.bfloat16, "split8", torch.bfloat16),
    (torch.float16, "split8", torch.float32), (torch.float16, "split8", torch.bfloat16),
    (torch.bfloat16, "fp32", torch.bfloat16), (torch.float16, "fp32", torch.bfloat16),
    (torch.bfloat16, "none", torch.bfloat16), (torch.float16, "none", torch.bfloat16),
    (torch.float32, "fp32", torch.bfloat16),
    (torch.bfloat16, "split16", "int8"), (torch.bfloat16, "split8", "int8"), (torch.float16, "split8", "int8"),
    (torch.bfloat16, "fp32", "int8"), (torch.bfloat16, "none", "int8"), (torch.float32, "fp32", "int8"),
]


def test_compact_modes_are_what_the_kernel_serves():
    assert BACKEND.COMPACT_MODES == frozenset({"split16", "split8", "bf16", "int8", "sr"})


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("param_dtype,master_weights,state_dtype", RNE_MODES)
def test_rne_modes_match_the_spec_bitwise(param_dtype, master_weights, state_dtype, amsgrad):
    hypers = [Hyper(2e-3, 0.9, 0.999, 1e-8, 0.01, amsgrad, False)]
    param, state = make_state(N, param_dtype, master_weights, state_dtype, amsgrad, seed=1)
    for step in range(3):
        grad_dtype = torch.float32 if step % 2 else param_dtype
        run_checked([(param, make_grad(N, grad_dtype, seed=step), state, 0, master_weights)], hypers, stats(factor=0.75))


@pytest.mark.parametrize("amsgrad", [False, True])
def test_split16_equals_the_fp32_master_path(amsgrad):
    """The same step from the same master: params, moments and step bitwise; the master too but
    for the tie rule (the split16 master one fp32 ulp toward the param, the param the same)."""
    hypers = [Hyper(1e-3, 0.9, 0.99, 1e-8, 0.1, amsgrad, True)]
    param, state = make_state(N, torch.bfloat16, "split16", torch.float32, amsgrad, seed=2)
    for step in range(4):
        master = C.join16(param, state["master_low16"])  # the fp32 master both paths start from
        fp32 = {k: v.clone() for k, v in state.items() if k != "master_low16"}
        fp32["master_param"] = master.clone()
        p32 = param.clone()
        grad = make_grad(N, torch.bfloat16, seed=10 + step)
        st = stats(factor=1.25)
        run_native([(param, grad, state, 0, "split16")], hypers, st)
        run_native([(p32, grad.clone(), fp32, 0, "fp32")], hypers, st)
        same_bits(param, p32, "param")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            if key in state:
                same_bits(state[key], fp32[key], key)
        joined = C.join16(param, state["master_low16"])
        low = fp32["master_param"].view(torch.int32) & 0xFFFF
        tie = low == 0x8000
        same_bits(joined[~tie], fp32["master_param"][~tie], "master (no tie)")
        ulps = (joined[tie].view(torch.int32).long() - fp32["master_param"][tie].view(torch.int32).long()).abs()
        assert bool((ulps == 1).all()), "a tie's master moves by exactly one fp32 ulp"  # rare here: see the next test


def test_split16_ties_keep_the_param_rne_and_move_the_master_one_ulp():
    """Zero moments and gradient: the new master is w * (1 - lr*wd) exactly; pick masters that land on ties."""
    lr, wd = 1e-3, 0.5
    decay = torch.tensor(1 - lr * wd, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    candidates = torch.randn(1 << 20, generator=gen)
    candidates = C.join16(*C.split16(candidates))  # representable as split16
    lands = ((candidates * decay).view(torch.int32) & 0xFFFF) == 0x8000
    w = torch.cat([candidates[lands], candidates[:4096]])
    assert int(lands.sum()) > 4
    param, low = C.split16(w)
    zeros = torch.zeros_like(w)
    state = {"step": torch.tensor(0.0), "exp_avg": zeros.clone(), "exp_avg_sq": zeros.clone(), "master_low16": low}
    spec = (param.clone(), torch.zeros_like(param), clone_state(state), 0, "split16")
    native = (param, torch.zeros_like(param), state, 0, "split16")
    hypers = [Hyper(lr, 0.9, 0.999, 1e-8, wd, False, False)]
    run_native([native], hypers, stats())
    run_spec([spec], hypers, stats())
    assert_same_case(native, spec, "ties")
    exact = w * decay
    same_bits(param, exact.to(torch.bfloat16), "param = RNE(exact master)")
    moved = (C.join16(param, state["master_low16"]).view(torch.int32).long() - exact.view(torch.int32).long()).abs()
    tie = (exact.view(torch.int32) & 0xFFFF) == 0x8000
    assert bool((moved[tie] == 1).all()) and bool((moved[~tie] == 0).all())


def test_skipped_step_leaves_every_compact_buffer_bitwise():
    hypers = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)]
    cases = []
    for i, (dtype, mw, sd) in enumerate(RNE_MODES):
        param, state = make_state(5000, dtype, mw, sd, True, seed=20 + i)
        cases.append((param, make_grad(5000, dtype, seed=i), state, 0, mw))
    before = [(p.clone(), g.clone(), clone_state(s)) for p, g, s, _, _ in cases]
    run_native(cases, hypers, stats(skip=1.0), grad_scale=torch.tensor([8.0]), rounding_seed=123)
    for (p, g, s, _, _), (p0, g0, s0) in zip(cases, before):
        same_bits(p, p0, "param")
        same_bits(g, g0, "grad")
        for key in s:
            same_bits(s[key], s0[key], key)


def test_mixed_list_with_grad_scale_and_two_groups():
    """fp32-path and compact tensors in one call, each equal to the spec; grads unscaled in place."""
    hypers = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False), Hyper(3e-3, 0.8, 0.99, 1e-6, 0.0, True, True)]
    layout = [(torch.float32, "fp32", torch.float32), (torch.bfloat16, "fp32", torch.float32)] + RNE_MODES
    cases = []
    for i, (dtype, mw, sd) in enumerate(layout):
        n = 3000 + 517 * i
        group = i % 2
        param, state = make_state(n, dtype, mw, sd, hypers[group].amsgrad, seed=40 + i)
        cases.append((param, make_grad(n, torch.float32 if i % 3 == 0 else dtype, seed=60 + i), state, group, mw))
    grads = [c[1].clone() for c in cases]
    scale = torch.tensor([1024.0])
    inv = scale.double().reciprocal().float()
    run_checked(cases, hypers, stats(factor=float(inv) * 0.5), grad_scale=scale)
    for i, (case, g) in enumerate(zip(cases, grads)):
        same_bits(case[1], (g.float() * inv).to(g.dtype), f"tensor {i}: unscaled grad")


# ------------------------------------------------------------------ stochastic rounding

def sr_case(n, seed, param_dtype=torch.bfloat16, master_weights="none", state_dtype=torch.bfloat16):
    param, state = make_state(n, param_dtype, master_weights, state_dtype, True, seed=seed)
    return param, make_grad(n, torch.bfloat16, seed=seed), state


def fp32_twin(param, grad, state, master_weights):
    """The same step on fp32 moments (and an fp32 master for a param without one): the unrounded values."""
    twin = {k: (v.float() if v.dtype == torch.bfloat16 else v).clone() for k, v in state.items()}
    if master_weights == "none":
        twin["master_param"] = param.float()
    return (param.clone(), grad.clone(), twin, 0, "fp32" if master_weights == "none" else master_weights)


def neighbours_and_bias(rounded, exact, what):
    """rounded (bf16) is one of exact's two bf16 neighbours, and the rounding errors average to ~0."""
    u = exact.view(torch.int32).long() & 0xFFFFFFFF
    r = rounded.view(torch.int16).long() & 0xFFFF
    down = u >> 16
    ok = (r == down) | (r == down + 1)
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} values are not a bf16 neighbour"
    frac = (u & 0xFFFF).double() / 65536  # P(round up) for an unbiased SR
    up = (r == down + 1).double()
    err = up - frac  # mean 0, variance <= 1/4 per element
    limit = 5 * 0.5 / err.numel() ** 0.5
    assert abs(float(err.mean())) < limit, f"{what}: biased by {float(err.mean())} ulp (limit {limit})"
    inexact = frac > 0
    assert 0.2 < float(up[inexact].mean()) < 0.8, f"{what}: rounds one way only"


@pytest.mark.parametrize("master_weights", ["none", "split16", "fp32"])
def test_stochastic_rounding_is_unbiased_between_neighbours(master_weights):
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False)]
    param, grad, state = sr_case(1 << 17, seed=7, master_weights=master_weights)
    twin = fp32_twin(param, grad, state, master_weights)
    run_native([(param, grad, state, 0, master_weights)], hypers, stats(), rounding_seed=2**61 + 12345)
    run_native([twin], hypers, stats())
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        neighbours_and_bias(state[key], twin[2][key], key)
    if master_weights == "none":
        neighbours_and_bias(param, twin[2]["master_param"], "param")
    else:  # an exact master: the param is RNE of it, never stochastic
        same_bits(param, twin[0], "param")
    same_bits(state["step"], twin[2]["step"], "step")


def test_stochastic_rounding_reproducible_per_seed_and_distinct_per_seed_and_tensor():
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False)]

    def run(seed):
        a, b = sr_case(20000, seed=9), sr_case(20000, seed=9)  # two identical tensors in one call
        run_native([(a[0], a[1], a[2], 0, "none"), (b[0], b[1], b[2], 0, "none")], hypers, stats(), rounding_seed=seed)
        return a, b

    a1, b1 = run(42)
    a2, _ = run(42)
    a3, _ = run(43)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        same_bits(a1[2][key], a2[2][key], f"{key}: same seed")
        assert not torch.equal(a1[2][key], a3[2][key]), f"{key}: another seed draws other bits"
        assert not torch.equal(a1[2][key], b1[2][key]), f"{key}: another tensor draws other bits"
    same_bits(a1[0], a2[0], "param: same seed")
    assert not torch.equal(a1[0], a3[0]) and not torch.equal(a1[0], b1[0])


def test_stochastic_rounding_does_not_depend_on_the_thread_count():
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False, False)]
    results = []
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            param, grad, state = sr_case(200_000, seed=11)
            run_native([(param, grad, state, 0, "none")], hypers, stats(), rounding_seed=7)
            results.append((param, state))
    finally:
        torch.set_num_threads(threads)
    same_bits(results[0][0], results[1][0], "param")
    for key in ("exp_avg", "exp_avg_sq"):
        same_bits(results[0][1][key], results[1][1][key], key)


def test_without_a_seed_a_bf16_param_without_master_takes_the_rne_spec():
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False, False)]
    param, state = make_state(9000, torch.bfloat16, "none", torch.float32, False, seed=13)
    run_checked([(param, make_grad(9000, torch.bfloat16, seed=13), state, 0, "none")], hypers, stats())


# ------------------------------------------------------------------ bad input

def bad_call(masters=None, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, param_dtype=torch.bfloat16):
    p = torch.randn(300).to(param_dtype)
    p0 = p.clone()
    m = torch.zeros(300, dtype=exp_avg_dtype)
    v = torch.zeros(300, dtype=exp_avg_sq_dtype)
    step = torch.tensor(0.0)
    hypers = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)]
    with pytest.raises(Exception) as info:
        BACKEND.adamw_update_(Batch([p], [torch.ones(300, dtype=param_dtype)], [m], [v], [None], [step], [masters], [0], hypers), stats())
    same_bits(p, p0, "param untouched")
    assert float(step) == 0.0
    return str(info.value)


def test_bad_compact_dtypes_are_refused_before_anything_is_written():
    assert "int16 (split16 low halves), which needs a bfloat16 param" in bad_call(
        masters=torch.zeros(300, dtype=torch.int16), param_dtype=torch.float16)
    assert "int8 (split8 residuals), which needs a bfloat16 or float16 param" in bad_call(
        masters=torch.zeros(300, dtype=torch.int8), param_dtype=torch.float32)
    assert "must be float32 (fp32 master), int16 (split16) or int8 (split8)" in bad_call(
        masters=torch.zeros(300, dtype=torch.int32))
    assert "holds int8 codes but moment_scales is None" in bad_call(exp_avg_dtype=torch.int8, exp_avg_sq_dtype=torch.uint8)
    assert "keep exp_avg as int8 codes and exp_avg_sq / max_exp_avg_sq as uint8 codes" in bad_call(
        exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    assert "a tensor's moments share one dtype" in bad_call(exp_avg_dtype=torch.bfloat16)


@pytest.mark.parametrize("bad", ["short", "float64", "on a float moment"])
def test_bad_int8_scales_are_refused_before_anything_is_written(bad):
    """Every tensor is checked before the first write: a bad entry of the second tensor leaves the first untouched."""
    good = make_state(5000, torch.bfloat16, "split8", "int8", False, seed=70)
    other = make_state(5000, torch.bfloat16, "split8", "int8" if bad != "on a float moment" else torch.float32, False,
                       seed=71)
    cases = [(good[0], make_grad(5000, torch.bfloat16, 1), good[1], 0, "split8"),
             (other[0], make_grad(5000, torch.bfloat16, 2), other[1], 0, "split8")]
    scales = [moment_scales(good[1]), moment_scales(other[1])]
    if bad == "short":
        scales[1] = (scales[1][0][:-1], scales[1][1], None)
    elif bad == "float64":
        scales[1] = (scales[1][0].double(), scales[1][1], None)
    else:
        scales[1] = scales[0]
    before = [(p.clone(), clone_state(s)) for p, _, s, _, _ in cases]
    hypers = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)]
    with pytest.raises(RuntimeError, match="moment_scales"):
        BACKEND.adamw_update_(Batch([c[0] for c in cases], [c[1] for c in cases], [moment(c[2], "exp_avg") for c in cases],
                                    [moment(c[2], "exp_avg_sq") for c in cases], [None, None], [c[2]["step"] for c in cases],
                                    [c[2]["master_residual8"] for c in cases], [0, 0], hypers, scales), stats())
    for (p, _, s, _, _), (p0, s0) in zip(cases, before):
        same_bits(p, p0, "param")
        for key in s:
            same_bits(s[key], s0[key], key)


def test_int8_blocks_smaller_than_a_block_and_ragged_tails():
    """int8 states of tensors under one block, one block plus a bit, and a range plus a partial block
    (the optimizer keeps tensors under SMALL_TENSOR_NUMEL fp32, but the kernel serves any size)."""
    hypers = [Hyper(2e-3, 0.9, 0.999, 1e-8, 0.01, True, False)]
    cases = []
    for i, n in enumerate((1, 100, 257, 65536 + 31)):
        gen = torch.Generator().manual_seed(80 + i)
        master = torch.randn(n, generator=gen) * 0.5
        param = master.to(torch.bfloat16)
        state = {"step": torch.tensor(2.0)}
        state["master_residual8"] = C.split8(master, torch.bfloat16)[1]
        for key, kind in (("exp_avg", "signed"), ("exp_avg_sq", "sqrt"), ("max_exp_avg_sq", "sqrt")):
            value = torch.randn(n, generator=gen) * 1e-2 if kind == "signed" else torch.rand(n, generator=gen) * 1e-4
            state[key + "_codes"], state[key + "_scales"] = C.quantize(value, kind)
        cases.append((param, make_grad(n, torch.float32, seed=i), state, 0, "split8"))
    for _ in range(2):
        run_checked(cases, hypers, stats(factor=0.5), against_spec=False)


def test_int8_moments_with_a_tensor_lr_and_maximize():
    """A 0-d tensor lr (read by the op) and maximize on int8 moments, against the spec with the same float lr."""
    lr = torch.tensor(3e-3, dtype=torch.float64)
    param, state = make_state(9000, torch.bfloat16, "split16", "int8", True, seed=90)
    spec = (param.clone(), make_grad(9000, torch.bfloat16, 5), clone_state(state), 0, "split16")
    native = (param, spec[1].clone(), state, 0, "split16")
    run_native([native], [Hyper(lr, 0.9, 0.999, 1e-8, 0.01, True, True)], stats(factor=2.0))
    run_spec([spec], [Hyper(3e-3, 0.9, 0.999, 1e-8, 0.01, True, True)], stats(factor=2.0))
    assert_like_spec(native, spec, "tensor lr")


@pytest.mark.parametrize("test_utils", ["test_schema", "test_faketensor", "test_aot_dispatch_dynamic"])
def test_opcheck_with_compact_state_and_a_seed(test_utils):
    """The op with int16/int8 masters, bf16 and int8 moments (with their scales) and rounding_seed keeps its
    registration honest (torch.compile)."""
    cases = [make_state(n, dt, mw, sd, True, seed=3) + (mw,) for n, dt, mw, sd in
             [(700, torch.bfloat16, "split16", torch.bfloat16), (700, torch.float16, "split8", torch.float32),
              (4500, torch.bfloat16, "split8", "int8")]]
    empty = torch.empty(0)
    scales = [t if t is not None else empty for _, s, _ in cases for t in (moment_scales(s) or (None,) * 3)]
    args = ([p for p, _, _ in cases], [make_grad(p.numel(), p.dtype, 1) for p, _, _ in cases],
            [moment(s, "exp_avg") for _, s, _ in cases], [moment(s, "exp_avg_sq") for _, s, _ in cases],
            [moment(s, "max_exp_avg_sq") for _, s, _ in cases], [s["step"] for _, s, _ in cases],
            [s[MASTER_KEY[mw]] for _, s, mw in cases], [0, 0, 0], [1e-3], [None], [0.9], [0.999], [1e-8], [0.01], [1],
            torch.tensor([0.0, 0.0, 1.0, 0.0]), None, None, 77, scales)
    torch.library.opcheck(torch.ops.ampfused.adamw_update.default, args, test_utils=test_utils)
