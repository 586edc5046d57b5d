"""ampfused: fused mixed-precision AdamW and GradScaler for PyTorch.

Importing this package compiles nothing, patches nothing and probes no hardware.
"""
from . import checkpoint, distributed, functional
from .optim import FusedAmpAdamW
from .scaler import GradScaler

__all__ = ["FusedAmpAdamW", "GradScaler", "checkpoint", "distributed", "functional"]
__version__ = "0.1.0"
