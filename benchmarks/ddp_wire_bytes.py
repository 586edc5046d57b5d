"""Bytes on the wire of the gradient all-reduce under DDP, per synced step, by configuration.

    python benchmarks/ddp_wire_bytes.py [--world 2] [--width 512] [--layers 4] [--backend gloo]

Counts the payload of every gradient all-reduce of one synced backward (N-1 ``no_sync()``
micro-batches, then one synced): DDP's own buckets through a counting comm hook (which then runs
DDP's default all-reduce), ampfused's fp32 flat reduction through a counting wrapper of
``torch.distributed.all_reduce``. A ring all-reduce sends and receives ``2 (W-1)/W`` times the payload
per rank; both figures are printed, with the dtype each all-reduce ran in.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ampfused  # noqa: E402

CONFIGS = (
    ("fp32 params, torch DDP", torch.float32, {}, "ddp"),
    ("bf16 params, fp32_grad_accumulation=False, torch DDP", torch.bfloat16, dict(fp32_grad_accumulation=False), "ddp"),
    ("bf16 params, defaults, ampfused.distributed.data_parallel", torch.bfloat16, {}, "ampfused"),
)


def build(width, layers, dtype):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods).to(dtype)


def worker(rank, world, port, args, out):
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    counted = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        counted.append((tensor.numel() * tensor.element_size(), tensor.dtype))
        return real_all_reduce(tensor, *a, **k)

    def counting_hook(state, bucket):
        buffer = bucket.buffer()
        counted.append((buffer.numel() * buffer.element_size(), buffer.dtype))
        fut = real_all_reduce(buffer.div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    rows = []
    for name, dtype, opt_kwargs, wrap in CONFIGS:
        model = build(args.width, args.layers, dtype)
        opt = ampfused.FusedAmpAdamW(model.parameters(), lr=1e-3, **opt_kwargs)
        if wrap == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        else:
            ddp = ampfused.distributed.data_parallel(model, opt)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(None, counting_hook)
        dist.all_reduce = counting_all_reduce
        x = torch.randn(8, args.width).to(dtype)
        for step in range(2):  # the second step is the measured one (DDP rebuilds buckets after the first)
            counted.clear()
            for micro in range(args.micro):
                if micro < args.micro - 1:
                    with ddp.no_sync():
                        ddp(x).float().square().mean().backward()
                else:
                    ddp(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        dist.all_reduce = real_all_reduce
        params = sum(p.numel() for p in model.parameters())
        payload = sum(b for b, _ in counted)
        rows.append((name, params, payload, sorted({str(d).replace("torch.", "") for _, d in counted})))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step (N-1 under no_sync)")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ddp_wire_bytes_{os.getpid()}.pt")
    mp.spawn(worker, args=(args.world, port, args, out), nprocs=args.world, join=True)
    rows = torch.load(out, weights_only=True)
    os.unlink(out)
    ring = 2 * (args.world - 1) / args.world
    print(f"| configuration (W={args.world}, {args.micro} micro-batches/step) | params | all-reduce dtype | payload B/step | B/param | "
          f"ring B sent per rank |")
    print("|---|---:|---|---:|---:|---:|")
    for name, params, payload, dtypes in rows:
        print(f"| {name} | {params} | {', '.join(dtypes)} | {payload} | {payload / params:.3f} | {ring * payload:.0f} |")


if __name__ == "__main__":
    main()
