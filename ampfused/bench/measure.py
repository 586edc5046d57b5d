"""Timing, the roofline stream, peak memory and the correctness comparison (what each metric
means: benchmarks/README.md §1, "Metrics")."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Timing:
    """ms per call: median and p20/p80 over the rounds' values (a round's: its burst's mean) or single calls."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int  # calls timed
    unstable: str = ""  # why this timing should not be trusted; "" when it is stable
    error: str = ""  # the function raised: "Type: message" (no timing then)
    rounds: list = field(default_factory=list)  # the per-round values, in round order (interleaved())

    @property
    def spread(self) -> float:  # (p80 - p20) / median
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else math.inf


@dataclass
class Budget:
    """Per timed function: ``min_samples`` calls, ``min_s`` seconds, ``rounds`` rounds of ``burst`` calls at
    least; up to ``max_s`` while a spread is above ``max_spread``."""

    min_s: float
    max_s: float
    min_samples: int = 10
    max_spread: float = 0.15
    rounds: int = 10
    cap_s: float = 120.0  # per case: the minimums give way only here (a runaway slow provider)
    burst: int = 1


def quantiles(values) -> tuple[float, float, float]:
    """(median, p20, p80), linear interpolation between the closest ranks (numpy's default), in float64."""
    return tuple(torch.tensor(values, dtype=torch.float64).quantile(
        torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist())


def summarize(times_ms: list[float], budget: Budget, samples: int | None = None) -> Timing:
    """The Timing of ``times_ms`` (single calls, or per-round values of ``samples`` calls in all)."""
    if not times_ms:
        return Timing(math.nan, math.nan, math.nan, 0, unstable="no samples")
    t = Timing(*quantiles(times_ms), samples or len(times_ms))
    if t.samples < budget.min_samples:
        t.unstable = f"{t.samples} samples < {budget.min_samples}"
    elif len(times_ms) < min(budget.rounds, budget.min_samples):
        t.unstable = f"{len(times_ms)} rounds < {min(budget.rounds, budget.min_samples)}"
    elif t.spread > budget.max_spread:
        t.unstable = f"p20-p80 spread {100 * t.spread:.0f}% > {100 * budget.max_spread:.0f}%"
    return t


def ratio(num: Timing, den: Timing) -> tuple[float, float, float]:
    """(median, p20, p80) of num / den round by round (the two were timed in the same rounds)."""
    pairs = [a / b for a, b in zip(num.rounds, den.rounds) if b > 0]
    return quantiles(pairs) if pairs else (math.nan,) * 3


def _burst_timer(device: torch.device, host: bool, clock: Callable[[], float]):
    """burst(fn, calls) -> ms of each call: the clock (CPU, host mode) or CUDA events (L2 flushed before each)."""
    cuda = device.type == "cuda"
    flush = torch.empty(64 << 20, dtype=torch.int32, device=device) if cuda and not host else None

    def burst(fn, calls: int) -> list[float]:
        times, events = [], []
        for _ in range(calls):
            if flush is not None:
                flush.zero_()  # 256 MiB: no step starts with its operands in L2
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
                fn()
                events[-1][1].record()
                continue
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            fn()
            times.append((clock() - t0) * 1e3)
        if events:
            torch.cuda.synchronize()
        return times + [start.elapsed_time(end) for start, end in events]

    return burst


def interleaved(fns: dict[str, Callable[[], None]], device: torch.device, budget: Budget, *, host: bool = False,
                clock: Callable[[], float] = time.perf_counter, on_round: Callable[[], None] | None = None
                ) -> dict[str, Timing]:
    """Time every function of ``fns`` in alternating bursts, so machine load and drift hit all alike; one
    untimed call of each sets its burst length; ``on_round`` is called after every round. A function that
    raises leaves the rotation with ``error`` (the rules: benchmarks/README.md §1, "Metrics")."""
    burst_of = _burst_timer(device, host, clock)
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    calls, errors, burst = {name: 0 for name in fns}, {}, {}
    for name, fn in fns.items():  # calibration (and a warm-up after whatever ran before)
        try:
            t_s = max(burst_of(fn, 1)[0], 1e-6) * 1e-3
            burst[name] = max(budget.burst, math.ceil(max(budget.min_samples, budget.min_s / t_s) / budget.rounds))
        except Exception as exc:  # noqa: BLE001 -- a crashing provider is a failed provider
            errors[name] = f"{type(exc).__name__}: {exc}"
    begin = clock()
    deadline, cap = begin + budget.max_s * max(len(burst), 1), begin + budget.cap_s
    while burst:
        for name in list(burst):
            try:
                times = burst_of(fns[name], burst[name])
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {exc}"
                del burst[name]
                continue
            rounds[name].append(sum(times) / len(times))
            calls[name] += len(times)
        if on_round is not None:
            on_round()
        enough = all(len(rounds[k]) >= budget.rounds and calls[k] >= budget.min_samples and
                     sum(rounds[k]) * burst[k] * 1e-3 >= budget.min_s for k in burst)
        if enough and all(not summarize(rounds[k], budget, calls[k]).unstable for k in burst):
            break
        if (enough and clock() >= deadline) or clock() >= cap:
            break  # out of time: what is still noisy (or short) is reported as unstable
    out = {name: Timing(math.nan, math.nan, math.nan, 0, error=err) for name, err in errors.items()}
    for name in (n for n in fns if n not in errors):
        out[name] = summarize(rounds[name], budget, calls[name])
        out[name].rounds = rounds[name]
    return out


COPY_CAP_BYTES = 4 << 30


class DeviceCopy:
    """The practical roofline: ``a += b`` over fp32 buffers moving ``nbytes`` (at most COPY_CAP_BYTES), in
    place as AdamW updates (benchmarks/README.md §1, "Metrics")."""

    @classmethod
    def over_working_set(cls, working_set_bytes: float, device: torch.device) -> "DeviceCopy":
        return cls(1.5 * working_set_bytes, device)  # a and b of W/2 each: a sweep moves 3 x W/2

    def __init__(self, nbytes: float, device: torch.device):
        n = max(int(min(nbytes, COPY_CAP_BYTES)) // 12, 1)  # fp32 elements per buffer: 3 x 4 bytes per element
        self.a = torch.ones(n, device=device)
        self.b = torch.full((n,), 1e-30, device=device)  # a stays 1.0: no denormals, no overflow
        self.moved, self.working_set = 3 * n * 4, 2 * n * 4

    def fn(self) -> None:
        self.a.add_(self.b)

    def gbps(self, timing: Timing) -> float:
        return self.moved / (timing.median_ms * 1e-3) / 1e9


def stream_key(working_set_bytes: float) -> float:
    """Working sets within a few percent share one roofline stream (two significant digits)."""
    return float(f"{working_set_bytes:.2g}") if working_set_bytes > 0 else 0.0


class PeakMemory:
    """Peak memory above the level at ``start()``: the CUDA allocator's, or on a CPU the peak RSS growth (/proc)."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)  # (freed heap back to the system: RSS starts from what is live)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _proc_status_kb("VmRSS") * 1024
        except (OSError, AttributeError):
            self.base = None

    def peak(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - self.base)
        return float("nan") if self.base is None else float(_proc_status_kb("VmHWM") * 1024 - self.base)


def _proc_status_kb(key: str) -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


# ---------------------------------------------------------------- correctness

# (rtol, atol): fp32 as the tests use; low precision allows one rounding step (1 ulp) of difference
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2.0**-7, 1e-6), torch.float16: (2.0**-10, 1e-6)}


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
            rtol, atol = TOLERANCES.get(got.dtype, TOLERANCES[torch.float32])
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


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views count once); a wrapper subclass (e.g.
    torchao's ``OptimState4bit``) counts its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    seen, todo = {}, list(tensors)
    while todo:
        t = todo.pop()
        if is_traceable_wrapper_subclass(t):
            todo += [getattr(t, name) for name in t.__tensor_flatten__()[0]]
        else:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def all_finite(results: dict[str, list]) -> bool:
    return all(bool(torch.isfinite(t).all()) for ts in results.values() for t in ts)
