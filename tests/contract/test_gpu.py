"""GPU-only checks (skipped without CUDA): no host sync in step(), CUDA-graph capture and replay of a
full step, and the compiled Triton kernels at sizes the interpreter cannot afford.

Backends are listed in GPU_BACKENDS; a backend not usable on this machine is skipped.
"""
import math

import pytest
import torch

import ampfused
from ampfused import _backends, reference
from ampfused._batch import Batch, Hyper

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["triton", "cuda"]


def require(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module, reason = _backends.probe(backend)
    reason = reason or _backends._device_reason(module, torch.device("cuda"))
    if reason:
        pytest.skip(f"{backend} backend unavailable on cuda: {reason}")
    return module


def gpu_params(dtypes=(torch.float32, torch.bfloat16, torch.float16), shapes=((1000,), (4097,), (33, 3)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to("cuda", d).requires_grad_() for s, d in zip(shapes, dtypes)]


def grads_for(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=g).mul_(3.0).to("cuda", p.dtype) for p in params]
    if step == 3:  # an overflowing step: skipped, bitwise
        grads[1].view(-1)[7] = math.inf
    return grads


def bitwise_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_training_steps_never_sync(backend, dtype):
    require(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to("cuda", dtype)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler("cuda", init_scale=2.0 ** 10, enabled=dtype == torch.float16)
    data = torch.randn(4, 8, 64, device="cuda", dtype=dtype)

    def iteration():
        for micro in data.split(2):  # two micro-batches: fp32 accumulation hooks run twice
            scaler.scale(model(micro).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    iteration()  # lazy state, pointer tables, Triton compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            iteration()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# compact state (DESIGN §9) replays as the fp32 state does: every buffer in the graph's launches
COMPACT_OPTIONS = [{}, dict(master_weights="split8", state_dtype="int8"), dict(master_weights=False, state_dtype=torch.bfloat16)]


@pytest.mark.parametrize("compact", COMPACT_OPTIONS, ids=["fp32", "split8-int8", "no-master-bf16"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_replay_of_step_matches_eager(backend, compact):
    require(backend)
    options = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, amsgrad=True, fp32_grad_accumulation=False, backend=backend,
                   **compact)
    eager_params = gpu_params()
    graph_params = [p.detach().clone().requires_grad_() for p in eager_params]
    eager = ampfused.FusedAmpAdamW(eager_params, **options)
    graphed = ampfused.FusedAmpAdamW(graph_params, **options)
    static_grads = [torch.zeros_like(p) for p in graph_params]
    for p, g in zip(graph_params, static_grads):
        p.grad = g

    def eager_step(k):
        for p, g in zip(eager_params, grads_for(eager_params, k)):
            p.grad = g
        eager.step()

    def load_static(k):
        for s, g in zip(static_grads, grads_for(graph_params, k)):
            s.copy_(g)

    # warm up on a side stream (lazy state, tables, compilation), as torch's CUDA-graph docs ask
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load_static(0)
        graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    eager_step(0)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    graph_norm = graphed.grad_norm  # written by every replay

    for k in range(1, 7):
        load_static(k)
        graph.replay()
        eager_step(k)
        torch.cuda.synchronize()
        assert bitwise_equal(graph_norm, eager.grad_norm), f"step {k}: grad_norm"
        assert math.isfinite(eager.grad_norm.item()) == (k != 3)
        for i, (pe, pg) in enumerate(zip(eager_params, graph_params)):
            assert bitwise_equal(pg.detach(), pe.detach()), f"step {k}: param {i}"
            for key, value in eager.state[pe].items():
                assert bitwise_equal(graphed.state[pg][key], value), f"step {k}: param {i} state {key}"
    assert all(float(eager.state[p]["step"]) == 6.0 for p in eager_params)  # 7 steps, one skipped


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_large_and_many_tensors_match_reference(backend):
    module = require(backend)
    g = torch.Generator().manual_seed(1)
    sizes = [3_000_001, 65537, 1025, 1] + [1 + i % 17 for i in range(2000)]
    dtypes = [(torch.float32, torch.bfloat16, torch.float16)[i % 3] for i in range(len(sizes))]
    hypers = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, False), Hyper(torch.tensor(2e-3, device="cuda"), 0.8, 0.99, 1e-6, 0.1, True, True)]
    hyper_of = [hypers[i % 2] for i in range(len(sizes))]
    params = [torch.randn(n, generator=g).to("cuda", d) for n, d in zip(sizes, dtypes)]
    state = dict(
        params=params,
        grads=[torch.randn(n, generator=g).to("cuda", d) for n, d in zip(sizes, dtypes)],
        exp_avgs=[torch.randn(n, generator=g).mul_(0.1).cuda() for n in sizes],
        exp_avg_sqs=[torch.rand(n, generator=g).mul_(0.01).cuda() for n in sizes],
        max_exp_avg_sqs=[torch.rand(n, generator=g).mul_(0.01).cuda() if h.amsgrad else None for n, h in zip(sizes, hyper_of)],
        steps=list(torch.arange(len(sizes), dtype=torch.float32, device="cuda").unbind()),
        masters=[p.float() if p.dtype != torch.float32 else None for p in params],
    )
    want = {k: [None if t is None else t.clone() for t in v] for k, v in state.items()}
    stats = torch.tensor([0.0, 0.0, 0.3, 0.0], device="cuda")  # norm, skip, factor, sumsq
    group_ids = [i % 2 for i in range(len(sizes))]
    module.adamw_update_(Batch(*state.values(), group_ids, hypers), stats)
    reference.adamw_update_(Batch(*want.values(), group_ids, hypers), stats)
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps"):
        for a, b in zip(state[key], want[key]):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for p, m in zip(state["params"], state["masters"]):
        if m is not None:
            assert bitwise_equal(p, m.to(p.dtype))

    # stats: one launch over ~1300 programs; fixed-order reduction, so bitwise reproducible
    sums = []
    for _ in range(10):
        stats = torch.zeros(4, device="cuda")
        module.grad_stats_(Batch.of_grads(state["grads"]), torch.tensor([2.0], device="cuda"), None, None, stats)
        sumsq = stats[3]
        sums.append(sumsq)
    exact = sum(float(g.double().mul(0.5).pow(2).sum()) for g in state["grads"])
    assert abs(sums[0].item() - exact) <= 1e-5 * exact
    assert all(bitwise_equal(s, sums[0]) for s in sums)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_replay_with_30_groups_and_bf16_lr_tensor(backend):
    """More groups than travel by value (a group table per step) and a bf16 lr tensor (no
    longer cast into a temporary): nothing a replay reads may be freed after capture. The caching
    allocator is churned between replays so that freed blocks would be handed out and overwritten."""
    require(backend)
    def build():
        params = [torch.randn(97 + 31 * i, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
                  .requires_grad_() for i in range(30)]
        lrs = [torch.tensor(1e-3 * (1 + i % 7), device="cuda", dtype=torch.bfloat16) for i in range(30)]
        groups = [dict(params=[p], lr=lr, weight_decay=0.01 * (i % 3)) for i, (p, lr) in enumerate(zip(params, lrs))]
        return params, lrs, ampfused.FusedAmpAdamW(groups, max_grad_norm=1.0, backend=backend)
    eager_params, eager_lrs, eager = build()
    graph_params, graph_lrs, graphed = build()
    static_grads = [torch.zeros_like(p) for p in graph_params]
    for p, g in zip(graph_params, static_grads):
        p.grad = g

    def grads(k):
        g = torch.Generator().manual_seed(100 + k)
        return [torch.randn(p.shape, generator=g).to("cuda") for p in eager_params]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s, g in zip(static_grads, grads(0)):
            s.copy_(g)
        graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    for p, g in zip(eager_params, grads(0)):
        p.grad = g
    eager.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()

    for k in range(1, 11):
        for lrs in (eager_lrs, graph_lrs):  # a scheduler writing the lr tensors in place
            for i, lr in enumerate(lrs):
                lr.fill_(1e-3 * (1 + (i + k) % 7))
        for s, g in zip(static_grads, grads(k)):
            s.copy_(g)
        churn = [torch.full((4096,), float("nan"), device="cuda") for _ in range(64)]  # reuse of freed blocks
        pinned = [torch.full((4096,), float("nan")).pin_memory() for _ in range(8)]
        graph.replay()
        del churn, pinned
        for p, g in zip(eager_params, grads(k)):
            p.grad = g
        eager.step()
        torch.cuda.synchronize()
        for i, (pe, pg) in enumerate(zip(eager_params, graph_params)):
            assert bitwise_equal(pg.detach(), pe.detach()), f"replay {k}: param {i}"
            for key, value in eager.state[pe].items():
                assert bitwise_equal(graphed.state[pg][key], value), f"replay {k}: param {i} state {key}"
