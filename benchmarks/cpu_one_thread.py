"""The CPU target of the compiled backend, checked in one command.

One thread, fp32 params in GPT-2-like shapes scaled to 30M params, the full AMP step with
clipping: stock ``scaler.unscale_`` + ``clip_grad_norm_`` + ``scaler.step(AdamW(fused=True |
foreach=True))`` + ``scaler.update()`` against ``FusedAmpAdamW(backend="cpu")`` + ``ampfused.GradScaler``
(the providers of ``bench.py``, correctness-gated the same way). Target: >= 1.3x over fused,
>= 4x over foreach.

    python benchmarks/cpu_one_thread.py [--params 30M]
"""
from __future__ import annotations

import argparse
import sys

import torch

from ampfused.bench import cli, configs, measure, providers

STOCK_FUSED_TARGET, STOCK_FOREACH_TARGET = 1.3, 4.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/cpu_one_thread.py")
    parser.add_argument("--params", type=cli.parse_size, default=30_000_000, help="total parameter count, e.g. 20M, 30M")
    args = parser.parse_args(argv)
    total = args.params
    torch.set_num_threads(1)
    device = torch.device("cpu")
    case = configs.Case(("tensors",), configs.shape_set("gpt2-like", total), configs.FP32_CLIP)
    data = providers.CaseData(case, device, 0)
    budget = measure.Budget(min_s=1.0, max_s=4.0, min_samples=10)
    live, expected = {}, None
    for name in ("torch-fused", "torch-foreach", "ampfused-cpu"):
        provider = providers.make(name, case, data, device)
        for _ in range(2):
            provider.restore_grads()
            provider.step()
        results = {k: [t.detach().clone() for t in v] for k, v in provider.results().items()}
        if expected is None:
            expected = results
        elif mismatch := measure.compare(results, expected):
            print(f"{name}: correctness gate FAILED: {mismatch}")
            return 1
        live[name] = provider
    timings = measure.interleaved({n: p.step for n, p in live.items()}, device, budget)  # load hits all alike
    medians = {}
    for name, timing in timings.items():
        if timing.error:
            print(f"{name}: FAILED: {timing.error}")
            return 1
        medians[name] = timing.median_ms
        print(f"{name:14s} {timing.median_ms:8.1f} ms/step (p20 {timing.p20_ms:.1f}, p80 {timing.p80_ms:.1f}, "
              f"{timing.samples} samples){'  UNSTABLE: ' + timing.unstable if timing.unstable else ''}")
    vs_fused = medians["torch-fused"] / medians["ampfused-cpu"]
    vs_foreach = medians["torch-foreach"] / medians["ampfused-cpu"]
    ok = vs_fused >= STOCK_FUSED_TARGET and vs_foreach >= STOCK_FOREACH_TARGET
    print(f"{case.label}, 1 thread: ampfused-cpu is {vs_fused:.2f}x torch-fused (target {STOCK_FUSED_TARGET}x) and "
          f"{vs_foreach:.2f}x torch-foreach (target {STOCK_FOREACH_TARGET}x): {'MET' if ok else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
