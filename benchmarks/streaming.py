"""Large tensors: how fast each pass streams, and the whole step against torch fused.

From a checkout: ``python benchmarks/streaming.py`` (defaults: 50M fp32 params in 4 tensors, 1 and 2 threads):

1. **passes**: every pass alone against the ``a += b`` stream, as ``python benchmarks/passes.py``
   measures them (its rows and tables).
2. **steps**: the whole ``step()`` with fresh gradients each step (new ``p.grad`` tensors, written
   just before the step outside the timing, as backward leaves them; ``p.grad = None`` after it):
   torch fused vs ``FusedAmpAdamW(skip_nonfinite=False)`` (*plain*, one pass) and the default
   (*guard*, stats + update), and ``clip_grad_norm_`` + torch fused vs ``max_grad_norm=1.0``
   (*clip*), and the same with a GradScaler (torch's ``unscale_`` before the clip; ampfused with and
   without ``keep_scaled_grads``). One step of every provider per round, the order rotated each round; then every
   provider's params and moments are checked against its torch counterpart.

Writes ``streaming.csv`` and ``streaming.md`` to ``--out`` and prints the tables with the load of
the machine (load average, and the cores other processes kept busy: ``environment.Load``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import ampfused
from ampfused.bench import cli, measure
from ampfused.bench.configs import BETAS, EPS, GRAD_STD, LR, MAX_GRAD_NORM, WEIGHT_DECAY, human
from ampfused.bench.environment import Load, environment, loadavg
from ampfused.bench.report import fmt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, however this file is loaded
import passes  # noqa: E402
from passes import make_row, ms_cell, pass_rows, pass_table  # noqa: E402

# ---------------------------------------------------------------- 2. steps

STEP_PROVIDERS = {  # name: (baseline it is compared with, modeled bytes per element)
    "torch-fused": ("", 28),
    "ampfused-plain": ("torch-fused", 28),
    "ampfused-guard": ("torch-fused", 32),
    "torch-fused+clip": ("", 40),
    "ampfused+clip": ("torch-fused+clip", 32),
    # the GradScaler recipe: torch unscales in place (8) before clip_grad_norm_ (12)
    # and the fused step (28); ampfused reads g once for the stats (4) and writes it back unscaled
    # (DESIGN §2.7: 4) in the update, or not with keep_scaled_grads
    "torch-fused+scaler+clip": ("", 48),
    "ampfused+scaler+clip": ("torch-fused+scaler+clip", 36),
    "ampfused+scaler+clip+keep_scaled_grads": ("torch-fused+scaler+clip", 32),
}
LOSS_SCALE = 1024.0  # the scaled providers' gradients are the plain ones times this


class StepProvider:
    def __init__(self, name: str, init: list[torch.Tensor]):
        self.name = name
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        hypers = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        self.scaled = "+scaler" in name
        scale = dict(init_scale=LOSS_SCALE, growth_interval=10**6)  # the scale stays put while timed
        if name.startswith("torch"):
            self.opt = torch.optim.AdamW(self.params, fused=True, **hypers)
            self.scaler = torch.amp.GradScaler("cpu", **scale) if self.scaled else None
        else:
            self.opt = ampfused.FusedAmpAdamW(self.params, skip_nonfinite=name != "ampfused-plain", backend="cpu",
                                              max_grad_norm=MAX_GRAD_NORM if "+clip" in name else None,
                                              keep_scaled_grads=name.endswith("+keep_scaled_grads"), **hypers)
            self.scaler = ampfused.GradScaler("cpu", **scale) if self.scaled else None
        self.clip = name.startswith("torch") and "+clip" in name
        if self.scaler is not None:
            self.scaler.scale(torch.ones(()))  # as a loop's scaler.scale(loss): builds the scale tensor

    def step(self) -> None:
        if self.scaler is not None and self.clip:
            self.scaler.unscale_(self.opt)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM, foreach=True)
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()

    def moments(self, p):
        return self.opt.state[p]["exp_avg"], self.opt.state[p]["exp_avg_sq"]


def step_rows(numel: int, tensors: int, rounds: int, env: dict, clock=time.perf_counter) -> list[dict]:
    """Part 2 at the current thread count (CPU): one row per provider."""
    sizes = [numel // tensors] * tensors
    sizes[0] += numel - sum(sizes)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen).mul_(0.02) for n in sizes]
    grads = [torch.randn(n, generator=gen).mul_(GRAD_STD) for n in sizes]  # norm >> 1: clipping engages
    scaled_grads = [g * LOSS_SCALE for g in grads]  # exact: a power of two
    providers = [StepProvider(name, init) for name in STEP_PROVIDERS]
    del init
    samples: dict[str, list[float]] = {p.name: [] for p in providers}
    load = Load().start()
    for r in range(rounds + 1):  # round 0 builds the lazy state and is not timed
        k = r % len(providers)
        for provider in providers[k:] + providers[:k]:
            for p, g in zip(provider.params, scaled_grads if provider.scaled else grads):
                p.grad = g.clone()  # fresh: new pages, written just now (as backward leaves them)
            start = clock()
            provider.step()
            elapsed = clock() - start
            for p in provider.params:
                p.grad = None
            if r:
                samples[provider.name].append(elapsed * 1e3)
    other = load.stop()
    by_name = {p.name: p for p in providers}
    for p in providers:
        baseline = STEP_PROVIDERS[p.name][0]
        if baseline:
            _check_same(by_name[baseline], p)
    budget = measure.Budget(0.0, 0.0, min_samples=min(rounds, 10))
    timings = {name: measure.summarize(ts, budget) for name, ts in samples.items()}
    rows = []
    for name, t in timings.items():
        baseline, nbytes = STEP_PROVIDERS[name]
        row = make_row(env, "steps", numel, tensors, name, nbytes, t, load, other)
        if baseline:
            row.update(baseline=baseline, speedup_vs_baseline=timings[baseline].median_ms / t.median_ms)
        rows.append(row)
    return rows


def _check_same(reference: StepProvider, other: StepProvider) -> None:
    """The same steps on the same gradients: params and moments agree with stock torch's.

    With clipping the two sides scale the gradient by different
    coefficients: ``clip_grad_norm_``'s float ``_foreach_norm`` is off by up to ~5e-4 (relative) at
    12.5M elements a tensor (torch 2.13, CPU), ampfused sums in double blocks. Moments scale with the
    coefficient (rtol 1e-3); the params move by lr * m/(sqrt(v) + eps), where only eps keeps the
    coefficient from cancelling, so they stay within 2e-6 a step."""
    clip = "+clip" in other.name
    steps = int(reference.opt.state[reference.params[0]]["step"])
    p_tol = dict(rtol=1e-5, atol=2e-6 * steps) if clip else dict(rtol=1e-5, atol=1e-7)
    m_tol = dict(rtol=1e-3, atol=1e-9) if clip else dict(rtol=1e-5, atol=1e-9)
    for p_ref, p in zip(reference.params, other.params):
        torch.testing.assert_close(p, p_ref, **p_tol, msg=lambda m: f"{other.name} params differ: {m}")
        for got, want in zip(other.moments(p), reference.moments(p_ref)):
            torch.testing.assert_close(got, want, **m_tol, msg=lambda m: f"{other.name} moments differ: {m}")


# ---------------------------------------------------------------- output


def cpu_clock(threads: int):
    """[note: CPU-time clock] On a machine other jobs keep busy, wall time counts the time a step waited
    for a core. This clock counts only the CPU time of this process's threads, divided by the thread
    count: exact for one thread (everything runs on the caller). At more threads only a rough guide,
    wrong either way: a worker spinning at a barrier for a preempted partner is counted, a worker
    asleep while a serial part runs on one thread (torch's _foreach_norm: 2x "faster") is not."""
    if threads == 1:
        return time.thread_time
    return lambda: time.process_time() / threads


def step_table(rows: list[dict]) -> str:
    lines = ["| threads | step | B/elem | ms median (p20–p80) | GB/s | × baseline | timing | load avg | other cores |",
             "|---:|---|---:|---|---:|---|---|---|---:|"]
    for r in rows:
        ratio = f"{r['speedup_vs_baseline']:.2f} × {r['baseline']}" if r["baseline"] else "(baseline)"
        lines.append(f"| {r['threads']} | {r['name']} | {r['bytes_per_elem']} | {ms_cell(r)} | {fmt(r['gbps'], '.1f')} | "
                     f"{ratio} | {r['unstable'] or 'stable'} | {r['loadavg_before']} | {fmt(r['other_cores'], '.2f')} |")
    return "\n".join(lines)


def markdown(rows: list[dict], env: dict) -> str:
    """streaming.md: the passes' table (as benchmarks/passes.py writes it), the clock, the steps' table."""
    parts = passes.markdown(rows, "Large tensors: passes and steps", env).split("\n")
    parts.insert(4, f"- clock: {env.get('clock', 'wall')} (wall: perf_counter; cpu: CPU time per thread, "
                 "benchmarks/streaming.py [note: CPU-time clock])")  # after the versions line
    steps = [r for r in rows if r["section"] == "steps"]
    if steps:
        parts += [f"## Steps at {human(steps[0]['numel'])} params in {steps[0]['tensors']} tensors, fresh gradients "
                  "each step", "", step_table(steps), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/streaming.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=cli.parse_size, default=50_000_000, help="fp32 params in all (default 50M)")
    parser.add_argument("--tensors", type=cli.positive_int, default=4, help="tensors they are split into (default 4)")
    parser.add_argument("--threads", type=cli.size_list, default=(1, 2), help="thread counts (default 1,2)")
    parser.add_argument("--rounds", type=cli.positive_int, default=15, help="timed steps per provider (default 15)")
    parser.add_argument("--parts", type=cli.choice_list(("passes", "steps")), default=("passes", "steps"))
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: the CPU time of this process per thread (exact at 1 thread; see cpu_clock)")
    parser.add_argument("--out", default="bench-results/streaming", help="output folder")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    torch.set_flush_denormal(True)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        env = environment(device, threads)
        env["clock"] = args.clock
        clock = cpu_clock(threads) if args.clock == "cpu" else time.perf_counter
        print(f"{threads} thread(s): {env['hardware']}; load average {loadavg()}", flush=True)
        if "passes" in args.parts:
            part = pass_rows(args.size, args.tensors, device, measure.Budget(0.3, 1.5, min_samples=10), env, clock=clock)
            print(pass_table(part), flush=True)
            rows += part
        if "steps" in args.parts:
            part = step_rows(args.size, args.tensors, args.rounds, env, clock=clock)
            print(step_table(part), flush=True)
            rows += part
    env = dict(environment(device, torch.get_num_threads()), clock=args.clock)
    paths = passes.write(rows, args.out, "streaming", markdown(rows, env))
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
