"""No function of the Triton kernels (``kernels/``: device functions and launched kernels alike)
takes more than MAX_PARAMETERS parameters: a tensor's fields travel as its row (``adamw.Row``), a
group's as its scalars, so a misplaced argument cannot silently line up with the wrong field."""
import ast
from pathlib import Path

MAX_PARAMETERS = 20
KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _parameter_counts():
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
                yield f"{path.name}::{node.name}", n


def test_no_kernel_function_takes_more_than_twenty_parameters():
    counts = dict(_parameter_counts())
    assert "adamw.py::_adamw_update_kernel" in counts and "adamw.py::_store_state" in counts
    over = {name: n for name, n in counts.items() if n > MAX_PARAMETERS}
    assert not over, f"functions with more than {MAX_PARAMETERS} parameters: {over}"
