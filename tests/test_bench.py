"""Smoke tests of the benchmarks: `python -m ampfused bench --quick` end to end, its correctness gate,
and a tiny run of the end-to-end training benchmark. Each runs in a subprocess from a directory
outside the repository, as a user would run the installed package."""
import csv
import os
import subprocess
import sys

import pytest


def run(args, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_bench_quick_writes_outputs_and_passes_the_gate(tmp_path):
    out = tmp_path / "results"
    proc = run(["-m", "ampfused", "bench", "--quick", "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness gate: PASSED" in proc.stdout
    for name in ("bench.csv", "bench.md", "size_sweep.png", "configs_speedup.png", "tensors_sweep.png"):
        assert (out / name).stat().st_size > 0, name
    rows = read_rows(out / "bench.csv")
    providers = {r["provider"] for r in rows}
    assert {"torch-foreach", "torch-fused"} <= providers
    assert any(p.startswith("ampfused-") for p in providers)
    assert all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 and float(r["copy_gbps"]) > 0
        assert r["torch"] and r["hardware"] and r["date"]
    fp32 = {r["provider"]: float(r["bytes_per_param"]) for r in rows if r["config"] == "fp32-scaled-clip"}
    assert fp32["torch-fused"] == 48 and fp32["ampfused-reference"] == 32  # DESIGN §4
    assert "| torch-fused |" in (out / "bench.md").read_text()


WRONG_KERNEL = """
import sys
import ampfused.reference as reference
reference.adamw_update_ = lambda *args, **kwargs: None  # a kernel that is fast and wrong: it updates nothing
from ampfused.benchmarks import bench
sys.exit(bench.main(sys.argv[1:]))
"""


def test_bench_gate_rejects_a_wrong_kernel(tmp_path):
    out = tmp_path / "results"
    proc = run(["-c", WRONG_KERNEL, "--quick", "--sweeps", "size", "--sizes", "64K", "--backends", "reference",
                "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness gate: FAILED" in proc.stdout
    rows = {r["provider"]: r for r in read_rows(out / "bench.csv")}
    assert rows["ampfused-reference"]["status"] == "FAILED"
    assert rows["ampfused-reference"]["median_ms"] == ""  # a failed provider posts no number
    assert "gate:" in rows["ampfused-reference"]["detail"]
    assert rows["torch-foreach"]["status"] == "ok"


def test_bench_train_tiny_run_passes_parity(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "train"
    proc = run(["-m", "ampfused.benchmarks.bench_train", "--tiny", "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parity: PASS" in proc.stdout
    for name in ("train.csv", "train.md", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
