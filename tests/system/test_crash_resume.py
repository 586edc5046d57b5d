"""Crash and resume: a training subprocess killed with SIGKILL mid-run, or inside a
checkpoint save, resumes from its last valid checkpoint bitwise identically to an uninterrupted run,
for fp32 params (autocast) and for bf16 params with master weights and fp32 accumulation."""
import os
import random
import runpy
import signal
import subprocess
import sys

import pytest
import torch

import ampfused.checkpoint as ckpt

WORKER = os.path.join(os.path.dirname(__file__), "crash_resume_worker.py")
STEPS = 14
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")


def run_trainer(directory, *extra, kill_after=None):
    """Run the worker; with kill_after=N, SIGKILL it as soon as it reports step N."""
    proc = subprocess.Popen([sys.executable, WORKER, str(directory), str(STEPS), *extra]
                            + (["--slow-after", str(kill_after)] if kill_after else []),
                            cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if kill_after is not None and line.strip() == f"step {kill_after}":
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=300)
    return proc.returncode, "".join(out), proc.stderr.read()


def run_in_process(directory):
    """The uninterrupted run, in this process (saves a ~3 s subprocess start); RNGs are restored after."""
    argv, py_state = sys.argv, random.getstate()
    sys.argv = [WORKER, str(directory), str(STEPS)]
    try:
        with torch.random.fork_rng(devices=[]):
            with pytest.raises(SystemExit) as exit_info:
                runpy.run_path(WORKER, run_name="__main__")
    finally:
        sys.argv = argv
        random.setstate(py_state)
    assert exit_info.value.code == 0


def assert_bitwise_same_run(a, b):
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert a["losses"] == b["losses"]
    for dtype in ("torch.float32", "torch.bfloat16"):
        model_a, model_b, opt_a, opt_b = a[f"{dtype}/model"], b[f"{dtype}/model"], a[f"{dtype}/optimizer"], b[f"{dtype}/optimizer"]
        for key in model_a:
            assert torch.equal(model_a[key], model_b[key]), (dtype, key)
        assert opt_a["param_groups"] == opt_b["param_groups"]
        for index, state in opt_a["state"].items():
            assert ("master_param" in state) == (dtype == "torch.bfloat16")
            for key, value in state.items():
                assert torch.equal(value, opt_b["state"][index][key]), (dtype, index, key)
        for key in ("scaler", "scheduler"):
            assert a[f"{dtype}/{key}"] == b[f"{dtype}/{key}"], (dtype, key)


def test_sigkill_in_save_and_mid_run_then_resume_is_bitwise_identical(tmp_path):
    """Each subprocess pays ~7 s of imports (torch, then torch._dynamo on the first
    optimizer), so this runs on the default backend only and trains the fp32 and the bf16 model in
    the same processes; the per-backend state-dict round trip is in test_skip_and_state_dict.py."""
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    clean.mkdir(), crashed.mkdir()
    run_in_process(clean)

    # 1. killed inside the third save: the data is in a temp file that never got its final name
    rc, out, err = run_trainer(crashed, "--die-in-save", "3")
    assert rc == -signal.SIGKILL, err
    names = sorted(os.listdir(crashed / "ckpt"))
    assert [n for n in names if n.endswith(".pt")] == ["step0003.pt", "step0006.pt"], names
    leftovers = [n for n in names if n.endswith(".tmp")]
    assert leftovers, "the kill should have left the temporary file of the third save"
    # a non-atomic writer killed half-way leaves a truncated file under the final name: never valid
    whole = (crashed / "ckpt" / leftovers[0]).read_bytes()
    (crashed / "ckpt" / "step0009.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ckpt.CheckpointError, match="not a complete"):
        ckpt.load(crashed / "ckpt" / "step0009.pt")
    assert ckpt.latest(crashed / "ckpt").endswith("step0006.pt")

    # 2. resumed, then killed mid-run after step 11 (the checkpoint of step 9 replaced the bad file)
    rc, out, err = run_trainer(crashed, "--resume", kill_after=11)
    assert rc == -signal.SIGKILL, err
    assert "resumed step0006.pt" in out
    assert not (crashed / "final.pt").exists()

    # 3. resumed again: runs to the end, bitwise equal to the run that was never interrupted
    rc, out, err = run_trainer(crashed, "--resume")
    assert rc == 0, err
    assert "resumed step0009.pt" in out
    assert_bitwise_same_run(clean / "final.pt", crashed / "final.pt")


def test_checkpoint_file_checks(tmp_path):
    obj = {"w": torch.arange(10.0), "step": 3}
    ckpt.save(obj, tmp_path / "a.pt")
    assert torch.equal(ckpt.load(tmp_path / "a.pt")["w"], obj["w"])
    assert os.listdir(tmp_path) == ["a.pt"]
    data = bytearray((tmp_path / "a.pt").read_bytes())
    data[100] ^= 0xFF  # one flipped bit in the payload
    (tmp_path / "b.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="checksum"):
        ckpt.load(tmp_path / "b.pt")
    torch.save(obj, tmp_path / "c.pt")  # a plain torch.save file is not a complete ampfused checkpoint
    with pytest.raises(ckpt.CheckpointError, match="end marker"):
        ckpt.load(tmp_path / "c.pt")
    (tmp_path / "d.pt").write_bytes(b"")
    assert ckpt.latest(tmp_path).endswith("a.pt")
    assert ckpt.latest(tmp_path / "missing") is None
