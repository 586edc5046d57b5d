"""Stochastic rounding (``rounding_seed``) on every backend's update: each bf16 write without an
exact master is one of its two bf16 neighbours, unbiased, reproducible per seed and different between
seeds and tensors; exact masters are never rounded stochastically; without a seed the update is the
round-to-nearest spec. The CUDA kernel (on the GPU and through the host emulation) draws the CPU
kernel's bits: one counter-based hash of (seed, tensor index, element index), csrc/compact_random.h.
"""
import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused import _compiled
from ampfused._batch import Hyper
from helpers import DEVICE, assert_same_state, check_step, clone_compact, compact_update, constant_entry, same_bits, spec_step

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def sr_case(kernel, n, seed, master_weights="none"):
    """bf16 params and moments with AMSGrad from random fp32 values, as the optimizer would hold them
    after a few steps (small moments: some new exp_avg_sq exceed the AMSGrad buffer)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 0.5
    exp_avg = torch.randn(n, generator=gen) * 1e-2
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-4
    fp32_state = {"step": torch.tensor(3.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "master_param": master,
                  "max_exp_avg_sq": exp_avg_sq + torch.rand(n, generator=gen) * 1e-4}
    param = master.to(torch.bfloat16).to(kernel.device)
    state = C.encode_state(param, {k: t.to(kernel.device) for k, t in fp32_state.items()}, master_weights, torch.bfloat16)
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(seed + 100)) * 1e-2).to(torch.bfloat16)
    return param, grad.to(kernel.device), state


def fp32_twin(param, grad, state, master_weights):
    """The same step on fp32 moments (and an fp32 master for a param without one): the unrounded values."""
    twin = {k: (v.float() if k in C.MOMENTS else v).clone() for k, v in state.items()}  # (split16's bits stay bits)
    if master_weights == "none":
        twin["master_param"] = param.float()
    return param.clone(), grad.clone(), twin


def neighbours_and_bias(rounded, exact, what):
    """rounded (bf16) is one of exact's two bf16 neighbours, and the rounding errors average to ~0."""
    u = exact.cpu().view(torch.int32).long() & 0xFFFFFFFF
    r = rounded.cpu().view(torch.int16).long() & 0xFFFF
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
def test_stochastic_rounding_is_unbiased_between_neighbours(kernel, master_weights):
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False)]
    param, grad, state = sr_case(kernel, kernel.sr_n, seed=7, master_weights=master_weights)
    twin = fp32_twin(param, grad, state, master_weights)
    kernel.step([(param, grad, state)], hypers=hypers, rounding_seed=2**61 + 12345)
    kernel.step([twin], hypers=hypers)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        neighbours_and_bias(state[key], twin[2][key], key)
    if master_weights == "none":
        neighbours_and_bias(param, twin[2]["master_param"], "param")
    else:  # an exact master: the param is RNE of it, never stochastic
        same_bits(param, twin[0], "param")
    same_bits(state["step"], twin[2]["step"], "step")


def test_stochastic_rounding_reproducible_per_seed_and_distinct_per_seed_and_tensor(kernel):
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False)]
    n = min(20000, kernel.sr_n // 2)

    def run(seed):
        a, b = sr_case(kernel, n, seed=9), sr_case(kernel, n, seed=9)  # two identical tensors in one call
        kernel.step([a, b], hypers=hypers, rounding_seed=seed)
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


@pytest.mark.parametrize("kernel", ["cpu"], indirect=True)
def test_stochastic_rounding_does_not_depend_on_the_thread_count(kernel):
    """The CPU kernel's bits do not depend on how its work ranges are split over threads."""
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False, False)]
    results = []
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            param, grad, state = sr_case(kernel, 200_000, seed=11)
            kernel.step([(param, grad, state)], hypers=hypers, rounding_seed=7)
            results.append((param, state))
    finally:
        torch.set_num_threads(threads)
    same_bits(results[0][0], results[1][0], "param")
    for key in ("exp_avg", "exp_avg_sq"):
        same_bits(results[0][1][key], results[1][1][key], key)


def test_without_a_seed_a_bf16_param_without_master_takes_the_rne_spec(kernel):
    entry = kernel.entry(kernel.n, torch.bfloat16, "none", torch.float32, seed=13)
    check_step(kernel, [entry], [("none", torch.float32)])


def test_stochastic_rounding_is_unbiased_and_seeded(kernel):
    n = kernel.sr_n
    exact = constant_entry(n, torch.float32, kernel.device)
    exact = (exact[0].float(), exact[1], exact[2])  # an fp32 param: the exact result of the param too
    spec_step(*exact, Hyper(*(1e-2, 0.9, 0.999, 1e-8, 0.01), True, False))
    runs = []
    for seed in (11, 11, 12):
        entry = constant_entry(n, torch.bfloat16, kernel.device)
        kernel.step([entry], amsgrad=True, rounding_seed=seed)
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

    rne = constant_entry(n, torch.bfloat16, kernel.device)
    kernel.step([rne], amsgrad=True)  # round to nearest: the spec bitwise
    spec_rne = constant_entry(n, torch.bfloat16, kernel.device)
    spec_step(*spec_rne, Hyper(*(1e-2, 0.9, 0.999, 1e-8, 0.01), True, False))
    assert_same_state(rne, spec_rne, "RNE")


def test_stochastic_rounding_draws_the_cpu_kernels_bits(cuda_kernel):
    """One hash of (seed, tensor index, element index) on both devices: the CUDA and CPU kernels
    round every bf16 write the same way (their fp32 math is the same too: correctly rounded
    division and sqrt, the same fmas; a CPU build without FMA rounds differently)."""
    kernel = cuda_kernel
    cpu, why = _compiled.get_backend("cpu")
    if cpu is None:
        pytest.skip(f"compiled CPU backend unavailable: {why}")
    if cpu.cpu_isa == "default":
        pytest.skip("the CPU kernels' baseline build has no fma: its fp32 math differs from the GPU's")
    configs = [(torch.bfloat16, "none", torch.bfloat16, 1000), (torch.bfloat16, "fp32", torch.bfloat16, kernel.n),
               (torch.float32, "fp32", torch.bfloat16, 333), (torch.bfloat16, "split8", torch.bfloat16, 4097)]
    gpu = [kernel.entry(n, dt, mw, sd, amsgrad=True, seed=20 + i) for i, (dt, mw, sd, n) in enumerate(configs)]
    host = [(p.cpu(), g.cpu(), {k: t.cpu() for k, t in s.items()}) for p, g, s in gpu]
    kernel.step(gpu, amsgrad=True, factor=0.5, rounding_seed=1234567)
    compact_update(cpu, host, amsgrad=True, factor=0.5, rounding_seed=1234567)
    for i, (a, b) in enumerate(zip(gpu, host)):
        assert_same_state((a[0].cpu(), None, {k: t.cpu() for k, t in a[2].items()}), b, f"tensor {i}")


def test_stochastic_rounding_leaves_exact_masters_exact(kernel):
    """With a split16 master nothing is rounded: a seed changes no bit of param or master."""
    entry = kernel.entry(kernel.n, torch.bfloat16, "split16", torch.float32)
    other = clone_compact(entry)
    kernel.step([entry], rounding_seed=3)
    kernel.step([other])
    assert_same_state(entry, other, "split16 under SR")


# ------------------------------------------------------------------ through the optimizer


def test_stochastic_rounding_is_reproducible_and_unbiased(backend):
    """The same torch seed gives the same bits; SR of bf16 params without master follows the fp32 run on average."""
    ends = []
    for _ in range(2):
        # 2048 elements: the mean's spread after 20 steps is ~6e-5 (binomial moves of one 2^-8 ulp), a
        # fifth of the bound below
        params = [torch.nn.Parameter(torch.full((2048,), 1.0, device=DEVICE).to(torch.bfloat16))]
        opt = ampfused.FusedAmpAdamW(params, lr=1e-4, weight_decay=0.0, master_weights=False,
                                     stochastic_rounding=True, backend=backend)
        torch.manual_seed(11)
        for _ in range(20):
            params[0].grad = torch.ones_like(params[0])
            opt.step()
        ends.append(params[0].detach().clone())
    assert torch.equal(ends[0], ends[1])
    # each step moves the param by lr = 1e-4 (Adam's unit step), far below half a bf16 ulp at 1.0 (2^-8):
    # RNE would never move it; SR moves it by 20 * 1e-4 on average
    mean = ends[0].float().mean().item()
    assert abs(mean - (1.0 - 20e-4)) < 3e-4

