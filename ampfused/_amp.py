"""AMP helper shared by FusedAmpAdamW and GradScaler: unscale gradients in place and flag inf/NaN.

Not a pass of the step (those live behind ``ampfused._backends``): this is what
``GradScaler.unscale_`` does to gradients the user wants to read unscaled before ``step()``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def unscale_and_check_(grads: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """``g *= inv_scale`` in place for every grad and ``found_inf = 1`` if any is non-finite.

    Any float dtype: torch's ``_amp_foreach_non_finite_check_and_unscale_`` is used where it
    accepts the dtype, plain tensor ops elsewhere (bf16 on CUDA).
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, group in by_dtype.items():
        if dtype == torch.bfloat16 and group[0].device.type == "cuda":
            for grad in group:
                found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(grad)).any().float()))
                grad.copy_(grad.float() * inv_scale)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
