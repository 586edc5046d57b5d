"""Smoke tests of the checkout's large-tensor benchmark (benchmarks/streaming.py) and its per-pass study
(benchmarks/passes.py): every pass gets a timing, GB/s and its fraction of the a += b stream, and the
step comparison checks every provider against stock torch before it reports a ratio."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

from ampfused import _compiled

pytestmark = pytest.mark.skipif(_compiled.load()[0] is None, reason="ampfused._C is not built (no compiled CPU passes)")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(args, cwd):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_streaming_reports_passes_and_steps(tmp_path):
    out = tmp_path / "s"
    proc = run_script([str(BENCHMARKS / "streaming.py"), "--size", "64K", "--threads", "1", "--rounds", "3",
                "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = rows(out / "streaming.csv")
    passes = {r["name"]: r for r in table if r["section"] == "passes"}
    assert {"stats: read g (fp32)", "update: fp32 param, g, m, v in place", "accumulate: fp32 += bf16",
            "torch fused AdamW step (fp32)", "roofline: a += b (fp32)"} <= set(passes)
    for r in passes.values():
        assert float(r["gbps"]) > 0 and float(r["roofline_frac"]) > 0, r
    assert float(passes["roofline: a += b (fp32)"]["roofline_frac"]) == pytest.approx(1.0)
    steps = {r["name"]: r for r in table if r["section"] == "steps"}
    assert set(steps) == {"torch-fused", "ampfused-plain", "ampfused-guard", "torch-fused+clip", "ampfused+clip",
                          "torch-fused+scaler+clip", "ampfused+scaler+clip", "ampfused+scaler+clip+keep_scaled_grads"}
    assert steps["ampfused+clip"]["baseline"] == "torch-fused+clip"
    assert steps["ampfused+scaler+clip+keep_scaled_grads"]["baseline"] == "torch-fused+scaler+clip"
    assert int(steps["ampfused+scaler+clip"]["bytes_per_elem"]) == 36
    assert float(steps["ampfused-plain"]["speedup_vs_baseline"]) > 0
    assert "% of a += b" in (out / "streaming.md").read_text()


@pytest.mark.slow
def test_passes_study_writes_its_table(tmp_path):
    out = tmp_path / "b"
    proc = run_script([str(BENCHMARKS / "passes.py"), "--quick", "--device", "cpu", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stats: read g (fp32)" in proc.stdout  # the per-pass table is printed
    assert "round" in proc.stderr  # with a progress bar of its rounds
    table = rows(out / "passes.csv")
    assert {r["numel"] for r in table} == {"1000000"}
    assert all(float(r["gbps"]) > 0 and r["roofline_gbps"] for r in table)
