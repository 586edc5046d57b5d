"""Triton backend of ampfused (installed as ``ampfused.kernels``; relative imports only).

The passes, each one launch per device whatever the number of tensors; ``ampfused.reference``
is their specification. Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
``host_only()`` is the seam for timing the host side of a step alone: inside it nothing is launched.
"""
from ._runtime import NAME, host_only, supports
from .accumulate import accumulate_
from .adamw import adamw_update_
from .scaler import scaler_update_
from .stats import grad_stats_

# Compact state the update pass serves natively (split masters, bf16 / int8 / int4 moments, stochastic
# rounding of bf16 writes); ampfused.functional sends other encodings to the reference passes.
COMPACT_MODES = frozenset({"split16", "split8", "bf16", "int8", "int4", "sr"})

__all__ = ["NAME", "COMPACT_MODES", "host_only", "supports", "accumulate_", "grad_stats_", "adamw_update_", "scaler_update_"]
