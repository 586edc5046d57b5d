"""No internal function of the package (``ampfused/`` and the Triton ``kernels/``: device functions
and launched kernels alike) takes more than MAX_PARAMETERS parameters: a tensor's fields travel as
its row (``adamw.Row``), a group's as its scalars, a step's tensors as one ``Batch``, so a misplaced
argument cannot silently line up with the wrong field. The public signatures of DESIGN §1, which
mirror torch's, are exempt."""
import ast
from pathlib import Path

MAX_PARAMETERS = 20
ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"ampfused/functional.py::fused_amp_adamw", "ampfused/optim.py::__init__"}  # torch.optim.AdamW's arguments


def _parameter_counts():
    for path in sorted([*(ROOT / "kernels").glob("*.py"), *(ROOT / "ampfused").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
                yield f"{path.relative_to(ROOT).as_posix()}::{node.name}", n


def test_no_internal_function_takes_more_than_twenty_parameters():
    counts = dict(_parameter_counts())
    assert "kernels/adamw.py::_adamw_update_kernel" in counts and "kernels/adamw.py::_store_state" in counts
    assert all(counts.get(name, 0) > MAX_PARAMETERS for name in PUBLIC), "the exemptions must still be needed"
    over = {name: n for name, n in counts.items() if n > MAX_PARAMETERS and name not in PUBLIC}
    assert not over, f"functions with more than {MAX_PARAMETERS} parameters: {over}"
