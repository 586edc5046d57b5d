"""FusedAmpAdamW's compact modes on the CUDA backend, GPU only: every tensor stepped natively and near
the reference backend's run, two launches a step and no host sync, and stochastic rounding refused
under CUDA graph capture (its seed is drawn on the host)."""
import math

import pytest
import torch

import ampfused
from ampfused import _compact as C
from ampfused import _compiled, functional
from helpers import MASTER_KEYS, compact_update, same_bits

if not torch.cuda.is_available():
    BACKEND, WHY = None, "needs a CUDA GPU; this machine has none"
else:
    BACKEND, WHY = _compiled.get_backend("cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(BACKEND is None, reason=f"CUDA backend unavailable: {WHY}")]

SMALL = C.SMALL_TENSOR_NUMEL - 1
NATIVE_MODES = [("split16", None), ("split8", "int8"), ("split16", torch.bfloat16), (False, torch.bfloat16),
                ("fp32", "int8"), (False, "int8"), ("fp32", "int4"), ("split16", "int4"), (False, "int4")]


def cuda_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    # blockwise moments (int8 / int4: 2-D, from SMALL_TENSOR_NUMEL on) in rows of 1000, no whole number
    # of blocks, past one 65536-element chunk, and in one whole row; two 1-D tensors keep fp32 moments
    shapes = ((70, 1000), (1, 4096), (SMALL,), (17,))
    return [torch.nn.Parameter((torch.randn(s, generator=g) / 4).to(torch.bfloat16).to("cuda")) for s in shapes]


def cuda_train(params, backend, steps=6, **options):
    opt = ampfused.FusedAmpAdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, backend=backend, **options)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 1024.0
            if step == 3 and p is params[0]:
                grad.view(-1)[5] = math.inf  # a skipped step
            p.grad = grad.to(p.dtype).to("cuda")
        opt.grad_scale = torch.tensor(1024.0, device="cuda")
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("master_weights,state_dtype", NATIVE_MODES)
def test_optimizer_runs_compact_modes_natively_and_near_the_reference(master_weights, state_dtype):
    """Every tensor of these modes is stepped by the CUDA kernel (none goes to the reference passes),
    and the run stays within the encodings' resolution of the reference backend's run (tests/compact/
    test_optimizer_runs.py holds every backend to the same, with tighter per-mode rules)."""
    options = dict(master_weights=master_weights, state_dtype=state_dtype)
    native_params, ref_params = cuda_params(), cuda_params()
    opt = cuda_train(native_params, "cuda", **options)
    cuda_train(ref_params, "reference", **options)
    exp_avgs = [opt.state[p].get("exp_avg_codes", opt.state[p].get("exp_avg")) for p in native_params]
    masters = [next((opt.state[p][k] for k in MASTER_KEYS if k in opt.state[p]), None) for p in native_params]
    assert functional.fallback_indices(BACKEND, native_params, exp_avgs, masters) == []
    assert any(e.dtype != torch.float32 for e in exp_avgs) or master_weights == "split16"
    for a, b in zip(native_params, ref_params):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)
    if (master_weights, state_dtype) == ("split16", None):  # exact: the fp32-master run of the same kernel
        fp32_params = cuda_params()
        cuda_train(fp32_params, "cuda", master_weights="fp32")
        for a, b in zip(native_params, fp32_params):
            same_bits(a.detach(), b.detach(), "split16 vs fp32 masters")


def test_compact_step_is_two_launches_and_never_syncs():
    params = cuda_params()
    opt = cuda_train(params, "cuda", steps=1, master_weights="split8", state_dtype="int8", stochastic_rounding=True)
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
    # int8-moment tensors, and the two 1-D ones (split8 masters, fp32 moments)
    assert sum("update_kernel" in n for n in names) == 2, names
    assert sum("stats_kernel" in n for n in names) == 1, names


def test_stochastic_rounding_is_refused_under_graph_capture():
    params = cuda_params()
    opt = cuda_train(params, "cuda", steps=1, state_dtype=torch.bfloat16, stochastic_rounding=True)
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
    from helpers import compact_entry

    entry = compact_entry(1000, torch.bfloat16, "none", torch.bfloat16, "cuda")
    compact_update(BACKEND, [entry], rounding_seed=1)  # tables built outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            compact_update(BACKEND, [entry], rounding_seed=2)
