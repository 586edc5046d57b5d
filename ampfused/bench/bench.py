"""`python -m ampfused bench`: the optimizer-step benchmark of ampfused against the stock torch.amp path.

For every case (a parameter set under a step configuration, see ``configs.py``) and every provider
(stock ``torch.optim.AdamW`` foreach / fused with ``torch.amp.GradScaler``, and ``FusedAmpAdamW``
with ``ampfused.GradScaler`` on each available backend, see ``providers.py``):

1. build the provider from the case's seeded params and gradients;
2. **correctness gate**: run ``--gate-steps`` steps (gradients restored before each) and compare
   the fp32 weights and the params with those of stock ``torch-fused`` after the same steps
   (fp32 rtol 1e-5; low-precision params within one rounding step). A provider that fails is
   reported as FAILED, is not timed, and the command exits with status 1;
3. time ``step()`` (what it contains: ``providers.py``) of all the providers that passed, and a
   device stream (``a += b``, the roofline) of each byte count, **interleaved** (``measure.interleaved``), then check the
   weights are still finite. [note: oracle untimed] The ``reference`` backend is the oracle and the
   fallback, not a contender: when a compiled backend is measured too and ``--backends`` does not
   name it, it is gated but not timed (status ``untimed``): its pure-PyTorch passes were the
   slowest rows of the run and answer no question of the benchmark;
4. report median and p20/p80 ms per step, bytes moved per step (``providers.bytes_per_param``),
   the bytes kept between steps per param (measured from the provider's tensors),
   effective GB/s, the fraction of that roofline's GB/s, the speedup over
   each stock path, peak memory, the cores other processes kept busy meanwhile, and whether the
   timing is ``unstable`` (too few samples, or a p20-p80 spread above ``--max-spread``).

The ``host`` sweep times the host side of ``step()`` alone on many tiny tensors (see
``configs.py`` [note: host sweep]) and reports ampfused's host time over stock torch-fused's.
The ``passes`` sweep times every pass of the compiled backend alone at a large size (50M on the CPU
plan) against the ``a += b`` stream and torch's own passes (``streaming.py``): GB/s per pass and
its fraction of the roofline, in ``passes.csv`` / ``passes.md``.

Outputs in ``--out`` (default ``bench-results/``): ``bench.csv``, ``bench.md``, ``summary.md`` (the
README's results table) and ``*.png`` (the plots need matplotlib: ``pip install "ampfused[bench]"``).
``python -m ampfused bench train [...]`` runs the end-to-end training benchmark (``bench_train.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

from . import cli, configs, measure, providers, report, streaming
from .environment import Load, environment

# per timed function and case: seconds of its own measured time (at least, at most while noisy), samples at least.
# [note: cpu budget] 0.3 s at most while noisy: on a loaded machine most CPU timings stay noisy to the
# end and are marked unstable anyway; longer only made the default run longer.
BUDGETS = {
    "quick": measure.Budget(0.02, 0.1, min_samples=5, rounds=5),
    "cpu": measure.Budget(0.1, 0.3, min_samples=10),
    "gpu": measure.Budget(0.1, 1.0, min_samples=10),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ampfused bench", description=__doc__.split("\n\n")[0],
                                     epilog="python -m ampfused bench train --help: the end-to-end training benchmark")
    parser.add_argument("--out", default="bench-results", help="output folder (default: bench-results/)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="~30 s smoke run on small sizes (used by the tests)")
    parser.add_argument("--plan", choices=sorted(configs.PLANS), default=None,
                        help="sizes to run (default: quick with --quick, else gpu or cpu by device)")
    parser.add_argument("--sweeps", type=cli.choice_list(configs.SWEEPS), default=configs.SWEEPS,
                        help=f"comma list of: {', '.join(configs.SWEEPS)} (default: all)")
    parser.add_argument("--sizes", type=cli.size_list, default=None, help="override the size sweep, e.g. 1M,10M,100M,1B (the memory sweep takes the largest)")
    from ampfused import _backends

    parser.add_argument("--backends", type=cli.choice_list(_backends.BACKEND_NAMES), default=None,
                        help="comma list of ampfused backends (default: every backend available on the device)")
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="on CPU, also run the Triton backend through the (very slow) Triton interpreter")
    parser.add_argument("--threads", type=cli.positive_int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--gate-steps", type=cli.positive_int, default=2,
                        help="steps compared with stock torch-fused (default 2)")
    parser.add_argument("--max-spread", type=cli.fraction, default=None,
                        help="p20-p80 spread over the median above which a timing is unstable (default 0.15)")
    parser.add_argument("--strict", action="store_true", help="exit with status 3 when any timing is unstable")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def ampfused_backends(device: torch.device, requested, interpreter: bool) -> tuple[list[str], dict[str, str]]:
    """(backends to benchmark, {backend: why it is not benchmarked})."""
    from ampfused import _backends

    names = list(requested) if requested else list(_backends.BACKEND_NAMES)
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


class _SameStatsReference:
    """The memory-mode gate's oracle backend ([note: memory-mode gate]): ``tested``'s stats pass and
    its split of the tensors (``COMPACT_MODES``), the reference passes for every update."""

    def __init__(self, tested):
        from ampfused import reference

        self._reference, self._tested = reference, tested
        self.NAME = f"{tested.NAME}-stats+reference"
        self.COMPACT_MODES = getattr(tested, "COMPACT_MODES", frozenset())
        self.grad_stats_ = tested.grad_stats_
        self.adamw_update_ = reference.adamw_update_

    def __getattr__(self, name):  # accumulate_, scaler_update_, ...: the reference's
        return getattr(self._reference, name)


def gate_steps(provider, args, device) -> None:
    """The steps whose results the gate compares."""
    for _ in range(args.gate_steps):
        provider.restore_grads()
        provider.step()
    if device.type == "cuda":
        torch.cuda.synchronize()


def gate(provider, name, args, device, expected, case=None, data=None):
    """Check a provider that ran ``gate_steps``: (mismatch description or "", fp32 weights if this is the reference)."""
    if name == "torch-fused":  # built first: the reference of the gate
        return "", {k: [t.detach().clone() for t in v] for k, v in provider.results().items()}
    if expected is None and name != "ampfused-reference":
        return "no reference: stock torch-fused failed on this case", None
    if expected is None:  # the memory-mode gate's own oracle run
        return "", None
    mode = providers.memory_mode(name)
    if mode is None:
        return measure.compare(provider.results(), expected), None
    # [note: memory-mode gate] a lossy mode is held to the reference backend running the same mode
    # (the specification of its encodings) under the tested backend's own stats pass: an int8 code
    # is a whole quantization step (up to 1/8 of a moment), so the ulp or two by which two stats
    # passes' norms differ (fp32 vs double sums) flips the codes of elements at a rounding tie, and
    # those masters then differ by a few percent of a step. With the same clip coefficient the
    # moments are bitwise equal and the masters within the fp32 tolerance; the stats pass itself is
    # the same code as the fp32 rows', which are gated against stock. split16 is also held to stock
    # fp32 masters, as every fp32 row (its bitwise equality with fp32 masters, ties aside, is
    # tests/compact's business).
    oracle = providers.make(f"ampfused-reference{providers.MODE}{mode}", case, data, device)
    oracle.opt._backend = _SameStatsReference(provider.opt._get_backend())
    gate_steps(oracle, args, device)
    want = {k: [t.detach().clone() for t in v] for k, v in oracle.results().items()}
    oracle.close()
    mismatch = measure.compare(provider.results(), want)
    if not mismatch and mode == "split16":
        mismatch = measure.compare(provider.results(), expected)
    return (f"vs ampfused-reference@{mode}: {mismatch}" if mismatch else ""), None


def run_case(case, names, device, args, budget, env, progress, untimed=()) -> list[dict]:
    """Gate every provider, then time the ones that passed (but ``untimed``) interleaved; one row per provider."""
    data = providers.CaseData(case, device, args.seed)
    rows = {name: report.base_row(env, case, name) for name in names}
    live, expected = {}, None
    stub = case.host and device.type == "cpu" and "ampfused-triton" in names
    progress.describe(f"{case.config.name} {case.shapes.family} {configs.human(case.shapes.numel)}")
    for name in names:  # built one after the other, so peak memory is each one's own increment
        row = rows[name]
        memory = measure.PeakMemory(device)
        memory.start()
        provider = None
        try:
            provider = providers.make(name, case, data, device)
            if stub and name == "ampfused-triton":  # the interpreter would take minutes at 2000 tensors
                with stubbed_triton_kernels(True):
                    provider.step()
                peak = memory.peak()
                mismatch, reference = "", None
            else:
                gate_steps(provider, args, device)
                peak = memory.peak()  # the provider's own, before the gate builds its oracle twin
                mismatch, reference = gate(provider, name, args, device, expected, case, data)
            expected = reference if reference is not None else expected
            detail = f"gate: {mismatch}" if mismatch else ""
        except Exception as exc:  # a crashing provider is a failed provider, the others still run
            detail = f"{type(exc).__name__}: {exc}"
        if detail:
            row.update(status="FAILED", detail=detail)
            if provider is not None:
                provider.close()
            continue
        kept = provider.state_bytes()
        row.update(peak_mem_mb=peak / 2**20, state_mb=kept / 2**20, kept_bytes_per_param=kept / case.shapes.numel)
        if name in untimed:  # [note: oracle untimed]
            row.update(status="untimed", detail=UNTIMED_NOTE)
            provider.close()
            continue
        live[name] = provider
    fns = {name: p.step for name, p in live.items()}
    copies = {} if case.host else {rows[n]["bytes_per_step"]: None for n in live}
    for nbytes in copies:
        copies[nbytes] = measure.DeviceCopy(nbytes, device)
        fns[f"copy {nbytes}"] = copies[nbytes].fn
    load = Load().start()
    with stubbed_triton_kernels(stub and "ampfused-triton" in live):
        timings = measure.interleaved(fns, device, budget, host=case.host)
    other = load.stop()
    for name, provider in live.items():
        row, timing = rows[name], timings[name]
        if timing.error:
            row.update(status="FAILED", detail=timing.error)
        elif not measure.all_finite(provider.results()):
            row.update(status="FAILED", detail="non-finite weights after the timed steps")
        else:
            row.update(status="ok", median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
                       samples=timing.samples, unstable=timing.unstable, timer="host" if case.host else "device",
                       other_cores=other)
            if stub and name == "ampfused-triton":
                row["detail"] = STUB_NOTE
            copy = timings.get(f"copy {row['bytes_per_step']}")
            if copy is not None and not copy.error:
                row["roofline_gbps"] = copies[row["bytes_per_step"]].gbps(copy)
                if copy.unstable and not row["unstable"]:
                    row["unstable"] = f"roofline stream: {copy.unstable}"
        provider.close()
    copies.clear()
    progress.update(len(names))
    out = [rows[n] for n in names]
    report.add_derived(out)
    return out


UNTIMED_NOTE = "gate passed; the oracle is not timed (--backends naming it times it)"
STUB_NOTE = "Triton kernels stubbed: host time only, not gated (tests/ check the kernels in the interpreter)"


@contextlib.contextmanager
def stubbed_triton_kernels(active: bool):
    """[note: stubbed kernels] On a CPU the Triton backend runs in the interpreter, whose kernel time
    says nothing about a GPU. For the host sweep its timed steps launch nothing (the launch objects
    are no-ops; everything before the launch -- plan checks, tables, uploads -- runs), so its row is
    the host side of a step alone, as on a GPU where launches are asynchronous. Its gate is
    skipped (stubbed launches update nothing); the test suite checks these kernels."""
    if not active:
        yield
        return
    from ampfused.kernels import adamw, stats

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    saved = stats._grad_stats_kernel, adamw._adamw_update_kernel
    stats._grad_stats_kernel = adamw._adamw_update_kernel = NoLaunch()
    try:
        yield
    finally:
        stats._grad_stats_kernel, adamw._adamw_update_kernel = saved


def run_passes(plan_name: str, device: torch.device, backends: list[str], budget, env: dict) -> list[dict]:
    """The ``passes`` sweep: the compiled backend's passes alone (streaming.pass_rows), when it is here."""
    if device.type not in backends:
        print(f"passes sweep: skipped (the compiled {device.type} backend is not available)")
        return []
    return streaming.pass_rows(configs.PASSES_NUMEL[plan_name], configs.PASSES_TENSORS, device, budget, env,
                               backend_name=device.type)


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


def case_providers(case, names) -> list[str]:
    """The host sweep compares torch-fused (with or without clipping) with ampfused: foreach is not its question.
    keep_scaled_grads changes nothing without a scaler: its row is in scaled cases only. The memory modes'
    rows are the memory sweep's (which has no keep_scaled_grads row: bf16 runs unscaled)."""
    memory = "memory" in case.sweeps
    names = [n for n in names if (providers.MODE in n) == memory or (memory and providers.MODE not in n and
                                                                     not n.endswith(providers.KEEP_SCALED))]
    names = [n for n in names if case.config.loss_scaling or not n.endswith(providers.KEEP_SCALED)]
    return [n for n in names if n != "torch-foreach"] if case.host else names


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["train"]:  # `python -m ampfused bench train ...`: the end-to-end benchmark
        from . import bench_train

        return bench_train.main(argv[1:], prog="python -m ampfused bench train")
    parser = build_parser()
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
    args.threads = args.threads or len(os.sched_getaffinity(0))  # arguments checked: now change the process
    torch.set_num_threads(args.threads)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # see providers.py [note: synthesized gradients]
    budget = BUDGETS[plan_name]
    if args.max_spread is not None:
        budget = measure.Budget(budget.min_s, budget.max_s, budget.min_samples, args.max_spread, budget.rounds)

    cases = configs.plan(plan_name, args.sweeps, args.sizes)
    names = ["torch-fused", "torch-foreach"] + [f"ampfused-{b}" for b in backends]
    oracle_only = "reference" in backends and len(backends) > 1 and "reference" not in (args.backends or ())
    untimed = {"ampfused-reference"} if oracle_only else set()
    if backends:  # scaled rows both ways (p.grad unscaled, as torch, or kept scaled), for the first backend
        names.insert(3, f"ampfused-{backends[0]}{providers.KEEP_SCALED}")
        if "memory" in args.sweeps:  # and the memory modes of DESIGN §9 (configs [note: memory modes])
            names += [f"ampfused-{backends[0]}{providers.MODE}{mode}" for mode in configs.MEMORY_MODES]
    env = environment(device, args.threads)
    env.update(plan=plan_name, command=" ".join(["python -m ampfused bench", *argv]))
    print(f"ampfused bench: {len(cases)} cases x {len(names)} providers on {env['hardware']} "
          f"(torch {env['torch']}, triton {env['triton']})")
    print(f"ampfused backends: {', '.join(backends) or 'none'}" +
          "".join(f"\n  not benchmarked: {k}: {v}" for k, v in skipped.items()))
    if "host" in args.sweeps and device.type == "cpu" and "triton" in backends:
        print(f"host sweep, ampfused-triton: {STUB_NOTE}")

    rows = []
    started = time.perf_counter()
    load = Load().start()
    warm_up(names, device)
    progress = cli.Progress(sum(len(case_providers(c, names)) for c in cases), unit="run")
    try:
        for case in cases:
            rows += run_case(case, case_providers(case, names), device, args, budget, env, progress, untimed)
    finally:
        progress.close()
    pass_rows = run_passes(plan_name, device, backends, budget, env) if "passes" in args.sweeps else []
    env.update(other_cores=f"{load.stop():.2f}", loadavg_after=load.loadavg_after,
               wall_s=f"{time.perf_counter() - started:.0f}")

    os.makedirs(args.out, exist_ok=True)
    paths, plot_problem = report.write_all(rows, env, backends, skipped, budget, args.out)
    if pass_rows:
        paths += streaming.write(pass_rows, args.out, "ampfused passes against the a += b stream", env, stem="passes")
        print(streaming.markdown(pass_rows, "Passes against the a += b stream", env))
    print(report.markdown_summary(rows))
    print(report.load_line(env))
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
