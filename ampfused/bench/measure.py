"""Timing, the roofline stream, peak memory and the correctness comparison (what each metric
means: benchmarks/README.md §1, "Metrics")."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int
    unstable: str = ""  # why this timing should not be trusted; "" when it is stable
    error: str = ""  # the function raised: "Type: message" (no timing then)

    @property
    def spread(self) -> float:
        """(p80 - p20) / median."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else math.inf


@dataclass
class Budget:
    """Per timed function: at least ``min_samples`` calls and ``min_s`` seconds of its own measured
    time, in ``rounds`` interleaved rounds; measuring goes on (up to ``max_s`` per function) while
    a spread is above ``max_spread``."""

    min_s: float
    max_s: float
    min_samples: int = 10
    max_spread: float = 0.15
    rounds: int = 10
    cap_s: float = 120.0  # per case: the minimums give way only here (a runaway slow provider)


def summarize(times_ms: list[float], budget: Budget) -> Timing:
    if not times_ms:
        return Timing(math.nan, math.nan, math.nan, 0, unstable="no samples")
    # linear interpolation between the closest ranks (numpy's default), in float64
    median, p20, p80 = torch.tensor(times_ms, dtype=torch.float64).quantile(
        torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    t = Timing(median, p20, p80, len(times_ms))
    if t.samples < budget.min_samples:
        t.unstable = f"{t.samples} samples < {budget.min_samples}"
    elif t.spread > budget.max_spread:
        t.unstable = f"p20-p80 spread {100 * t.spread:.0f}% > {100 * budget.max_spread:.0f}%"
    return t


class _CallTimer:
    """Times one call of ``fn`` in ms: perf_counter (CPU, host mode) or CUDA events (GPU device time)."""

    def __init__(self, device: torch.device, host: bool, clock: Callable[[], float]):
        self.cuda = device.type == "cuda"
        self.host, self.clock = host, clock
        self.flush = torch.empty(64 << 20, dtype=torch.int32, device=device) if self.cuda and not host else None
        self.pending: list = []

    def call(self, fn, sink: list) -> None:
        if self.cuda and self.host:
            torch.cuda.synchronize()
        if self.flush is not None:
            self.flush.zero_()  # 256 MiB: no step starts with its operands in L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.pending.append((start, end, sink))
            return
        t0 = self.clock()
        fn()
        sink.append((self.clock() - t0) * 1e3)

    def finish(self) -> None:
        """Collect the CUDA-event times recorded since the last finish (one synchronize per burst)."""
        if self.pending:
            torch.cuda.synchronize()
            for start, end, sink in self.pending:
                sink.append(start.elapsed_time(end))
            self.pending.clear()


def interleaved(fns: dict[str, Callable[[], None]], device: torch.device, budget: Budget, *, host: bool = False,
                clock: Callable[[], float] = time.perf_counter, on_round: Callable[[], None] | None = None
                ) -> dict[str, Timing]:
    """Time every function of ``fns`` in alternating bursts, so machine load, clock changes and thermal
    drift hit all of them alike (the rules: benchmarks/README.md §1, "Metrics"); ``on_round`` is
    called after every round (a progress bar). One untimed call of each sets its burst length, so a
    slow function and a fast one both reach their minimum in about ``rounds`` rounds. A function
    that raises leaves the rotation and is reported with ``error``."""
    timer = _CallTimer(device, host, clock)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    errors: dict[str, str] = {}
    burst: dict[str, int] = {}
    for name, fn in fns.items():  # calibration (and a warm-up after whatever ran before)
        probe: list[float] = []
        try:
            timer.call(fn, probe)
            timer.finish()
        except Exception as exc:  # noqa: BLE001 -- a crashing provider is a failed provider
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        t_s = max(probe[0], 1e-6) * 1e-3
        burst[name] = max(1, math.ceil(max(budget.min_samples, budget.min_s / t_s) / budget.rounds))
    own_s = {name: 0.0 for name in burst}
    begin = clock()
    deadline, cap = begin + budget.max_s * max(len(burst), 1), begin + budget.cap_s
    rounds = 0
    while burst:
        for name in list(burst):
            try:
                for _ in range(burst[name]):
                    timer.call(fns[name], samples[name])
                timer.finish()
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {exc}"
                del burst[name]
                timer.pending.clear()
        rounds += 1
        if on_round is not None:
            on_round()
        for name in burst:
            own_s[name] = sum(samples[name]) * 1e-3
        enough = rounds >= budget.rounds and all(
            len(samples[n]) >= budget.min_samples and own_s[n] >= budget.min_s for n in burst)
        if enough and all(not summarize(samples[n], budget).unstable for n in burst):
            break
        now = clock()
        if (enough and now >= deadline) or now >= cap:
            break  # out of time: what is still noisy (or short) is reported as unstable
    out = {name: summarize(ts, budget) for name, ts in samples.items() if name not in errors}
    out.update({name: Timing(math.nan, math.nan, math.nan, 0, error=err) for name, err in errors.items()})
    return out


COPY_CAP_BYTES = 4 << 30


class DeviceCopy:
    """The practical roofline: ``a += b`` over fp32 buffers moving ``nbytes`` (read a and b, write a),
    in place as AdamW updates (why not ``copy_``: benchmarks/README.md §1, "Metrics"). Capped at
    COPY_CAP_BYTES, where bandwidth is long flat, so a 1B-param case needs no more device memory.

    :meth:`over_working_set` sizes it by the memory it touches instead (a and b together): a
    stream over fewer bytes than a step's working set keeps more of them in the last-level cache
    and flatters the step, over more bytes it shortchanges it.
    """

    @classmethod
    def over_working_set(cls, working_set_bytes: float, device: torch.device) -> "DeviceCopy":
        return cls(1.5 * working_set_bytes, device)  # a and b of W/2 each: a sweep moves 3 x W/2

    def __init__(self, nbytes: float, device: torch.device):
        moved = int(min(nbytes, COPY_CAP_BYTES))
        n = max(moved // 12, 1)  # fp32 elements per buffer: 3 x 4 bytes per element
        self.a = torch.ones(n, device=device)
        self.b = torch.full((n,), 1e-30, device=device)  # a stays 1.0: no denormals, no overflow
        self.moved = 3 * n * 4

    def fn(self) -> None:
        self.a.add_(self.b)

    @property
    def working_set(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def gbps(self, timing: Timing) -> float:
        return self.moved / (timing.median_ms * 1e-3) / 1e9


def stream_key(working_set_bytes: float) -> float:
    """Working sets within a few percent share one roofline stream (two significant digits)."""
    if working_set_bytes <= 0:
        return 0.0
    return float(f"{working_set_bytes:.2g}")


class PeakMemory:
    """Peak memory above the level at ``start()``: the CUDA allocator's peak, or on a CPU the growth of
    the peak resident set (VmHWM, reset through /proc/self/clear_refs; NaN without /proc)."""

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


def compare(results: dict[str, list], expected: dict[str, list], against: str = "stock") -> str:
    """'' when every tensor of ``expected``'s keys matches within tolerance, else the first mismatch."""
    for key in expected:
        for i, (got, want) in enumerate(zip(results[key], expected[key])):
            got, want = got.detach(), want.detach()
            if key == "param" and "master" in expected and _same(got, results["master"][i]) and \
                    _same(want, expected["master"][i]):
                continue  # fp32 params are their own masters: compared above
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"{key}[{i}]: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
            rtol, atol = tolerance(got.dtype)
            if not torch.isfinite(got).all():
                return f"{key}[{i}] has non-finite values"
            if got.dtype == torch.float32 and torch.allclose(got, want, rtol=rtol, atol=atol):
                continue  # the common case, without the float copies below
            g, w = got.float().reshape(-1), want.float().reshape(-1)  # (element j: in row-major order)
            excess = (g - w).abs() - (atol + rtol * w.abs())
            if (excess > 0).any():
                j = int(excess.argmax())
                return (f"{key}[{i}] element {j}: {float(g[j]):.8g} vs {against} {float(w[j]):.8g} "
                        f"(rtol {rtol:.1e}, atol {atol:.1e})")
    return ""


def _same(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once), minus ``exclude``'s."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}
    for t in _plain(tensors):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _plain(tensors):
    """The plain tensors holding ``tensors``' data: a wrapper subclass (a peer's quantized optimizer state,
    e.g. torchao's ``OptimState4bit``) reports its logical size as its storage, so its inner tensors count."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            yield from _plain(getattr(t, name) for name in t.__tensor_flatten__()[0])
        else:
            yield t


def all_finite(results: dict[str, list]) -> bool:
    return all(bool(torch.isfinite(t).all()) for ts in results.values() for t in ts)
