"""Flat fp32 storage for optimizer-owned tensors, with one view per parameter.

[note: flat state] ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param`` and
``main_grad`` each live in one fp32 buffer per device; ``optimizer.state[p]`` holds views with the
shapes torch.optim.AdamW uses. Every view starts on a 128-byte boundary so that vectorized kernels
never straddle two params in one access and every view is 16-byte aligned.

[note: memory formats] A view gets the strides of its param (``channels_last`` included), as
``torch.zeros_like(p, memory_format=torch.preserve_format)`` would: any dense, non-overlapping
tensor covers one block of ``numel`` elements, and with equal strides element ``i`` of that block is
the same logical element in param, grad and every state tensor, so the passes stay element-wise
over flat memory.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

ALIGN_BYTES = 128
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels read and write
# [note: wide params] float64 and complex params train as in torch.optim.AdamW (fp64 math; complex
# through view_as_real) but the kernels never see them: functional.run_step hands them to the
# reference passes inside the same step (one global norm, one skip flag), and their state is plain
# tensors of the param's dtype, outside the flat fp32 buffers.
WIDE_DTYPES = (torch.float64, torch.complex64, torch.complex128)
PARAM_DTYPES = SUPPORTED_DTYPES + WIDE_DTYPES


def is_dense(t: Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements (any dimension order, no gaps or overlaps)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_strides(t: Tensor) -> tuple[int, ...]:
    """The strides a dense copy of ``t`` gets: its own when it is dense, else contiguous ones."""
    return tuple(t.stride()) if is_dense(t) else tuple(torch.empty(t.shape, device="meta").stride())


def aligned_offsets(numels: Sequence[int], element_size: int = 4) -> tuple[list[int], int]:
    """Start offset (in elements) of each chunk, each a multiple of ALIGN_BYTES; and the total size."""
    align = max(1, ALIGN_BYTES // element_size)
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


class FlatBuffer:
    """One zero-initialised buffer holding a chunk shaped (and strided) like each of ``like``."""

    def __init__(self, like: Sequence[Tensor], device: torch.device, dtype: torch.dtype = torch.float32):
        element_size = torch.empty((), dtype=dtype).element_size()
        self.offsets, total = aligned_offsets([t.numel() for t in like], element_size)
        # allocators guarantee less than 128 bytes on some devices (64 on CPU): over-allocate and shift
        raw = torch.zeros(total + ALIGN_BYTES // element_size, dtype=dtype, device=device)
        shift = (-raw.data_ptr() % ALIGN_BYTES) // element_size
        self.data = raw[shift : shift + total]
        base = self.data.storage_offset()
        self.views = [self.data.as_strided(t.shape, dense_strides(t), base + o) for o, t in zip(self.offsets, like)]

    def __len__(self) -> int:
        return len(self.views)


def check_grad(p: Tensor, grad: Tensor) -> None:
    """A gradient the kernels can read for ``p``: dense, same shape and device, a supported dtype."""
    if grad.is_sparse:
        raise RuntimeError("FusedAmpAdamW does not support sparse gradients")
    if grad.shape != p.shape:
        raise RuntimeError(f"gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(p.shape)}")
    # [note: grad dtype] autograd gives p.dtype, or p.grad_dtype when the user set one (fp32 grads
    # for bf16 params are fine); the kernels read float32, float16 and bfloat16.
    if p.dtype in WIDE_DTYPES or grad.dtype in WIDE_DTYPES:
        if grad.dtype != p.dtype:
            raise RuntimeError(f"gradient of dtype {grad.dtype} for a {p.dtype} parameter: a float64 or complex "
                               "parameter takes a gradient of its own dtype")
    elif grad.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(
            f"gradient of dtype {grad.dtype} for a {p.dtype} parameter: FusedAmpAdamW reads float32, float16 and "
            "bfloat16 gradients")
    if grad.device != p.device:
        raise RuntimeError(f"gradient on {grad.device} for a parameter on {p.device}")
