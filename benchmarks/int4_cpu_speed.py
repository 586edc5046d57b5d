"""The CPU speed target of int4 moments (issue 35 item 7), checked in one command.

One thread, bf16 params in 2-D tensors (rows of ``--row`` elements, ``--params`` in all), bf16 grads,
no master and stochastic rounding (the 5 B/param mode), and with ``--split16`` the exact-master mode
too: ``FusedAmpAdamW(backend="cpu", state_dtype="int4")`` against the same optimizer with
``state_dtype="int8"`` and, where torchao is installed, torchao's ``AdamW4bit(bf16_stochastic_round=True)``
on copies of the same tensors. The steps are timed side by side in interleaved bursts
(``ampfused.bench.measure.interleaved``, medians), on an idle machine and then with one spinning
process on every core (``benchmarks/busy.py``'s ``spinners``, as DataLoader workers keep them busy).
Targets: the int4 step takes at most 1.1x the int8 step and is at least 5x faster than AdamW4bit.

    python benchmarks/int4_cpu_speed.py [--params 4M] [--row 1024] [--split16] [--no-busy]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import ampfused
from ampfused.bench import cli, measure
from ampfused.bench.environment import Load, cpu_isa, cpu_model, loadavg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however this file is loaded
import busy  # noqa: E402

INT8_RATIO_TARGET, TORCHAO_TARGET = 1.1, 5.0
BUDGET = measure.Budget(min_s=1.0, max_s=6.0, min_samples=10, rounds=10, cap_s=90.0)


def tensors(total: int, row: int, seed: int = 0):
    """bf16 params and grads of rows of ``row`` elements, ``total`` elements in all (4 tensors or fewer)."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(1, total // row)
    count = min(4, rows)
    shapes = [(rows // count + (i < rows % count), row) for i in range(count)]
    params = [(torch.randn(s, generator=gen) * 0.05).bfloat16() for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 0.01).bfloat16() for s in shapes]
    return params, grads


def ampfused_step(params, grads, master_weights, state_dtype):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt = ampfused.FusedAmpAdamW(ps, lr=1e-3, backend="cpu", master_weights=master_weights, state_dtype=state_dtype,
                                 stochastic_rounding=master_weights is False)
    return opt.step, opt


def torchao_step(params, grads):
    try:
        from torchao.optim import AdamW4bit
    except ImportError as exc:
        return None, f"torchao is not installed ({exc})"
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt = AdamW4bit(ps, lr=1e-3, bf16_stochastic_round=True)
    return opt.step, None


def run(fns, label: str) -> dict[str, measure.Timing]:
    load = Load().start()
    t0 = time.perf_counter()
    timings = measure.interleaved(fns, torch.device("cpu"), BUDGET)
    other = load.stop()
    print(f"\n{label}: {time.perf_counter() - t0:.0f} s, other processes kept {other:.2f} cores busy "
          f"(load average {load.loadavg_before} -> {load.loadavg_after})")
    for name, t in timings.items():
        if t.error:
            print(f"  {name:28s} FAILED: {t.error}")
            continue
        print(f"  {name:28s} {t.median_ms:9.2f} ms/step (p20 {t.p20_ms:.2f}, p80 {t.p80_ms:.2f}, {t.samples} samples)"
              f"{'  unstable: ' + t.unstable if t.unstable else ''}")
    return timings


def verdict(timings, modes) -> bool:
    ok = True
    ao = timings.get("torchao AdamW4bit")
    for mode in modes:
        int4, int8 = timings[f"ampfused {mode} int4"], timings[f"ampfused {mode} int8"]
        ratio = int4.median_ms / int8.median_ms
        met = ratio <= INT8_RATIO_TARGET
        line = f"  {mode}: int4 / int8 = {ratio:.3f} (target <= {INT8_RATIO_TARGET})"
        if ao is not None and not ao.error:
            speedup = ao.median_ms / int4.median_ms
            line += f"; AdamW4bit / int4 = {speedup:.1f}x (target >= {TORCHAO_TARGET}x)"
            met = met and speedup >= TORCHAO_TARGET
        print(line + f": {'MET' if met else 'NOT MET'}")
        ok = ok and met
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/int4_cpu_speed.py")
    parser.add_argument("--params", type=cli.parse_size, default=4_000_000, help="total parameter count, e.g. 4M")
    parser.add_argument("--row", type=int, default=1024, help="elements per row of the 2-D tensors")
    parser.add_argument("--split16", action="store_true", help="also time the exact-master (split16) mode")
    parser.add_argument("--no-busy", action="store_true", help="skip the run with every core kept busy")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    params, grads = tensors(args.params, args.row)
    print(f"{sum(p.numel() for p in params) / 1e6:.2f}M bf16 params in {[tuple(p.shape) for p in params]}, "
          f"bf16 grads, 1 thread; {cpu_model()}, {cpu_isa()}, torch {torch.__version__}, load average {loadavg()}")
    modes = ["no-master+SR"] + (["split16"] if args.split16 else [])
    fns, opts = {}, []
    for mode in modes:
        for state_dtype in ("int8", "int4"):
            step, opt = ampfused_step(params, grads, False if mode == "no-master+SR" else mode, state_dtype)
            fns[f"ampfused {mode} {state_dtype}"] = step
            opts.append(opt)
    step, why = torchao_step(params, grads)
    if step is None:
        print(f"torchao AdamW4bit: not timed: {why}")
    else:
        import torchao

        print(f"torchao {torchao.__version__}: AdamW4bit(bf16_stochastic_round=True) (its first step compiles)")
        fns["torchao AdamW4bit"] = step
    for fn in fns.values():  # first steps: state made, torchao's torch.compile done
        fn()
        fn()
    for opt in opts:  # the int4 state is served natively: codes packed two per byte
        state = opt.state[opt.param_groups[0]["params"][0]]
        assert state["exp_avg_codes"].dtype in (torch.int8, torch.uint8), sorted(state)
    ok = verdict(run(fns, "idle cores"), modes)
    if not args.no_busy:
        cores = os.cpu_count() or 1
        with busy.spinners(cores):
            ok = verdict(run(fns, f"busy cores ({cores} spinning processes)"), modes) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
