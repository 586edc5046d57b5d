"""Optional integration tests (see conftest.py)."""
