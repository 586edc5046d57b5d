"""PNG plots of the optimizer-step benchmark (matplotlib; ``report.write_all`` skips them without it).

Every bar or point carries the p20-p80 spread of its timing as an error bar; ratios are drawn on a
log axis around a 1.0 line, so 2x faster and 2x slower look alike; unstable timings get a dagger.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

KEY = ("case names: fp32 / bf16 / fp16 = param dtype · x1 / x4 = micro-batches accumulated in fp32 · "
       "scaled = GradScaler on · clip = global-norm clipping at 1.0, noclip = none")
COLORS = {"torch-fused": "#4c72b0", "torch-foreach": "#8c8c8c", "ampfused-cuda": "#dd8452", "ampfused-triton": "#c44e52",
          "ampfused-cpu": "#dd8452", "ampfused-reference": "#55a868"}


def _ok(rows, sweep):
    return [r for r in rows if sweep in r["sweeps"].split("+") and r["status"] == "ok"]


def _providers(rows):
    return list(dict.fromkeys(r["provider"] for r in rows))


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


def _legend_beside(ax):
    """The legend right of the axes, where it covers no bar (inside, "best" still lands on some)."""
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _bars(ax, groups, names, value, err, dagger):
    """Grouped bars on a log axis: value(group, name) -> float or None; err -> (lo, hi) absolute; dagger -> bool."""
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys, lo, hi, marks = [], [], [], [], []
        for g, group in enumerate(groups):
            y = value(group, name)
            if y is None:
                continue
            a, b = err(group, name)
            xs.append(g - 0.4 + width * (i + 0.5))
            ys.append(y)
            lo.append(max(y - a, 0))
            hi.append(max(b - y, 0))
            marks.append(dagger(group, name))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name, color=COLORS.get(name), error_kw={"linewidth": 0.8})
        for x, y, mark in zip(xs, ys, marks):
            if mark:
                ax.annotate("†", (x, y), xytext=(4, 1), textcoords="offset points", ha="left", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [g.replace("-", "\n") for g in groups], fontsize=7.5)
    ax.set_yscale("log")
    _log_ticks(ax.yaxis)
    ax.grid(axis="y", which="both", alpha=0.3)


def plot_configs(rows, path) -> bool:
    subset = _ok(rows, "configs")
    if not subset:
        return False
    cell = {(r["config"], r["provider"]): r for r in subset}
    groups = list(dict.fromkeys(r["config"] for r in subset))
    names = _providers(subset)
    others = [n for n in names if n != "torch-fused"]
    # stacked: one x axis of names; 2.6 inches more on the right for the legends
    fig, (left, right) = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(groups)) + 2.6, 8.5))

    def speedup(g, n):
        r, f = cell.get((g, n)), cell.get((g, "torch-fused"))
        return f["median_ms"] / r["median_ms"] if r and f else None

    def speedup_err(g, n):
        r, f = cell[(g, n)], cell[(g, "torch-fused")]
        return f["p20_ms"] / r["p80_ms"], f["p80_ms"] / r["p20_ms"]

    def unstable(g, n):
        return bool(cell.get((g, n), {}).get("unstable"))

    _bars(left, groups, others, speedup, speedup_err, unstable)
    left.axhline(1.0, color="black", linewidth=1)
    left.set_ylabel("speedup over torch AdamW(fused=True)\n(log scale; > 1 = faster)")
    left.set_title("speedup (error bars: p20–p80 of both timings)", fontsize=9)
    _legend_beside(left)
    _bars(right, groups, names, lambda g, n: cell[(g, n)]["median_ms"] if (g, n) in cell else None,
          lambda g, n: (cell[(g, n)]["p20_ms"], cell[(g, n)]["p80_ms"]), unstable)
    right.set_ylabel("ms per step (log scale)")
    right.set_title("absolute time (median, p20–p80)", fontsize=9)
    _legend_beside(right)
    shapes = subset[0]["case"].split(" on ", 1)[-1]
    _finish(fig, path, f"Optimizer step, every configuration, {shapes}", subset[0]["hardware"], KEY + " · † unstable timing")
    return True


def plot_size(rows, path) -> bool:
    subset = _ok(rows, "size")
    if not subset:
        return False
    cfgs = list(dict.fromkeys(r["config"] for r in subset))
    fig, axes = plt.subplots(1, len(cfgs), figsize=(6.5 * len(cfgs), 4.6), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        part = [r for r in subset if r["config"] == cfg]
        for name in _providers(part):
            pts = sorted((r["numel"], r) for r in part if r["provider"] == name)
            xs = [n for n, _ in pts]
            ys = [r["gbps"] for _, r in pts]
            lo = [r["gbps"] - r["bytes_per_step"] / (r["p80_ms"] * 1e6) for _, r in pts]
            hi = [r["bytes_per_step"] / (r["p20_ms"] * 1e6) - r["gbps"] for _, r in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", markersize=4, capsize=2, label=name, color=COLORS.get(name))
        copy = sorted({(r["numel"], r["roofline_gbps"]) for r in part if r["provider"] == "torch-fused" and r["roofline_gbps"] != ""})
        if copy:
            ax.plot(*zip(*copy), linestyle="--", color="black", label="roofline of torch-fused's row (a += b over its working set)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax.yaxis)
        ax.set(title=cfg, xlabel="parameters (4 equal tensors)", ylabel="effective GB/s (modeled bytes / median time)")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7.5)
    _finish(fig, path, "Optimizer step vs total size (error bars: p20–p80)", subset[0]["hardware"])
    return True


def plot_tensors(rows, path) -> bool:
    subset = _ok(rows, "tensors")
    if not subset:
        return False
    cfgs = list(dict.fromkeys(r["config"] for r in subset))
    fig, axes = plt.subplots(1, len(cfgs), figsize=(6 * len(cfgs), 4.6), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        part = {(f"{r['family']} {r['tensors']} tensors", r["provider"]): r for r in subset if r["config"] == cfg}
        groups = list(dict.fromkeys(g for g, _ in part))
        _bars(ax, groups, _providers(subset),
              lambda g, n: part[(g, n)]["median_ms"] if (g, n) in part else None,
              lambda g, n: (part[(g, n)]["p20_ms"], part[(g, n)]["p80_ms"]),
              lambda g, n: bool(part.get((g, n), {}).get("unstable")))
        ax.set_xticks(range(len(groups)), [g.replace(" ", "\n", 1) for g in groups], fontsize=8)
        ax.set(title=cfg, ylabel="ms per step (log scale)")
        ax.legend(fontsize=7.5)
    total = subset[0]["case"].split(" on ", 1)[-1].split(" ")[1]
    _finish(fig, path, f"Tensor count at the same total size ({total} params)", subset[0]["hardware"],
            KEY + " · † unstable timing")
    return True


def plot_host(rows, path) -> bool:
    subset = _ok(rows, "host")
    if not subset:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for name in _providers(subset):
        for clip, fresh, style in ((True, False, "-"), (False, False, ":"), (True, True, "--")):
            pts = sorted(((r["tensors"], r) for r in subset if r["provider"] == name and r["clip"] == clip
                          and r["config"].endswith("fresh-grads") == fresh), key=lambda x: x[0])
            if not pts:
                continue
            label = f"{name}, {'clip' if clip else 'noclip'}{', fresh grads' if fresh else ''}"
            xs = [n for n, _ in pts]
            left.errorbar(xs, [r["median_ms"] for _, r in pts],
                          yerr=[[r["median_ms"] - r["p20_ms"] for _, r in pts], [r["p80_ms"] - r["median_ms"] for _, r in pts]],
                          linestyle=style, marker="o", markersize=4, capsize=2, color=COLORS.get(name), label=label)
            ratio = [(n, r["host_ratio_vs_torch_fused"]) for n, r in pts if r["host_ratio_vs_torch_fused"] != ""]
            if ratio:
                right.plot(*zip(*ratio), linestyle=style, marker="o", markersize=4, color=COLORS.get(name), label=label)
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
    _finish(fig, path, "Host time per optimizer step on tiny tensors (device work ≈ 0)", subset[0]["hardware"])
    return True


def write_plots(rows, out) -> list[str]:
    paths = []
    for filename, plot in (("configs_speedup.png", plot_configs), ("size_sweep.png", plot_size),
                           ("tensors_sweep.png", plot_tensors), ("host_sweep.png", plot_host)):
        path = os.path.join(out, filename)
        if plot(rows, path):
            paths.append(path)
    return paths
