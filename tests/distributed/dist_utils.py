"""Multi-process test harness: spawned workers on 127.0.0.1, meeting at a store this process serves, bounded in time.

A worker is a module-level function ``fn(rank, world, *args)`` that runs with a process group
already initialized (gloo on CPU, nccl with one GPU per rank); an exception in any rank fails the
test with that rank's traceback, and a hang (a collective some rank never joins) fails it after
``timeout`` seconds instead of blocking CI.
"""
import faulthandler
import os
import shutil
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

requires_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available() or sys.platform == "win32",
    reason="needs torch.distributed with the gloo backend (not built into this torch)")


READY = "dist_utils/ready"  # ranks that have joined the process group (counted on the harness's store)
STARTUP_TIMEOUT = 300.0  # spawning ranks and importing torch: seconds on an idle machine, minutes on a busy one


def _entry(rank, world, port, backend, fn, args, timeout, stacks_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1" if backend == "gloo" else "0")
    if os.environ["TRITON_INTERPRET"] == "1":
        import triton_interpreter

        triton_interpreter.install()
    global _stacks  # kept open for the life of the rank: a fatal signal writes every thread's stack there
    _stacks = open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w")
    faulthandler.enable(file=_stacks, all_threads=True)
    torch.set_num_threads(1)  # 2-4 ranks share the CI machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # the rendezvous store is the harness's, served from the port it holds (see run)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    store.add(READY, 1)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and checked: leave without the interpreter's finalization and C++ static destructors, where
    # torch's gloo process has aborted ("terminate called without an active exception") in CI runs
    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.disable()
    os._exit(0)


def rank_device() -> torch.device:
    """This rank's device: its GPU under nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rank_backends(skip=()) -> list[str]:
    """The ampfused backends that serve this rank's device, minus ``skip``."""
    from helpers import available_backends

    return [b for b in available_backends(rank_device()) if b not in skip]


def rank_batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` inputs of 6 features and targets of 3 (the width of every model here) on this rank's
    device, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g).to(rank_device()), torch.randn(rows, 3, generator=g).to(rank_device())


def run(fn, world: int, *args, timeout: float = 150.0, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; fail on any error, or when the ranks
    do not all join the group within ``STARTUP_TIMEOUT`` s or then do not finish within ``timeout`` s.

    A rank that passed leaves at once (``os._exit`` after its group is destroyed), skipping the
    teardown where torch's gloo process has aborted in CI runs ("terminate called without an active
    exception"). A gloo rank that still aborts reruns the whole test once, with a warning that names
    the rank and holds its threads' stacks; a second abort fails. Any other signal (a segfault in our
    extension, say: its stacks go to stderr), a Python error or a hang never reruns.
    """
    try:
        _run_once(fn, world, args, timeout, backend)
    except mp.ProcessExitedException as crash:
        if backend != "gloo" or crash.signal_name != "SIGABRT":
            if crash.signal_name is not None:
                print(f"rank {crash.error_index} ({crash.signal_name}), its threads:\n{getattr(crash, 'stacks', '')}",
                      file=sys.stderr)
            raise
        warnings.warn(f"{getattr(fn, '__name__', fn)}: rank {crash.error_index} aborted; running the test again. "
                      f"Its threads:\n{getattr(crash, 'stacks', '')}", RuntimeWarning)
        _run_once(fn, world, args, timeout, backend)


def _run_once(fn, world: int, args: tuple, timeout: float, backend: str) -> None:
    """One spawn of ``world`` ranks (see :func:`run`).

    The rendezvous port is bound here, by the store this process serves, and held until the ranks are
    done: a port picked free and released before the ranks bind it can be taken meanwhile (another
    test's listener, any connection's ephemeral port), which fails the run with "address already in
    use". The time bound starts when every rank is in the group (spawning and importing under load is
    slow, and is not a hang); a collective that waits longer than ``timeout`` fails in its rank.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT))
    stacks_dir = tempfile.mkdtemp(prefix="dist_utils_stacks_")
    ctx = mp.start_processes(_entry, args=(world, store.port, backend, fn, args, timeout, stacks_dir), nprocs=world,
                             join=False, start_method="spawn")
    name = getattr(fn, "__name__", fn)
    spawned, started = time.monotonic(), None
    try:
        while not ctx.join(timeout=0.5):
            now = time.monotonic()
            if started is None and store.add(READY, 0) >= world:
                started = now
            if started is None and now - spawned >= STARTUP_TIMEOUT:
                pytest.fail(f"{name}: not every one of {world} processes joined the group within {STARTUP_TIMEOUT:.0f} s")
            if started is not None and now - started >= timeout:
                pytest.fail(f"{name} on {world} processes did not finish within {timeout:.0f} s")
    except mp.ProcessExitedException as crash:
        stacks = os.path.join(stacks_dir, f"rank{crash.error_index}.txt")  # none when it died before faulthandler
        if os.path.exists(stacks):
            with open(stacks) as f:
                crash.stacks = f.read()[-4000:]
        raise
    finally:
        for p in ctx.processes:  # only ours, by handle
            if p.is_alive():
                p.kill()
                p.join()
        del store
        shutil.rmtree(stacks_dir, ignore_errors=True)
