"""Smoke tests of the benchmarks: `python -m ampfused bench --quick` end to end, its correctness gate,
the `unstable` marking (with a fake clock) and `--strict`, the thread count it picks from the load,
runs without the optional plotting and progress packages; and the checkout's benchmarks/ (the
end-to-end training benchmark, the README-table writer). Runs of the commands are subprocesses
started outside the repository, as a user would run the installed package (and the checkout's
scripts by their path)."""
import csv
import importlib.util
import json
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampfused
from ampfused import _compiled
from ampfused.bench import configs, environment, measure, report

HAVE_COMPILED = _compiled.load()[0] is not None
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_study(name):
    """A module of the checkout's benchmarks/ folder (not installed), loaded from its file."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ampfused_study_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = load_study("summary")


def run_bench(args, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_bench_quick_writes_outputs_and_passes_the_gate(tmp_path):
    out = tmp_path / "results"
    proc = run_bench(["-m", "ampfused", "bench", "--quick", "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness gate: PASSED" in proc.stdout
    for name in ("bench.csv", "bench.md", "run.json", "size_sweep.png", "configs_speedup.png", "tensors_sweep.png",
                 "host_sweep.png"):
        assert (out / name).stat().st_size > 0, name
    rows = read_rows(out / "bench.csv")
    providers = {r["provider"] for r in rows}
    assert {"torch-foreach", "torch-fused"} <= providers
    assert any(p.startswith("ampfused-") for p in providers)
    # the reference backend is the oracle beside a compiled one: gated on every case, not timed
    oracle = [r for r in rows if r["provider"] == "ampfused-reference"]
    assert oracle and all(r["status"] == "untimed" and r["median_ms"] == "" and "gate passed" in r["detail"] for r in oracle)
    rows = [r for r in rows if r["provider"] != "ampfused-reference"]
    assert all(r["status"] == "ok" for r in rows)
    device_rows = [r for r in rows if r["timer"] == "device"]
    host_rows = [r for r in rows if r["timer"] == "host"]
    assert device_rows and host_rows
    for r in device_rows:
        assert float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 and float(r["roofline_gbps"]) > 0
        assert float(r["roofline_frac"]) <= 1.0 and r["roofline_from"], r  # issue 36 item 6
        # the stream touches the row's own working set (its kept state), to two significant digits
        assert float(r["working_set_mb"]) == pytest.approx(float(r["state_mb"]), rel=0.06)
    for r in rows:
        assert r["torch"] and r["hardware"] and r["date"]
        assert int(r["samples"]) >= 5  # the quick plan's minimum, unless marked unstable for it
        assert float(r["other_cores"]) >= 0
    for r in host_rows:  # stock fused with and without clipping against ampfused, as a host-time ratio
        assert {r["provider"] for r in host_rows} >= {"torch-fused", "ampfused-cpu"}
        assert (r["host_ratio_vs_torch_fused"] != "") == r["provider"].startswith("ampfused-")
    assert {r["clip"] for r in host_rows} == {"True", "False"}
    fp32 = {r["provider"]: float(r["bytes_per_param"]) for r in rows + oracle if r["config"] == "fp32-scaled-clip"}
    assert fp32["torch-fused"] == 48 and fp32["ampfused-reference"] == 36  # docs/design.md §4: 32 + the unscaled p.grad write
    kept = [v for name, v in fp32.items() if name.endswith("+keep_scaled_grads")]
    assert kept and all(v == 32 for v in kept)  # the first backend's row without the p.grad write
    assert "| torch-fused |" in (out / "bench.md").read_text()
    memory = {r["provider"]: r for r in rows if "memory" in r["sweeps"].split("+")}
    modes = {p.split("@", 1)[1]: r for p, r in memory.items() if "@" in p}
    assert set(modes) == set(configs.MEMORY_MODES)  # every mode of DESIGN §9, gated (all rows are ok)
    main = next(r for p, r in memory.items() if p.startswith("ampfused-") and "@" not in p)
    kept = {name: float(r["kept_bytes_per_param"]) for name, r in modes.items()}
    assert 18 <= float(main["kept_bytes_per_param"]) < 18.1  # 2 + 4 + 8 + 4, measured from the tensors
    assert 9 <= kept["split8+int8"] < 9.1 and 16 <= kept["split16"] < 16.1  # (int8: + 8 B of scales per 256)
    assert float(modes["split8+int8"]["bytes_per_param"]) < float(main["bytes_per_param"])
    tables = summary.bench_summary(*summary.read_bench(out))  # the README's tables, from bench.csv and run.json
    assert "Memory modes" in tables and "speed × fp32 masters" in tables
    host = [line for line in tables.splitlines() if line.startswith("| 148 |")]
    assert sorted(line.split(" | ")[2] for line in host) == ["fresh", "same", "same"]  # no two rows read alike
    assert len({tuple(line.split(" | ")[:3]) for line in host}) == 3


WRONG_KERNEL = """
import sys
import ampfused.reference as reference
reference.adamw_update_ = lambda *args, **kwargs: None  # a kernel that is fast and wrong: it updates nothing
from ampfused.bench import bench
sys.exit(bench.main(sys.argv[1:]))
"""


def test_bench_gate_rejects_a_wrong_kernel(tmp_path):
    out = tmp_path / "results"
    proc = run_bench(["-c", WRONG_KERNEL, "--quick", "--sweeps", "size", "--sizes", "64K", "--backends", "reference",
                "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness gate: FAILED" in proc.stdout
    rows = {r["provider"]: r for r in read_rows(out / "bench.csv")}
    assert rows["ampfused-reference"]["status"] == "FAILED"
    assert rows["ampfused-reference"]["median_ms"] == ""  # a failed provider posts no number
    assert "gate:" in rows["ampfused-reference"]["detail"]
    assert rows["torch-foreach"]["status"] == "ok"


@pytest.mark.slow
def test_bench_train_tiny_run_passes_parity(tmp_path):
    """Every memory mode but int4 within 1% of fp32 in 40 tiny steps; int4's 16 levels need longer
    (docs/results/int4-train.md: the 400-step runs), and run in the 12-step harness test below."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "train"
    modes = [m for m in load_study("train_modes").MODES if "int4" not in m]
    proc = run_bench([str(BENCHMARKS / "bench_train.py"), "--tiny", "--modes", ",".join(modes), "--peers", "none",
                      "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parity: PASS" in proc.stdout
    for name in ("train.csv", "train.md", "summary.md", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    rows = {r["variant"]: r for r in read_rows(out / "train.csv")}
    modes = {r["mode"]: r for r in rows.values() if r["mode"]}
    assert set(modes) == {m for m in load_study("train_modes").MODES if "int4" not in m}  # one variant per mode, gated
    assert all(r["parity"] == "PASS" and abs(float(r["rel_diff_vs_fp32"])) <= 0.01 for r in modes.values())
    kept = {m: float(r["kept_bytes_per_param"]) for m, r in modes.items()}
    fp32_masters = float(rows["ampfused-bf16-params"]["kept_bytes_per_param"])
    assert 18 <= fp32_masters < 18.1 and 16 <= kept["split16"] < 16.1 and 15 <= kept["split8"] < 15.1
    assert kept["split8+int8"] < kept["split8"] and 0 < float(modes["split8+int8"]["coded_fraction"]) < 1  # small tensors: fp32
    assert modes["split16"]["identity"].startswith("identical to an fp32-master twin at all 40 steps")
    assert int(modes["split16"]["ties"]) >= 0 and modes["split8"]["identity"] == ""
    assert "ampfused-bf16-params@split16: identical" in (out / "train.md").read_text()


# ---------------------------------------------------------------- timing: interleaving and `unstable`


class FakeClock:
    """A clock that only the timed functions move: each call advances it by its next duration."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def __call__(self):
        return self.now

    def fn(self, name, durations):
        durations = itertools.cycle(durations)

        def step():
            self.calls.append(name)
            self.now += next(durations)

        return step


def test_interleaved_timing_alternates_and_marks_noisy_timings_unstable():
    clock = FakeClock()
    # a burst of 10 calls a round: "spiky" stalls one call in ten (a preemption), "noisy" drifts between rounds
    fns = {"steady": clock.fn("steady", [1e-3]), "spiky": clock.fn("spiky", [1e-3] * 9 + [6e-3]),
           "noisy": clock.fn("noisy", [1e-3] * 10 + [3e-3] * 10)}
    budget = measure.Budget(min_s=0.05, max_s=0.2, min_samples=10, max_spread=0.15, rounds=5)
    timings = measure.interleaved(fns, torch.device("cpu"), budget, clock=clock)
    steady, spiky, noisy = timings["steady"], timings["spiky"], timings["noisy"]
    assert steady.unstable == "" and steady.median_ms == pytest.approx(1.0) and steady.samples >= 50
    assert spiky.unstable == "" and spiky.median_ms == pytest.approx(1.5)  # a round's value: the mean of its burst
    assert noisy.unstable.startswith("p20-p80 spread") and noisy.p20_ms < 1.5 < 2.5 < noisy.p80_ms
    assert len(steady.rounds) == len(noisy.rounds) == len(spiky.rounds) >= budget.rounds
    switches = sum(a != b for a, b in zip(clock.calls, clock.calls[1:]))
    assert switches >= 3 * budget.rounds - 1  # bursts alternate, not one function after the other
    # a noisy function is measured for longer, up to max_s per function, before it is given up on
    assert 0.2 * 3 <= clock.now <= 0.2 * 3 + 0.2
    # speedups are taken round by round: a drift that hits both sides of a round cancels
    assert measure.ratio(noisy, noisy) == pytest.approx((1.0, 1.0, 1.0)) and measure.ratio(noisy, steady)[2] > 2.5


def test_interleaved_timing_marks_too_few_samples_and_reports_errors():
    clock = FakeClock()

    def broken():
        raise RuntimeError("kernel crashed")

    fns = {"slow": clock.fn("slow", [1.0]), "fast": clock.fn("fast", [1e-3]), "broken": broken}
    budget = measure.Budget(min_s=0.01, max_s=0.1, min_samples=10, rounds=5, cap_s=3.0)
    timings = measure.interleaved(fns, torch.device("cpu"), budget, clock=clock)
    assert timings["slow"].unstable.endswith("samples < 10") and timings["slow"].samples < 10
    assert timings["fast"].samples > timings["slow"].samples  # bursts: a fast function gets more calls per round
    assert timings["broken"].error == "RuntimeError: kernel crashed" and math.isnan(timings["broken"].median_ms)


def _rows(unstable_stock: str):
    case = configs.Case(("configs",), configs.shape_set("gpt2-like", 4096), configs.FP32_CLIP)
    env = {"date": "d", "hardware": "h", "torch": "t", "triton": "x", "ampfused": "a", "plan": "quick"}
    rows = []
    for name, ms, unstable in (("torch-fused", 2.0, unstable_stock), ("torch-foreach", 4.0, ""), ("ampfused-cpu", 1.0, "")):
        row = report.base_row(env, case, name)
        row.update(status="ok", timer="device", median_ms=ms, p20_ms=ms * 0.9, p80_ms=ms * 1.1, samples=20,
                   unstable=unstable, roofline_gbps=10.0, other_cores=0.5)
        rows.append(row)
    report.add_derived(rows)
    return rows


def test_unstable_rows_are_marked_in_table_csv_and_summary(tmp_path):
    rows = _rows("p20-p80 spread 40% > 15%")
    by = {r["provider"]: r for r in rows}
    assert by["ampfused-cpu"]["speedup_vs_torch_fused"] == pytest.approx(2.0)
    assert by["ampfused-cpu"]["unstable"] == "compared with unstable torch-fused"  # its ratio is no better than its base
    assert by["torch-foreach"]["unstable"] == ""
    table = report.markdown_table(rows)
    assert "| **unstable**: p20-p80 spread 40% > 15% |" in table and "| stable |" in table
    report.write_csv(rows, tmp_path / "bench.csv")
    assert [r["unstable"] for r in read_rows(tmp_path / "bench.csv")] == [
        "p20-p80 spread 40% > 15%", "", "compared with unstable torch-fused"]
    text = summary.bench_summary(rows, {"date": "d", "hardware": "h", "torch": "t", "triton": "x", "ampfused": "a"})
    assert "2 of 3 timings unstable (marked †)" in text and "2.00 †" in text
    assert "unstable" not in report.markdown_table(_rows(""))


def _stream_rows(rows_spec):
    """Device rows of one case: (provider, GB/s it reached, working set MiB, its a += b stream's GB/s)."""
    case = configs.Case(("configs",), configs.shape_set("few-large", 50_000_000), configs.FP32_CLIP)
    env = {"date": "d", "hardware": "h", "torch": "t", "triton": "x", "ampfused": "a", "plan": "cpu"}
    rows = []
    for name, gbps, working_set_mb, stream_gbps in rows_spec:
        row = report.base_row(env, case, name)
        ms = row["bytes_per_step"] / (gbps * 1e9) * 1e3
        row.update(status="ok", timer="device", median_ms=ms, p20_ms=ms, p80_ms=ms, samples=20, unstable="",
                   roofline_gbps=stream_gbps, working_set_mb=working_set_mb, other_cores=0.0)
        rows.append(row)
    report.add_derived(rows)
    return {r["provider"]: r for r in rows}


def test_no_row_claims_more_than_the_roofline():
    """issue 36 item 6: a provider that streams faster than torch's a += b on a working set at least as
    large sets the roofline (the hardware demonstrably does that much); a faster one on a smaller
    working set (more of it cached) does not lift the roofline of a larger one."""
    by = _stream_rows([("torch-fused", 20.0, 763, 25.0), ("ampfused-cpu", 35.0, 763, 25.0),
                       ("ampfused-cpu@split8+int8", 45.0, 300, 40.0)])
    assert all(r["roofline_frac"] <= 1.0 for r in by.values())
    assert by["ampfused-cpu"]["roofline_frac"] == pytest.approx(1.0)
    assert by["torch-fused"]["roofline_gbps"] == pytest.approx(35.0)
    assert by["torch-fused"]["roofline_frac"] == pytest.approx(20 / 35)
    assert by["torch-fused"]["roofline_from"].startswith("ampfused-cpu's 35.0 GB/s on 763 MiB")
    # the compact row streamed faster than its own stream on 300 MiB: its roofline is itself, not 35 GB/s
    compact = by["ampfused-cpu@split8+int8"]
    assert compact["roofline_gbps"] == pytest.approx(45.0) and compact["roofline_frac"] == pytest.approx(1.0)
    assert "(the a += b stream over 300 MiB: 40.0)" in compact["roofline_from"]
    slower = _stream_rows([("torch-fused", 20.0, 763, 25.0), ("ampfused-cpu", 24.0, 763, 25.0)])
    assert slower["ampfused-cpu"]["roofline_gbps"] == 25.0 and slower["ampfused-cpu"]["roofline_frac"] == pytest.approx(0.96)


def test_the_roofline_stream_touches_the_working_set_it_is_given():
    copy = measure.DeviceCopy.over_working_set(3 << 20, torch.device("cpu"))
    assert copy.working_set == pytest.approx(3 << 20, rel=1e-3)  # a and b together
    assert copy.moved == pytest.approx(1.5 * copy.working_set)  # one sweep reads a and b and writes a
    assert measure.stream_key(800_123_456) == measure.stream_key(801_000_000) == 8.0e8


@pytest.mark.parametrize("average,peak,threads,marked", [
    (0.05, 0.10, 2, False),  # an idle machine's own noise
    (0.30, 1.00, 2, True),   # a burst from another process in one window
    (1.00, 1.10, 1, False),  # on 2 cores, one thread beside one busy core: what the thread choice allowed
    (1.60, 1.90, 1, True),   # more than the one core the thread left free
])
def test_load_from_other_processes_beyond_the_free_cores_marks_a_timing(monkeypatch, average, peak, threads, marked):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    why = environment.overlapping_load(average, peak, threads)
    assert bool(why) == marked
    if marked:
        assert f"{average:.2f} cores busy on average, {peak:.2f} at peak" in why


def test_load_windows_catch_a_burst_the_average_dilutes(monkeypatch):
    """Three 0.5 s windows, another process busy on one core in the second only: the average says a
    third of a core, the peak window one core."""
    ticks = iter([0.0, 0.0, 0.6, 0.6, 1.2, 1.2, 1.8, 1.8, 1.8])  # start, then one window per tick
    # (machine busy jiffies, total jiffies over 2 cores, our own jiffies): 2 x 50 jiffies of wall per window
    samples = iter([(0, 0, 0), (0, 0, 0), (10, 100, 10), (70, 200, 20), (80, 300, 30), (80, 300, 30)])
    monkeypatch.setattr(environment, "_sample", lambda: next(samples))
    windows = environment.LoadWindows(window_s=0.5, clock=lambda: next(ticks)).start()
    for _ in range(3):
        windows.tick()
    average, peak = windows.stop()
    assert windows.windows == pytest.approx([0.0, 1.0, 0.0])
    assert average == pytest.approx(1 / 3) and peak == pytest.approx(1.0)


def test_a_case_timed_under_load_marks_its_rows_unstable(monkeypatch):
    """The load measured during a case lands in that case's own rows (not only in the run's footer)."""
    from ampfused.bench import bench

    class Loaded:  # other processes kept 1.5 cores of 2 busy while the case was timed
        def start(self):
            return self

        def tick(self):
            pass

        def stop(self):
            return 1.5, 1.9

    monkeypatch.setattr(bench, "LoadWindows", Loaded)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    case = configs.Case(("size",), configs.shape_set("few-large", 4096), configs.FP32_CLIP)
    args = bench.build_parser().parse_args(["--quick"])
    args.threads = 1
    env = {"date": "d", "hardware": "h", "torch": "t", "triton": "x", "ampfused": "a", "plan": "quick"}

    class Quiet:
        def describe(self, text):
            pass

        def update(self, n=1):
            pass

    rows = bench.run_case(case, ["torch-fused", "ampfused-reference"], torch.device("cpu"), args,
                          bench.BUDGETS["quick"], env, Quiet())
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for r in rows:
        assert r["unstable"].startswith("other processes kept 1.50 cores busy on average, 1.90 at peak"), r["unstable"]
        assert r["other_cores"] == 1.5 and r["other_cores_peak"] == 1.9
        assert r["roofline_frac"] <= 1.0 and r["roofline_from"]
    assert "1.50 (1.90)" in report.markdown_table(rows)


def test_strict_fails_the_run_on_unstable_timings(tmp_path):
    args = ["-m", "ampfused", "bench", "--quick", "--sweeps", "size", "--sizes", "64K", "--backends", "reference",
            "--max-spread", "1e-9"]  # no real timing is that steady
    proc = run_bench([*args, "--out", str(tmp_path / "a"), "--strict"], cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    # torch x2, ampfused, ampfused+keep_scaled_grads
    assert "--strict: 4 unstable timings" in proc.stderr and "correctness gate: PASSED" in proc.stdout
    rows = read_rows(tmp_path / "a" / "bench.csv")
    assert all(r["unstable"] for r in rows)
    assert "**unstable**" in (tmp_path / "a" / "bench.md").read_text()
    assert "4 of 4 timings unstable" in summary.bench_summary(*summary.read_bench(tmp_path / "a"))


# ---------------------------------------------------------------- optional dependencies

WITHOUT_BENCH_EXTRA = """
import sys
sys.modules["matplotlib"] = None  # import matplotlib raises ImportError, as when it is not installed
sys.modules["tqdm"] = None
from ampfused.bench import bench
sys.exit(bench.main(sys.argv[1:]))
"""


def test_bench_without_matplotlib_still_writes_csv_and_markdown(tmp_path):
    out = tmp_path / "results"
    proc = run_bench(["-c", WITHOUT_BENCH_EXTRA, "--quick", "--sweeps", "size", "--sizes", "64K", "--backends", "reference",
                "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "bench.csv").stat().st_size > 0 and "| torch-fused |" in (out / "bench.md").read_text()
    assert (out / "run.json").exists() and not list(out.glob("*.png"))
    assert 'matplotlib is not installed; `pip install "ampfused[bench]"` for the PNG plots' in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_train_without_matplotlib_still_writes_csv_and_markdown(tmp_path):
    out = tmp_path / "train"
    code = WITHOUT_BENCH_EXTRA.replace("from ampfused.bench import bench",
                                       f"sys.path.insert(0, {str(BENCHMARKS)!r})\nimport bench_train as bench")
    # the int4 modes through the harness (12 steps: the loss gate loosened, the outputs are what is tested)
    proc = run_bench(["-c", code, "--tiny", "--steps", "12", "--modes", "split8+int4,no-master+sr+int4", "--peers", "none",
                      "--tolerance", "0.05", "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "train.csv").exists() and (out / "train.md").exists() and not (out / "loss_curves.png").exists()
    coded = {r["mode"]: float(r["coded_fraction"]) for r in read_rows(out / "train.csv") if r["mode"]}
    assert set(coded) == {"split8+int4", "no-master+sr+int4"} and all(0 < f < 1 for f in coded.values())
    assert '`pip install "ampfused[bench]"` for loss_curves.png' in proc.stderr


def test_summary_command_pastes_the_tables_into_the_readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench-summary -->\nold table\n<!-- end -->\nmiddle\n<!-- train-summary -->\nold\n<!-- end -->\n")
    (tmp_path / "b").mkdir()
    rows = _rows("")
    report.write_csv(rows, tmp_path / "b" / "bench.csv")
    env = {"date": "d", "hardware": "h", "torch": "t", "triton": "x", "ampfused": "a", "command": "python -m ampfused bench",
           "wall_s": "99", "other_cores": "1.00", "untrusted": ""}
    (tmp_path / "b" / "run.json").write_text(json.dumps(env))
    assert summary.main(["--bench", str(tmp_path / "b"), "--readme", str(readme)]) == 0
    table = summary.bench_summary(rows, env)  # the CSV's rows give the table the rows themselves give
    assert (tmp_path / "b" / "summary.md").read_text() == table + "\n" and "| 2.00 |" in table and "99 s wall" in table
    assert readme.read_text() == (f"intro\n<!-- bench-summary -->\n{table}\n<!-- end -->\nmiddle\n"
                                  "<!-- train-summary -->\nold\n<!-- end -->\n")
    loaded = summary.bench_summary(rows, {**env, "command": "python -m ampfused bench --out /tmp/x --quick",
                                          "untrusted": "no thread count fits the free cores"})
    assert "`python -m ampfused bench --quick`" in loaded and "/tmp/x" not in loaded  # no path of the machine
    assert "**no thread count fits the free cores.**" in loaded
    with pytest.raises(SystemExit) as exit_info:  # a folder without a run is an argument error, not a traceback
        summary.main(["--train", str(tmp_path / "missing"), "--readme", str(readme)])
    assert exit_info.value.code == 2


def test_plain_step_benchmark_checks_results_before_it_reports(capsys):
    plain_step = load_study("plain_step")

    plain_step.main(total=20_000, rounds=2)
    out = capsys.readouterr().out
    assert "1 thread(s)" in out and "2 thread(s)" in out and "torch" in out and "ampfused" in out


def test_plain_step_gate_rejects_a_diverging_optimizer():
    plain_step = load_study("plain_step")

    sizes = [100, 30]
    ref, other = plain_step._optimizer("torch", sizes, None), plain_step._optimizer("torch", sizes, None)
    for opt in (ref, other):
        opt.step()
    with torch.no_grad():
        other.param_groups[0]["params"][1][3] += 1e-3
    with pytest.raises(AssertionError, match="params differ"):
        plain_step._check_same(ref, other, "broken")


@pytest.mark.skipif(not HAVE_COMPILED, reason="needs the compiled cpu backend (ampfused._C)")
def test_grad_stats_placement_benchmark_runs_and_agrees(capsys):
    grad_stats_placement = load_study("grad_stats_placement")

    grad_stats_placement.main(total=20_000, rounds=2)
    out = capsys.readouterr().out
    assert out.count("as the pass in step()") == 2


def test_split16_twin_counts_ties_and_catches_a_master_off_by_more_than_the_tie_rule():
    """bench train's identity check of split16 (train_modes [note: split16 lockstep twin]) on its own."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5000).mul_(0.02).bfloat16())]
    twin = load_study("train_modes").Split16Twin(params, lr=3e-3, backend="reference")
    opt = ampfused.FusedAmpAdamW(params, lr=3e-3, backend="reference", master_weights="split16")
    for step in range(30):
        params[0].main_grad.copy_(torch.randn(5000).mul_(1e-3))
        params[0].grad = params[0].main_grad
        twin.step(params)
        opt.step()
        opt.zero_grad()
        twin.check(params, opt, step)
    assert twin.verdict().startswith("identical to an fp32-master twin at all 30 steps"), twin.verdict()
    ties = twin.ties  # a tie is 2^-16 of the elements per step: a few in 150K element-steps
    assert ties > 0 and f"but at {ties} ties" in twin.verdict()
    opt.state[params[0]]["master_low16"][7] += 2  # two fp32 ulps off, at an element that is no tie
    params[0].main_grad.zero_()
    params[0].grad = params[0].main_grad
    twin.step(params)
    opt.step()
    twin.check(params, opt, 30)
    assert twin.verdict().startswith("NOT identical to fp32 masters: step 30, param 0: master differs")


# ---------------------------------------------------------------- threads that fit the free cores


@pytest.mark.parametrize("requested, other, threads, trusted", [
    (None, 0.05, 2, True),   # idle: every core
    (None, 1.0, 1, True),    # one spinning neighbour on 2 cores: 1 thread
    (None, 0.6, 1, True),    # most of a core taken: it is not free
    (None, 1.9, 1, False),   # no core free: no setting fits
    (2, 1.0, 2, False),      # --threads wins, but 2 threads do not fit 1 free core
    (1, 1.0, 1, True),
])
def test_threads_follow_the_free_cores(monkeypatch, requested, other, threads, trusted):
    monkeypatch.setattr(environment.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(environment.os, "cpu_count", lambda: 2)
    got, line, untrusted = environment.pick_threads(requested, other=other)
    assert got == threads and line.startswith(f"threads: {threads} of 2 cores") and f"kept {other:.2f} of 2" in line
    assert (untrusted == "") == trusted and (trusted or "not to be trusted" in untrusted)
    assert (f"compare them with `--threads {threads}` runs" in line) == (threads < 2 and requested is None)


def test_bench_header_names_the_threads_and_the_load(tmp_path):
    out = tmp_path / "r"
    proc = run_bench(["-m", "ampfused", "bench", "--quick", "--sweeps", "size", "--sizes", "64K", "--backends", "reference",
                "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("threads: "))
    env = json.loads((out / "run.json").read_text())
    assert line.startswith(f"threads: {env['threads']} of ") and "busy in the 1 s before the start" in line
    assert ("not to be trusted" in proc.stdout) == bool(env["untrusted"])  # said where it applies, and only there
    assert ("**not to be trusted**" in (out / "bench.md").read_text()) == bool(env["untrusted"])
    assert f"- {line}\n" in (out / "bench.md").read_text()  # the report says it too


def test_host_only_runs_the_triton_host_side_and_launches_nothing():
    """The seam the host sweep times the Triton backend through on a CPU (ampfused.kernels.host_only)."""
    from ampfused import _backends

    module, why = _backends.probe("triton")
    if module is None or _backends._device_reason(module, torch.device("cpu")):
        pytest.skip(f"the Triton backend cannot run on CPU tensors here: {why or 'TRITON_INTERPRET is not set'}")
    from ampfused import kernels

    params = [torch.nn.Parameter(torch.ones(300)) for _ in range(3)]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt = ampfused.FusedAmpAdamW(params, lr=0.1, backend="triton", max_grad_norm=1.0)
    with kernels.host_only():
        opt.step()  # tables built, arguments checked, nothing launched
    assert all(torch.equal(p, torch.ones(300)) for p in params) and opt.state[params[0]]["exp_avg"].abs().sum() == 0
    opt.step()  # and outside it the same optimizer steps
    assert all(bool((p < 1).all()) for p in params)


# ---------------------------------------------------------------- benchmarks/busy.py (the busy-cores study)


@pytest.mark.skipif(not HAVE_COMPILED, reason="needs the compiled cpu backend (ampfused._C)")
def test_tiny_busy_sweep_gives_its_rows_and_passes_the_gate(tmp_path):
    proc = run_bench([str(BENCHMARKS / "busy.py"), "--quick", "--shapes", "148x16", "--threads", "1", "--threads", "2",
                      "--spinners", "1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 spinning process(es)" in proc.stdout and "correctness gate: PASSED (6 rows" in proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 148x16 ")]
    assert sorted((r[2].strip(), r[3].strip()) for r in rows) == [("accumulate", "1"), ("accumulate", "2"), ("clip", "1"),
                                                                  ("clip", "2"), ("plain", "1"), ("plain", "2")]
    for r in rows:
        torch_ms, ours_ms, ratio = (float(r[i].split()[0].rstrip("*")) for i in (4, 5, 6))
        assert torch_ms > 0 and ours_ms > 0 and ratio == pytest.approx(ours_ms / torch_ms, rel=0.02, abs=0.01)


def test_busy_spinners_end_even_on_error():
    busy = load_study("busy")
    with pytest.raises(RuntimeError, match="inside"):
        with busy.spinners(2) as procs:
            assert len(procs) == 2 and all(p.is_alive() for p in procs)
            raise RuntimeError("inside")
    assert not any(p.is_alive() for p in procs)


@pytest.mark.skipif(not HAVE_COMPILED, reason="needs the compiled cpu backend (ampfused._C)")
def test_busy_gate_sees_a_buffer_or_moment_that_differs():
    """The accumulate row's two sides are the hook's op and torch's add_; the gate sees what differs."""
    busy = load_study("busy")
    params, grads = busy._tensors((5, 70_000), seed=0)
    sides = {kind: busy._Accumulation(kind, params, grads) for kind in ("torch", "ampfused")}
    for side in sides.values():
        side.step()
        side.step()
    assert busy.compare(sides["ampfused"].results(), sides["torch"].results()) == ""
    sides["ampfused"].main_grads[1][7] += 1.0
    assert busy.compare(sides["ampfused"].results(), sides["torch"].results()).startswith("main_grad[1] element 7:")
    a = {"param": [torch.ones(4)], "exp_avg": [torch.zeros(4)], "exp_avg_sq": [torch.zeros(4)]}
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    b["exp_avg_sq"][0][2] = 1e-3
    assert busy.compare(a, b).startswith("exp_avg_sq[0] element 2:")


def test_busy_left_the_installed_command_for_the_checkout(tmp_path, capsys):
    proc = run_bench(["-m", "ampfused", "bench", "busy", "--quick"], cwd=tmp_path)
    assert proc.returncode == 2 and "python benchmarks/busy.py" in proc.stderr and "Traceback" not in proc.stderr
    from ampfused.bench import bench

    with pytest.raises(SystemExit) as exit_:
        bench.main(["busy"])
    assert exit_.value.code == 2 and "from a checkout: python benchmarks/busy.py" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        load_study("busy").main(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: python benchmarks/busy.py ")
