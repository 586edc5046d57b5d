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
