"""ampfused: fused mixed-precision AdamW and GradScaler for PyTorch.

Importing this package compiles nothing, patches nothing and probes no hardware.
"""
import os as _os

# Installed, ampfused.kernels sits beside this file; imported from a checkout (PYTHONPATH, or
# `python` run in its root), it is the checkout's top-level kernels/ (DESIGN §5), found through
# this package's search path as setuptools' package-dir mapping finds it for an install.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.exists(_os.path.join(__path__[0], "kernels", "__init__.py"))
        and _os.path.exists(_os.path.join(_ROOT, "kernels", "__init__.py"))):
    __path__.append(_ROOT)
del _os, _ROOT

from . import checkpoint, distributed, functional
from ._unused_options import UnusedOptionWarning
from .optim import FusedAmpAdamW
from .scaler import GradScaler

__all__ = ["FusedAmpAdamW", "GradScaler", "UnusedOptionWarning", "checkpoint", "distributed", "functional"]
__version__ = "0.1.0"
