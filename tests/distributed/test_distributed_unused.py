"""Unused params under ampfused.distributed.data_parallel, and plain DDP over bf16 params, on 2 gloo ranks.

- data_parallel with MoE-style experts (one used on every rank, one on rank 1 only, one by nobody), a
  layer frozen mid-run, and static_graph: the same grad-None pattern as stock DDP with
  find_unused_parameters=True on a bf16 twin (values within bf16 reduction rounding); params, masters,
  moments and step counts equal torch.optim.AdamW on fp32 masters fed the same gradients; a param
  unused everywhere stays bitwise unchanged with no state.
- plain DDP(model) over a bf16 model (a frozen layer too) with FusedAmpAdamW's defaults and no_sync()
  accumulation, plain / gradient_as_bucket_view / static_graph: trains, warns once naming
  data_parallel, p.grad is DDP's bf16 reduction (equal on every rank), and the step equals
  torch.optim.AdamW on fp32 masters fed those bf16-reduced gradients.
"""
import warnings

import torch
import torch.distributed as dist

import ampfused
from dist_utils import rank_backends, rank_batch, rank_device, requires_gloo, run
from helpers import mlp, tol

pytestmark = requires_gloo
WORLD, STEPS, FREEZE_AT = 2, 4, 2
DDP = torch.nn.parallel.DistributedDataParallel


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 3) for _ in range(3))
        self.head = torch.nn.Linear(3, 3)
        self.to(rank_device(), torch.bfloat16)
        self.head.float()  # DDP keeps a real reducer under data_parallel

    def forward(self, x, route):
        h = torch.tanh(self.inp(x))
        return self.head(sum(self.experts[i](h) for i in route).float())


def route_of(rank):
    return [0, 1] if rank == 1 else [0]  # expert 2: nobody


def bf16_batch(step, rank):
    x, y = rank_batch(10 * step + rank, 4)
    return x.to(torch.bfloat16), y


def check_unused(rank, backend, static_graph):
    model, twin = MoE(), MoE()
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)
    ref = torch.optim.AdamW(masters, lr=1e-2)
    kwargs = dict(static_graph=True) if static_graph else dict(find_unused_parameters=True)
    ours, stock = ampfused.distributed.data_parallel(model, opt, **kwargs), DDP(twin, **kwargs)
    nobody = [p.detach().clone() for p in model.experts[2].parameters()]
    what = f"{backend} static_graph={static_graph}"
    for step in range(STEPS):
        if step == FREEZE_AT and not static_graph:  # a static graph may not change: frozen only without it
            model.experts[0].requires_grad_(False), twin.experts[0].requires_grad_(False)
            frozen = [p.detach().clone() for p in model.experts[0].parameters()]
            frozen_state = {k: opt.state[model.experts[0].weight][k].clone() for k in ("step", "exp_avg")}
        x, y = bf16_batch(step, rank)
        for ddp in (ours, stock):
            torch.nn.functional.mse_loss(ddp(x, route_of(rank)), y).backward()
        for i, (p, q, m) in enumerate(zip(model.parameters(), twin.parameters(), masters)):
            assert (p.grad is None) == (q.grad is None), f"{what} step {step}: param {i} grad None must match DDP's"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad.float(), rtol=2e-2, atol=2e-3, msg=f"{what}: grad {i}")
                gathered = [torch.empty_like(p.grad) for _ in range(WORLD)]
                dist.all_gather(gathered, p.grad)
                assert torch.equal(gathered[0], gathered[1]), f"{what}: grad {i} differs across ranks"
            m.grad = None if p.grad is None else p.grad.detach().float().clone()
        assert model.experts[2].weight.grad is None, "an expert nobody routed to must keep grad None"
        assert model.experts[1].weight.grad is not None, "an expert one rank used gets the average"
        opt.step(), ref.step()
        opt.zero_grad(), twin.zero_grad()
        with torch.no_grad():
            for p, q in zip(model.parameters(), twin.parameters()):
                q.copy_(p)
    for i, (p, m) in enumerate(zip(model.parameters(), masters)):
        state, expected = opt.state[p], ref.state[m]
        assert bool(state) == bool(expected), f"{what}: param {i} state exists in one optimizer only"
        torch.testing.assert_close(state.get("master_param", p).float(), m, **tol(backend), msg=f"{what}: master {i}")
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], **tol(backend), msg=f"{what}: {key} {i}")
    for p, before in zip(model.experts[2].parameters(), nobody):
        assert torch.equal(p, before) and not opt.state[p], f"{what}: an expert nobody used must be untouched"
    if not static_graph:
        for p, before in zip(model.experts[0].parameters(), frozen):
            assert torch.equal(p, before), f"{what}: a layer frozen mid-run must not move"
        assert torch.equal(opt.state[model.experts[0].weight]["step"], frozen_state["step"]), f"{what}: frozen step advanced"


def make_bf16(frozen=True):
    model = mlp(6, 12, 12, 3, dtype=torch.bfloat16, device=rank_device())
    if frozen:
        model[2].requires_grad_(False)
    return model


def check_plain_ddp(rank, backend, ddp_kwargs):
    model = make_bf16()
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, backend=backend)  # the defaults: fp32 accumulation
    ddp = DDP(model, **ddp_kwargs)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in trainable]
    ref = torch.optim.AdamW(masters, lr=1e-2)
    frozen = [p.detach().clone() for p in model[2].parameters()]
    what = f"plain DDP {backend} {ddp_kwargs}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ddp_kwargs.get("static_graph"):  # DDP learns a static graph from a synced first backward
            ddp(bf16_batch(0, rank)[0]).float().sum().backward()
            opt.zero_grad()
        for step in range(STEPS):
            for micro in range(2):  # the articles' loop: no_sync() on all but the last micro-batch
                x, y = bf16_batch(100 + step * 2 + micro, rank)
                if micro == 0:
                    with ddp.no_sync():
                        torch.nn.functional.mse_loss(ddp(x).float(), y).backward()
                else:
                    torch.nn.functional.mse_loss(ddp(x).float(), y).backward()
            for i, (p, m) in enumerate(zip(trainable, masters)):
                assert p.grad.dtype == torch.bfloat16, f"{what}: DDP reduces the gradient in the param dtype"
                gathered = [torch.empty_like(p.grad) for _ in range(WORLD)]
                dist.all_gather(gathered, p.grad)
                assert torch.equal(gathered[0], gathered[1]), f"{what}: grad {i} differs across ranks"
                m.grad = p.grad.float()
            opt.step(), ref.step()
            opt.zero_grad(), ref.zero_grad()
    ours = [w for w in caught if "ampfused.distributed.data_parallel" in str(w.message)]
    assert len(ours) == 1, f"{what}: one warning naming data_parallel, got {[str(w.message) for w in caught]}"
    for i, (p, m) in enumerate(zip(trainable, masters)):
        torch.testing.assert_close(opt.state[p]["master_param"], m, **tol(backend), msg=f"{what}: master {i}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref.state[m][key], **tol(backend), msg=f"{what}: {key} {i}")
    for p, before in zip(model[2].parameters(), frozen):
        assert torch.equal(p, before) and not opt.state[p], f"{what}: the frozen layer must be untouched"


def _worker(rank, world):
    for backend in rank_backends():
        check_unused(rank, backend, static_graph=False)
        check_unused(rank, backend, static_graph=True)
        for ddp_kwargs in ({}, dict(gradient_as_bucket_view=True), dict(static_graph=True)):
            check_plain_ddp(rank, backend, ddp_kwargs)


def test_unused_params_and_plain_ddp_match_torch():
    run(_worker, WORLD, timeout=240)
