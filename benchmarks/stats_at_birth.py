"""Stats at the gradient's birth: does recording the sums of squares in the CPU accumulation beat the stats pass?

``python benchmarks/stats_at_birth.py [--threads 1 2] [--rounds 30] [--total 4000000]``

The CPU accumulation of bf16 gradients into fp32 storage (the first micro-batch's copy in the adopt
hook, later ones in the C++ pre-hook) can leave each param's partial sums of squares and non-finite
flag, so that the step's stats pass skips the gradients nobody edited since (``ampfused/_main_grad.py``).
That moves arithmetic into every micro-batch's accumulation to save one
read of the fp32 gradients per step. This measures the trade on the bench's bf16 rows (GPT-2-like
shapes, x1 and x4 micro-batches, with and without clipping), at 1 and 2 threads:

- **step**: two optimizers on copies of the same seeded params, one built with
  ``AMPFUSED_STATS_AT_BIRTH=0`` (every gradient read by the stats pass: the path without the change),
  one with records. A timed step is N real backwards through autograd's AccumulateGrad nodes
  (``torch.autograd.backward(params, grads)``: the engine runs the optimizer's hooks and nothing
  else), ``step()``, ``zero_grad()``; the two are timed alternately, round by round.
- **parts**: per 4M elements, ``ampfused::accumulate`` against the recording add, torch's
  ``copy_`` (the adopt hook without records) against the recording copy, and the stats pass.

Before any timing, both arms take three steps and their params, masters and moments must be equal
bit for bit, and the records must have been used (a record is marked used by the step that takes it).

The records did not win and are not in the package (``docs/results/stats-at-birth.md``): this script
runs on the experiment's commit, ``git checkout 1b3e6cd`` and a rebuild; elsewhere it says so and exits.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ampfused
from ampfused import _compiled
from ampfused.bench.configs import BETAS, EPS, GRAD_STD, LR, MAX_GRAD_NORM, WEIGHT_DECAY, shape_set


STATS_AT_BIRTH_ENV = "AMPFUSED_STATS_AT_BIRTH"  # the experiment's switch ("0": records off)
EXPERIMENT = "1b3e6cd"


class Arm:
    """bf16 params (copies of ``init``) and a FusedAmpAdamW built with records on or off."""

    def __init__(self, init: list[torch.Tensor], records: bool, clip: bool):
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        os.environ[STATS_AT_BIRTH_ENV] = "1" if records else "0"
        try:
            self.opt = ampfused.FusedAmpAdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                              max_grad_norm=MAX_GRAD_NORM if clip else None, backend="cpu")
        finally:
            del os.environ[STATS_AT_BIRTH_ENV]
        assert bool(self.opt.main_grads.records) == records

    def step(self, micro_batches: list[list[torch.Tensor]]) -> None:
        for grads in micro_batches:
            torch.autograd.backward(self.params, grads)
        self.opt.step()
        self.opt.zero_grad()

    def results(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.params]
        for p in self.params:
            s = self.opt.state[p]
            out += [s["master_param"], s["exp_avg"], s["exp_avg_sq"]]
        return out


def check(init, micro_batches, clip: bool) -> None:
    """Records on and off give the same bits, and the records were used."""
    on, off = Arm(init, True, clip), Arm(init, False, clip)
    for _ in range(3):
        for grads in micro_batches:
            torch.autograd.backward(on.params, grads)
        versions = [r[0].item() for r in on.opt.main_grads.records.values()]
        assert all(v >= 0 for v in versions), "a record was not written by the accumulation"
        on.opt.step()
        assert all(r[0].item() == -1 for r in on.opt.main_grads.records.values()), "a record was not used"
        on.opt.zero_grad()
        off.step(micro_batches)
        assert torch.equal(on.opt.grad_norm, off.opt.grad_norm)
    for a, b in zip(on.results(), off.results()):
        assert torch.equal(a, b), "records on and off differ"


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e3, s[len(s) // 5] * 1e3, s[(4 * len(s)) // 5] * 1e3


def time_steps(init, micro_batches, clip: bool, rounds: int) -> dict:
    arms = {"records off": Arm(init, False, clip), "records on": Arm(init, True, clip)}
    times = {name: [] for name in arms}
    for r in range(rounds + 2):  # the first two rounds allocate and warm up: not timed
        order = list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]
        for name, arm in order:
            start = time.perf_counter()
            arm.step(micro_batches)
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    return times


def time_parts(sizes: list[int], rounds: int) -> dict:
    ops = torch.ops.ampfused
    gen = torch.Generator().manual_seed(1)
    mains = [torch.zeros(n) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * GRAD_STD).to(torch.bfloat16) for n in sizes]
    records = [torch.full((3 + -(-n // (1 << 16)),), -1, dtype=torch.int64) for n in sizes]
    stats = torch.empty(4)
    work = {
        "add (accumulate)": lambda: [ops.accumulate(m, g) for m, g in zip(mains, grads)],
        "add + record": lambda: [ops._accumulate_and_record(m, g, r, False) for m, g, r in zip(mains, grads, records)],
        "copy (torch copy_)": lambda: [m.copy_(g) for m, g in zip(mains, grads)],
        "copy + record": lambda: [ops._accumulate_and_record(m, g, r, True) for m, g, r in zip(mains, grads, records)],
        "stats pass": lambda: ops.grad_stats(mains, None, None, None, stats),
    }
    times = {name: [] for name in work}
    for r in range(rounds + 2):
        for name, fn in work.items():
            start = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--total", type=int, default=4_000_000)
    args = parser.parse_args()
    module, why = _compiled.load()
    if module is None:
        raise SystemExit(f"the compiled cpu backend is needed here: {why}")
    if not hasattr(torch.ops.ampfused, "_accumulate_and_record"):
        raise SystemExit(f"the birth records are not in this build: they live on commit {EXPERIMENT} "
                         "(git checkout it, pip install --no-build-isolation -e ., run this again)")
    sizes = list(shape_set("gpt2-like", args.total).sizes)
    gen = torch.Generator().manual_seed(0)
    init = [(torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16) for n in sizes]
    batches = [[(torch.randn(n, generator=gen) * GRAD_STD).to(torch.bfloat16) for n in sizes] for _ in range(4)]
    print(f"{len(sizes)} bf16 tensors, {sum(sizes)} elements, CPU ISA {module.CPU_ISA}, "
          f"load {os.getloadavg()[0]:.1f} at start")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in (1, 4):
            for clip in (True, False):
                row = f"bf16-x{n}-{'clip' if clip else 'noclip'}"
                check(init, batches[:n], clip)
                times = time_steps(init, batches[:n], clip, args.rounds)
                (off, off20, off80), (on, on20, on80) = (quantiles(times[k]) for k in ("records off", "records on"))
                # paired by round (the two arms ran back to back): robust to the load drifting between rounds
                saved = quantiles([a - b for a, b in zip(times["records off"], times["records on"])])
                print(f"{threads} thread(s) {row:16s} step+backward ms: records off {off:6.2f} [{off20:.2f}-{off80:.2f}]  "
                      f"on {on:6.2f} [{on20:.2f}-{on80:.2f}]  off/on {off / on:.3f}  saved per step "
                      f"{saved[0]:+.2f} [{saved[1]:+.2f}..{saved[2]:+.2f}]  (load {os.getloadavg()[0]:.1f})")
        parts = time_parts(sizes, args.rounds)
        print(f"{threads} thread(s) parts, ms per {sum(sizes)} elements: " + "; ".join(
            f"{name} {quantiles(v)[0]:.2f} [{quantiles(v)[1]:.2f}-{quantiles(v)[2]:.2f}]" for name, v in parts.items()))


if __name__ == "__main__":
    main()
