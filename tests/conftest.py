"""Shared fixtures: every semantic test runs once per backend available on the test device.

The test device is the GPU when there is one, else the CPU. On a CPU machine the Triton kernels
run through the Triton interpreter, which must be switched on before they are imported.
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter

    triton_interpreter.install()

from ampfused import _backends  # noqa: E402
from helpers import DEVICE, available_backends  # noqa: E402

BACKENDS = available_backends()


def pytest_report_header(config):
    rows = [f"{n}: {'yes' if ok else 'no'}{' (' + why + ')' if why else ''}" for n, ok, why in _backends.report()]
    return [f"ampfused test device: {DEVICE}; backends under test: {', '.join(BACKENDS)}"] + rows


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Name of a backend that can serve tensors on DEVICE."""
    return request.param


@pytest.fixture
def device():
    return DEVICE


def _slow_triton_run(item) -> bool:
    """The Triton interpreter takes seconds a step through the optimizer with int8 / int4 moments; CI's
    slow step runs those cases (`pytest tests -m slow`). The fast suite keeps, for Triton, every mode
    through the kernel against the specification (tests/compact/test_update_matches_spec.py,
    test_skipped_step_writes_nothing, test_split16_equals_the_fp32_master_path) and each blockwise
    encoding once through the optimizer: the state-dict round trip under an fp32 master, which steps,
    saves, loads and steps again. The reference and cpu backends run every case."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("backend") != "triton" or DEVICE.type != "cpu":
        return False
    name, test = Path(item.fspath).name, item.originalname
    if (name, test) == ("test_optimizer_runs.py", "test_split16_is_the_fp32_master_run_bitwise"):
        return True
    mode = params.get("mode")
    master, state_dtype = (mode[:2] if isinstance(mode, tuple) and len(mode) >= 2
                           else (params.get("master_weights"), params.get("state_dtype")))
    if name == "test_int4_moments.py":
        state_dtype = "int4"
    if state_dtype not in ("int8", "int4"):
        return False
    return (test, master) != ("test_state_dict_round_trips_bitwise", "fp32")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow_triton_run(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: a checkout dir named gpu matches that
            item.add_marker(skip_gpu)


def pytest_ignore_collect(collection_path, config):
    """The optional integration group (real trainers, inductor) is collected only when asked for:
    `pytest tests/integration` or AMPFUSED_INTEGRATION=1 (what .ci/integration.sh does)."""
    if collection_path == Path(__file__).parent / "integration":
        asked = os.environ.get("AMPFUSED_INTEGRATION") == "1" or any("integration" in str(a) for a in config.args)
        return None if asked else True
    return None
