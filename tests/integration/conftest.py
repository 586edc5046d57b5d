"""Optional integration group: real trainers (transformers, lightning, accelerate) and inductor.

Runs only when asked for: `pytest tests/integration` (what `.ci/integration.sh` does) or
AMPFUSED_INTEGRATION=1; a plain `pytest tests` skips it so the default CI stays fast. Every test is
marked `integration` and skips with the reason when its package is missing."""
import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: optional group (transformers, lightning, accelerate, inductor)")


def pytest_collection_modifyitems(config, items):
    asked = os.environ.get("AMPFUSED_INTEGRATION") == "1" or any("integration" in str(arg) for arg in config.args)
    skip = pytest.mark.skip(reason="integration group: run .ci/integration.sh or `pytest tests/integration`")
    for item in items:
        if "tests/integration" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
            if not asked:
                item.add_marker(skip)
