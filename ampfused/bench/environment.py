"""What a benchmark row records about the machine: versions, hardware, and the load other processes put
on it; and the thread count that fits the cores they leave free."""
from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
import time

import torch


def environment(device: torch.device, threads: int) -> dict[str, str]:
    import ampfused

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    hardware = (torch.cuda.get_device_name(device) if device.type == "cuda" else
                cpu_model() + f", {threads} thread" + ("s" if threads != 1 else "") + f", {cpu_isa()}")
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device.type, "hardware": hardware,
            "torch": torch.__version__, "triton": triton_version, "ampfused": ampfused.__version__,
            "python": platform.python_version(), "threads": str(threads), "loadavg": loadavg()}


PROBE_S = 1.0  # how long pick_threads watches the machine before the run


def pick_threads(requested: int | None, other: float | None = None) -> tuple[int, str, str]:
    """(threads, the header line that says why, "" or why the timings are not to be trusted): unless
    ``requested``, the cores other processes left free over PROBE_S (from 0.7 of a core), at least one."""
    cores = len(os.sched_getaffinity(0))
    if other is None:
        load = Load().start()
        time.sleep(PROBE_S)
        other = load.stop()
    if other != other:  # NaN: no /proc
        return requested or cores, f"threads: {requested or cores} (the load of other processes is not measurable here)", ""
    free = max(0.0, min(cores, (os.cpu_count() or cores) - other))
    seen = f"other processes kept {other:.2f} of {os.cpu_count()} cores busy in the {PROBE_S:g} s before the start"
    threads = requested or max(1, min(cores, math.floor(free + 0.3)))
    line = f"threads: {threads} of {cores} cores ({'--threads' if requested else 'the free cores; --threads N to choose'}); {seen}"
    if threads < cores and not requested:
        # ampfused gains more from extra threads than torch does: an idle default run's speedups are larger
        line += f"; these ratios are {threads}-thread ones: compare them with `--threads {threads}` runs, not with an idle default run"
    untrusted = ""
    if free < 0.7:
        untrusted = f"{seen}: no thread count fits the free cores, so the timings are not to be trusted"
    elif threads > free + 0.5:
        untrusted = f"{seen}: {threads} threads do not fit the {free:.1f} free cores, so the timings are not to be trusted"
    return threads, line, untrusted


def cpu_isa() -> str:
    """Which ISA variant of the compiled CPU loops runs (AMPFUSED_CPU_ISA forces one)."""
    from ampfused import _compiled

    module, _ = _compiled.load()
    return f"ampfused._C ISA {module.CPU_ISA}" if module is not None else "no ampfused._C"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
        return (f"{fields.get('Model name', platform.processor())} ({fields.get('CPU(s)', '?')} CPUs, "
                f"L3 {fields.get('L3 cache', '?')})")
    except (OSError, subprocess.SubprocessError, ValueError):
        return platform.processor() or platform.machine()


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


class Load:
    """CPU cores kept busy by *other* processes between ``start()`` and ``stop()`` (/proc/stat busy jiffies
    minus this process's own; 1.0: one core busy the whole time; NaN without /proc)."""

    def __init__(self):
        self.begin, self.loadavg_before, self.loadavg_after = None, "?", "?"

    def start(self) -> "Load":
        self.loadavg_before, self.begin = loadavg(), _sample()
        return self

    def stop(self) -> float:
        self.loadavg_after = loadavg()
        return self.other_cores(self.begin, _sample())

    @staticmethod
    def other_cores(begin, end) -> float:
        if begin is None or end is None or end[1] <= begin[1]:
            return float("nan")
        (busy0, total0, own0), (busy1, total1, own1) = begin, end
        elapsed = (total1 - total0) / max(os.cpu_count() or 1, 1)  # jiffies of wall time
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / elapsed


class LoadWindows:
    """:class:`Load` over a timed block and in windows of at least ``window_s`` (closed by ``tick()``): the
    busiest window catches a burst that the average dilutes."""

    def __init__(self, window_s: float = 0.5, clock=time.monotonic):
        self.window_s, self.clock, self.total, self.windows = window_s, clock, Load(), []
        self._begin, self._start = None, 0.0

    def start(self) -> "LoadWindows":
        self.total.start()
        self._begin, self._start = _sample(), self.clock()
        return self

    def tick(self) -> None:
        if self.clock() - self._start >= self.window_s:
            self._close_window()

    def _close_window(self) -> None:
        end = _sample()
        other = Load.other_cores(self._begin, end)
        if other == other:  # not NaN
            self.windows.append(other)
        self._begin, self._start = end, self.clock()

    def stop(self) -> tuple[float, float]:
        """(average other cores over the block, the busiest window's; NaN without /proc)."""
        if self.clock() - self._start >= self.window_s / 2 or not self.windows:
            self._close_window()
        average = self.total.stop()
        return average, max(self.windows, default=average)


def overlapping_load(average: float, peak: float, threads: int, margin: float = 0.25) -> str:
    """Why a timing overlapped load from other processes (more than the cores ``threads`` leave free plus
    ``margin``, on average or at peak), or ""."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    worst = max(average, peak)
    if worst != worst or worst <= max(cores - threads, 0) + margin:  # NaN: not measurable, not marked
        return ""
    return (f"other processes kept {average:.2f} cores busy on average, {peak:.2f} at peak, "
            f"while {threads} thread(s) ran on {cores} cores")


def _sample():
    """(machine busy jiffies, machine total jiffies, this process's jiffies) or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return total - idle, total, int(own[11]) + int(own[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
