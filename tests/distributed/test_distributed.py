"""DistributedDataParallel and ZeroRedundancyOptimizer on 2 gloo processes.

- fp32 params, stock DDP with no_sync() over the accumulation micro-batches: equal to
  torch.optim.AdamW + clip_grad_norm_ on the same DDP run (params and state), and to one process
  on the large batch.
- bf16 params with default FusedAmpAdamW (fp32 accumulation) through ampfused.distributed.data_parallel,
  plain / gradient_as_bucket_view / static_graph: p.grad after the synced backward is the fp32
  all-reduced gradient, identical on every rank; master weights equal one process accumulating all
  micro-batches in fp32 within fp32-accumulation tolerance.
- ZeroRedundancyOptimizer(optimizer_class=FusedAmpAdamW): trains like it does with torch AdamW; with
  max_grad_norm the norm covers every partition; fp32 accumulation of bf16 params is refused.
"""
import pytest
import torch
import torch.distributed as dist

import ampfused
from dist_utils import rank_backends, rank_batch, rank_device, requires_gloo, run
from helpers import mlp, tol

pytestmark = requires_gloo
WORLD, MICRO, PER_MICRO, STEPS, CLIP = 2, 2, 3, 4, 0.05
DDP = torch.nn.parallel.DistributedDataParallel


def replicated_model(dtype=torch.float32, fp32_head=False):
    """fp32_head: the last layer stays fp32, so DDP's own reducer has params left (real DDP buckets)."""
    model = mlp(6, 12, 3, dtype=dtype, device=rank_device())
    if fp32_head:
        model[2].float()
        model[2].register_forward_pre_hook(lambda module, args: tuple(a.float() for a in args))
    return model


def micro_batch(step, index):
    """Micro-batch ``index`` of the WORLD * MICRO micro-batches of one step."""
    return rank_batch(100 * step + index, PER_MICRO)


def micro_loss(model, step, index, scale):
    x, y = micro_batch(step, index)
    out = model(x.to(next(model.parameters()).dtype))
    return torch.nn.functional.mse_loss(out.float(), y, reduction="sum") * scale


def backward_ddp(ddp, rank, step):
    """N micro-batches on this rank: no_sync() on the first N-1; DDP averages over ranks, so * WORLD."""
    scale = WORLD / (WORLD * MICRO * PER_MICRO)
    for micro in range(MICRO):
        index = rank * MICRO + micro
        if micro < MICRO - 1:
            with ddp.no_sync():
                micro_loss(ddp, step, index, scale).backward()
        else:
            micro_loss(ddp, step, index, scale).backward()


def backward_one_process(model, step):
    for index in range(WORLD * MICRO):
        micro_loss(model, step, index, 1 / (WORLD * MICRO * PER_MICRO)).backward()


def check_fp32_ddp(rank, backend):
    ours, stock = replicated_model(), replicated_model()
    ddp_ours, ddp_stock = DDP(ours), DDP(stock)
    opt = ampfused.FusedAmpAdamW(ours.parameters(), lr=1e-2, max_grad_norm=CLIP, backend=backend)
    ref = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    for step in range(STEPS):
        backward_ddp(ddp_ours, rank, step)
        backward_ddp(ddp_stock, rank, step)
        norm = torch.nn.utils.clip_grad_norm_(stock.parameters(), CLIP)
        assert norm > CLIP
        opt.step(), ref.step()
        torch.testing.assert_close(opt.grad_norm, norm, **tol(backend))
        opt.zero_grad(), ref.zero_grad()
    for i, (p, q) in enumerate(zip(ours.parameters(), stock.parameters())):
        torch.testing.assert_close(p, q, **tol(backend), msg=f"fp32 DDP {backend}: param {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], **tol(backend), msg=f"fp32 DDP {backend}: {key} {i}")
    single = replicated_model()
    single_opt = ampfused.FusedAmpAdamW(single.parameters(), lr=1e-2, max_grad_norm=CLIP, backend=backend)
    for step in range(STEPS):
        backward_one_process(single, step)
        single_opt.step()
        single_opt.zero_grad()
    for i, (p, q) in enumerate(zip(ours.parameters(), single.parameters())):  # the sums run in another order
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"fp32 DDP {backend} vs one process: param {i}")


def check_bf16_ddp(rank, backend, ddp_kwargs, fp32_head):
    model = replicated_model(torch.bfloat16, fp32_head)
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=CLIP, backend=backend)
    ddp = ampfused.distributed.data_parallel(model, opt, **ddp_kwargs)
    assert isinstance(ddp, DDP), "a DistributedDataParallel to code that asks (get_state_dict strips its prefix)"
    assert (getattr(ddp, "reducer", None) is not None) == fp32_head, "DDP's reducer keeps the fp32 params; with none left, none"
    what = f"bf16 DDP {backend} {ddp_kwargs} fp32_head={fp32_head}"
    if ddp_kwargs.get("static_graph"):
        # torch's DDP learns a static graph from a synced first backward (no_sync() there trips an internal
        # assert in its reducer, with fp32 params and torch.optim.AdamW alike): one synced backward, discarded
        micro_loss(ddp, 0, rank, 1.0).backward()
        opt.zero_grad()
    for step in range(STEPS):
        backward_ddp(ddp, rank, step)
        for p in model.parameters():
            assert p.grad.dtype == torch.float32, f"{what}: p.grad must be fp32"
            assert p.dtype == torch.float32 or p.grad is p.main_grad, f"{what}: p.grad must be the fp32 main_grad"
            gathered = [torch.empty_like(p.grad) for _ in range(WORLD)]
            dist.all_gather(gathered, p.grad)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: p.grad differs across ranks after sync"
        opt.step()
        opt.zero_grad()
    # oracle: one process, the same bf16 micro-batch gradients summed in fp32 (another order)
    single = replicated_model(torch.bfloat16, fp32_head)
    single_opt = ampfused.FusedAmpAdamW(single.parameters(), lr=1e-2, max_grad_norm=CLIP, backend=backend)
    for step in range(STEPS):
        backward_one_process(single, step)
        single_opt.step()
        single_opt.zero_grad()
    for i, (p, q) in enumerate(zip(model.parameters(), single.parameters())):
        master, expected = opt.state[p].get("master_param", p), single_opt.state[q].get("master_param", q)
        torch.testing.assert_close(master, expected, rtol=1e-4, atol=1e-5, msg=f"{what}: master weight {i} vs one process")


def check_zero(rank, backend):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ours, stock = replicated_model(), replicated_model()
    ddp_ours, ddp_stock = DDP(ours), DDP(stock)
    opt = ZeroRedundancyOptimizer(ours.parameters(), optimizer_class=ampfused.FusedAmpAdamW, lr=1e-2, max_grad_norm=CLIP, backend=backend)
    ref = ZeroRedundancyOptimizer(stock.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    assert len(opt.optim.param_groups[0]["params"]) < 4, "ZeRO must partition the params"
    for step in range(STEPS):
        backward_ddp(ddp_ours, rank, step)
        backward_ddp(ddp_stock, rank, step)
        norm = torch.nn.utils.clip_grad_norm_(stock.parameters(), CLIP)
        opt.step(), ref.step()
        torch.testing.assert_close(opt.optim.grad_norm, norm, **tol(backend), msg="ZeRO: the norm must cover every partition")
        opt.zero_grad(), ref.zero_grad()
    for i, (p, q) in enumerate(zip(ours.parameters(), stock.parameters())):
        torch.testing.assert_close(p, q, **tol(backend), msg=f"ZeRO {backend}: param {i}")
    for p, q in zip(ours.parameters(), stock.parameters()):
        if p in opt.optim.state:
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.optim.state[p][key], ref.optim.state[q][key], **tol(backend))
    # the explicit form: a partition built by hand names its group (no ZeroRedundancyOptimizer on the stack)
    mine = [p for i, p in enumerate(ours.parameters()) if i % WORLD == rank]
    part = ampfused.FusedAmpAdamW(mine, lr=1e-2, max_grad_norm=CLIP, backend=backend, partition_group=dist.group.WORLD)
    backward_ddp(ddp_ours, rank, STEPS)
    backward_ddp(ddp_stock, rank, STEPS)
    part.step()
    norm = torch.nn.utils.clip_grad_norm_(stock.parameters(), CLIP)
    torch.testing.assert_close(part.grad_norm, norm, **tol(backend), msg="partition_group: the norm must cover every partition")
    with pytest.raises(ValueError, match="fp32_grad_accumulation=False"):
        ZeroRedundancyOptimizer(replicated_model(torch.bfloat16).parameters(), optimizer_class=ampfused.FusedAmpAdamW)
    # one param on two ranks: one partition is empty, and that rank must still join the stats all-reduce
    lone = DDP(torch.nn.Linear(6, 3, bias=False).to(rank_device()))
    opt = ZeroRedundancyOptimizer(lone.parameters(), optimizer_class=ampfused.FusedAmpAdamW, lr=1e-2, max_grad_norm=CLIP, backend=backend)
    for step in range(2):
        x, y = micro_batch(step, rank)
        torch.nn.functional.mse_loss(lone(x), y).backward()
        opt.step()
        opt.zero_grad()
    gathered = [torch.empty_like(lone.module.weight) for _ in range(WORLD)]
    dist.all_gather(gathered, lone.module.weight.detach())
    assert torch.equal(gathered[0], gathered[1]), "ZeRO with an empty partition: ranks diverged"


def check_ddp_refusals():
    model = replicated_model(torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(model.parameters())
    with pytest.raises(TypeError, match="bare module"):
        ampfused.distributed.data_parallel(DDP(replicated_model()), opt)
    with pytest.raises(ValueError, match="not params of this module"):
        ampfused.distributed.data_parallel(replicated_model(torch.bfloat16), opt)
    # the plain DDP(model) a tutorial writes: DDP reduces the bf16 gradients itself, with a warning that says what to do
    plain = DDP(model)
    with pytest.warns(UserWarning, match="ampfused.distributed.data_parallel"):
        plain(micro_batch(0, dist.get_rank())[0].to(torch.bfloat16)).float().sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters()), "DDP's params keep bf16 gradients"
    opt.step()


def _worker(rank, world, skip=()):
    for backend in rank_backends(skip):
        check_fp32_ddp(rank, backend)
        check_bf16_ddp(rank, backend, {}, fp32_head=False)
        for ddp_kwargs in ({}, dict(gradient_as_bucket_view=True), dict(static_graph=True)):
            check_bf16_ddp(rank, backend, ddp_kwargs, fp32_head=True)
        check_zero(rank, backend)
    check_ddp_refusals()


def test_ddp_and_zero_match_torch_and_one_process():
    run(_worker, WORLD, timeout=240)
