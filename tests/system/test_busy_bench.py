"""`python -m ampfused bench busy`: a tiny run gives its rows with the gate passed, the spinners
never outlive the sweep, and the gate sees a moment that differs. Timings are not asserted (the
numbers are docs/results/cpu-busy.md's)."""
import os
import subprocess
import sys

import pytest
import torch

from ampfused import _compiled
from ampfused.__main__ import COMMANDS
from ampfused.bench import busy

needs_cpu_backend = pytest.mark.skipif(_compiled.load()[0] is None, reason="ampfused._C (the cpu backend) is not built")


@needs_cpu_backend
def test_tiny_busy_sweep_gives_its_rows_and_passes_the_gate(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ampfused", "bench", "busy", "--quick", "--shapes", "148x16",
                           "--threads", "1", "--threads", "2", "--spinners", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 spinning process(es)" in proc.stdout
    assert "correctness gate: PASSED (6 rows" in proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 148x16 ")]
    assert sorted((r[2].strip(), r[3].strip()) for r in rows) == [("accumulate", "1"), ("accumulate", "2"), ("clip", "1"),
                                                                  ("clip", "2"), ("plain", "1"), ("plain", "2")]
    for r in rows:
        torch_ms, ours_ms, ratio = (float(r[i].split()[0].rstrip("*")) for i in (4, 5, 6))
        assert torch_ms > 0 and ours_ms > 0 and ratio == pytest.approx(ours_ms / torch_ms, rel=0.02, abs=0.01)


def test_spinners_spin_and_end_even_on_error():
    with pytest.raises(RuntimeError, match="inside"):
        with busy.spinners(2) as procs:
            assert len(procs) == 2 and all(p.is_alive() for p in procs)
            raise RuntimeError("inside")
    assert not any(p.is_alive() for p in procs)


@needs_cpu_backend
def test_accumulation_row_gates_the_hook_op_against_torch_add():
    """The accumulate row's two sides are the hook's op and torch's add_; the gate sees a buffer that differs."""
    params, grads = busy._tensors((5, 70_000), seed=0)
    sides = {kind: busy._Accumulation(kind, params, grads) for kind in ("torch", "ampfused")}
    for side in sides.values():
        side.step()
        side.step()
    assert busy.compare(sides["ampfused"].results(), sides["torch"].results()) == ""
    sides["ampfused"].main_grads[1][7] += 1.0
    assert busy.compare(sides["ampfused"].results(), sides["torch"].results()).startswith("main_grad[1] element 7:")


def test_gate_names_a_moment_that_differs():
    a = {"param": [torch.ones(4)], "exp_avg": [torch.zeros(4)], "exp_avg_sq": [torch.zeros(4)]}
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    assert busy.compare(a, b) == ""
    b["exp_avg_sq"][0][2] = 1e-3
    assert busy.compare(a, b).startswith("exp_avg_sq[0] element 2:")


def test_busy_is_listed_and_has_its_help(capsys):
    assert "  bench busy " in COMMANDS
    with pytest.raises(SystemExit) as exit_:
        busy.main(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m ampfused bench busy ")
