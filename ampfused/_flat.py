"""Flat fp32 storage for optimizer-owned tensors, with one view per parameter.

[note: flat state] ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param`` and
``main_grad`` each live in one contiguous fp32 buffer per device; ``optimizer.state[p]`` holds views
with the shapes torch.optim.AdamW uses. Every view starts on a 128-byte boundary so that vectorized
kernels never straddle two params in one access and every view is 16-byte aligned.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

ALIGN_BYTES = 128


def aligned_offsets(numels: Sequence[int], element_size: int = 4) -> tuple[list[int], int]:
    """Start offset (in elements) of each chunk, each a multiple of ALIGN_BYTES; and the total size."""
    align = max(1, ALIGN_BYTES // element_size)
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


class FlatBuffer:
    """One zero-initialised fp32 buffer holding a chunk shaped like each of ``like``."""

    def __init__(self, like: Sequence[Tensor], device: torch.device, dtype: torch.dtype = torch.float32):
        element_size = torch.empty((), dtype=dtype).element_size()
        self.offsets, total = aligned_offsets([t.numel() for t in like], element_size)
        # allocators guarantee less than 128 bytes on some devices (64 on CPU): over-allocate and shift
        raw = torch.zeros(total + ALIGN_BYTES // element_size, dtype=dtype, device=device)
        shift = (-raw.data_ptr() % ALIGN_BYTES) // element_size
        self.data = raw[shift : shift + total]
        self.views = [self.data[o : o + t.numel()].view(t.shape) for o, t in zip(self.offsets, like)]

    def __len__(self) -> int:
        return len(self.views)
