"""Which 4-bit grids and block size for int4 moments: a measurement study (issue 35).

    python benchmarks/int4_grids.py [--seeds 0,1] [--pairs M:V,...] [--pair-seeds 2,3,4] [--out DIR]

Two measurements, on the training benchmark's CPU model and data (``bench_train.py``'s "cpu"
preset: 2 layers, d=64, 400 steps of 4 x 4 x 64 bytes, lr 3e-3, global-norm clip 1.0, 128 held-out
batches; ``train_model``):

* **training**: fp32 params with ``torch.optim.AdamW`` (foreach, the benchmark's betas and weight
  decay); after every step each state moment that ampfused would keep in int4
  (``_contract.encoding_for``) is replaced by its int4 round trip, ``_compact.quantize4`` then
  ``_compact.dequantize4`` with the grid under study ("fake quant": the fused step computes the
  update from the fp32 moments and stores exactly that round trip). Held-out loss against the fp32
  run of the same seed (the seed sets the initial weights and the batch order, as in bench_train).
* **update error**: fp32 ``exp_avg`` / ``exp_avg_sq`` recorded from the fp32 run (seed 0) at
  ``RECORD_STEPS``; per element, the AdamW update direction ``m_hat / (sqrt(v_hat) + eps)`` (bias
  corrected, as torch computes it) with decoded against exact moments: median and p99 of the
  relative error, the share of elements whose update is over 2x or under 0.5x the exact one (a sign
  flip or a zero counts as under), and the largest ``|update| / |exact update|`` (the zero-point
  check: a v that decodes to 0 would make it ~1/eps), and the relative L2 error of the whole update.
* **dead zone**: the share of int4 elements whose stored exp_avg is 0 after a training run's last
  step (they move by weight decay alone).
* **noise floor**: the noisy linear regression of ``tests/compact/test_compact_training.py`` (a bf16
  64 x 80 weight, 200 steps of the specification's step), which trains to its noise floor: the final
  loss with each ``exp_avg`` grid (e3m1 for sqrt(v)) against fp32 moments, with an fp32 master and
  with no master + stochastic rounding. Near the optimum every element of a row is noise of one
  size, so the grid's steps between 1/8 and 1 of the block maximum decide.

Block layouts: ``rows`` is the real one ([note: blocks in rows]: ``SCALE_BLOCK`` elements within
each dim-0 row; on this d=64 model most rows are 64 elements, so its real blocks are its rows);
``flat128`` / ``flat256`` block the flattened tensor instead (reshaped to ``(-1, B)``, zero padded,
each row one block), which is what blocks of B elements do on a model whose rows are multiples of B.

Grids are 16 ascending levels in units of the block scale; their 15 bounds are the fp32 midpoints,
as ``_contract`` derives them. ``exp_avg`` levels are signed (scale max |m|); ``exp_avg_sq`` levels
are in the sqrt domain (scale max sqrt(v), decoded value squared). The results are in
docs/results/int4-grids.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

from ampfused import _compact, _contract

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however this file is loaded
from bench_train import HYPERS, MAX_GRAD_NORM, PRESETS  # noqa: E402
from train_model import GPT, batches, stdlib_corpus  # noqa: E402

RECORD_STEPS = (50, 200, 400)
EPS = 1e-8  # torch.optim.AdamW's default, which the benchmark keeps


def _fp32(levels) -> tuple[float, ...]:
    return tuple(torch.tensor(levels, dtype=torch.float64).float().tolist())


# exp_avg grids (signed, scale max |m|)
SIGNED_GRIDS = {
    # the dynamic-exponent map of torchao / bitsandbytes (the first provisional table)
    "de": _fp32(sorted([-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                        0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0])),
    # sign + power of two: +-2^-k for k = 0..6, and zero twice (the 16th code)
    "log": _fp32(sorted([s * 2.0 ** -k for s in (-1, 1) for k in range(7)] + [0.0, 0.0])),
    # E2M1 (OCP FP4) magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} / 6, signed (zero twice)
    "fp4": _fp32(sorted(s * f / 6 for s in (-1, 1) for f in (0, 0.5, 1, 1.5, 2, 3, 4, 6))),
    # E2M1 with 1 on top: +-{1, .75, .5, .375, .25, .1875, .125} (2^-e and 0.75 * 2^-e), zero twice
    "e2m1": _fp32(sorted([s * x for s in (-1, 1) for x in (1, .75, .5, .375, .25, .1875, .125)] + [0.0, 0.0])),
    # linear: +-k/7, and zero twice
    "linear": _fp32(sorted([k / 7 for k in range(-7, 8)] + [0.0])),
    # E2M1 with 1 on top widened by two powers of two: +-{1, .75, .5, .375, .25, .125, 1/16}, zero twice (the contract's)
    "e2m1-wide": _contract.INT4_SIGNED_LEVELS,
}
# sqrt(exp_avg_sq) grids (non-negative, scale max sqrt(v))
SQRT_GRIDS = {
    # E3M1 without zero: 2^-e and 0.75 * 2^-e, e = 0..7 (the contract's provisional table)
    "e3m1": _contract.INT4_SQRT_LEVELS,
    # powers of two: 2^-k, k = 15..0
    "log2": _fp32([2.0 ** -k for k in range(15, -1, -1)]),
    # torchao's 4-bit v map: v levels (k + 1) / 16 of the block's max v, here in the sqrt domain
    "linear-v": _fp32([math.sqrt((k + 1) / 16) for k in range(16)]),
}
GRIDS = {"signed": SIGNED_GRIDS, "sqrt": SQRT_GRIDS}
LAYOUTS = ("rows", "flat128", "flat256")


def bounds_of(levels) -> tuple[float, ...]:
    """The 15 decision bounds of 16 ascending levels: fp32 midpoints, as ``_contract`` derives them."""
    return _fp32([(a + b) / 2 for a, b in zip(levels, levels[1:])])


def round_trip(x: torch.Tensor, kind: str, grid: str, layout: str) -> torch.Tensor:
    """``x`` through int4 codes of ``GRIDS[kind][grid]`` and back, blocked as ``layout`` says."""
    levels = GRIDS[kind][grid]
    if layout == "rows":
        blocked = x
    else:
        block = int(layout.removeprefix("flat"))
        flat = x.reshape(-1)
        blocked = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)
    codes, scales = _compact.quantize4(blocked, kind, bounds=bounds_of(levels))
    out = _compact.dequantize4(codes, scales, kind, levels=levels)
    return out.reshape(-1)[: x.numel()].view_as(x) if layout != "rows" else out


def int4_params(model) -> list[torch.Tensor]:
    """The params whose moments ampfused keeps in int4 (``_contract.encoding_for``)."""
    return [p for p in model.parameters() if _contract.encoding_for(p, "fp32", "int4")[1] == "int4"]


def train(preset, data, seed: int, m_grid=None, v_grid=None, layout="flat256", record=None) -> dict:
    """One bench_train-like fp32 run; exp_avg / exp_avg_sq of the int4 params fake-quantized with
    ``m_grid`` / ``v_grid`` (None: kept fp32) after every step. ``record``: a dict filled with the
    fp32 moments at ``RECORD_STEPS``."""
    cfg, accum = preset["model"], preset["accum"]
    split = int(0.9 * len(data))
    train_b = batches(data[:split], preset["micro_batch"], cfg.context, preset["steps"] * accum, seed, "cpu")
    eval_b = batches(data[split:], preset["micro_batch"], cfg.context, preset["eval_batches"], seed + 1, "cpu")
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=preset["lr"], foreach=True, **HYPERS)
    quantized = int4_params(model)
    losses = []
    for step in range(preset["steps"]):
        total = 0.0
        for k in range(accum):
            x, y = train_b[step * accum + k]
            loss = model(x, y) / accum
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        with torch.no_grad():
            for p in quantized:
                state = opt.state[p]
                if m_grid is not None:
                    state["exp_avg"].copy_(round_trip(state["exp_avg"], "signed", m_grid, layout))
                if v_grid is not None:
                    state["exp_avg_sq"].copy_(round_trip(state["exp_avg_sq"], "sqrt", v_grid, layout))
        if record is not None and (step + 1 in RECORD_STEPS or step + 1 == preset["steps"]):
            record[step + 1] = [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone(),
                                 float(opt.state[p]["step"])) for p in quantized]
    model.eval()
    with torch.no_grad():
        eval_loss = sum(float(model(x, y)) for x, y in eval_b) / len(eval_b)
    tail = max(1, len(losses) // 10)
    # exp_avg's dead zone: elements whose stored m is 0 after the last step (they move by weight decay only)
    m_zero = sum(int((opt.state[p]["exp_avg"] == 0).sum()) for p in quantized) / sum(p.numel() for p in quantized)
    return {"eval_loss": eval_loss, "train_loss": sum(losses[-tail:]) / tail, "m_zero_share": m_zero}


def direction(m, v, step, beta1, beta2):
    """AdamW's update direction as torch computes it: (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)."""
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    return (m / bc1) / (v.sqrt() / math.sqrt(bc2) + EPS)


def update_error(recorded, m_grid, v_grid, layout) -> dict:
    """Per-element error of the update direction with decoded moments, over all recorded steps' int4 tensors."""
    beta1, beta2 = HYPERS["betas"]
    exact, approx = [], []
    for tensors in recorded.values():
        for m, v, step in tensors:
            mq = m if m_grid is None else round_trip(m, "signed", m_grid, layout)
            vq = v if v_grid is None else round_trip(v, "sqrt", v_grid, layout)
            exact.append(direction(m, v, step, beta1, beta2).double().reshape(-1))
            approx.append(direction(mq, vq, step, beta1, beta2).double().reshape(-1))
    u, uq = torch.cat(exact), torch.cat(approx)
    rel = ((uq - u).abs() / u.abs()).float()
    ratio = uq / u
    return {"median_rel": float(rel.median()), "p99_rel": float(torch.quantile(rel, 0.99)),
            "over_2x": float((ratio > 2).double().mean()), "under_half": float((ratio < 0.5).double().mean()),
            "max_ratio": float(ratio.abs().max()), "l2_rel": float((uq - u).norm() / u.norm()), "elements": u.numel()}


PROVISIONAL = ("de", "e3m1")  # the contract's grids when this study ran


def configs(pairs) -> list[tuple[str | None, str | None, str]]:
    """(m grid, v grid, layout) of every quantized run: one moment at a time (the other fp32) with
    blocks of 256, then each of ``pairs`` and the provisional pair under every layout."""
    rows = [(g, None, "flat256") for g in SIGNED_GRIDS] + [(None, g, "flat256") for g in SQRT_GRIDS]
    for m, v in [PROVISIONAL] + [p for p in pairs if p != PROVISIONAL]:
        rows += [(m, v, layout) for layout in ("flat256", "flat128", "rows")]
    return rows


def noise_floor(m_grid, master_weights: str, stochastic: bool, steps: int = 200) -> float:
    """Final loss of the noise-floor regression with ``exp_avg`` on ``m_grid`` (None: fp32 moments)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 80, generator=g)
    y = x @ (torch.randn(64, 80, generator=g) / 8).T + 0.05 * torch.randn(512, 64, generator=g)
    params = [(torch.randn(64, 80, generator=g) / 8).bfloat16(), torch.zeros(64, dtype=torch.bfloat16)]
    grids = dict(_compact.INT4_GRIDS)
    if m_grid is not None:  # the specification's step reads its grids from INT4_GRIDS
        _compact.INT4_GRIDS["signed"] = (SIGNED_GRIDS[m_grid], bounds_of(SIGNED_GRIDS[m_grid]))
    try:
        states = [_compact.init_state(p, master_weights, torch.float32 if m_grid is None else "int4") for p in params]
        torch.manual_seed(0)

        def loss_and_grads():
            w, b = (p.float().requires_grad_() for p in params)
            loss = ((x @ w.T + b - y) ** 2).mean()
            loss.backward()
            return loss.detach(), (w.grad, b.grad)

        for _ in range(steps):
            _, grads = loss_and_grads()
            for p, grad, st in zip(params, grads, states):
                _compact.compact_adamw_step_(p, grad, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                                             stochastic_rounding=stochastic)
        return loss_and_grads()[0].item()
    finally:
        _compact.INT4_GRIDS.update(grids)


def label(m, v, layout) -> str:
    return f"m={m or 'fp32'} v={v or 'fp32'} {layout}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1", help="seeds of every training run")
    parser.add_argument("--pairs", default="log:e3m1,fp4:e3m1",
                        help="M:V,... grid pairs trained under every layout, beside the provisional de:e3m1")
    parser.add_argument("--pair-seeds", default="2,3,4",
                        help="more seeds for the fp32 run and the pairs with blocks of 256 only (empty: none)")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's 400 (smoke runs)")
    parser.add_argument("--update-only", action="store_true", help="the fp32 run and the update error, no int4 training")
    parser.add_argument("--out", default=os.path.join("bench-results", "int4-grids"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    preset = dict(PRESETS["cpu"])
    if args.steps:
        preset["steps"] = args.steps
    seeds = [int(s) for s in args.seeds.split(",")]
    pair_seeds = [int(s) for s in args.pair_seeds.split(",") if s]
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",") if p]
    os.makedirs(args.out, exist_ok=True)
    data = stdlib_corpus(preset["corpus"])
    print(f"int4_grids: torch {torch.__version__}, python {platform.python_version()}, {platform.processor() or platform.machine()}, "
          f"1 thread, steps {preset['steps']}, seeds {seeds} (+{pair_seeds} for the pairs), pairs {pairs}", flush=True)
    for kind, grids in GRIDS.items():
        for name, levels in grids.items():
            print(f"  {kind} {name}: {[float(f'{x:.6g}') for x in levels]}")

    results = {"steps": preset["steps"], "seeds": seeds, "pair_seeds": pair_seeds, "grids": GRIDS, "train": [], "update": []}
    path = os.path.join(args.out, "results.json")
    done = []  # runs of an earlier call with the same steps are reused (other --pairs add their rows only)
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        done = earlier["train"] if earlier["steps"] == preset["steps"] else []

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    def run(seed, m, v, layout, record=None):
        for r in done:
            if record is None and (r["seed"], r["m"], r["v"], r["layout"]) == (seed, m, v, layout):
                results["train"].append(r)
                return
        t0 = time.perf_counter()
        r = train(preset, data, seed, m, v, layout, record)
        r.update(seed=seed, m=m, v=v, layout=layout, seconds=time.perf_counter() - t0)
        results["train"].append(r)
        print(f"seed {seed} {label(m, v, layout)}: eval {r['eval_loss']:.4f} train {r['train_loss']:.4f} "
              f"({r['seconds']:.0f} s)", flush=True)
        save()

    recorded = {}
    run(seeds[0], None, None, "rows", recorded)  # the fp32 run, whose moments the update error uses
    update_rows = configs(pairs)
    for m in SIGNED_GRIDS:  # every pair with blocks of 256, for the update error only
        for v in SQRT_GRIDS:
            if (m, v, "flat256") not in update_rows:
                update_rows.append((m, v, "flat256"))
    for m, v, layout in update_rows:
        e = update_error(recorded, m, v, layout)
        e.update(m=m, v=v, layout=layout)
        results["update"].append(e)
        print(f"update {label(m, v, layout)}: median {e['median_rel']:.4f} p99 {e['p99_rel']:.3f} "
              f">2x {e['over_2x']:.2e} <0.5x {e['under_half']:.2e} max ratio {e['max_ratio']:.3f} "
              f"L2 {e['l2_rel']:.4f}", flush=True)
    save()
    if not args.update_only:
        for seed in seeds:
            if seed != seeds[0]:
                run(seed, None, None, "rows")
            for m, v, layout in configs(pairs):
                run(seed, m, v, layout)
        for seed in pair_seeds:
            run(seed, None, None, "rows")
            for m, v in [PROVISIONAL] + [p for p in pairs if p != PROVISIONAL]:
                run(seed, m, v, "flat256")
    for master_weights, stochastic in (("fp32", False), ("none", True)):
        base = noise_floor(None, master_weights, stochastic)
        for m in SIGNED_GRIDS:
            loss = noise_floor(m, master_weights, stochastic)
            results.setdefault("noise_floor", []).append(dict(m=m, master=master_weights, stochastic=stochastic,
                                                              loss=loss, fp32_moments=base))
    save()
    print_tables(results)


def print_tables(results) -> None:
    """Markdown tables: held-out loss against the fp32 run of the same seed, and the update error."""
    base = {r["seed"]: r["eval_loss"] for r in results["train"] if r["m"] is None and r["v"] is None}
    seeds = results["seeds"] + results["pair_seeds"]
    print("\n| exp_avg | sqrt(exp_avg_sq) | blocks | " + " | ".join(f"seed {s}" for s in seeds)
          + f" | mean of {len(results['seeds'])} | mean of all | m = 0 at the end (seed {seeds[0]}) |")
    print("|---|---|---|" + "---:|" * (len(seeds) + 3))
    print("| fp32 | fp32 | - | " + " | ".join(f"{base[s]:.4f}" if s in base else "" for s in seeds) + " | | | |")
    keys = []
    for r in results["train"]:
        if (r["m"], r["v"], r["layout"]) not in keys and (r["m"] is not None or r["v"] is not None):
            keys.append((r["m"], r["v"], r["layout"]))
    zero = {(r["m"], r["v"], r["layout"]): f"{100 * r['m_zero_share']:.1f}%" for r in results["train"]
            if r["seed"] == seeds[0] and "m_zero_share" in r}
    for m, v, layout in keys:
        d = {x["seed"]: 100 * (x["eval_loss"] / base[x["seed"]] - 1) for x in results["train"]
             if (x["m"], x["v"], x["layout"]) == (m, v, layout)}
        first = [d[s] for s in results["seeds"] if s in d]
        print(f"| {m or 'fp32'} | {v or 'fp32'} | {layout} | " + " | ".join(f"{d[s]:+.2f}%" if s in d else "" for s in seeds)
              + f" | {sum(first) / len(first):+.2f}% | {sum(d.values()) / len(d):+.2f}% | {zero.get((m, v, layout), '')} |")
    print("\n| exp_avg | sqrt(exp_avg_sq) | blocks | median rel. err | p99 rel. err | > 2x | < 0.5x | max ratio | L2 rel. err |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for e in results["update"]:
        print(f"| {e['m'] or 'fp32'} | {e['v'] or 'fp32'} | {e['layout']} | {e['median_rel']:.3f} | {e['p99_rel']:.3f} | "
              f"{100 * e['over_2x']:.2f}% | {100 * e['under_half']:.2f}% | {e['max_ratio']:.2f} | {e['l2_rel']:.3f} |")
    rows = results.get("noise_floor", [])
    print("\n| exp_avg (sqrt(v): e3m1) | fp32 master | no master + SR |")
    print("|---|---:|---:|")
    for m in dict.fromkeys(r["m"] for r in rows):
        cells = [f"{100 * (r['loss'] / r['fp32_moments'] - 1):+.2f}%" for r in rows if r["m"] == m]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
