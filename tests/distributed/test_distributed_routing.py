"""data_parallel when a rank's synced backward reaches none of the fp32-accumulated params, on 2 gloo ranks.

Each rank must still join the fp32 all-reduce, or the ranks that did reach them wait forever (the
harness fails a hang after its timeout instead of blocking).

- MoE whose shared layers are fp32 (DDP's own reducer) and whose bf16 experts are ampfused's: rank 0
  routes nothing to any expert in some steps, both ranks in one. Against stock DDP with
  find_unused_parameters=True on the same model (grad None pattern, grads) and torch.optim.AdamW on
  fp32 masters fed our gradients (params, masters, moments, step counts).
- A rank on which no param of the model gets a gradient at all (frozen shared layers, nothing routed,
  the output depending only on an input that requires grad), with and without a DDP reducer: the
  gradients are the average of the ranks' local gradients, zeros where a rank had none (grad None
  where no rank had one), the
  step equals the fp32-master oracle. Stock DDP hangs there when some rank reaches one of its params,
  so the oracle is the local gradients; with a DDP reducer that no rank reaches in a backward, every
  rank warns once that DDP joined nothing.
"""
import warnings

import torch
import torch.distributed as dist

import ampfused
from dist_utils import rank_backends, rank_batch, rank_device, requires_gloo, run
from helpers import tol

pytestmark = requires_gloo
WORLD = 2
DDP = torch.nn.parallel.DistributedDataParallel
# per step: (rank 0's experts, rank 1's experts, gate used); expert 2 only by rank 0 once, rank 0 often nothing
SCHEDULE = [([], [0, 1], True), ([2], [], True), ([], [], True), ([], [0], False), ([0], [0, 1], False)]


class Routed(torch.nn.Module):
    """Shared input layer (fp32 and trainable, or bf16 and frozen), three bf16 experts, an optional fp32 gate."""

    def __init__(self, shared_fp32: bool, gate: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 3) for _ in range(3))
        self.gate = torch.nn.Linear(8, 3) if gate else None
        self.to(rank_device(), torch.bfloat16)
        if self.gate is not None:
            self.gate.float()
        if shared_fp32:
            self.inp.float()
        else:
            self.inp.requires_grad_(False)

    def forward(self, x, route, use_gate):
        h = torch.tanh(self.inp(x.to(self.inp.weight.dtype))).float()
        z = x[:, :3].float() + h[:, :3]
        for i in route:
            z = z + self.experts[i](h.bfloat16()).float()
        if use_gate and self.gate is not None:
            z = z + self.gate(h)
        return z


def routed_loss(module, step, rank, requires_grad):
    x, y = rank_batch(10 * step + rank, 4)
    x.requires_grad_(requires_grad)
    route0, route1, use_gate = SCHEDULE[step]
    return torch.nn.functional.mse_loss(module(x, route1 if rank else route0, use_gate), y)


def setup(backend, shared_fp32, gate):
    """(model, its twin, params, fp32 masters, FusedAmpAdamW over the params, torch AdamW over the masters)."""
    model, twin = Routed(shared_fp32, gate), Routed(shared_fp32, gate)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    return (model, twin, params, masters, ampfused.FusedAmpAdamW(params, lr=1e-2, backend=backend),
            torch.optim.AdamW(masters, lr=1e-2))


def step_both(opt, ref, params, masters, twin, what):
    """Every rank holds the same gradient; the fp32 masters get a copy of it; both optimizers step; the
    twin takes our params."""
    for i, (p, m) in enumerate(zip(params, masters)):
        if p.grad is not None:
            gathered = [torch.empty_like(p.grad) for _ in range(WORLD)]
            dist.all_gather(gathered, p.grad)
            assert torch.equal(gathered[0], gathered[1]), f"{what}: grad {i} differs across ranks"
        m.grad = None if p.grad is None else p.grad.detach().float().clone()
    opt.step(), ref.step()
    opt.zero_grad(), twin.zero_grad()
    with torch.no_grad():
        for p, q in zip(params, twin.parameters()):
            q.copy_(p)


def check_state(opt, ref, params, masters, backend, what):
    for i, (p, m) in enumerate(zip(params, masters)):
        state, expected = opt.state[p], ref.state[m]
        assert bool(state) == bool(expected), f"{what}: param {i} state exists in one optimizer only"
        torch.testing.assert_close(state.get("master_param", p).float(), m, **tol(backend), msg=f"{what}: master {i}")
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], **tol(backend), msg=f"{what}: {key} {i}")


def check_rank_without_experts(rank, backend):
    """Rank 0 routes nothing to the bf16 experts: ours must still join; equal to stock DDP and the oracle."""
    model, twin, params, masters, opt, ref = setup(backend, shared_fp32=True, gate=True)
    ours = ampfused.distributed.data_parallel(model, opt, find_unused_parameters=True)
    stock = DDP(twin, find_unused_parameters=True)
    for step in range(len(SCHEDULE)):  # the fp32 shared layer keeps DDP's reducer busy on every rank
        what = f"{backend} step {step}"
        for ddp in (ours, stock):
            routed_loss(ddp, step, rank, requires_grad=False).backward()
        for i, (p, q) in enumerate(zip(params, twin.parameters())):
            assert (p.grad is None) == (q.grad is None), f"{what}: param {i} grad None must match DDP's"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad.float(), rtol=2e-2, atol=2e-3, msg=f"{what}: grad {i}")
        step_both(opt, ref, params, masters, twin, what)
    check_state(opt, ref, params, masters, backend, f"{backend} rank without experts")


def check_rank_without_any_gradient(rank, backend, gate):
    """Steps in which no param of the model gets a gradient on rank 0: the average of the local gradients."""
    model, twin, params, masters, opt, ref = setup(backend, shared_fp32=False, gate=gate)
    ddp = ampfused.distributed.data_parallel(model, opt, find_unused_parameters=True)
    assert (getattr(ddp, "reducer", None) is not None) == gate, "with every trainable param fp32-accumulated there is no DDP reducer"
    what = f"{backend} gate={gate}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(len(SCHEDULE)):
            routed_loss(ddp, step, rank, requires_grad=True).backward()
            routed_loss(twin, step, rank, requires_grad=True).backward()  # this rank's own gradients, no collective
            for i, (p, q) in enumerate(zip(params, twin.parameters())):
                local = torch.zeros(p.shape, device=rank_device()) if q.grad is None else q.grad.float()
                mask = torch.tensor([float(q.grad is not None)], device=rank_device())
                dist.all_reduce(local), dist.all_reduce(mask)
                if not mask.item():
                    assert p.grad is None, f"{what} step {step}: param {i} unused on every rank must keep grad None"
                else:
                    assert p.grad is not None, f"{what} step {step}: param {i} used on a rank must get a gradient"
                    torch.testing.assert_close(p.grad, local / WORLD, rtol=1e-6, atol=1e-7, msg=f"{what}: grad {i}")
            step_both(opt, ref, params, masters, twin, f"{what} step {step}")
    skipped = [w for w in caught if "reaches none of the params DistributedDataParallel" in str(w.message)]
    assert len(skipped) == (1 if gate else 0), f"{what}: one warning when DDP's reducer joined nothing, got {skipped}"
    check_state(opt, ref, params, masters, backend, what)
    for p in model.inp.parameters():
        assert not opt.state[p], f"{what}: the frozen shared layer has no state"


def _worker(rank, world):
    for backend in rank_backends():
        check_rank_without_experts(rank, backend)
        check_rank_without_any_gradient(rank, backend, gate=False)
        check_rank_without_any_gradient(rank, backend, gate=True)


def test_every_rank_joins_when_a_rank_reaches_none_of_the_fp32_params():
    run(_worker, WORLD, timeout=240)
