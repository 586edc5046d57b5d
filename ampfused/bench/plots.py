"""PNG plots of the optimizer-step benchmark (matplotlib; ``report.write_all`` skips them without it).
Every bar or point carries the p20-p80 spread of its timing as an error bar; ratios are drawn on a
log axis around a 1.0 line, so 2x faster and 2x slower look alike; unstable timings get a dagger."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

from .configs import MEMORY_MODES  # noqa: E402
from .providers import KEEP_SCALED, MODE  # noqa: E402

KEY = ("case names: fp32 / bf16 / fp16 = param dtype · x1 / x4 = micro-batches accumulated in fp32 · "
       "scaled = GradScaler on · clip = global-norm clipping at 1.0, noclip = none")
# One fixed style per provider, the same in every plot: a colour each for the stock paths, the backends,
# each backend's keep_scaled_grads row (also hatched, diamond markers) and each memory mode (dotted
# hatch, square markers).
COLORS = {"torch-fused": "#1f77b4", "torch-foreach": "#7f7f7f", "ampfused-cpu": "#ff7f0e", "ampfused-cuda": "#d62728",
          "ampfused-triton": "#9467bd", "ampfused-reference": "#2ca02c"}
KEEP_COLORS = {"ampfused-cpu": "#ffbb78", "ampfused-cuda": "#ff9896", "ampfused-triton": "#c5b0d5",
               "ampfused-reference": "#98df8a"}
MODE_COLORS = dict(zip(MEMORY_MODES, ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79", "#637939", "#e7ba52",
                                      "#843c39", "#7b4173", "#000000")))


def style(name: str) -> dict:
    """{color, hatch, marker} of provider ``name``."""
    base, _, mode = name.partition(MODE)
    if mode:
        return dict(color=MODE_COLORS.get(mode, "#000000"), hatch="..", marker="s")
    if base.endswith(KEEP_SCALED):
        return dict(color=KEEP_COLORS.get(base.removesuffix(KEEP_SCALED), "#000000"), hatch="//", marker="D")
    return dict(color=COLORS.get(base, "#000000"), hatch=None, marker="o")


def _names(rows, key="provider"):
    return list(dict.fromkeys(r[key] for r in rows))


def _log_ticks(axis, locator=None):
    """Plain numbers (0.5, 1, 2, 5, 10) on a log axis, not 2×10⁰; at 1-2-5 steps unless ``locator``."""
    axis.set_major_locator(locator or ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _finish(fig, path, title, hardware, key=None):
    fig.suptitle(f"{title}\n{hardware}", fontsize=10)
    if key:
        fig.text(0.5, 0.01, key, ha="center", fontsize=7.5, wrap=True)
    fig.tight_layout(rect=(0, 0.05 if key else 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _legend_beside(ax, *others):
    """The legend (of ``ax`` and ``others``) right of ``ax``, where it covers no bar (inside, "best" still lands on some)."""
    entries = {label: h for a in (*others, ax) for h, label in zip(*a.get_legend_handles_labels())}
    ax.legend(entries.values(), entries.keys(), fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _bars(ax, groups, names, cell, value=lambda r: r["median_ms"], err=lambda r: (r["p20_ms"], r["p80_ms"])):
    """Grouped bars on a log axis: cell[(group, name)] -> row; value(row) -> float (default: ms); err(row)
    -> (lo, hi) absolute; a dagger marks an unstable row."""
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        bars = [(g - 0.4 + width * (i + 0.5), cell[(group, name)]) for g, group in enumerate(groups) if (group, name) in cell]
        if not bars:  # (an empty bar set would still take a legend entry, in a default colour)
            continue
        ys = [value(r) for _, r in bars]
        lo, hi = zip(*((max(y - err(r)[0], 0), max(err(r)[1] - y, 0)) for y, (_, r) in zip(ys, bars)))
        look = style(name)
        ax.bar([x for x, _ in bars], ys, width, yerr=[lo, hi], capsize=2, label=name, color=look["color"],
               hatch=look["hatch"], edgecolor="white", linewidth=0, error_kw={"linewidth": 0.8})
        for (x, r), y in zip(bars, ys):
            if r["unstable"]:
                ax.annotate("†", (x, y), xytext=(4, 1), textcoords="offset points", ha="left", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [g.replace("-", "\n") for g in groups], fontsize=7.5)
    ax.set_yscale("log")
    _log_ticks(ax.yaxis)
    ax.grid(axis="y", which="both", alpha=0.3)


def plot_configs(subset, path) -> str:
    cell = {(r["config"], r["provider"]): r for r in subset}
    groups, names = _names(subset, "config"), _names(subset)
    # stacked: one x axis of names; 2.6 inches more on the right for the legends
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(groups)) + 2.6, 8.5))
    fused = {g: cell[(g, "torch-fused")] for g in groups if (g, "torch-fused") in cell}
    versus = {k: r for k, r in cell.items() if k[0] in fused}  # (the table's speedup: of round-by-round ratios)
    _bars(top, groups, [n for n in names if n != "torch-fused"], versus,
          lambda r: r.get("speedup_vs_torch_fused") or fused[r["config"]]["median_ms"] / r["median_ms"],
          lambda r: (fused[r["config"]]["p20_ms"] / r["p80_ms"], fused[r["config"]]["p80_ms"] / r["p20_ms"]))
    top.axhline(1.0, color="black", linewidth=1)
    top.set_ylabel("speedup over torch AdamW(fused=True)\n(log scale; > 1 = faster)")
    top.set_title("speedup (error bars: p20–p80 of both timings)", fontsize=9)
    _bars(bottom, groups, names, cell)
    bottom.set_ylabel("ms per step (log scale)")
    bottom.set_title("absolute time (median, p20–p80)", fontsize=9)
    for ax in (top, bottom):
        _legend_beside(ax)
    return _finish(fig, path, f"Optimizer step, every configuration, {subset[0]['case'].split(' on ', 1)[-1]}",
                   subset[0]["hardware"], KEY + " · † unstable timing")


def plot_size(subset, path) -> str:
    cfgs = _names(subset, "config")
    fig, axes = plt.subplots(1, len(cfgs), figsize=(max(8.0, 6.5 * len(cfgs)), 4.6), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        part = [r for r in subset if r["config"] == cfg]
        for name in _names(part):
            pts = sorted(((r["numel"], r) for r in part if r["provider"] == name), key=lambda p: p[0])
            ys = [r["gbps"] for _, r in pts]
            err = [[y - r["bytes_per_step"] / (r["p80_ms"] * 1e6) for y, (_, r) in zip(ys, pts)],
                   [r["bytes_per_step"] / (r["p20_ms"] * 1e6) - y for y, (_, r) in zip(ys, pts)]]
            ax.errorbar([n for n, _ in pts], ys, yerr=err, marker=style(name)["marker"], markersize=4, capsize=2,
                        label=name, color=style(name)["color"])
        copy = sorted({(r["numel"], r["roofline_gbps"]) for r in part if r["provider"] == "torch-fused" and r["roofline_gbps"] != ""})
        if copy:
            ax.plot(*zip(*copy), linestyle="--", color="black", label="roofline of torch-fused's row (a += b over its working set)")
        ax.set(xscale="log", yscale="log", title=cfg, xlabel="parameters (4 equal tensors)",
               ylabel="effective GB/s (modeled bytes / median time)")
        _log_ticks(ax.yaxis)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7.5)
    return _finish(fig, path, "Optimizer step vs total size (error bars: p20–p80)", subset[0]["hardware"])


def plot_tensors(subset, path) -> str:
    cfgs = _names(subset, "config")
    fig, axes = plt.subplots(1, len(cfgs), figsize=(6 * len(cfgs) + 2.6, 4.6), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        part = {(f"{r['family']} {r['tensors']} tensors", r["provider"]): r for r in subset if r["config"] == cfg}
        groups = list(dict.fromkeys(g for g, _ in part))
        _bars(ax, groups, _names(subset), part)
        ax.set_xticks(range(len(groups)), [g.replace(" ", "\n", 1) for g in groups], fontsize=8)
        ax.set(title=cfg, ylabel="ms per step (log scale)")
    _legend_beside(axes[0][-1], *axes[0][:-1])
    total = subset[0]["case"].split(" on ", 1)[-1].split(" ")[1]
    return _finish(fig, path, f"Tensor count at the same total size ({total} params)", subset[0]["hardware"],
                   KEY + " · † unstable timing")


def plot_host(subset, path) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for name in _names(subset):
        look = style(name)
        for clip, fresh, dash in ((True, False, "-"), (False, False, ":"), (True, True, "--")):
            pts = sorted(((r["tensors"], r) for r in subset if r["provider"] == name and r["clip"] == clip
                          and r["config"].endswith("fresh-grads") == fresh), key=lambda p: p[0])
            if not pts:
                continue
            line = dict(linestyle=dash, marker=look["marker"], markersize=4, color=look["color"],
                        label=f"{name}, {'clip' if clip else 'noclip'}{', fresh grads' if fresh else ''}")
            left.errorbar([n for n, _ in pts], [r["median_ms"] for _, r in pts], capsize=2, **line,
                          yerr=[[r["median_ms"] - r["p20_ms"] for _, r in pts], [r["p80_ms"] - r["median_ms"] for _, r in pts]])
            ratio = [(n, r["host_ratio_vs_torch_fused"]) for n, r in pts if r["host_ratio_vs_torch_fused"] != ""]
            if ratio:
                right.plot(*zip(*ratio), **line)
    left.set(xscale="log", yscale="log", xlabel="tensors (16 elements each)", ylabel="host ms per step (log scale)",
             title="host time of step() + update()")
    right.axhline(1.0, color="black", linewidth=1)
    right.axhline(0.5, color="gray", linewidth=0.8, linestyle="--", label="0.5 (target without clipping)")
    right.set(xscale="log", yscale="log", xlabel="tensors (16 elements each)",
              ylabel="ampfused host time ÷ torch-fused's\n(log scale; < 1 = less host time)", title="ratio to stock, same clipping")
    for ax in (left, right):
        _log_ticks(ax.yaxis)
        _log_ticks(ax.xaxis, ticker.FixedLocator(sorted({r["tensors"] for r in subset})))
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7.5)
    return _finish(fig, path, "Host time per optimizer step on tiny tensors (device work ≈ 0)", subset[0]["hardware"])


def write_plots(rows, out) -> list[str]:
    """The plot of every sweep with ok rows: the paths written."""
    plots = {"configs": ("configs_speedup.png", plot_configs), "size": ("size_sweep.png", plot_size),
             "tensors": ("tensors_sweep.png", plot_tensors), "host": ("host_sweep.png", plot_host)}
    subsets = {sweep: [r for r in rows if sweep in r["sweeps"].split("+") and r["status"] == "ok"] for sweep in plots}
    return [plot(subsets[sweep], os.path.join(out, name)) for sweep, (name, plot) in plots.items() if subsets[sweep]]
