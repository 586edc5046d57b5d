"""The plainest drop-in, interleaved: fp32 params, no scaler, no clipping, at 1 and 2 threads.

``python -m ampfused.benchmarks.plain_step``: ``torch.optim.AdamW(fused=True).step()`` against
``FusedAmpAdamW().step()`` on the same GPT-2-like 4M-param shapes, 40 alternating steps per thread
count; prints the medians, the ratio and each side's 1->2-thread speedup (issue: the always-on NaN
guard costs ampfused a pass here, 32 vs 28 B/param).
"""
from __future__ import annotations

import math
import statistics
import time

import torch

import ampfused

from .configs import GPT2_124M


def _optimizer(kind: str, sizes: list[int]):
    params = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, fused=True) if kind == "torch" else ampfused.FusedAmpAdamW(params)
    opt.step()  # lazy state
    return opt


def main(total: int = 4_000_000, rounds: int = 40) -> None:
    scale = total / sum(math.prod(s) for s in GPT2_124M)
    sizes = [max(1, int(math.prod(s) * scale)) for s in GPT2_124M]
    medians = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        stock, ours = _optimizer("torch", sizes), _optimizer("ampfused", sizes)
        times = {"torch": [], "ampfused": []}
        for _ in range(rounds):
            for name, opt in (("torch", stock), ("ampfused", ours)):
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
        medians[threads] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        m = medians[threads]
        print(f"{threads} thread(s): torch fused {m['torch']:.2f} ms, ampfused-{ours.backend} {m['ampfused']:.2f} ms, "
              f"ampfused is {m['torch'] / m['ampfused']:.2f}x stock")
    print(f"1->2 thread speedup: torch {medians[1]['torch'] / medians[2]['torch']:.2f}x, "
          f"ampfused {medians[1]['ampfused'] / medians[2]['ampfused']:.2f}x")


if __name__ == "__main__":
    main()
