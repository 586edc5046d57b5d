"""Packaging promises: lazy import, info command, isinstance compatibility."""
import os
import subprocess
import sys

import torch

import ampfused


def test_info_lists_every_backend_with_a_reason():
    result = subprocess.run([sys.executable, "-m", "ampfused", "info"], capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr
    for name in ("cuda", "triton", "cpu", "reference"):
        assert f"  {name}" in result.stdout
    assert "auto backend for cpu" in result.stdout
    for line in result.stdout.splitlines():
        if "unavailable" in line:
            assert ": " in line.split("unavailable", 1)[1], f"no reason given: {line}"


def test_subclasses_what_trainers_check():
    p = torch.nn.Parameter(torch.ones(2))
    assert isinstance(ampfused.FusedAmpAdamW([p]), torch.optim.Optimizer)
    assert isinstance(ampfused.GradScaler("cpu"), torch.amp.GradScaler)
    assert ampfused.FusedAmpAdamW._step_supports_amp_scaling


def test_required_backends_are_available():
    """CI names the backends that must be under test (AMPFUSED_REQUIRE_BACKENDS=reference,triton,cpu),
    so a build that silently lost one fails instead of quietly testing less."""
    from helpers import available_backends

    required = [b for b in os.environ.get("AMPFUSED_REQUIRE_BACKENDS", "reference").split(",") if b]
    missing = [b for b in required if b not in available_backends()]
    reasons = {name: why for name, _, why in ampfused._backends.report()}
    assert not missing, {b: reasons.get(b) for b in missing}


def test_a_source_tree_without_the_extension_warns_once_and_names_the_fix(tmp_path):
    """A checkout imported ahead of the install that has ``ampfused._C`` (README's `python -m ...` inside
    the checkout after a regular install): the compiled backends do not vanish in silence."""
    import glob
    import shutil

    installed = os.path.dirname(os.path.abspath(ampfused.__file__))
    if not glob.glob(os.path.join(installed, "_C*")):
        import pytest

        pytest.skip("the imported ampfused has no built _C")
    shutil.copytree(installed, tmp_path / "ampfused", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    code = ("import sys\n"  # as after a regular install: no editable finder serves ampfused._C from elsewhere
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', ''))]\n"
            "import warnings, torch, ampfused\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
            "    for _ in range(2):\n"
            "        opt = ampfused.FusedAmpAdamW([p]); opt.step()\n"
            "print(ampfused.__file__); print(opt.backend)\n"
            "print(len([w for w in caught if 'compiled cpu/cuda backends are unavailable' in str(w.message)]))\n"
            "print(dict((n, r) for n, _, r in ampfused._backends.report())['cpu'])\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(installed)}  # the install, behind the source tree
    env.pop("AMPFUSED_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    imported, backend, warned, reason = proc.stdout.splitlines()
    assert imported.startswith(str(tmp_path)) and backend == "reference"  # the copy was imported, without _C
    assert warned == "1"  # once, not per optimizer
    assert f"the install in {installed} has one" in reason and "pip install --no-build-isolation -e ." in reason
