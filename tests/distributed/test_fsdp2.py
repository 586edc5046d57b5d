"""FSDP2 (fully_shard, DTensor params): FusedAmpAdamW(max_grad_norm=c) on local shards equals
torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ on the same sharded model — params, every state
tensor and the norm — with and without MixedPrecisionPolicy(bf16 params, fp32 reduce), with and
without gradient accumulation (set_requires_gradient_sync); an inf/NaN in one rank's shard skips the
step on every rank; mixed plain + DTensor params are refused. 2 and 4 gloo processes."""
import math

import pytest
import torch

import ampfused
from dist_utils import rank_backends, rank_batch, rank_device, requires_gloo, run
from helpers import mlp, tol

pytestmark = requires_gloo
STEPS, MICRO, BATCH, CLIP = 3, 2, 4, 0.05  # the small clip makes every step clip


def sharded_model(mp_policy=None):
    from torch.distributed.fsdp import fully_shard

    # the same init on every rank, as FSDP2 expects; 7 and 5 rows: uneven shards on 2 and 4 ranks, an empty one on 4
    model = mlp(6, 7, 5, 3, device=rank_device())
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in (model[0], model[2]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_batch(rank, step, micro):
    return rank_batch(1000 * step + 10 * micro + rank, BATCH)


def train_step(model, rank, step, accumulate):
    micros = MICRO if accumulate else 1
    for micro in range(micros):
        model.set_requires_gradient_sync(micro == micros - 1)
        x, y = shard_batch(rank, step, micro)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare_to_torch(rank, backend, mp_policy, accumulate):
    ours, stock = sharded_model(mp_policy), sharded_model(mp_policy)
    opt = ampfused.FusedAmpAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP, backend=backend)
    ref = torch.optim.AdamW(stock.parameters(), lr=1e-2, weight_decay=0.1)
    what = f"backend={backend} mp={mp_policy is not None} accumulate={accumulate} rank={rank}"
    for step in range(STEPS):
        train_step(ours, rank, step, accumulate)
        train_step(stock, rank, step, accumulate)
        norm = full(torch.nn.utils.clip_grad_norm_(stock.parameters(), CLIP))
        ref.step()
        opt.step()
        assert norm > CLIP, f"{what}: the test must clip"
        torch.testing.assert_close(opt.grad_norm, norm, **tol(backend), msg=f"{what}: grad_norm at step {step}")
        opt.zero_grad()
        ref.zero_grad()
    for i, (p, q) in enumerate(zip(ours.parameters(), stock.parameters())):
        assert type(opt.state[p]["exp_avg"]) is type(p), f"{what}: state of a DTensor param must be a DTensor"
        torch.testing.assert_close(local(p), local(q), **tol(backend), msg=f"{what}: param {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(local(opt.state[p][key]), local(ref.state[q][key]), **tol(backend), msg=f"{what}: {key} {i}")
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == STEPS


def check_skip_on_every_rank(rank, world, backend):
    """inf in one shard of the last rank only: every rank skips, bitwise; the scaler backs off everywhere."""
    model = sharded_model()
    opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=CLIP, backend=backend)
    scaler = ampfused.GradScaler(rank_device().type, init_scale=1024.0)
    for step in range(2):
        x, y = shard_batch(rank, step, 0)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1:
            before = [local(p).clone() for p in model.parameters()] + [local(opt.state[p][k]).clone() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")]
            if rank == world - 1:
                local(next(model.parameters()).grad).view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    after = [local(p) for p in model.parameters()] + [local(opt.state[p][k]) for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")]
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"backend={backend} rank={rank}: tensor {i} changed in a skipped step"
    assert not torch.isfinite(opt.grad_norm), f"rank {rank}: grad_norm of a skipped step must be non-finite"
    assert scaler.get_scale() == 512.0, f"rank {rank}: the scaler must back off on every rank"
    assert scaler.skipped_steps == 1


def check_mixed_params_refused(rank):
    model = sharded_model()
    plain = torch.nn.Parameter(torch.zeros(3, device=rank_device()))
    with pytest.raises(ValueError, match="DTensors and the others plain tensors"):
        ampfused.FusedAmpAdamW([*model.parameters(), plain])
    opt = ampfused.FusedAmpAdamW(model.parameters())
    with pytest.raises(ValueError, match="DTensors and the others plain tensors"):
        opt.add_param_group({"params": [plain]})
    assert len(opt.param_groups) == 1, "a refused group must not be half-added"


def check_functional(rank, backend):
    """ampfused.functional.fused_amp_adamw on DTensor lists: local passes, global norm."""
    model = sharded_model()
    x, y = shard_batch(rank, 0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(full(g)) for g in grads]))
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.zeros((), device=rank_device()) for _ in params]
    norm, skipped = ampfused.functional.fused_amp_adamw(
        params, grads, *states, [None] * len(params), steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, max_grad_norm=CLIP, backend=backend)
    torch.testing.assert_close(norm, expected, **tol(backend), msg=f"functional {backend}: global norm")
    assert float(skipped) == 0 and all(float(s) == 1 for s in steps)


def _worker(rank, world, skip=()):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for backend in rank_backends(skip):
        for mp_policy in (None, bf16):
            for accumulate in (False, True):
                compare_to_torch(rank, backend, mp_policy, accumulate)
        check_skip_on_every_rank(rank, world, backend)
        check_functional(rank, backend)
    check_mixed_params_refused(rank)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_matches_torch_adamw_with_clip_grad_norm(world):
    # 4 ranks: the compiled backend and the oracle (the Triton interpreter runs on 2)
    run(_worker, world, () if world == 2 else ("triton",), timeout=240)
