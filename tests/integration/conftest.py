"""Optional integration group: real trainers (transformers, lightning, accelerate) and inductor.

Run with `.ci/integration.sh` or `pytest tests/integration -q`; every test is marked `integration`
and skips with the reason when its package is missing."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: needs optional packages (transformers, lightning, accelerate)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/integration" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
