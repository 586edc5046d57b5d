"""The test-only extension (csrc/testing/): ops that only tests call, kept out of ``ampfused._C``.

``ops()`` builds it on first use in a process with ``torch.utils.cpp_extension.load`` (the arguments
come from csrc/build_extension.py, so it is compiled as ``_C``'s CPU files are) into
``build/testing_extension`` of the checkout, where it is reused until a source changes, and returns
``torch.ops.ampfused_testing``. Without a C++ compiler the calling test is skipped and says so.
"""
import functools
import importlib.util
import os
import shutil

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_EXTENSION = os.path.join(ROOT, "csrc", "build_extension.py")


def build_extension():
    """csrc/build_extension.py as a module (it is loaded by path, as setup.py does)."""
    spec = importlib.util.spec_from_file_location("ampfused_build_extension", BUILD_EXTENSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _load():
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build the test-only extension csrc/testing/"
    from torch.utils import cpp_extension

    build_dir = os.path.join(ROOT, "build", "testing_extension")
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(build_directory=build_dir, verbose=False, **build_extension().testing_load_kwargs(torch))
    return None


def ops():
    """torch.ops.ampfused_testing, built on first use; skips the calling test when no compiler is found."""
    why_not = _load()
    if why_not is not None:
        pytest.skip(why_not)
    return torch.ops.ampfused_testing
