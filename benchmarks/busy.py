"""`python benchmarks/busy.py` (from a checkout): the ``cpu`` backend's step against torch's fused AdamW while one
spinning process keeps every core busy (as DataLoader workers do).

Rows (``plain``, ``clip``, ``accumulate``), the gate and the budgets: benchmarks/README.md §1.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time

import torch

from ampfused.bench import cli, measure
from ampfused.bench.environment import Load, cpu_isa, cpu_model, loadavg

SHAPES = {  # name -> numel of each tensor: all overhead, 4M elements in 148 tensors, a few large ones
    "148x16": (16,) * 148,
    "148x27K": (27_027,) * 148,
    "4x3.1M": (3_100_000,) * 4,
}
MODES = ("plain", "clip", "accumulate")
# A tiny step is shorter than one preemption by a spinner: many short bursts, so both sides see the
# same preemptions. A large step is long (torch's steps take seconds where they stall): fewer rounds and a
# cap per row, but enough rounds that two runs' medians agree.
BUDGETS = {
    "small": measure.Budget(0.3, 0.6, min_samples=20, rounds=40, cap_s=8.0),
    "large": measure.Budget(0.3, 0.6, min_samples=15, rounds=15, cap_s=10.0),
    "quick": measure.Budget(0.005, 0.02, min_samples=3, rounds=3, cap_s=2.0),
}
SMALL = 1 << 20  # elements: a row below this takes the "small" budget
SPIN_LIFETIME_S = 300.0  # a spinner ends by itself after this, should the benchmark be killed outright


def _spin(deadline: float, parent: int) -> None:
    """Keep one core busy until ``deadline`` or until the parent is gone."""
    n = 0
    while True:
        n += 1
        if n % 100_000 == 0 and (time.monotonic() >= deadline or os.getppid() != parent):
            return


@contextlib.contextmanager
def spinners(count: int, lifetime_s: float = SPIN_LIFETIME_S):
    """``count`` processes spinning on the CPU for the duration of the block (terminated on any exit)."""
    # fork: the child runs only the pure-Python loop above (no torch, no OpenMP), and starts at once
    ctx = multiprocessing.get_context("fork")
    procs = []
    try:
        for _ in range(count):
            p = ctx.Process(target=_spin, args=(time.monotonic() + lifetime_s, os.getpid()), daemon=True)
            p.start()
            procs.append(p)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _tensors(numels, seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in numels]
    grads = [torch.randn(n, generator=gen) for n in numels]
    return params, grads


class _Accumulation:
    """The backward hook's add of a bf16 micro-batch gradient into an fp32 buffer: the op the C++ hook of
    csrc/accumulate_hook.cpp calls, or torch's own ``main_grad.add_(grad)``."""

    def __init__(self, kind: str, params, grads):
        self.main_grads = [torch.zeros_like(p) for p in params]
        self.grads = [g.to(torch.bfloat16) for g in grads]
        add = torch.ops.ampfused.accumulate if kind == "ampfused" else torch.Tensor.add_

        def step():
            for main_grad, grad in zip(self.main_grads, self.grads):
                add(main_grad, grad)
        self.step = step

    def restore_grads(self) -> None:
        pass

    def results(self) -> dict[str, list]:
        return {"main_grad": self.main_grads}


class _Side:
    """One optimizer over its own copy of the row's params, gradients attached."""

    def __init__(self, kind: str, mode: str, params, grads):
        from ampfused import FusedAmpAdamW

        self.params = [p.clone().requires_grad_() for p in params]
        self.grads = grads
        self.restore_grads()
        if kind == "torch":
            self.opt = torch.optim.AdamW(self.params, lr=1e-3, fused=True)
            clip = mode == "clip"

            def step():
                if clip:
                    torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.opt.step()
        else:
            self.opt = FusedAmpAdamW(self.params, lr=1e-3, backend="cpu", skip_nonfinite=False,
                                     max_grad_norm=1.0 if mode == "clip" else None)
            step = self.opt.step
        self.step = step

    def restore_grads(self) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone()

    def results(self) -> dict[str, list]:
        state = [self.opt.state[p] for p in self.params]
        return {"param": self.params, "exp_avg": [s["exp_avg"] for s in state],
                "exp_avg_sq": [s["exp_avg_sq"] for s in state]}


def compare(got: dict[str, list], want: dict[str, list]) -> str:
    """'' when every param and moment (or buffer) matches torch's within tolerance, else the first mismatch."""
    return measure.compare(got, want, against="torch")


def run_row(shape: str, mode: str, threads: int, budget: measure.Budget, gate_steps: int = 2, seed: int = 0) -> dict:
    torch.set_num_threads(threads)
    params, grads = _tensors(SHAPES[shape], seed)
    sides = {kind: _Accumulation(kind, params, grads) if mode == "accumulate" else _Side(kind, mode, params, grads)
             for kind in ("torch", "ampfused")}
    for side in sides.values():
        for _ in range(gate_steps):
            side.restore_grads()
            side.step()
    mismatch = compare(sides["ampfused"].results(), sides["torch"].results())
    row = dict(shape=shape, numel=sum(SHAPES[shape]), mode=mode, threads=threads, gate=mismatch or "passed")
    if mismatch:
        return row
    timings = measure.interleaved({kind: side.step for kind, side in sides.items()}, torch.device("cpu"), budget,
                                  host=True)
    for kind, t in timings.items():
        row[f"{kind}_ms"], row[f"{kind}_p20"], row[f"{kind}_p80"] = t.median_ms, t.p20_ms, t.p80_ms
        row[f"{kind}_note"] = t.error or t.unstable
    row["ratio"] = row["ampfused_ms"] / row["torch_ms"]
    return row


def table(rows: list[dict]) -> str:
    """Markdown: median ms per step (p20-p80), ours over torch's median; * marks an unstable timing."""
    lines = ["| tensors | elements | mode | threads | torch fused ms (p20-p80) | ampfused cpu ms (p20-p80) | ours / torch |",
             "|---|---:|---|---:|---:|---:|---:|"]
    notes = []
    for r in rows:
        head = f"| {r['shape']} | {r['numel']:,} | {r['mode']} | {r['threads']} |"
        if r["gate"] != "passed":
            lines.append(f"{head} gate FAILED: {r['gate']} | | |")
            continue
        cells = []
        for kind in ("torch", "ampfused"):
            mark = "*" if r[kind + "_note"] else ""
            cells.append(f"{r[kind + '_ms']:.3f}{mark} ({r[kind + '_p20']:.3f}-{r[kind + '_p80']:.3f})")
            if r[kind + "_note"]:
                notes.append(f"{r['shape']} {r['mode']} {r['threads']}t {kind}: {r[kind + '_note']}")
        lines.append(f"{head} {cells[0]} | {cells[1]} | {r['ratio']:.2f} |")
    if notes:
        lines += ["", "`*` unstable: " + "; ".join(notes)]
    return "\n".join(lines)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=cli.choice_list(tuple(SHAPES)), default=tuple(SHAPES),
                        help=f"comma list of: {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--modes", type=cli.choice_list(MODES), default=MODES, help="plain, clip, accumulate (default: all)")
    parser.add_argument("--threads", type=cli.positive_int, action="append", default=None,
                        help="thread count of a row; repeatable (default: 1 and torch's default)")
    parser.add_argument("--spinners", type=int, default=None,
                        help="spinning processes (default: one per core; 0 for an unloaded run)")
    parser.add_argument("--quick", action="store_true", help="a tiny budget (used by the tests; the timings mean little)")
    return parser


def main(argv: list[str] | None = None, prog: str = "python benchmarks/busy.py") -> int:
    args = build_parser(prog).parse_args(argv)
    from ampfused import _backends

    try:
        _backends.resolve("cpu", torch.device("cpu"))
    except (RuntimeError, ValueError) as exc:
        print(f"{prog}: the cpu backend is not available: {exc}", file=sys.stderr)
        return 2
    default_threads = torch.get_num_threads()
    thread_counts = tuple(dict.fromkeys(args.threads or (1, default_threads)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    count = cores if args.spinners is None else max(args.spinners, 0)
    cases = [(s, m, t) for t in thread_counts for s in args.shapes for m in args.modes]
    print(f"{prog}: {cpu_model()}, {cpu_isa()}, torch {torch.__version__} (default {default_threads} threads)")
    print(f"{count} spinning process(es) on {cores} core(s); load average before: {loadavg()}")
    rows = []
    load = Load().start()
    progress = cli.Progress(len(cases), "row")
    try:
        with spinners(count):
            for shape, mode, threads in cases:
                progress.describe(f"{shape} {mode} {threads} thread(s)")
                size = "quick" if args.quick else "small" if sum(SHAPES[shape]) < SMALL else "large"
                rows.append(run_row(shape, mode, threads, BUDGETS[size]))
                progress.update()
    finally:
        progress.close()
        torch.set_num_threads(default_threads)
    busy = load.stop()
    print(f"cores other processes kept busy meanwhile: {busy:.2f} (spinners included); "
          f"load average after: {loadavg()}")
    print(table(rows))
    failed = [r for r in rows if r["gate"] != "passed"]
    if failed:
        print(f"correctness gate: FAILED ({len(failed)} of {len(rows)} rows)")
        return 1
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"correctness gate: PASSED ({len(rows)} rows: params and moments, or accumulated buffers, match torch's)")
    print(f"worst ours / torch: {worst['ratio']:.2f} ({worst['shape']} {worst['mode']}, {worst['threads']} thread(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
