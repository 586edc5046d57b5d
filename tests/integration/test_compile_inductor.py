"""The torch.compile tests of tests/optimizer/test_compile.py with the default inductor backend (C++ on CPU, ~1 min)."""
import shutil

import pytest
import torch

import test_compile as base

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on CPU needs a C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiled_model_trains_like_eager(dtype):
    eager, _ = base.run(dtype, None)
    compiled, _ = base.run(dtype, None, compile_model=True, compiler="inductor")
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
