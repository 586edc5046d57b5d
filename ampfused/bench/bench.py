"""`python -m ampfused bench`: the optimizer-step benchmark of ampfused against the stock torch.amp path.

Every provider of a case is gated against stock torch-fused, then those that passed are timed interleaved
(benchmarks/README.md §1).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import torch

from .. import _gpu_advice
from . import cli, configs, measure, providers, report
from .environment import Load, LoadWindows, environment, overlapping_load, pick_threads

# per timed function and case: seconds of its own time (at least; at most while noisy), calls, rounds and
# calls per round (at least); a round's value is its burst's mean (measure.interleaved; benchmarks/README.md §1)
BUDGETS = {
    "quick": measure.Budget(0.02, 0.1, min_samples=5, rounds=5),
    "cpu": measure.Budget(0.1, 0.4, min_samples=10, rounds=12, burst=3),
    "gpu": measure.Budget(0.1, 1.0, min_samples=10, rounds=10, burst=3),
}
TRAIN_COMMAND = "python benchmarks/bench_train.py"
BUSY_COMMAND = "python benchmarks/busy.py"
UNTIMED_NOTE = "gate passed; the oracle is not timed (--backends naming it times it)"
STUB_NOTE = ("Triton kernels not launched (ampfused.kernels.host_only): host time only, not gated "
             "(tests/ check the kernels in the interpreter)")
MODE_GATE_NUMEL = 1_000_000
BIG_CPU_CASE = 20_000_000  # params: above it a CPU case leaves out torch-foreach and the untimed oracle


def build_parser() -> argparse.ArgumentParser:
    from ampfused import _backends

    parser = argparse.ArgumentParser(prog="python -m ampfused bench", description=__doc__.split("\n\n")[0],
                                     epilog=f"from a checkout: the end-to-end training benchmark {TRAIN_COMMAND}, "
                                            f"the busy-cores study {BUSY_COMMAND}")
    add = parser.add_argument
    add("--out", default="bench-results", help="output folder (default: bench-results/)")
    add("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    add("--quick", action="store_true", help="~30 s smoke run on small sizes (used by the tests)")
    add("--plan", choices=sorted(configs.PLANS), help="sizes to run (default: quick with --quick, else gpu or cpu by device)")
    add("--sweeps", type=cli.choice_list(configs.SWEEPS), default=configs.SWEEPS,
        help=f"comma list of: {', '.join(configs.SWEEPS)} (default: all)")
    add("--sizes", type=cli.size_list, help="override the size sweep, e.g. 1M,10M,100M,1B (the memory sweep takes the largest)")
    add("--backends", type=cli.choice_list(_backends.BACKEND_NAMES),
        help="comma list of ampfused backends (default: every backend available on the device)")
    add("--triton-interpreter", action="store_true", help="on CPU, also run the Triton backend through the (very slow) Triton interpreter")
    add("--threads", type=cli.positive_int, help="CPU threads (default: the cores other processes leave free, measured at the start)")
    add("--gate-steps", type=cli.positive_int, default=2, help="steps compared with stock torch-fused (default 2)")
    add("--max-spread", type=cli.fraction, help="p20-p80 spread over the median above which a timing is unstable (default 0.15)")
    add("--strict", action="store_true", help="exit with status 3 when any timing is unstable")
    add("--seed", type=int, default=0)
    return parser


def ampfused_backends(device: torch.device, requested, interpreter: bool) -> tuple[list[str], dict[str, str]]:
    """(backends to benchmark, {backend: why it is not benchmarked})."""
    from ampfused import _backends

    no_gpu = device.type == "cpu" and not _gpu_advice.machine_has_gpu()
    chosen, skipped = [], {}
    for name in list(requested) if requested else list(_backends.BACKEND_NAMES):
        if device.type == "cpu" and name == "triton" and not (interpreter or requested):
            skipped[name] = ((_gpu_advice.no_gpu_reason(name) if no_gpu else _gpu_advice.INTERPRETER)
                             + " (--triton-interpreter runs it anyway)")
            continue
        try:
            _backends.resolve(name, device)
        except (RuntimeError, ValueError) as exc:
            skipped[name] = _gpu_advice.no_gpu_reason(name) if no_gpu and name in _gpu_advice.GPU_BACKENDS else str(exc)
            continue
        chosen.append(name)
    return chosen, skipped


def gate_steps(provider, args, device) -> None:
    for _ in range(args.gate_steps):
        provider.restore_grads()
        provider.step()
    if device.type == "cuda":
        torch.cuda.synchronize()


def _copy(results) -> dict:
    return {k: [t.detach().clone() for t in v] for k, v in results.items()}


def gated(name, case, args, device) -> dict:
    """The results of provider ``name`` after the gate's steps on ``case`` (built and dropped here)."""
    provider = providers.make(name, case, providers.CaseData(case, device, args.seed), device)
    torch.manual_seed(args.seed)  # stochastic rounding draws each step's seed from torch's generator: the same for both twins
    try:
        gate_steps(provider, args, device)
        return _copy(provider.results())
    finally:
        provider.close()


def gate(provider, name, args, device, expected, case) -> str:
    """Check a provider that ran ``gate_steps`` against stock torch-fused's results: "" or the mismatch."""
    if expected is None:
        return "" if name == "ampfused-reference" else "no reference: stock torch-fused failed on this case"
    mode = providers.memory_mode(name)
    if mode is None:
        return measure.compare(provider.results(), expected)
    # A lossy mode is held to the reference backend running the same mode (the specification of its
    # encodings), both on the case without clipping: two stats passes' norms may differ by an ulp,
    # which would flip int8 codes at a rounding tie. split16 is also held to stock fp32 masters. The
    # twins take the case's shapes scaled to at most MODE_GATE_NUMEL params (benchmarks/README.md §1).
    shapes = configs.shape_set(case.shapes.family, min(case.shapes.numel, MODE_GATE_NUMEL))
    unclipped = configs.Case(case.sweeps, shapes, dataclasses.replace(case.config, clip=False))
    got, want = (gated(n, unclipped, args, device) for n in (name, f"ampfused-reference{providers.MODE}{mode}"))
    if configs.MEMORY_MODES[mode].get("master_weights") is False:  # the master is the bf16 param: its 1-ulp rule
        got, want = ({"param": r["param"]} for r in (got, want))
    mismatch = measure.compare(got, want)
    if mismatch:
        return f"vs ampfused-reference@{mode}: {mismatch}"
    return measure.compare(provider.results(), expected) if mode == "split16" else ""


def host_only():
    """The host sweep's Triton rows on a CPU: the host side only, no kernel launched."""
    from ampfused import kernels

    return kernels.host_only()


def build_and_gate(case, names, device, args, rows, untimed) -> dict:
    """Build and gate every provider of ``case`` in turn (so peak memory is each one's own increment):
    {name: provider} of those that passed and are timed; the others' rows say why not."""
    data = providers.CaseData(case, device, args.seed)
    live, expected = {}, None
    stub = case.host and device.type == "cpu"
    for name in names:
        memory, provider = measure.PeakMemory(device), None
        memory.start()
        try:
            provider = providers.make(name, case, data, device)
            if stub and name == "ampfused-triton":  # the interpreter would take minutes at 2000 tensors
                with host_only():
                    provider.step()
                peak, mismatch = memory.peak(), ""
            else:
                gate_steps(provider, args, device)
                peak = memory.peak()  # the provider's own, before the gate builds its oracle twin
                if name == "torch-fused":  # built first: the reference of the gate
                    expected, mismatch = _copy(provider.results()), ""
                else:
                    mismatch = gate(provider, name, args, device, expected, case)
            detail = f"gate: {mismatch}" if mismatch else ""
        except Exception as exc:  # a crashing provider is a failed provider, the others still run
            detail = f"{type(exc).__name__}: {exc}"
        if detail:
            rows[name].update(status="FAILED", detail=detail)
        else:
            kept = provider.state_bytes()
            rows[name].update(peak_mem_mb=peak / 2**20, state_mb=kept / 2**20, kept_bytes_per_param=kept / case.shapes.numel)
            if name not in untimed:
                live[name] = provider
                continue
            rows[name].update(status="untimed", detail=UNTIMED_NOTE)  # the oracle beside a compiled backend
        if provider is not None:
            provider.close()
    return live


def run_case(case, names, device, args, budget, env, progress, untimed=()) -> list[dict]:
    """Gate every provider, then time the ones that passed (but ``untimed``) interleaved; one row per provider."""
    rows = {name: report.base_row(env, case, name) for name in names}
    progress.describe(f"{case.config.name} {case.shapes.family} {configs.human(case.shapes.numel)}")
    live = build_and_gate(case, names, device, args, rows, untimed)
    stub = case.host and device.type == "cpu" and "ampfused-triton" in live
    fns = {name: p.step for name, p in live.items()}
    # the roofline stream of a row touches as many bytes as the row's provider keeps (its working
    # set), so that the last-level cache holds the same share of both (benchmarks/README.md §1)
    stream_of = {} if case.host else {n: measure.stream_key(live[n].state_bytes()) for n in live}
    copies = {key: measure.DeviceCopy.over_working_set(key, device) for key in dict.fromkeys(stream_of.values())}
    fns.update({f"copy {key:g}": copy.fn for key, copy in copies.items()})
    load = LoadWindows().start()
    with host_only() if stub else contextlib.nullcontext():
        timings = measure.interleaved(fns, device, budget, host=case.host, on_round=load.tick)
    other, other_peak = load.stop()
    # a timing that load from other processes overlapped is marked in its own row (a CUDA
    # device timing is not the CPU's: only CPU and host timings are)
    overlap = overlapping_load(other, other_peak, args.threads) if device.type == "cpu" or case.host else ""
    for name, provider in live.items():
        row, timing = rows[name], timings[name]
        if timing.error or not measure.all_finite(provider.results()):
            row.update(status="FAILED", detail=timing.error or "non-finite weights after the timed steps")
            provider.close()
            continue
        row.update(status="ok", median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
                   samples=timing.samples, unstable="; ".join(filter(None, (overlap, timing.unstable))),
                   timer="host" if case.host else "device", _timing=timing, other_cores=other, other_cores_peak=other_peak)
        if stub and name == "ampfused-triton":
            row["detail"] = STUB_NOTE
        key = stream_of.get(name)
        copy = timings.get(f"copy {key:g}") if key is not None else None
        if copy is not None and not copy.error:
            row.update(roofline_gbps=copies[key].gbps(copy), working_set_mb=copies[key].working_set / 2**20)
            row["roofline_from"] = f"a += b over {row['working_set_mb']:.0f} MiB"
            if copy.unstable and not row["unstable"]:
                row["unstable"] = f"roofline stream: {copy.unstable}"
        provider.close()
    copies.clear()
    progress.update(len(names))
    out = [rows[n] for n in names]
    report.add_derived(out)
    return out


def warm_up(cases, names, device) -> None:
    """One untimed step of every provider on a tiny case it applies to: lazy initialisation stays out of
    the first row."""
    done = set()
    for case in cases:
        tiny = configs.Case(case.sweeps, configs.shape_set("few-large", 4096), case.config)
        for name in [n for n in case_providers(case, names, device) if n not in done]:
            done.add(name)
            try:
                provider = providers.make(name, tiny, providers.CaseData(tiny, device), device)
                provider.step()
                provider.close()
            except Exception:  # reported properly by the real run
                pass


def case_providers(case, names, device) -> list[str]:
    """The providers of ``case`` (which run where: benchmarks/README.md §1, "Correctness gate")."""
    memory = "memory" in case.sweeps
    names = [n for n in names if (providers.MODE in n) == memory or (memory and providers.MODE not in n and
                                                                     not n.endswith(providers.KEEP_SCALED))]
    names = [n for n in names if case.config.loss_scaling or not n.endswith(providers.KEEP_SCALED)]
    if device.type == "cpu" and case.shapes.numel > BIG_CPU_CASE:
        names = [n for n in names if n != "torch-foreach" and not n.startswith("ampfused-reference")]
    return [n for n in names if n != "torch-foreach"] if case.host else names


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    parser = build_parser()
    moved = {"train": f"the end-to-end training benchmark is not installed; from a checkout: {TRAIN_COMMAND}",
             "busy": f"the busy-cores study is not installed; from a checkout: {BUSY_COMMAND}"}
    if argv[:1] and argv[0] in moved:
        parser.error(moved[argv[0]])
    args = parser.parse_args(argv)
    if args.triton_interpreter:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before ampfused.kernels is first imported
    device = cli.pick_device(parser, args.device)
    plan_name = args.plan or ("quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu"))
    if args.sizes and not {"size", "memory"} & set(args.sweeps):
        parser.error("--sizes sets the size and memory sweeps, which --sweeps leaves out")
    backends, skipped = ampfused_backends(device, args.backends, args.triton_interpreter)
    if args.backends and not backends:
        parser.error("--backends: none of the requested backends can run here: " +
                     "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    threads_line, untrusted = "", ""
    if device.type == "cpu":  # arguments checked: now measure the machine and change the process
        args.threads, threads_line, untrusted = pick_threads(args.threads)
        torch.set_flush_denormal(True)  # the synthesized gradients shrink while timed (providers.py)
    args.threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    budget = dataclasses.replace(BUDGETS[plan_name], max_spread=args.max_spread or BUDGETS[plan_name].max_spread)

    cases = configs.plan(plan_name, args.sweeps, args.sizes)
    names = ["torch-fused", "torch-foreach"] + [f"ampfused-{b}" for b in backends]
    oracle_only = "reference" in backends and len(backends) > 1 and "reference" not in (args.backends or ())
    untimed = {"ampfused-reference"} if oracle_only else set()
    if backends:  # scaled rows both ways (p.grad unscaled, as torch, or kept scaled), for the first backend
        names.insert(3, f"ampfused-{backends[0]}{providers.KEEP_SCALED}")
        if "memory" in args.sweeps:  # and the memory modes of DESIGN §9 (configs.MEMORY_MODES)
            names += [f"ampfused-{backends[0]}{providers.MODE}{mode}" for mode in configs.MEMORY_MODES]
    env = environment(device, args.threads)
    env.update(plan=plan_name, command=" ".join(["python -m ampfused bench", *argv]), untrusted=untrusted,
               threads_choice=threads_line)
    lines = [f"ampfused bench: {len(cases)} cases x {len(names)} providers on {env['hardware']} "
             f"(torch {env['torch']}, triton {env['triton']})", threads_line, untrusted and f"WARNING: {untrusted}",
             f"ampfused backends: {', '.join(backends) or 'none'}", *(f"  not benchmarked: {k}: {v}" for k, v in skipped.items()),
             device.type == "cpu" and set(skipped) & set(_gpu_advice.GPU_BACKENDS) and not _gpu_advice.machine_has_gpu()
             and _gpu_advice.no_gpu_note(),
             "host" in args.sweeps and device.type == "cpu" and "triton" in backends and f"host sweep, ampfused-triton: {STUB_NOTE}"]
    print("\n".join(line for line in lines if line))

    rows, started, load = [], time.perf_counter(), Load().start()
    warm_up(cases, names, device)
    progress = cli.Progress(sum(len(case_providers(c, names, device)) for c in cases), unit="run")
    try:
        for case in cases:
            rows += run_case(case, case_providers(case, names, device), device, args, budget, env, progress, untimed)
    finally:
        progress.close()
    other, cores = load.stop(), len(os.sched_getaffinity(0))
    env.update(other_cores=f"{other:.2f}", loadavg_after=load.loadavg_after, wall_s=f"{time.perf_counter() - started:.0f}")
    if device.type == "cpu" and not env["untrusted"] and other > cores - args.threads + 0.5:
        env["untrusted"] = (f"other processes kept {other:.2f} cores busy during the run, more than the "
                            f"{cores - args.threads} left beside {args.threads} thread(s): the timings are not to be trusted")
    return finish(rows, env, backends, skipped, budget, args)


def finish(rows, env, backends, skipped, budget, args) -> int:
    """Write the outputs, print the tables and the verdicts; the exit status."""
    os.makedirs(args.out, exist_ok=True)
    paths, plot_problem = report.write_all(rows, env, backends, skipped, budget, args.out)
    print(report.markdown_summary(rows))
    print(report.load_line(env))
    if env["untrusted"]:
        print(f"WARNING: {env['untrusted']}")
    print("wrote " + ", ".join(paths))
    if plot_problem:
        print(f"plots not written: {plot_problem}", file=sys.stderr)
    failed = [r for r in rows if r["status"] not in ("ok", "untimed")]
    timed = [r for r in rows if r["status"] == "ok"]
    unstable = [r for r in timed if r["unstable"]]
    for r in unstable:
        print(f"unstable: {r['provider']} on {r['case']}: {r['unstable']}", file=sys.stderr)
    print(f"timing: {len(timed) - len(unstable)} of {len(timed)} timings stable"
          + (f", {len(unstable)} unstable (see the 'timing' column)" if unstable else ""))
    if failed:
        for r in failed:
            print(f"FAILED {r['provider']} on {r['case']}: {r['detail']}", file=sys.stderr)
        print(f"correctness gate: FAILED ({len(failed)} of {len(rows)} runs)")
        return 1
    gated_only = len(rows) - len(timed)
    print(f"correctness gate: PASSED ({len(rows)} runs match stock torch-fused" +
          (f"; {gated_only} of them, the reference backend's, gated but not timed)" if gated_only else ")"))
    if unstable and args.strict:
        print(f"--strict: {len(unstable)} unstable timings", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
