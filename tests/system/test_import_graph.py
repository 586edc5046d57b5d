"""The package's import graph: acyclic, the pass contract a leaf, nothing heavy at ``import ampfused``.

Read from the source with ``ast`` (no import runs): every ``import``/``from ... import`` in a module,
at module level or inside a function (a lazy import is still an arrow), and every
``importlib.import_module("ampfused....")`` with a literal name (how ``_backends`` finds backends).
"""
import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path


PACKAGE = "ampfused"
ROOT = Path(importlib.util.find_spec(PACKAGE).origin).parent  # the source tree under an editable install


def module_files() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the package folder (sub-packages included)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts))] = path
    return out


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """The package modules that ``name`` (at ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(target: str) -> str | None:  # a module of this package (not one outside its folder)
        return target if target in modules else None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from . import x` names a module when x is one, else an attribute of the package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            module = known(target)
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_reader_sees_lazy_and_importlib_arrows():
    graph = import_graph()
    assert "ampfused._contract" in graph["ampfused.functional"]
    assert "ampfused.optim" in graph["ampfused.distributed"]  # a lazy, in-function import
    assert {"ampfused.reference", "ampfused._compiled"} <= graph["ampfused._backends"]  # importlib by name


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_contract_is_a_leaf():
    assert import_graph()["ampfused._contract"] == set()
    tree = ast.parse((ROOT / "_contract.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "typing", "torch"}, imported


def test_reducers_sit_below_the_optimizer():
    graph = import_graph()
    below = {"ampfused._reducers", "ampfused._dtensor", "ampfused.functional", "ampfused._state", "ampfused._plan"}
    for name in below:
        assert "ampfused.optim" not in graph[name] and "ampfused.distributed" not in graph[name], name
    assert "ampfused.distributed" not in graph["ampfused.optim"]


def test_import_probes_nothing_and_loads_no_kernels_in_a_fresh_interpreter():
    """``import ampfused`` probes no backend and loads neither Triton nor the extension; the public
    submodules are attributes of the package right after it."""
    code = ("import sys, ampfused; from ampfused import _backends; "
            "assert not _backends._probed, _backends._probed; "
            "bad = [m for m in sys.modules if m in ('triton', 'ampfused._C') or m.startswith('ampfused.kernels')]; "
            "assert not bad, bad; "
            "assert callable(ampfused.distributed.data_parallel) and callable(ampfused.functional.fused_amp_adamw); "
            "print('clean')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr
