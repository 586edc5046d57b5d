"""Optional integration group: real trainers (transformers, lightning, accelerate) and inductor.

Collected only when asked for: `pytest tests/integration` (what `.ci/integration.sh` does) or
AMPFUSED_INTEGRATION=1; a plain `pytest tests` leaves it out (tests/conftest.py) so the default CI
stays fast. Every test is
marked `integration` and skips with the reason when its package is missing."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: optional group (transformers, lightning, accelerate, inductor)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/integration" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
