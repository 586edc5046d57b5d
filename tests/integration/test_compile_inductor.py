"""The torch.compile tests of tests/optimizer/test_compile.py with the default inductor backend (C++ on CPU, ~1 min)."""
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch


def _load_base():
    """tests/optimizer/test_compile.py, whose runs this file repeats with inductor."""
    spec = importlib.util.spec_from_file_location("optimizer_test_compile", Path(__file__).parents[1] / "optimizer" / "test_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _load_base()

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on CPU needs a C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiled_model_trains_like_eager(dtype):
    eager, _ = base.train_compiled(dtype, None)
    compiled, _ = base.train_compiled(dtype, None, compile_model=True, compiler="inductor")
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
