"""Flat memory: the tensors every backend addresses from ``data_ptr()`` as ``numel`` consecutive elements.

The Triton kernels, which import nothing of ``ampfused``, keep the same two tests (``dense`` and
``same_flat_layout`` in kernels/_tables.py); tests/contract/test_contract.py checks that they agree
on every layout.
"""
from torch import Tensor


def is_dense(t: Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements (any dimension order, no gaps or
    overlaps): what every backend addresses as flat memory from ``data_ptr()``."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_flat_layout(t: Tensor, like: Tensor) -> bool:
    """Element k of ``t``'s memory is element k of ``like``'s (both contiguous, or equal strides)."""
    return (t.is_contiguous() and like.is_contiguous()) or (t.shape == like.shape and t.stride() == like.stride())
