"""Timing, the device-copy roofline, peak memory and the correctness comparison.

[note: timers] CPU: ``torch.utils.benchmark.Timer.adaptive_autorange`` with a fixed thread count
(it reports per-block mean times; blocks are one step long once a step takes more than ~0.1 ms
times 10^4 timer overheads, i.e. per-step samples for every size measured here but the smallest).
GPU: ``triton.testing.do_bench`` (CUDA events around every call, L2 flushed between calls), with a
plain CUDA-event loop as the fallback when Triton is missing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils import benchmark


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int


@dataclass
class Budget:
    """Seconds of measurement per timing: at least ``min_s`` (and 4 samples), at most ``max_s``."""

    min_s: float
    max_s: float


def time_fn(fn: Callable[[], None], device: torch.device, threads: int, budget: Budget) -> Timing:
    if device.type == "cuda":
        return _time_cuda(fn, budget)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    m = timer.adaptive_autorange(threshold=0.1, min_run_time=budget.min_s, max_run_time=budget.max_s)
    times = np.asarray(m.times) * 1e3
    return Timing(float(np.median(times)), float(np.percentile(times, 20)), float(np.percentile(times, 80)), len(times))


def _time_cuda(fn, budget: Budget) -> Timing:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        med, p20, p80 = do_bench(fn, warmup=max(1, int(budget.min_s * 250)), rep=max(1, int(budget.min_s * 1000)),
                                 quantiles=[0.5, 0.2, 0.8])
        return Timing(med, p20, p80, -1)
    fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(50)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(50)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = np.array([s.elapsed_time(e) for s, e in zip(starts, ends)])
    return Timing(float(np.median(times)), float(np.percentile(times, 20)), float(np.percentile(times, 80)), len(times))


COPY_CAP_BYTES = 4 << 30


def copy_bandwidth(nbytes: float, device: torch.device, threads: int, budget: Budget) -> float:
    """GB/s of ``dst.copy_(src)`` moving ``nbytes`` (read nbytes/2, write nbytes/2): the practical roofline.

    [note: copy cap] above 4 GiB moved the copy runs on 4 GiB (bandwidth is flat well before that),
    so a 1B-param case does not need another 48 GB of device memory.
    """
    moved = int(min(nbytes, COPY_CAP_BYTES))
    half = max(moved // 8, 1)  # fp32 elements per buffer
    src = torch.ones(half, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device, threads, budget)
    del src, dst
    return 2 * half * 4 / (timing.median_ms * 1e-3) / 1e9


class PeakMemory:
    """Peak memory while a provider is alive, in bytes above the level at ``start()``.

    CUDA: the caching allocator's peak. CPU: growth of the process's peak resident set (VmHWM,
    reset by writing 5 to /proc/self/clear_refs) after ``malloc_trim``; approximate, since glibc can
    serve a provider from heap memory an earlier one freed (an undercount, never an overcount of
    what the provider needed beyond that). NaN where /proc is not available.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _proc_status_kb("VmRSS") * 1024
        except OSError:
            self.base = None

    def peak(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - self.base)
        if self.base is None:
            return float("nan")
        return float(_proc_status_kb("VmHWM") * 1024 - self.base)


def _proc_status_kb(key: str) -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


# ---------------------------------------------------------------- correctness


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol): fp32 as the tests use; low precision allows one rounding step (1 ulp) of difference."""
    if dtype == torch.bfloat16:
        return 2.0**-7, 1e-6
    if dtype == torch.float16:
        return 2.0**-10, 1e-6
    return 1e-5, 1e-6


def compare(results: dict[str, list], expected: dict[str, list]) -> str:
    """'' when every tensor matches within tolerance, else a description of the worst mismatch."""
    for key in ("master", "param"):
        for i, (got, want) in enumerate(zip(results[key], expected[key])):
            got = got.detach()
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"{key}[{i}]: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
            rtol, atol = tolerance(got.dtype)
            g, w = got.float(), want.float()
            if not torch.isfinite(g).all():
                return f"{key}[{i}] has non-finite values"
            excess = (g - w).abs() - (atol + rtol * w.abs())
            if (excess > 0).any():
                j = int(excess.argmax())
                return (f"{key}[{i}] element {j}: {float(g[j]):.8g} vs stock {float(w[j]):.8g} "
                        f"(rtol {rtol:.1e}, atol {atol:.1e})")
    return ""


def storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once), minus ``exclude``'s."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def all_finite(results: dict[str, list]) -> bool:
    return all(bool(torch.isfinite(t).all()) for ts in results.values() for t in ts)
