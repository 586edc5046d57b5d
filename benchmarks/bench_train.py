"""End-to-end training benchmark: a small byte-level GPT on the Python standard library's source.

Run from a checkout: ``python benchmarks/bench_train.py`` (``--help`` for the options).
Every variant trains the same model from the same initial weights on the same batches, with
gradient accumulation over ``accum`` micro-batches and global-norm clipping at 1.0:

* ``fp32`` -- no autocast, fp32 params, ``torch.optim.AdamW(fused=True)``: the reference run;
* ``torch-amp`` -- autocast + ``torch.amp.GradScaler`` + ``unscale_`` + ``clip_grad_norm_`` +
  ``AdamW(fused=True)`` (the stock mixed-precision recipe);
* ``ampfused-fp32-params`` -- autocast + ``ampfused.GradScaler`` + ``FusedAmpAdamW(max_grad_norm=1)``;
* ``torch-<bf16|fp16>-params`` -- the model itself in the autocast dtype with the hand-written stock
  recipe: ``AdamW(fused=True)`` on fp32 master copies, grads added into their fp32 ``.grad`` after
  every backward, params copied back after the step (:class:`MasterWeights`);
* ``ampfused-<bf16|fp16>-params`` -- the same model precision, with fp32 master weights in the
  optimizer and fp32 gradient accumulation (``p.main_grad``), same scaler and optimizer;
* ``ampfused-<bf16|fp16>-params@<mode>`` -- the same in each memory mode of DESIGN §9
  (``train_modes.MODES``: split16, split8, bf16 and int8 moments, split8 + int8, no master with
  stochastic rounding, and int4 moments with each master; ``--modes`` picks some);
* the peers' low-bit AdamW where installed (:data:`PEERS`; ``--peers`` picks some): torchao's
  ``AdamW4bit`` and ``AdamW8bit`` on the bf16 model with their bf16 stochastic rounding, and
  bitsandbytes' ``AdamW8bit`` on fp32 params under autocast, each as its project documents it;
  clipping by ``clip_grad_norm_``. A peer that is not installed, or cannot step here, is skipped
  with a printed note.

The scaler is enabled only for fp16 (bf16 needs no loss scaling). Autocast dtype: bf16 on CPU,
fp16 on CUDA (``--amp-dtype`` to change).

[note: interleaved steps] All variants are built up front and trained one step each in turn, so
machine load hits every variant alike; a variant's p20-p80 spread of step times above
``--max-spread`` of the median marks its timing ``unstable``. Peak memory is measured while each
variant is built and runs its first two (untimed) steps alone.

Reported per variant: tokens/s (tokens per step / median step time), median step time, the optimizer step's share of it (time from the
end of the last backward to the end of ``zero_grad``, with the device synchronized at both ends),
peak memory, the bytes kept per param between steps (measured from the tensors after a step's last
backward: ``train_modes.kept_bytes``; for int8 and int4 moments also the share of params that has
them), the final training loss (mean of the last 10% of steps) and the held-out loss.
**Convergence parity**: the held-out loss of every mixed-precision variant (stock autocast +
GradScaler + fused AdamW, the FusedAmpAdamW variants and every memory mode) must be within
``--tolerance`` (1%) of the fp32 run's; ``split16`` must also be identical to fp32 masters, step by
step (``train_modes`` [note: split16 lockstep twin]). The script prints ``parity: PASS`` or
``parity: FAIL`` and exits non-zero on FAIL. The hand-written stock bf16/fp16-params recipe and
the peers are shown for comparison only ("info").
"""
from __future__ import annotations

import argparse
import csv
import importlib
import importlib.metadata
import os
import sys
import time

import torch

import ampfused
from ampfused import _compact
from ampfused.bench import cli, measure
from ampfused.bench.environment import Load, environment

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however this file is loaded
import train_modes  # noqa: E402
from train_model import GPT, GPTConfig, batches, stdlib_corpus  # noqa: E402

PRESETS = {
    # micro_batch sequences of `context` bytes, `accum` micro-batches per step
    "tiny": dict(model=GPTConfig(n_layer=1, n_head=2, d_model=32, context=32), micro_batch=4, accum=2, steps=40,
                 corpus=300_000, eval_batches=8, lr=3e-3),
    # at 120 steps the loss still falls fast and bf16 params sit ~3% off the
    # fp32 curve (stock and ampfused alike); by 400 steps they converge. Runs that differ by rounding
    # alone still end up to ~1% apart there, so the held-out set is 128 batches (32 KB): a smaller one
    # added its own noise to the 1% gate.
    "cpu": dict(model=GPTConfig(n_layer=2, n_head=4, d_model=64, context=64), micro_batch=4, accum=4, steps=400,
                corpus=2_000_000, eval_batches=128, lr=3e-3),
    "gpu": dict(model=GPTConfig(n_layer=6, n_head=8, d_model=512, context=256), micro_batch=16, accum=4, steps=400,
                corpus=30_000_000, eval_batches=32, lr=1e-3),
}
MAX_GRAD_NORM = 1.0
PROG = "python benchmarks/bench_train.py"
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv, prog=PROG):
    from ampfused import _backends

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("bench-results", "train"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: gpu or cpu by device")
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (the tests use it)")
    parser.add_argument("--steps", type=cli.positive_int, default=None)
    parser.add_argument("--amp-dtype", choices=sorted(AMP_DTYPES), default=None, help="default: bf16 on CPU, fp16 on CUDA")
    parser.add_argument("--backend", choices=_backends.BACKEND_NAMES, default=None, help="ampfused backend (default: auto)")
    parser.add_argument("--threads", type=cli.positive_int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--tolerance", type=cli.fraction, default=0.01, help="relative held-out loss difference allowed vs fp32")
    parser.add_argument("--max-spread", type=cli.fraction, default=0.15,
                        help="p20-p80 spread of step times over the median above which a timing is unstable")
    parser.add_argument("--modes", type=cli.choice_list(("none", *train_modes.MODES)), default=tuple(train_modes.MODES),
                        help="memory modes to train as variants of the low-precision-params model, or none (default: all; "
                             f"{', '.join(train_modes.BF16_ONLY)} need bf16)")
    parser.add_argument("--peers", type=cli.choice_list(("none", *PEERS)), default=tuple(PEERS),
                        help="peers' optimizers to train beside ours where installed, or none (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    return parser, parser.parse_args(argv)


class MasterWeights:
    """The hand-written stock recipe for low-precision params: torch AdamW on fp32 master copies,
    micro-batch grads accumulated into the masters' fp32 .grad after every backward."""

    def __init__(self, model):
        self.params = [p for p in model.parameters()]
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)

    def accumulate(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad.add_(p.grad)
            p.grad = None

    def write_back(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)


HYPERS = dict(betas=(0.9, 0.95), weight_decay=0.1)  # with the preset's lr, for every optimizer


def ampfused_kwargs(lr: float, backend) -> dict:
    return dict(lr=lr, **HYPERS, max_grad_norm=MAX_GRAD_NORM, backend=backend)


class Peer:
    """Another project's AdamW, built as its documentation builds it: ``package.optim.<cls>`` on the
    model in ``params`` precision ("bf16" or "fp32", the latter under autocast) with ``options``."""

    def __init__(self, package: str, distribution: str, cls: str, params: str, **options):
        self.package, self.distribution, self.cls, self.params, self.options = package, distribution, cls, params, options

    def make(self, params, lr: float):
        optim = importlib.import_module(f"{self.package}.optim")
        return getattr(optim, self.cls)(params, lr=lr, **HYPERS, **self.options)

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.package}.optim.{self.cls}({options}) on {self.params} params" + (" under autocast" if self.params == "fp32" else "")

    def version(self) -> str:
        return f"{self.distribution} {importlib.metadata.version(self.distribution)}"

    def problem(self, device, lowp: str) -> str:
        """Why this peer cannot train here ("" if it can): not installed, another model precision, or a
        failing step on a tensor big enough to get its low-bit state."""
        if self.params not in (lowp, "fp32"):
            return f"runs on {self.params} params, this run's are {lowp}"
        try:
            param = torch.nn.Parameter(torch.zeros(64, 128, device=device, dtype=AMP_DTYPES.get(self.params, torch.float32)))
            param.grad = torch.ones_like(param)
            self.make([param], 1e-3).step()
        except ImportError as exc:
            return f"{exc.name or self.package} is not installed (pip install {self.distribution})"
        except Exception as exc:  # noqa: BLE001 (whatever keeps it from stepping here is the reason it is skipped)
            return f"its step fails here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return ""


# variant name -> the peer it trains; torchao's 4/8-bit states on bf16 params are its documented memory recipe
PEERS = {
    "torchao-AdamW4bit-bf16-params": Peer("torchao", "torchao", "AdamW4bit", "bf16", bf16_stochastic_round=True),
    "torchao-AdamW8bit-bf16-params": Peer("torchao", "torchao", "AdamW8bit", "bf16", bf16_stochastic_round=True),
    "bnb-AdamW8bit-fp32-params": Peer("bitsandbytes", "bitsandbytes", "AdamW8bit", "fp32"),
}


def split16_twin(cfg: GPTConfig, device, amp_dtype, lr: float, backend, seed: int):
    """The fp32-master twin of the split16 run, on a model built as ``build`` builds it (same seed, same
    weights); made before the run's peak memory is measured, so that the peak is the run's own."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device).to(amp_dtype)
    return train_modes.Split16Twin(list(model.parameters()), **ampfused_kwargs(lr, backend))


def build(variant: str, cfg: GPTConfig, device, amp_dtype, lr: float, backend, seed: int):
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    base, mode = variant.partition(train_modes.SEP)[0], train_modes.mode_of(variant)
    if not base.endswith("fp32-params") and base not in ("fp32", "torch-amp"):
        model.to(amp_dtype)
    if base.startswith("torch-") and base != "torch-amp":
        model.master = MasterWeights(model)
    use_scaler = base != "fp32" and amp_dtype == torch.float16
    if base.startswith("ampfused-"):
        opt = ampfused.FusedAmpAdamW(model.parameters(), **ampfused_kwargs(lr, backend), **(train_modes.MODES[mode] if mode else {}))
        scaler = ampfused.GradScaler(device.type, enabled=use_scaler)
    elif base in PEERS:
        opt = PEERS[base].make(model.parameters(), lr)
        scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    else:
        master = getattr(model, "master", None)
        opt = torch.optim.AdamW(master.masters if master else model.parameters(), fused=True, lr=lr, **HYPERS)
        scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    return model, opt, scaler


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


UNTIMED = 2  # the first steps include lazy initialisation
KEPT_AT = 1  # the step whose kept bytes are measured: the state exists from the first step on


class Run:
    """One variant being trained: ``step(i)`` runs optimizer step ``i`` (its micro-batches included)."""

    def __init__(self, variant, preset, train_batches, device, amp_dtype, backend, seed, twin=None):
        self.model, self.opt, self.scaler = build(variant, preset["model"], device, amp_dtype, preset["lr"], backend, seed)
        self.variant, self.preset, self.batches, self.device, self.amp_dtype = variant, preset, train_batches, device, amp_dtype
        self.autocast = variant != "fp32"
        self.master = getattr(self.model, "master", None)
        self.twin = twin  # split16's fp32-master twin (train_modes [note: split16 lockstep twin])
        self.params = list(self.model.parameters())
        self.losses, self.step_times, self.opt_times = [], [], []
        self.peak = self.kept = float("nan")

    def step(self, step: int) -> None:
        model, opt, scaler, master, device = self.model, self.opt, self.scaler, self.master, self.device
        accum = self.preset["accum"]
        sync(device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for k in range(accum):
            x, y = self.batches[step * accum + k]
            with torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.autocast):
                loss = model(x, y) / accum
            scaler.scale(loss).backward()
            if master is not None:
                master.accumulate()
            total += loss.detach()
        sync(device)
        aside = time.perf_counter()  # the bench's own measurements stay out of the step time
        if step == KEPT_AT:
            self.kept = train_modes.kept_bytes(self.params, opt, master)
        if self.twin is not None:
            self.twin.step(self.params)
        sync(device)
        t1 = time.perf_counter()
        t0 += t1 - aside
        if not self.variant.startswith("ampfused-"):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(master.masters if master else model.parameters(), MAX_GRAD_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=master is None)
        if master is not None:
            master.write_back()
        sync(device)
        t2 = time.perf_counter()
        self.losses.append(total)
        self.step_times.append(t2 - t0)
        self.opt_times.append(t2 - t1)
        if self.twin is not None:
            self.twin.check(self.params, opt, step)

    def result(self, eval_batches, max_spread: float) -> dict:
        model, device, steps = self.model, self.device, self.preset["steps"]
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.autocast):
            eval_loss = sum(float(model(x, y)) for x, y in eval_batches) / len(eval_batches)
        losses = torch.stack(self.losses).float().cpu().tolist()
        timed = slice(min(UNTIMED, steps - 1), None)
        times_ms = [t * 1e3 for t in self.step_times[timed]]
        timing = measure.summarize(times_ms, measure.Budget(0, 0, min_samples=10, max_spread=max_spread))
        tokens_per_step = self.preset["accum"] * self.batches[0][0].numel()
        tail = max(1, steps // 10)
        numel = sum(p.numel() for p in self.params)
        return {
            "variant": self.variant,
            "mode": train_modes.mode_of(self.variant) or "",
            "backend": PEERS[self.variant].version() if self.variant in PEERS else getattr(self.opt, "backend", "torch"),
            "tokens_per_s": tokens_per_step / (timing.median_ms * 1e-3),  # median: robust to a busy machine
            "step_ms": timing.median_ms, "step_p20_ms": timing.p20_ms, "step_p80_ms": timing.p80_ms,
            "unstable": timing.unstable,
            "optimizer_share": sum(self.opt_times[timed]) / sum(self.step_times[timed]),
            "peak_mem_mb": self.peak / 2**20,
            "kept_bytes_per_param": self.kept / numel,
            "coded_fraction": (train_modes.coded_elements(self.params, self.opt) / numel
                               if train_modes.MODES.get(train_modes.mode_of(self.variant), {}).get("state_dtype") in ("int8", "int4")
                               else ""),
            "identity": self.twin.verdict() if self.twin is not None else "",
            "ties": self.twin.ties if self.twin is not None else "",
            "final_train_loss": sum(losses[-tail:]) / tail,
            "eval_loss": eval_loss,
            "losses": losses,
        }


def train_all(variants, preset, train_batches, eval_batches, device, amp_dtype, backend, seed, max_spread, progress):
    """Build every variant and run its untimed first steps alone (peak memory), then interleave the rest."""
    runs = []
    warm = min(UNTIMED, preset["steps"])
    for variant in variants:
        twin = None
        if train_modes.mode_of(variant) == "split16":
            twin = split16_twin(preset["model"], device, amp_dtype, preset["lr"], backend, seed)
        memory = measure.PeakMemory(device)
        memory.start()
        run = Run(variant, preset, train_batches, device, amp_dtype, backend, seed, twin)
        for step in range(warm):
            run.step(step)
        run.peak = memory.peak()
        runs.append(run)
    for step in range(warm, preset["steps"]):
        for run in runs:  # [note: interleaved steps]
            run.step(step)
        progress.update(1)
    results = []
    for run in runs:
        results.append(run.result(eval_batches, max_spread))
    return results


def _kept(r) -> str:
    """The kept-bytes cell; int8 and int4 rows say how many params have coded moments (small tensors keep fp32)."""
    if r["kept_bytes_per_param"] != r["kept_bytes_per_param"]:  # NaN: a run too short to measure it
        return "–"
    cell = f"{r['kept_bytes_per_param']:.2f}"
    codes = train_modes.MODES[r["mode"]]["state_dtype"] if r["coded_fraction"] != "" else ""
    return cell + (f" ({codes}: {100 * r['coded_fraction']:.0f}% of params)" if codes else "")


def notes(results, tolerance) -> list[str]:
    """The lines under the table: what parity means, and split16's identity check."""
    lines = [f"parity: held-out loss within {100 * tolerance:.1f}% of the fp32 run's; the hand-written stock "
             "low-precision-params recipe is shown for comparison (info), not gated. kept B/param: params, gradients "
             "and optimizer state between steps, measured from the tensors after a step's last backward."]
    if any(r["coded_fraction"] != "" for r in results):
        lines.append(f"int8 and int4 moments: tensors under {_compact.SMALL_TENSOR_NUMEL} elements keep fp32 moments; the "
                     "share of params with coded moments is in the kept B/param cell.")
    peers = [r["variant"] for r in results if r["variant"] in PEERS]
    if peers:
        lines.append("peers (info, not gated), each as its project documents it and clipped by clip_grad_norm_: " +
                     "; ".join(f"{v}: {PEERS[v].describe()}" for v in peers) +
                     ". Their kept B/param counts the codes, scales and maps of their quantized state.")
    by_name = {r["variant"]: r for r in results}
    for r in results:
        if r["identity"]:
            fp32_masters, apart = by_name.get(r["variant"].partition(train_modes.SEP)[0]), ""
            if fp32_masters and r["eval_loss"] == fp32_masters["eval_loss"]:
                apart = f"; its held-out loss equals {fp32_masters['variant']}'s exactly"
            elif fp32_masters:  # (train_modes [note: split16 lockstep twin])
                apart = (f"; its free-running held-out loss is {r['eval_loss'] - fp32_masters['eval_loss']:+.1e} from "
                         f"{fp32_masters['variant']}'s: a tie moves the master by 1 ulp, and the runs part once a "
                         "param rounds the other way")
            lines.append(f"{r['variant']}: {r['identity']}{apart}.")
    return lines


def write_outputs(results, env, out, tolerance) -> tuple[list[str], str]:
    """Write CSV and markdown, then the loss plot when matplotlib is there; (paths, why the plot is missing or "")."""
    from summary import train_summary

    os.makedirs(out, exist_ok=True)
    columns = ["variant", "mode", "backend", "tokens_per_s", "step_ms", "step_p20_ms", "step_p80_ms", "unstable",
               "optimizer_share", "peak_mem_mb", "kept_bytes_per_param", "coded_fraction", "final_train_loss", "eval_loss",
               "rel_diff_vs_fp32", "parity", "ties", "identity"]
    paths = [os.path.join(out, n) for n in ("train.csv", "train.md", "train_curves.csv", "summary.md")]
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns + list(env))
        writer.writeheader()
        for r in results:
            writer.writerow({**{c: (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c]) for c in columns}, **env})
    table = [
        "| variant | backend | tokens/s | step ms median (p20–p80) | timing | optimizer share | peak MiB | kept B/param | "
        "final train loss | held-out loss | vs fp32 | parity |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        timing = f"**unstable**: {r['unstable']}" if r["unstable"] else "stable"
        table.append(f"| {r['variant']} | {r['backend']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} "
                     f"({r['step_p20_ms']:.1f}–{r['step_p80_ms']:.1f}) | {timing} | {100 * r['optimizer_share']:.1f}% | "
                     f"{r['peak_mem_mb']:.0f} | {_kept(r)} | {r['final_train_loss']:.4f} | {r['eval_loss']:.4f} | "
                     f"{100 * r['rel_diff_vs_fp32']:+.2f}% | {r['parity']} |")
    table = "\n".join(table + [""] + notes(results, tolerance))
    with open(paths[1], "w") as f:
        f.write("# ampfused end-to-end training benchmark\n\n- " + "; ".join(f"{k}: {v}" for k, v in env.items()) +
                "\n\n" + table + "\n")
    with open(paths[2], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step"] + [r["variant"] for r in results])
        for step, row in enumerate(zip(*(r["losses"] for r in results))):
            writer.writerow([step] + [f"{v:.5f}" for v in row])
    with open(paths[3], "w") as f:
        f.write(train_summary(table, env) + "\n")
    try:
        path = plot_losses(results, env, out)
    except ImportError as exc:
        return paths, f"{exc.name or exc} is not installed; `{cli.BENCH_EXTRA_HINT}` for loss_curves.png"
    return paths + [path], ""


# ---------------------------------------------------------------- the loss plot (matplotlib)


def _smooth(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(results, env, out) -> str:
    """Loss curves on top; below, each run's loss minus the fp32 run's (smoothed), where overlapping curves
    part: the precision recipes in one panel, the memory modes (with their fp32-master run) in another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    window = max(1, len(results[0]["losses"]) // 40)
    modes = [r for r in results if r["mode"]]
    panels = 3 if modes else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8.5, 4 + 2.6 * (panels - 1)), sharex=True,
                             gridspec_kw={"height_ratios": [3] + [2] * (panels - 1)})
    top, recipes = axes[0], axes[1]
    reference = _smooth(results[0]["losses"], window)
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    fp32_masters = next((r["variant"] for r in modes), "").partition("@")[0]
    for i, r in enumerate(results):
        curve = _smooth(r["losses"], window)
        label = f"{r['variant']} (held-out {r['eval_loss']:.3f}, {100 * r['rel_diff_vs_fp32']:+.2f}%)"
        style = ":" if r["mode"] else ("-" if r["variant"].startswith("ampfused") or r["variant"] == "fp32" else "--")
        kwargs = dict(color=palette[i % len(palette)], linewidth=1.0 if r["mode"] else 1.3)
        top.plot(curve, style, label=label, **kwargs)
        diff = [c - f for c, f in zip(curve, reference)]
        if not r["mode"]:
            recipes.plot(diff, style, **kwargs)
        if modes and (r["mode"] or r["variant"] == fp32_masters):
            axes[2].plot(diff, "-" if r["mode"] else "--", **kwargs, label=r["mode"] or f"{r['variant']} (fp32 masters)")
    top.set(ylabel="training loss (nats/byte)", title="training loss" + (f", moving average of {window} steps" if window > 1 else ""))
    recipes.set(ylabel="loss − fp32 run's", title="difference to the fp32 run: precision recipes")
    if modes:
        axes[2].set(ylabel="loss − fp32 run's", title="difference to the fp32 run: memory modes (DESIGN §9)")
        axes[2].legend(fontsize=7, ncol=2)
    for ax in axes:
        ax.axhline(0.0, color="black", linewidth=0.8) if ax is not top else None
        ax.grid(alpha=0.3)
    axes[-1].set(xlabel="optimizer step")
    top.legend(fontsize=6.5, ncol=2 if modes else 1)
    fig.suptitle(f"Byte-level GPT on stdlib source ({env.get('model', '')})\n{env['hardware']}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out, "loss_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    parser, args = parse_args(argv, prog)
    device = cli.pick_device(parser, args.device)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    preset = dict(PRESETS["tiny" if args.tiny else (args.preset or ("gpu" if device.type == "cuda" else "cpu"))])
    if args.steps:
        preset["steps"] = args.steps
    amp_dtype = AMP_DTYPES[args.amp_dtype or ("fp16" if device.type == "cuda" else "bf16")]
    lowp = "bf16" if amp_dtype == torch.bfloat16 else "fp16"
    cfg = preset["model"]

    started = time.perf_counter()
    load = Load().start()
    data = stdlib_corpus(preset["corpus"])
    split = int(0.9 * len(data))
    micro = preset["micro_batch"]
    train_batches = batches(data[:split], micro, cfg.context, preset["steps"] * preset["accum"], args.seed, device)
    eval_batches = batches(data[split:], micro, cfg.context, preset["eval_batches"], args.seed + 1, device)
    env = environment(device, threads)
    env.update(model=f"{cfg.n_layer} layers, d={cfg.d_model}, context {cfg.context}, "
               f"{sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M params",
               batch=f"{preset['accum']} x {micro} x {cfg.context} bytes", steps=str(preset["steps"]),
               amp_dtype=lowp, corpus=f"{len(data) / 1e6:.1f} MB of stdlib .py",
               command=" ".join([prog, *argv]))
    print("bench_train: " + "; ".join(f"{k}: {v}" for k, v in env.items()))

    variants = ["fp32", "torch-amp", "ampfused-fp32-params", f"torch-{lowp}-params", f"ampfused-{lowp}-params"]
    modes = [m for m in args.modes if m != "none"]
    unfit = [m for m in modes if m not in train_modes.modes_for(lowp)]
    if unfit:
        print(f"bench_train: not trained with {lowp} params: {', '.join(unfit)} (bf16 only)", file=sys.stderr)
    variants += [f"ampfused-{lowp}-params{train_modes.SEP}{m}" for m in modes if m not in unfit]
    peers = []
    for name in (p for p in args.peers if p != "none"):
        problem = PEERS[name].problem(device, lowp)
        if problem:
            print(f"bench_train: peer {name} skipped: {problem}", file=sys.stderr)
        else:
            peers.append(name)
    variants += peers
    if peers:
        env["peers"] = ", ".join(dict.fromkeys(PEERS[p].version() for p in peers))
    progress = cli.Progress(max(0, preset["steps"] - UNTIMED), unit="step")
    try:
        results = train_all(variants, preset, train_batches, eval_batches, device, amp_dtype, args.backend, args.seed,
                            args.max_spread, progress)
    finally:
        progress.close()
    env.update(other_cores=f"{load.stop():.2f}", loadavg_after=load.loadavg_after,
               wall_s=f"{time.perf_counter() - started:.0f}")
    reference = results[0]["eval_loss"]
    ok = True
    for r in results:
        r["rel_diff_vs_fp32"] = (r["eval_loss"] - reference) / reference
        within = abs(r["rel_diff_vs_fp32"]) <= args.tolerance
        if r["variant"] == "fp32":
            r["parity"] = "reference"
        elif r["variant"] == f"torch-{lowp}-params" or r["variant"] in PEERS:
            # a hand-written stock recipe or a peer, shown for comparison: it tells bf16-param effects from ampfused's
            r["parity"] = "info (within)" if within else "info (outside)"
        elif r["identity"] and not r["identity"].startswith("identical"):
            r["parity"] = "FAIL (not identical to fp32 masters)"
        else:
            r["parity"] = "PASS" if within else "FAIL"
        ok &= not r["parity"].startswith("FAIL")
    paths, plot_problem = write_outputs(results, env, args.out, args.tolerance)
    with open(paths[1]) as f:
        print(f.read())
    print("wrote " + ", ".join(paths))
    if plot_problem:
        print(f"plot not written: {plot_problem}", file=sys.stderr)
    print(f"parity: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
