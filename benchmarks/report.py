"""Rows of the optimizer-step benchmark and their outputs: CSV, markdown table, PNG plots."""
from __future__ import annotations

import csv
import math
import os

from . import configs, providers

COLUMNS = [
    "date", "device", "hardware", "torch", "triton", "ampfused", "python", "threads", "plan",
    "sweeps", "case", "config", "param_dtype", "micro_batches", "loss_scaling", "clip", "family", "numel", "tensors",
    "provider", "status", "detail", "median_ms", "p20_ms", "p80_ms", "samples",
    "bytes_per_param", "bytes_per_step", "gbps", "copy_gbps", "roofline_frac",
    "speedup_vs_torch_foreach", "speedup_vs_torch_fused", "peak_mem_mb", "state_mb", "loadavg",
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
    """GB/s, fraction of the copy roofline, and speedups over the stock rows of the same case."""
    stock = {r["provider"]: r["median_ms"] for r in rows if r["provider"] in STOCK_COLUMNS and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["gbps"] = r["bytes_per_step"] / (r["median_ms"] * 1e-3) / 1e9
        r["roofline_frac"] = r["gbps"] / r["copy_gbps"] if r["copy_gbps"] else ""
        for name, column in STOCK_COLUMNS.items():
            if name in stock:
                r[column] = stock[name] / r["median_ms"]


# ---------------------------------------------------------------- CSV and markdown


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def _fmt(value, spec: str, default: str = "–") -> str:
    if value == "" or value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| case | provider | ms/step median (p20–p80) | B/param | GB/s | % of copy | × torch-foreach | × torch-fused | state MiB | peak MiB | gate |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] == "ok":
            ms = f"{r['median_ms']:.3f} ({r['p20_ms']:.3f}–{r['p80_ms']:.3f})"
            gate = "ok"
        else:
            ms, gate = "–", f"**{r['status']}**: {r['detail'][:120]}"
        roof = _fmt(r["roofline_frac"] * 100 if r["roofline_frac"] != "" else "", ".0f")
        lines.append(
            f"| {r['case']} | {r['provider']} | {ms} | {r['bytes_per_param']:g} | {_fmt(r['gbps'], '.1f')} | {roof} | "
            f"{_fmt(r['speedup_vs_torch_foreach'], '.2f')} | {_fmt(r['speedup_vs_torch_fused'], '.2f')} | "
            f"{_fmt(r['state_mb'], '.0f')} | {_fmt(r['peak_mem_mb'], '.0f')} | {gate} |")
    return "\n".join(lines)


def markdown_summary(rows: list[dict]) -> str:
    parts = []
    for sweep, title in (("configs", "All step configurations"), ("size", "Total size sweep"), ("tensors", "Tensor count sweep")):
        subset = [r for r in rows if sweep in r["sweeps"].split("+")]
        if subset:
            parts += [f"### {title}", "", markdown_table(subset), ""]
    return "\n".join(parts)


def write_markdown(rows, env, backends, skipped, path) -> None:
    head = [
        "# ampfused optimizer-step benchmark",
        "",
        f"- date: {env['date']}; plan: {env['plan']}",
        f"- hardware: {env['hardware']}",
        f"- versions: torch {env['torch']}, triton {env['triton']}, ampfused {env['ampfused']}, python {env['python']}",
        f"- ampfused backends measured: {', '.join(backends) or 'none'}",
        f"- load average at start (1/5/15 min): {env.get('loadavg', '?')} -- other processes on the machine add noise",
    ]
    head += [f"- not measured: {name} ({why})" for name, why in skipped.items()]
    head += [
        "- timed: one optimizer step's tail (micro-batch gradient folding, unscale, clip, AdamW, scaler update, "
        "low-precision write-back); see benchmarks/providers.py",
        "- B/param: modeled bytes moved per parameter (benchmarks/providers.py `bytes_per_param`); "
        "% of copy: effective GB/s over a device copy's GB/s at the same byte count, measured in this run",
        "- state MiB: params, fp32 weights, grads and optimizer state the provider holds (exact); peak MiB: "
        "measured peak above the level before the provider was built (CUDA allocator; on CPU, approximate RSS growth)",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n" + markdown_summary(rows) + "\n")


# ---------------------------------------------------------------- plots


def _providers(rows):
    return list(dict.fromkeys(r["provider"] for r in rows))


def plot_size(rows, path) -> bool:
    subset = [r for r in rows if "size" in r["sweeps"].split("+") and r["status"] == "ok"]
    if not subset:
        return False
    import matplotlib.pyplot as plt

    cfgs = list(dict.fromkeys(r["config"] for r in subset))
    fig, axes = plt.subplots(1, len(cfgs), figsize=(6 * len(cfgs), 4.2), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        for name in _providers(subset):
            pts = sorted((r["numel"], r["gbps"]) for r in subset if r["config"] == cfg and r["provider"] == name)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        copy = sorted({(r["numel"], r["copy_gbps"]) for r in subset if r["config"] == cfg and r["provider"] == "torch-fused"})
        if copy:
            ax.plot(*zip(*copy), linestyle="--", color="gray", label="device copy (roofline)")
        ax.set_xscale("log")
        ax.set(title=cfg, xlabel="parameters", ylabel="effective GB/s (modeled bytes / time)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Optimizer step vs total size — {subset[0]['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bars(rows, sweep, group_key, value_key, ylabel, title, path) -> bool:
    subset = [r for r in rows if sweep in r["sweeps"].split("+") and r["status"] == "ok" and r[value_key] != ""]
    if not subset:
        return False
    import matplotlib.pyplot as plt
    import numpy as np

    cfgs = list(dict.fromkeys(r["config"] for r in subset)) if sweep == "tensors" else [None]
    n_groups = len(dict.fromkeys(group_key(r) for r in subset))
    panel_width = min(14, max(6, 1.1 * n_groups / len(cfgs)))  # about an inch per bar group, readable widths
    fig, axes = plt.subplots(1, len(cfgs), figsize=(panel_width * len(cfgs), 4.5), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        part = [r for r in subset if cfg is None or r["config"] == cfg]
        groups = list(dict.fromkeys(group_key(r) for r in part))
        names = _providers(part)
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [next((r[value_key] for r in part if group_key(r) == g and r["provider"] == name), 0) for g in groups]
            ax.bar(np.arange(len(groups)) + i * width - 0.4 + width / 2, values, width, label=name)
        ax.set_xticks(np.arange(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        if value_key.startswith("speedup"):
            ax.axhline(1.0, color="gray", linewidth=0.8)
        else:
            ax.set_yscale("log")  # providers differ by orders of magnitude
        ax.set(ylabel=ylabel, title=cfg or "")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title} — {subset[0]['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(rows, env, backends, skipped, out) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    paths = [os.path.join(out, "bench.csv"), os.path.join(out, "bench.md")]
    write_csv(rows, paths[0])
    write_markdown(rows, env, backends, skipped, paths[1])
    plots = {
        "size_sweep.png": lambda p: plot_size(rows, p),
        "configs_speedup.png": lambda p: plot_bars(rows, "configs", lambda r: r["config"], "speedup_vs_torch_fused",
                                                   "speedup over torch AdamW(fused=True)", "Step configurations", p),
        "tensors_sweep.png": lambda p: plot_bars(rows, "tensors", lambda r: f"{r['family']} ({r['tensors']} tensors)", "median_ms", "ms per step",
                                                 "Tensor count (same total size)", p),
    }
    for filename, plot in plots.items():
        path = os.path.join(out, filename)
        if plot(path):
            paths.append(path)
    return paths
