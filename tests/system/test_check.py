"""`python -m ampfused check` passes on every backend available here, and fails, naming the case, the
tensor or state key and the first bad element, when a backend is broken (a fake one, in process) --
the reference too: its oracle is torch (and the executable spec), never a backend."""
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import ampfused
from ampfused.__main__ import main as ampfused_main
from ampfused import _backends, _gpu_advice, check, reference
from ampfused._contract import SKIP
from helpers import DEVICE, available_backends

SOURCE_ROOT = str(Path(ampfused.__file__).resolve().parents[1])  # the tree this test imports (editable or installed)
ROW = re.compile(r"^(\w+)\s+(cpu|cuda)\s+(\S+)\s+(pass|FAIL)\s+(\S+)\s+([\d.]+)s$")


def check_table(out):
    """(backend, device, case, result) of every row of the printed table."""
    return [m.groups()[:4] for m in map(ROW.match, out.splitlines()) if m]


def expected_rows():
    devices = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    rows = set()
    for name in _backends.BACKEND_NAMES:
        device = next((d for d in devices if name in available_backends(torch.device(d))), None)
        if device is not None:
            rows |= {(name, device, case.name) for case in check.CASES if check.applies(case, name, torch.device(device))}
    return rows


def test_passes_on_every_available_backend_from_a_shell(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "ampfused", "check"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_table(proc.stdout)
    assert {(b, d, c) for b, d, c, _ in rows} == expected_rows(), proc.stdout
    assert all(result == "pass" for *_, result in rows), proc.stdout
    assert f"all {len(rows)} passed" in proc.stdout.splitlines()[-1]


def test_passes_in_process_on_the_reference(capsys):
    assert check.main(["--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert {c for _, _, c, r in check_table(out) if r == "pass"} == {c.name for c in check.CASES if not c.graph}


# ------------------------------------------------------------------ the check can fail


def fake_backend(**overrides):
    """The reference's passes under another name, with some of them replaced."""
    names = ("supports", "accumulate_", "grad_stats_", "adamw_update_", "scaler_update_", "COMPACT_MODES")
    fake = types.SimpleNamespace(NAME="cpu", **{n: getattr(reference, n) for n in names})
    for name, value in overrides.items():
        setattr(fake, name, value)
    return fake


def one_element_off(batch, *args, **kwargs):
    reference.adamw_update_(batch, *args, **kwargs)
    with torch.no_grad():
        batch.params[0].view(-1)[5] += 1e-3


def ignores_the_skip_flag(batch, stats, **kwargs):
    stats = stats.clone()
    stats[SKIP] = 0
    reference.adamw_update_(batch, stats, **kwargs)


def scale_off_by_an_ulp(found_inf, scale, *args, **kwargs):
    reference.scaler_update_(found_inf, scale, *args, **kwargs)
    scale.copy_(torch.nextafter(scale, torch.full_like(scale, torch.inf)))


BROKEN = {  # how the fake is broken -> a case and the start of the failure line it must print
    "one_element_off": (dict(adamw_update_=one_element_off), "fp32", "step 0: param 0 at index (0, 5): got "),
    "ignores_the_skip_flag": (dict(adamw_update_=ignores_the_skip_flag), "fp16-bf16-scaler-clip",
                              "step 1: param 0 at index (0, 0): got "),
    "scale_off_by_an_ulp": (dict(scaler_update_=scale_off_by_an_ulp), "fp16-bf16-scaler-clip",
                            "step 0: scaler scale: got 3000.000244140625, expected 3000.0 (bitwise)"),
}


@pytest.mark.parametrize("how", BROKEN)
def test_a_broken_backend_fails_naming_the_case_and_the_element(monkeypatch, capsys, how):
    overrides, case, failure = BROKEN[how]
    monkeypatch.setitem(_backends._probed, "cpu", (fake_backend(**overrides), ""))
    monkeypatch.setattr(ampfused.scaler, "_scaler_passes", {})  # the scaler finds its pass anew (the fake's)
    assert check.main(["--backend", "cpu", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert ("cpu", "cpu", case, "FAIL") in check_table(out), out
    lines = [line for line in out.splitlines() if line.startswith(f"FAILED cpu/{case}: ")]
    assert lines and lines[0].startswith(f"FAILED cpu/{case}: {failure}"), out
    assert re.search(r"got \S+, expected \S+", lines[0]), lines[0]
    if how == "ignores_the_skip_flag":
        assert "across a skipped step" in lines[0]
    assert "failed" in out.splitlines()[-1]


class OneElementOff:
    """A real backend whose update pass writes one wrong element into the first param after doing its job
    (off by more than a bf16 ulp, so a 16-bit param shows it too)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def adamw_update_(self, batch, *args, **kwargs):
        self._real.adamw_update_(batch, *args, **kwargs)
        with torch.no_grad():
            batch.params[0].view(-1)[5] += 0.05


def test_every_backend_broken_fails_every_case_it_runs(monkeypatch, capsys, backend):
    """The reference included: no row holds a backend to itself, so a wrong result always shows."""
    real, _ = _backends.probe(backend)
    monkeypatch.setitem(_backends._probed, backend, (OneElementOff(real), ""))
    assert check.main(["--backend", backend, "--device", DEVICE.type]) == 1
    out = capsys.readouterr().out
    cases = {c.name for c in check.CASES if check.applies(c, backend, DEVICE)}
    assert {(c, r) for b, _, c, r in check_table(out) if b == backend} == {(c, "FAIL") for c in cases}, out
    first = next(line for line in out.splitlines() if line.startswith(f"FAILED {backend}/fp32: "))
    assert first.startswith(f"FAILED {backend}/fp32: step 0: param 0 at index (0, 5): got "), first
    assert f"{len(cases)} of {len(cases)} failed" in out.splitlines()[-1]


class NoPasses:
    """A backend whose every pass raises: what the oracle must never call."""

    NAME = "none"

    def supports(self, device):
        return None

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"the oracle called a backend's {name}")
        return refuse


def test_the_oracle_runs_no_backend(monkeypatch):
    for name in _backends.BACKEND_NAMES:
        monkeypatch.setitem(_backends._probed, name, (NoPasses(), ""))
    monkeypatch.setattr(ampfused.scaler, "_scaler_passes", {})
    for case in check.CASES:
        if not case.graph:
            snaps = check.oracle_trajectory(case, DEVICE)
            assert len(snaps) == case.steps and snaps[-1][("param", 0)].dtype == case.params[0][1]


def test_a_backend_asked_for_but_unavailable_fails(monkeypatch, capsys):
    """On a GPU machine the probe's reason is passed on (without a GPU the line says that instead: test_cli)."""
    monkeypatch.setattr(_gpu_advice, "machine_has_gpu", lambda: True)
    monkeypatch.setitem(_backends._probed, "cuda", (None, "no CUDA build here"))
    assert check.main(["--backend", "cuda", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAILED cuda: not checked: " in out and "no CUDA build here" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_says_so(capsys):
    assert check.main(["--device", "cuda"]) == 1
    assert "CUDA is not available" in capsys.readouterr().out


def test_bad_backend_name_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ampfused_main(["check", "--backend", "nope"])
    assert exit_info.value.code == 2 and "argument --backend: invalid choice: 'nope'" in capsys.readouterr().err


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ampfused_main(["check", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: python -m ampfused check ")
    assert "--backend NAME" in out and "--device {cpu,cuda}" in out
