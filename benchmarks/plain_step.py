"""The plainest drop-in, interleaved: fp32 params, no scaler, no clipping, at 1 and 2 threads.

``python benchmarks/plain_step.py``: ``torch.optim.AdamW(fused=True).step()`` against
``FusedAmpAdamW().step()`` (the NaN guard on: ``ampfused``) and ``FusedAmpAdamW(skip_nonfinite=False)``
(torch's own semantics, one pass: ``ampfused-plain``) -- and DeepSpeed's ``DeepSpeedCPUAdam`` when ``deepspeed`` is installed
(its cpu_adam op is built on first use, about a minute) -- on the same GPT-2-like 4M-param shapes
and values, 40 alternating steps per thread count. Before any number is printed, every optimizer's
params and moments are checked against stock torch's. Prints the medians, the ratios and each
side's 1->2-thread speedup.

This is the case where the default ampfused moves more bytes than the optimizers without a NaN
guard (32 vs 28 B/param: DESIGN §2.2 makes the guard read every gradient before the first write);
``skip_nonfinite=False`` drops that pass and moves torch's 28 B/param. See docs/design.md, "Where
the NaN guard's pass goes".
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ampfused

from ampfused.bench.configs import shape_set


def _deepspeed_adam():
    """DeepSpeedCPUAdam, or None with the reason it is missing."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its op fails to build
        return None, f"{type(exc).__name__}: {exc}"
    return DeepSpeedCPUAdam, ""


def _optimizer(kind: str, sizes: list[int], ds_cls):
    gen = torch.Generator().manual_seed(0)  # every kind gets the same params and grads
    params = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    if kind == "torch":
        return torch.optim.AdamW(params, fused=True)
    if kind == "deepspeed":
        return ds_cls(params, adamw_mode=True, weight_decay=0.01)  # torch AdamW's default; DeepSpeed's is 0
    return ampfused.FusedAmpAdamW(params, skip_nonfinite=kind != "ampfused-plain")


def _check_same(reference, other, name: str) -> None:
    """The optimizers took the same number of steps on the same grads: params and moments agree."""
    for group_ref, group in zip(reference.param_groups, other.param_groups):
        for p_ref, p in zip(group_ref["params"], group["params"]):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} params differ: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(other.state[p][key], reference.state[p_ref][key], rtol=1e-5, atol=1e-9,
                                           msg=lambda m: f"{name} {key} differs: {m}")


def main(total: int = 4_000_000, rounds: int = 40) -> None:
    sizes = list(shape_set("gpt2-like", total).sizes)
    ds_cls, why = _deepspeed_adam()
    kinds = ["torch", "ampfused", "ampfused-plain"] + (["deepspeed"] if ds_cls is not None else [])
    if ds_cls is None:
        print(f"DeepSpeedCPUAdam not measured ({why})")
    medians = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        opts = {kind: _optimizer(kind, sizes, ds_cls) for kind in kinds}
        times = {kind: [] for kind in kinds}
        for _ in range(rounds + 1):  # the first round builds the lazy state and is not timed
            for kind, opt in opts.items():
                start = time.perf_counter()
                opt.step()
                times[kind].append(time.perf_counter() - start)
        for kind in kinds[1:]:
            _check_same(opts["torch"], opts[kind], kind)
        m = medians[threads] = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        cells = ", ".join(f"{k} {m[k]:.2f} ms ({m['torch'] / m[k]:.2f}x)" for k in kinds)
        print(f"{threads} thread(s), ms per step and speed vs torch fused: {cells}")
    speedups = ", ".join(f"{k} {medians[1][k] / medians[2][k]:.2f}x" for k in kinds)
    print(f"1->2 thread speedup: {speedups}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=4_000_000, help="params in all (default: 4M, GPT-2-like shapes)")
    parser.add_argument("--rounds", type=int, default=40, help="alternating timed steps per thread count (default: 40)")
    args = parser.parse_args()
    main(args.total, args.rounds)
