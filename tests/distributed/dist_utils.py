"""Multi-process test harness: spawned workers on 127.0.0.1 with a free port, bounded in time.

A worker is a module-level function ``fn(rank, world, *args)`` that runs with a process group
already initialized (gloo on CPU, nccl with one GPU per rank); an exception in any rank fails the
test with that rank's traceback, and a hang (a collective some rank never joins) fails it after
``timeout`` seconds instead of blocking CI.
"""
import os
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

requires_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available() or sys.platform == "win32",
    reason="needs torch.distributed with the gloo backend (not built into this torch)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, fn, args):
    os.environ.setdefault("TRITON_INTERPRET", "1" if backend == "gloo" else "0")
    torch.set_num_threads(1)  # 2-4 ranks share the CI machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def device() -> torch.device:
    """This rank's device: its GPU under nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def backends(skip=()) -> list[str]:
    """The ampfused backends that serve this rank's device, minus ``skip``."""
    from helpers import available_backends

    return [b for b in available_backends(device()) if b not in skip]


def run(fn, world: int, *args, timeout: float = 150.0, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; fail on any error or after ``timeout`` s."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), backend, fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{getattr(fn, '__name__', fn)} on {world} processes did not finish within {timeout:.0f} s")
    finally:
        for p in ctx.processes:  # only ours, by handle
            if p.is_alive():
                p.kill()
                p.join()
