"""Bytes kept per parameter by every memory mode, measured, beside peers' documented figures: a PNG for the README.

Ours are measured from the tensors (a bf16 model of two 1024x1024 layers after one step: params,
``opt.state_bytes()``, and the bf16 gradients autograd keeps when the optimizer reads them directly),
the same quantity as the ``kept B/param`` column of ``python -m ampfused bench --sweeps memory``.
The peers' bars are not measured here: they are computed from their documented layouts or quoted
from their paper, and the plot hatches and labels them so.

    python benchmarks/memory_modes.py [--out docs/results/memory_modes.png]
"""
from __future__ import annotations

import argparse
import sys

import torch

import ampfused

# (label, master_weights, state_dtype, fp32_grad_accumulation)
MODES = [
    ("fp32 master + fp32 moments (default)", None, None, True),
    ("split16", "split16", None, True),
    ("split16 + bf16 moments", "split16", torch.bfloat16, True),
    ("split8 + bf16 moments", "split8", torch.bfloat16, True),
    ("split8 + int8 moments", "split8", "int8", True),
    ("split8 + int8, bf16 grads", "split8", "int8", False),
    ("no master + int8, bf16 grads", False, "int8", False),
    ("split16 + int4, bf16 grads", "split16", "int4", False),
    ("split8 + int4, bf16 grads", "split8", "int4", False),
    ("no master + int4, bf16 grads", False, "int4", False),
]
# Not measured here: from each project's documented layout (or its paper), for a bf16/AMP model.
PEERS = [
    ("torch AdamW, fp32 params under autocast\n(param 4 + grad 4 + moments 8)", 16.0),
    ("torch AdamW + hand-written fp32 masters\n(bf16 param 2 + master 4 + fp32 grad 4 + moments 8)", 18.0),
    ("bitsandbytes AdamW8bit, fp32 params\n(param 4 + grad 4 + 8-bit moments 2 + scales)", 10.0),
    ("FlashOptim AdamW, 16-bit grads\n(paper, arXiv 2602.23349)", 7.0),
    ("torchao AdamW4bit, bf16 params\n(param 2 + bf16 grad 2 + 4-bit moments 1 + fp32 scales per 128)", 2 + 2 + 1 + 2 * 4 / 128),
]


def measure(master_weights, state_dtype, accumulate: bool) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False)).to(torch.bfloat16)
    opt = ampfused.FusedAmpAdamW(model.parameters(), master_weights=master_weights, state_dtype=state_dtype,
                                 fp32_grad_accumulation=accumulate, backend="reference")
    model(torch.randn(8, 1024, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    kept = sum(p.numel() * p.element_size() for p in params) + opt.state_bytes()
    if not accumulate:  # the optimizer reads autograd's bf16 gradients: they are kept between steps too
        kept += sum(p.grad.numel() * p.grad.element_size() for p in params)
    return kept / numel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/memory_modes.py")
    parser.add_argument("--out", default="docs/results/memory_modes.png")
    args = parser.parse_args(argv)
    ours = [(label, measure(mw, sd, acc)) for label, mw, sd, acc in MODES]
    for label, value in ours:
        print(f"{value:6.2f} B/param  ampfused {label}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'ampfused[bench]'): no plot written", file=sys.stderr)
        return 0
    rows = [(f"ampfused: {label}", value, False) for label, value in ours] + [(label, value, True) for label, value in PEERS]
    rows.sort(key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.2))
    for y, (label, value, peer) in enumerate(rows):
        ax.barh(y, value, color="#bbbbbb" if peer else "#3b7dd8", hatch="//" if peer else None, edgecolor="black")
        ax.text(value + 0.2, y, f"{value:.2f}" if not peer else f"{value:.3g} (documented)", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.set_xlabel("bytes kept per parameter between steps (bf16/AMP model)")
    ax.set_title("Bytes kept per param: ampfused measured (blue), peers documented (hatched)", fontsize=9)
    ax.set_xlim(0, max(r[1] for r in rows) + 4)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
