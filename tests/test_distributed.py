"""DistributedDataParallel (issue 6.4): two gloo processes with no_sync() over accumulation
micro-batches train like one process on the large batch; hook-based fp32 accumulation is refused
under DDP with an error that says what to do, and fp32_grad_accumulation=False works."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ampfused

WORLD, MICRO, PER_MICRO, STEPS = 2, 2, 3, 6
pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed with gloo")


def make_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)


def batch(step):
    """The global batch of one step: WORLD * MICRO * PER_MICRO samples."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(WORLD * MICRO * PER_MICRO, 6, generator=g), torch.randn(WORLD * MICRO * PER_MICRO, 3, generator=g)


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y, reduction="sum") / (WORLD * MICRO * PER_MICRO)


def train(model, opt, rank, ddp):
    for step in range(STEPS):
        x, y = batch(step)
        if ddp is None:  # one process, the large batch
            loss_fn(model(x.to(next(model.parameters()).dtype)), y).mul(WORLD).backward()
        else:
            for micro in range(MICRO):
                lo = (rank * MICRO + micro) * PER_MICRO
                xs, ys = x[lo:lo + PER_MICRO], y[lo:lo + PER_MICRO]
                if micro < MICRO - 1:
                    with ddp.no_sync():
                        loss_fn(ddp(xs.to(next(model.parameters()).dtype)), ys).mul(WORLD).backward()
                else:  # DDP averages over ranks: the * WORLD above makes it the sum of the large-batch loss
                    loss_fn(ddp(xs.to(next(model.parameters()).dtype)), ys).mul(WORLD).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for name, dtype, kwargs in (("fp32", torch.float32, {}), ("bf16_no_acc", torch.bfloat16, dict(fp32_grad_accumulation=False))):
            model = make_model(dtype)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5, **kwargs)
            results[name] = train(model, opt, rank, ddp)
        model = make_model(torch.bfloat16)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2)
        try:
            train(model, opt, rank, ddp)
            results["bf16_acc_error"] = None
        except RuntimeError as exc:
            results["bf16_acc_error"] = str(exc)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_no_sync_accumulation_matches_one_process_on_the_large_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for name in ("fp32", "bf16_no_acc"):
        for a, b in zip(ranks[0][name], ranks[1][name]):
            assert torch.equal(a, b), f"{name}: ranks diverged"
    single = {}
    for name, dtype, kwargs in (("fp32", torch.float32, {}), ("bf16_no_acc", torch.bfloat16, dict(fp32_grad_accumulation=False))):
        model = make_model(dtype)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5, **kwargs)
        single[name] = train(model, opt, 0, None)
    for a, b in zip(ranks[0]["fp32"], single["fp32"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0]["bf16_no_acc"], single["bf16_no_acc"]):  # bf16 grads summed in another order
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    error = ranks[0]["bf16_acc_error"]
    assert error is not None and "fp32_grad_accumulation=False" in error and "DistributedDataParallel" in error
