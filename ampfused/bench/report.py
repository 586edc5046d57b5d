"""Rows of the optimizer-step benchmark and their outputs: CSV, ``bench.md``, ``run.json`` (read by
``benchmarks/summary.py``) and the PNG plots (``plots.py``, when matplotlib is installed)."""
from __future__ import annotations

import csv
import json
import math
import os

from . import configs, measure, providers

COLUMNS = [
    "date", "device", "hardware", "torch", "triton", "ampfused", "python", "threads", "plan",
    "sweeps", "case", "config", "param_dtype", "micro_batches", "loss_scaling", "clip", "family", "numel", "tensors",
    "provider", "status", "detail", "timer", "median_ms", "p20_ms", "p80_ms", "samples", "unstable",
    "bytes_per_param", "bytes_per_step", "gbps", "roofline_gbps", "roofline_frac", "working_set_mb", "roofline_from",
    "speedup_vs_torch_foreach", "speedup_vs_torch_fused", "host_ratio_vs_torch_fused", "peak_mem_mb", "state_mb", "kept_bytes_per_param",
    "other_cores", "other_cores_peak", "loadavg",
]
STOCK_COLUMNS = {"torch-foreach": "speedup_vs_torch_foreach", "torch-fused": "speedup_vs_torch_fused"}


def base_row(env: dict, case: configs.Case, provider: str) -> dict:
    cfg, shapes = case.config, case.shapes
    per_param = providers.bytes_per_param(provider, case)
    row = {c: "" for c in COLUMNS}
    row.update({k: v for k, v in env.items() if k in row})
    row.update(sweeps="+".join(case.sweeps), case=case.label, config=cfg.name, param_dtype=cfg.param_dtype,
               micro_batches=cfg.micro_batches, loss_scaling=cfg.loss_scaling, clip=cfg.clip, family=shapes.family,
               numel=shapes.numel, tensors=shapes.count, provider=provider, status="", detail="",
               bytes_per_param=per_param, bytes_per_step=per_param * shapes.numel)
    return row


def add_derived(rows: list[dict]) -> None:
    """GB/s, roofline fraction and speedups over the case's stock rows (host sweep: host time over
    torch-fused's), from round-by-round ratios where timed interleaved; a ratio to an unstable stock row
    is unstable too."""
    stock = {r["provider"]: r for r in rows if r["provider"] in STOCK_COLUMNS and r["status"] == "ok"}

    def ratio(num, den):
        if num.get("_timing") and den.get("_timing"):
            return measure.ratio(num["_timing"], den["_timing"])[0]
        return num["median_ms"] / den["median_ms"]

    for r in rows:
        if r["status"] != "ok":
            continue
        if r["timer"] == "host":
            if "torch-fused" in stock and r["provider"] not in STOCK_COLUMNS:
                r["host_ratio_vs_torch_fused"] = ratio(r, stock["torch-fused"])
        else:
            r["gbps"] = r["bytes_per_step"] / (r["median_ms"] * 1e-3) / 1e9
            for name, column in STOCK_COLUMNS.items():
                if name in stock:
                    r[column] = ratio(stock[name], r)
        if not r["unstable"] and r["provider"] not in STOCK_COLUMNS:
            shaky = [n for n, s in stock.items() if s["unstable"] and (r["timer"] != "host" or n == "torch-fused")]
            if shaky:
                r["unstable"] = f"compared with unstable {', '.join(shaky)}"
    add_roofline(rows)


def add_roofline(rows: list[dict]) -> None:
    """``roofline_frac`` of every device-timed row, at most 1: over its ``a += b`` stream's GB/s, or a
    provider's that reached more on a working set at least as large (``roofline_from`` names it)."""
    timed = [r for r in rows if r["status"] == "ok" and r["timer"] != "host" and r["gbps"] != "" and r["roofline_gbps"] != ""]
    size = {id(r): r["working_set_mb"] if r.get("working_set_mb", "") != "" else 0.0 for r in timed}
    for r in timed:
        faster = [q for q in timed if size[id(q)] >= size[id(r)] and q["gbps"] > r["roofline_gbps"]]
        if faster:
            best = max(faster, key=lambda q: q["gbps"])
            r["roofline_from"] = (f"{best['provider']}'s {best['gbps']:.1f} GB/s on {size[id(best)]:.0f} MiB "
                                  f"(the a += b stream over {size[id(r)]:.0f} MiB: {r['roofline_gbps']:.1f})")
            r["roofline_gbps"] = best["gbps"]
        r["roofline_frac"] = r["gbps"] / r["roofline_gbps"]


# ---------------------------------------------------------------- CSV and markdown


def write_csv(rows: list[dict], path: str, columns: list[str] = COLUMNS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)


def fmt(value, spec: str, default: str = "–") -> str:
    if value == "" or value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return format(value, spec)


def _ms(r) -> str:
    return f"{r['median_ms']:.3f} ({r['p20_ms']:.3f}–{r['p80_ms']:.3f})"


def _timing(r) -> str:  # (an unstable row says why)
    return f"**unstable**: {r['unstable']}" if r["unstable"] else "stable"


def _other(r) -> str:  # cores other processes kept busy during the row's case: average (busiest window)
    peak = r.get("other_cores_peak", "")
    return fmt(r["other_cores"], ".2f") + (f" ({fmt(peak, '.2f')})" if peak != "" else "")


def _gate(r) -> str:
    if r["status"] in ("ok", "untimed"):  # (detail: e.g. the host sweep's stubbed Triton kernels)
        return f"ok ({r['detail']})" if r["detail"] else "ok"
    return f"**{r['status']}**: {r['detail'][:120]}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| case | provider | ms/step median (p20–p80) | samples | timing | B/param | GB/s | % of roofline | × torch-foreach | "
        "× torch-fused | state MiB | kept B/param | peak MiB | other cores (peak) | gate |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        roof = fmt(r["roofline_frac"] * 100 if r["roofline_frac"] != "" else "", ".0f")
        lines.append(
            f"| {r['case']} | {r['provider']} | {_ms(r) if ok else '–'} | {r['samples'] if ok else '–'} | "
            f"{_timing(r) if ok else '–'} | {r['bytes_per_param']:g} | {fmt(r['gbps'], '.1f')} | {roof} | "
            f"{fmt(r['speedup_vs_torch_foreach'], '.2f')} | {fmt(r['speedup_vs_torch_fused'], '.2f')} | "
            f"{fmt(r['state_mb'], '.0f')} | {fmt(r['kept_bytes_per_param'], '.2f')} | {fmt(r['peak_mem_mb'], '.0f')} | {_other(r)} | {_gate(r)} |")
    return "\n".join(lines)


def host_table(rows: list[dict]) -> str:
    lines = [
        "| case | provider | host ms/step median (p20–p80) | samples | timing | host time ÷ torch-fused's | other cores (peak) | gate |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(f"| {r['case']} | {r['provider']} | {_ms(r) if ok else '–'} | {r['samples'] if ok else '–'} | "
                     f"{_timing(r) if ok else '–'} | {fmt(r['host_ratio_vs_torch_fused'], '.2f')} | "
                     f"{_other(r)} | {_gate(r)} |")
    return "\n".join(lines)


SWEEP_TITLES = (("configs", "All step configurations"), ("size", "Total size sweep"), ("tensors", "Tensor count sweep"),
                ("host", "Host time per step on tiny tensors"), ("memory", "Memory modes (compact state, DESIGN §9)"))


def markdown_summary(rows: list[dict]) -> str:
    parts = []
    for sweep, title in SWEEP_TITLES:
        subset = [r for r in rows if sweep in r["sweeps"].split("+")]
        if subset:
            parts += [f"### {title}", "", (host_table if sweep == "host" else markdown_table)(subset), ""]
    return "\n".join(parts)


def load_line(env: dict) -> str:
    return (f"machine load: other processes kept {env.get('other_cores', '?')} of {os.cpu_count()} cores busy on average "
            f"during the run (/proc/stat); load average (1/5/15 min) {env.get('loadavg', '?')} before, "
            f"{env.get('loadavg_after', '?')} after")


def write_markdown(rows, env, backends, skipped, budget, path) -> None:
    untimed = list(dict.fromkeys(r["provider"] for r in rows if r["status"] == "untimed"))
    head = [
        "# ampfused optimizer-step benchmark", "",
        f"- date: {env['date']}; plan: {env['plan']}; hardware: {env['hardware']}",
        f"- versions: torch {env['torch']}, triton {env['triton']}, ampfused {env['ampfused']}, python {env['python']}",
        f"- ampfused backends measured: {', '.join(backends) or 'none'}",
        f"- {env.get('threads_choice') or 'threads: ' + env['threads']}",
        f"- {load_line(env)}; per row: 'other cores' during that case, on average (in the busiest 0.5 s window)",
        *([f"- **not to be trusted**: {env['untrusted']}"] if env.get("untrusted") else []),
        f"- timing: all providers of a case and the roofline stream interleaved, in {budget.rounds}+ rounds of "
        f"{budget.burst}+ calls ({budget.min_samples}+ calls and {budget.min_s:g}+ s per timing); ms/step: median "
        "(p20–p80) of the rounds' means; × torch-*: median of the round-by-round ratios; **unstable** (with the "
        f"reason): fewer calls, a spread above {100 * budget.max_spread:.0f}% of the median, an unstable stock row "
        "or roofline stream, or more load from other processes than the free cores",
        *(f"- not measured: {name} ({why})" for name, why in skipped.items()),
        *([f"- gated but not timed: {', '.join(untimed)} (the oracle and fallback; `--backends` naming it times it)"]
          if untimed else []),
        "- timed: one optimizer step's tail (micro-batch gradient folding, unscale, clip, AdamW, scaler update, "
        "low-precision write-back); B/param: modeled bytes moved per parameter (`bytes_per_param`, "
        "ampfused/bench/providers.py); % of roofline: GB/s over an `a += b` stream's over the row's working set, "
        "or a faster provider's on one at least as large (`roofline_from` in the CSV)",
        "- state MiB: every tensor the provider keeps between steps (kept B/param: per parameter); peak MiB: "
        "measured peak above the level before the provider was built, through its build and gate steps", "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n" + markdown_summary(rows) + "\n")


def write_all(rows, env, backends, skipped, budget, out) -> tuple[list[str], str]:
    """Write CSV, markdown and (matplotlib permitting) plots; (paths written, why plots are missing or "")."""
    paths = [os.path.join(out, "bench.csv"), os.path.join(out, "bench.md"), os.path.join(out, "run.json")]
    write_csv(rows, paths[0])
    write_markdown(rows, env, backends, skipped, budget, paths[1])
    with open(paths[2], "w") as f:
        json.dump(env, f, indent=1)
    try:
        from . import plots
    except ImportError as exc:
        from .cli import BENCH_EXTRA_HINT

        return paths, f"{exc.name or exc} is not installed; `{BENCH_EXTRA_HINT}` for the PNG plots"
    return paths + plots.write_plots(rows, out), ""
