"""Each pass of the compiled backend and of torch alone, against the ``a += b`` stream.

The backend's stats, update and accumulate passes and torch's fused AdamW, ``clip_grad_norm_``'s
``_foreach_norm`` and ``_foreach_mul_`` and a plain ``sum``, timed interleaved with the stream over
as many fp32 elements: modeled bytes per element, GB/s and the fraction of the stream's. A read-only
pass is capped by the misses one core keeps in flight, below the stream (the ``sum`` row shows that
cap for torch).

From a checkout: ``python benchmarks/passes.py`` (50M fp32 elements in 4 tensors on a CPU, 100M on a
GPU; ``--quick`` 1M). Writes ``passes.csv`` / ``passes.md`` to ``--out``; ``benchmarks/streaming.py``
shares these rows and tables.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from ampfused.bench import cli, measure
from ampfused.bench.bench import BUDGETS
from ampfused.bench.configs import BETAS, EPS, GRAD_STD, LR, MAX_GRAD_NORM, WEIGHT_DECAY, human
from ampfused.bench.environment import Load, environment, pick_threads
from ampfused.bench.report import fmt, write_csv

# fp32 elements by plan: the bench's largest CPU size; 100M on a GPU keeps it within a 16 GB card
NUMEL = {"quick": 1_000_000, "cpu": 50_000_000, "gpu": 100_000_000}
TENSORS = 4

COLUMNS = ["date", "hardware", "torch", "ampfused", "clock", "section", "threads", "numel", "tensors", "name", "bytes_per_elem",
           "median_ms", "p20_ms", "p80_ms", "samples", "unstable", "gbps", "roofline_gbps", "roofline_frac",
           "baseline", "speedup_vs_baseline", "loadavg_before", "loadavg_after", "other_cores"]


class PassBench:
    """Tensors and timed functions of every pass over ``sizes`` fp32 elements (shared where a pass only
    reads them or where mutating them keeps every value finite)."""

    def __init__(self, sizes: list[int], device: torch.device, backend_name: str = "cpu"):
        from ampfused import _backends
        from ampfused._batch import Batch, Hyper

        gen = torch.Generator(device=device).manual_seed(0)
        self.backend = _backends.resolve(backend_name, device)[0]
        randn = lambda n, std: torch.randn(n, generator=gen, device=device).mul_(std)  # noqa: E731
        self.params = [randn(n, 0.02) for n in sizes]
        self.grads = [randn(n, GRAD_STD) for n in sizes]
        self.exp_avgs = [torch.zeros(n, device=device) for n in sizes]
        self.exp_avg_sqs = [torch.zeros(n, device=device) for n in sizes]
        self.steps = [torch.zeros((), device=device) for _ in sizes]
        self.low = [p.to(torch.bfloat16) for p in self.params]  # bf16 params (their masters: self.params)
        self.low_grads = [g.to(torch.bfloat16) for g in self.grads]
        self.group_ids = [0] * len(sizes)  # one param group
        self.groups = [Hyper(LR, BETAS[0], BETAS[1], EPS, WEIGHT_DECAY, False, False)]
        self.none = [None] * len(sizes)
        self.stats = torch.tensor([0.0, 0.0, 1.0, 0.0], device=device)  # not skipped, factor 1
        self.grad_scale = torch.ones((), device=device)
        self.norm_stats = torch.empty(4, device=device)
        self.grad_batch = Batch.of_grads(self.grads)
        self.batches: dict = {}  # (params, masters) -> the update's Batch
        self.torch_params = [torch.nn.Parameter(p.clone()) for p in self.params]
        for p, g in zip(self.torch_params, self.grads):
            p.grad = g  # read only by the fused step
        self.torch_opt = torch.optim.AdamW(self.torch_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                           fused=True)
        self.torch_opt.step()  # its lazy state

    def update(self, params, masters, grad_scale=None) -> None:
        batch = self.batches.get((id(params), id(masters)))
        if batch is None:  # built once per combination, outside the timed calls that follow
            from ampfused._batch import Batch

            batch = self.batches[(id(params), id(masters))] = Batch(
                params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.none, self.steps, masters, self.group_ids,
                self.groups)
        self.backend.adamw_update_(batch, self.stats, grad_scale=grad_scale)

    def functions(self) -> dict[str, tuple[float, object]]:
        """name -> (modeled bytes per element, fn). Every update leaves the grads as they were (a unit
        scale writes them back unchanged)."""
        b = self
        return {
            "stats: read g (fp32)": (4, lambda: b.backend.grad_stats_(b.grad_batch, None, None, MAX_GRAD_NORM, b.norm_stats)),
            "update: fp32 param, g, m, v in place": (28, lambda: b.update(b.params, b.none)),
            "update + unscaled g written back": (32, lambda: b.update(b.params, b.none, b.grad_scale)),
            "update: bf16 param, fp32 master": (30, lambda: b.update(b.low, b.params)),
            "accumulate: fp32 += bf16": (10, lambda: [b.backend.accumulate_(g, lg) for g, lg in zip(b.grads, b.low_grads)]),
            "torch fused AdamW step (fp32)": (28, b.torch_opt.step),
            "torch _foreach_norm (clip's read)": (4, lambda: torch._foreach_norm(b.grads)),
            "torch _foreach_mul_ (clip's scale)": (8, lambda: torch._foreach_mul_(b.grads, 1.0)),
            "torch sum (a plain read)": (4, lambda: [g.sum() for g in b.grads]),
        }


def pass_rows(numel: int, tensors: int, device: torch.device, budget: measure.Budget, env: dict,
              backend_name: str = "cpu", clock=time.perf_counter, on_round=None) -> list[dict]:
    """The passes at the current thread count: one row per pass (and the roofline's own)."""
    sizes = [numel // tensors] * tensors
    sizes[0] += numel - sum(sizes)
    bench = PassBench(sizes, device, backend_name)
    roofline = measure.DeviceCopy(12 * numel, device)  # a += b over numel fp32 elements
    fns = {name: fn for name, (_, fn) in bench.functions().items()}
    fns["roofline: a += b (fp32)"] = roofline.fn
    load = Load().start()
    timings = measure.interleaved(fns, device, budget, clock=clock, on_round=on_round)
    other = load.stop()
    roof = timings["roofline: a += b (fp32)"]
    roof_gbps = roofline.gbps(roof) if not roof.error else math.nan
    rows = []
    per_elem = {name: nbytes for name, (nbytes, _) in bench.functions().items()}
    per_elem["roofline: a += b (fp32)"] = 12
    for name, t in timings.items():
        row = make_row(env, "passes", numel, tensors, name, per_elem[name], t, load, other)
        row.update(roofline_gbps=roof_gbps, roofline_frac=row["gbps"] / roof_gbps if row["gbps"] != "" else "")
        rows.append(row)
    return rows


def make_row(env, section, numel, tensors, name, nbytes, t: measure.Timing, load: Load, other: float) -> dict:
    row = {c: "" for c in COLUMNS}
    row.update({k: v for k, v in env.items() if k in row})
    row.update(section=section, numel=numel, tensors=tensors, name=name, bytes_per_elem=nbytes,
               loadavg_before=load.loadavg_before, loadavg_after=load.loadavg_after, other_cores=other)
    if t.error:
        row.update(unstable=f"error: {t.error}")
        return row
    row.update(median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, samples=t.samples, unstable=t.unstable,
               gbps=nbytes * numel / (t.median_ms * 1e-3) / 1e9)
    return row


# ---------------------------------------------------------------- output


def pass_table(rows: list[dict]) -> str:
    lines = ["| threads | pass | B/elem | ms median (p20–p80) | GB/s | % of a += b | timing | load avg | other cores |",
             "|---:|---|---:|---|---:|---:|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['name']} | {r['bytes_per_elem']} | {ms_cell(r)} | {fmt(r['gbps'], '.1f')} | "
                     f"{fmt(r['roofline_frac'] * 100 if r['roofline_frac'] != '' else '', '.0f')} | "
                     f"{r['unstable'] or 'stable'} | {r['loadavg_before']} | {fmt(r['other_cores'], '.2f')} |")
    return "\n".join(lines)


def ms_cell(r) -> str:
    if r["median_ms"] == "":
        return "–"
    return f"{r['median_ms']:.1f} ({r['p20_ms']:.1f}–{r['p80_ms']:.1f})"


def markdown(rows: list[dict], title: str, env: dict) -> str:
    """The pass rows' table under a header naming the machine (``passes.md``)."""
    passes = [r for r in rows if r["section"] == "passes"]
    parts = [f"# {title}", "", f"- date: {env['date']}; hardware: {env['hardware']}",
             f"- versions: torch {env['torch']}, ampfused {env['ampfused']}", ""]
    if passes:
        parts += [f"## Passes at {human(passes[0]['numel'])} fp32 elements in {passes[0]['tensors']} tensors", "",
                  pass_table(passes), ""]
    return "\n".join(parts)


def write(rows: list[dict], out: str, stem: str, text: str) -> list[str]:
    """``<stem>.csv`` (every row) and ``<stem>.md`` (``text``) in ``out``."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"{stem}.csv"), os.path.join(out, f"{stem}.md")]
    write_csv(rows, paths[0], COLUMNS)
    with open(paths[1], "w") as f:
        f.write(text + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/passes.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="1M elements and a short timing budget (a smoke run)")
    parser.add_argument("--size", type=cli.parse_size, default=None,
                        help="fp32 elements in all (default: 1M with --quick, else 100M on a GPU, 50M on a CPU)")
    parser.add_argument("--tensors", type=cli.positive_int, default=TENSORS,
                        help=f"tensors they are split into (default {TENSORS})")
    parser.add_argument("--threads", type=cli.positive_int, default=None,
                        help="CPU threads (default: the cores other processes leave free, measured at the start)")
    parser.add_argument("--out", default=os.path.join("bench-results", "passes"), help="output folder")
    args = parser.parse_args(argv)
    device = cli.pick_device(parser, args.device)
    from ampfused import _backends

    try:
        _backends.resolve(device.type, device)
    except (RuntimeError, ValueError) as exc:
        parser.error(f"the compiled {device.type} backend is not available: {exc}")
    plan = "quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu")
    numel = args.size or NUMEL[plan]
    threads = args.threads or torch.get_num_threads()
    if device.type == "cpu":  # as the step benchmark: the cores other processes leave free
        threads, threads_line, untrusted = pick_threads(args.threads)
        print(threads_line + (f"\nWARNING: {untrusted}" if untrusted else ""))
        torch.set_flush_denormal(True)
    torch.set_num_threads(threads)
    env = environment(device, threads)
    budget = BUDGETS[plan]
    progress = cli.Progress(budget.rounds, unit="round")
    progress.describe(f"passes {human(numel)}")
    try:
        rows = pass_rows(numel, args.tensors, device, budget, env, backend_name=device.type, on_round=progress.update)
    finally:
        progress.close()
    text = markdown(rows, "ampfused passes against the a += b stream", env)
    print(text)
    print("wrote " + ", ".join(write(rows, args.out, "passes", text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
