"""A test helper is defined once: in tests/helpers.py, a conftest or the one file that uses it.

Two test files that each define ``make_model`` or ``backward`` either copy one helper (then it
belongs in tests/helpers.py) or give one name to two different jobs (then each wants a name that
says which). Tests, pytest hooks and the entry points of spawned processes are exempt: their names
are a convention, not a helper.
"""
import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CONVENTIONS = {"main", "_worker", "pytest_collection_modifyitems", "pytest_configure", "pytest_addoption"}


def top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith(("test_", "Test")) and node.name not in CONVENTIONS}


def test_no_helper_name_is_defined_in_two_test_files():
    where = defaultdict(list)
    for path in sorted(TESTS.rglob("*.py")):
        for name in top_level_names(path):
            where[name].append(str(path.relative_to(TESTS)))
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, "helpers defined in more than one test file: " + "; ".join(
        f"{name} in {', '.join(files)}" for name, files in sorted(twice.items()))
