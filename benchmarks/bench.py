"""`python -m ampfused bench`: the optimizer-step benchmark of ampfused against the stock torch.amp path.

For every case (a parameter set under a step configuration, see ``configs.py``) and every provider
(stock ``torch.optim.AdamW`` foreach / fused with ``torch.amp.GradScaler``, and ``FusedAmpAdamW``
with ``ampfused.GradScaler`` on each available backend, see ``providers.py``):

1. build the provider from the case's seeded params and gradients;
2. **correctness gate**: run ``--gate-steps`` steps (gradients restored before each) and compare
   the fp32 weights and the params with those of stock ``torch-fused`` after the same steps
   (fp32 rtol 1e-5; low-precision params within one rounding step). A provider that fails is
   reported as FAILED, is not timed, and the command exits with status 1;
3. time ``step()`` (what it contains: ``providers.py``), then check the weights are still finite;
4. report median and p20/p80 ms per step, bytes moved per step (``providers.bytes_per_param``),
   effective GB/s, the fraction of a device copy's GB/s at the same byte count measured in the same
   run, the speedup over each stock path, and peak memory.

Outputs in ``--out`` (default ``bench-results/``): ``bench.csv``, ``bench.md``, ``*.png``.
``python -m ampfused bench train [...]`` runs the end-to-end training benchmark (``bench_train.py``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

import torch

from . import configs, measure, providers, report

# seconds of timing per provider and case: (at least, at most); the copy roofline gets a third of it
BUDGETS = {"quick": measure.Budget(0.03, 0.15), "cpu": measure.Budget(0.1, 0.5), "gpu": measure.Budget(0.1, 1.0)}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ampfused bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results", help="output folder (default: bench-results/)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="~20 s smoke run on small sizes (used by the tests)")
    parser.add_argument("--plan", choices=sorted(configs.PLANS), default=None,
                        help="sizes to run (default: quick with --quick, else gpu or cpu by device)")
    parser.add_argument("--sweeps", default="configs,size,tensors", help="comma list of: configs, size, tensors")
    parser.add_argument("--sizes", default=None, help="override the size sweep, e.g. 1M,10M,100M,1B")
    parser.add_argument("--backends", default=None,
                        help="comma list of ampfused backends (default: every backend available on the device)")
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="on CPU, also run the Triton backend through the (very slow) Triton interpreter")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--gate-steps", type=int, default=2, help="steps compared with stock torch-fused (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def parse_size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def ampfused_backends(device: torch.device, requested: str | None, interpreter: bool) -> tuple[list[str], dict[str, str]]:
    """(backends to benchmark, {backend: why it is not benchmarked})."""
    from ampfused import _backends

    names = requested.split(",") if requested else list(_backends.BACKEND_NAMES)
    chosen, skipped = [], {}
    for name in names:
        if device.type == "cpu" and name == "triton" and not (interpreter or requested):
            skipped[name] = "Triton interpreter on CPU is too slow to benchmark (--triton-interpreter to run it)"
            continue
        try:
            _backends.resolve(name, device)
        except (RuntimeError, ValueError) as exc:
            skipped[name] = str(exc)
            continue
        chosen.append(name)
    return chosen, skipped


def environment(device: torch.device, threads: int) -> dict[str, str]:
    import ampfused

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = _cpu_model() + f", {threads} threads"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device.type,
        "hardware": hardware,
        "torch": torch.__version__,
        "triton": triton_version,
        "ampfused": ampfused.__version__,
        "python": platform.python_version(),
        "threads": str(threads),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "",
    }


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = fields.get("Model name", platform.processor()).strip()
        return f"{model} ({fields.get('CPU(s)', '?').strip()} CPUs, L3 {fields.get('L3 cache', '?').strip()})"
    except (OSError, subprocess.SubprocessError, ValueError):
        return platform.processor() or platform.machine()


def run_case(case, names, device, args, budget, env, copy_cache, progress) -> list[dict]:
    """Gate, time and measure every provider on one case; one row per provider."""
    data = providers.CaseData(case, device, args.seed)
    rows, expected = [], None
    for name in names:
        progress.set_postfix_str(f"{case.config.name} {case.shapes.family} {configs.human(case.shapes.numel)} {name}")
        row = report.base_row(env, case, name)
        memory = measure.PeakMemory(device)
        memory.start()
        provider = None
        try:
            provider = providers.make(name, case, data, device)
            for _ in range(args.gate_steps):
                provider.restore_grads()
                provider.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if name == "torch-fused":  # run first: the reference of the gate
                expected = {k: [t.detach().clone() for t in v] for k, v in provider.results().items()}
                mismatch = ""
            elif expected is None:
                mismatch = "no reference: stock torch-fused failed on this case"
            else:
                mismatch = measure.compare(provider.results(), expected)
            if mismatch:
                row.update(status="FAILED", detail=f"gate: {mismatch}")
            else:
                timing = measure.time_fn(provider.step, device, args.threads, budget)
                if not measure.all_finite(provider.results()):
                    row.update(status="FAILED", detail="non-finite weights after the timed steps")
                else:
                    row.update(status="ok", median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
                               samples=timing.samples, peak_mem_mb=memory.peak() / 2**20,
                               state_mb=provider.state_bytes() / 2**20)
        except Exception as exc:  # a crashing provider is a failed provider, the others still run
            row.update(status="FAILED", detail=f"{type(exc).__name__}: {exc}")
        finally:
            if provider is not None:
                provider.close()
            del provider
        if row["status"] == "ok":
            nbytes = row["bytes_per_step"]
            if nbytes not in copy_cache:
                copy_budget = measure.Budget(budget.min_s / 3, budget.max_s / 3)
                copy_cache[nbytes] = measure.copy_bandwidth(nbytes, device, args.threads, copy_budget)
            row["copy_gbps"] = copy_cache[nbytes]
        rows.append(row)
        progress.update(1)
    report.add_derived(rows)
    return rows


def warm_up(names, device) -> None:
    """One untimed step of every provider on a tiny case: lazy initialisation stays out of the first row."""
    for config in (configs.FP32_CLIP, configs.BF16_X4_CLIP):
        case = configs.Case(("warm-up",), configs.shape_set("few-large", 4096), config)
        data = providers.CaseData(case, device)
        for name in names:
            try:
                provider = providers.make(name, case, data, device)
                provider.step()
                provider.close()
            except Exception:  # reported properly by the real run
                pass


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["train"]:  # `python -m ampfused bench train ...`: the end-to-end benchmark
        from . import bench_train

        return bench_train.main(argv[1:])
    args = parse_args(argv)
    if args.triton_interpreter:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before ampfused.kernels is first imported
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan_name = args.plan or ("quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu"))
    args.threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # see providers.py [note: synthesized gradients]

    sizes = tuple(parse_size(s) for s in args.sizes.split(",")) if args.sizes else None
    cases = configs.plan(plan_name, tuple(s.strip() for s in args.sweeps.split(",")), sizes)
    backends, skipped = ampfused_backends(device, args.backends, args.triton_interpreter)
    names = ["torch-fused", "torch-foreach"] + [f"ampfused-{b}" for b in backends]
    env = environment(device, args.threads)
    env["plan"] = plan_name
    print(f"ampfused bench: {len(cases)} cases x {len(names)} providers on {env['hardware']} "
          f"(torch {env['torch']}, triton {env['triton']})")
    print(f"ampfused backends: {', '.join(backends) or 'none'}" +
          "".join(f"\n  not benchmarked: {k}: {v}" for k, v in skipped.items()))

    from tqdm import tqdm

    rows, copy_cache = [], {}
    budget = BUDGETS[plan_name]
    warm_up(names, device)
    with tqdm(total=len(cases) * len(names), unit="run", file=sys.stderr, dynamic_ncols=True) as progress:
        for case in cases:
            rows += run_case(case, names, device, args, budget, env, copy_cache, progress)

    os.makedirs(args.out, exist_ok=True)
    paths = report.write_all(rows, env, backends, skipped, args.out)
    failed = [r for r in rows if r["status"] != "ok"]
    print(report.markdown_summary(rows))
    print("wrote " + ", ".join(paths))
    if failed:
        for r in failed:
            print(f"FAILED {r['provider']} on {r['case']}: {r['detail']}", file=sys.stderr)
        print(f"correctness gate: FAILED ({len(failed)} of {len(rows)} runs)")
        return 1
    print(f"correctness gate: PASSED ({len(rows)} runs match stock torch-fused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
