"""fp32 gradient accumulation for the post-accumulate-grad hook: ``main_grad += grad``.

Each fp16/bf16 gradient is read once, in the backward that made it (docs/design.md §3 has the
bytes); the step reads only the fp32 ``main_grad``.

Folding the last micro-batch's sum of squares in here would save the stats pass's 4 B/element, but
the hook cannot know which backward is the last before ``step()``; it would have to publish a
per-param sum of squares after every micro-batch, and ``grad_stats_`` would have to trust it (stale
after any write to ``main_grad`` outside the hook), a contract change in the core. So this is one
launch per call, a pure streaming kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _runtime


# Exactness: main_grad + grad is one rounding add of an exactly widened value: no product to
# contract and no comparison that depends on an identity, so fp fusion is left at Triton's default.
@triton.jit
def _widen(grad, GRAD_IS_BF16: tl.constexpr):
    if GRAD_IS_BF16:  # passed as int16 bits, widened exactly: see the bf16 note in _memory.py
        return (grad.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return grad.to(tl.float32)


@triton.jit
def _accumulate_kernel(main_grad_ptr, grad_ptr, numel, GRAD_IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    if first + BLOCK <= numel:  # a full block: no mask, so 16-byte vectors whatever numel is
        grad = _widen(tl.load(grad_ptr + offs), GRAD_IS_BF16)
        tl.store(main_grad_ptr + offs, tl.load(main_grad_ptr + offs) + grad)
    else:
        mask = offs < numel
        grad = _widen(tl.load(grad_ptr + offs, mask=mask, other=0), GRAD_IS_BF16)
        tl.store(main_grad_ptr + offs, tl.load(main_grad_ptr + offs, mask=mask) + grad, mask=mask)


@_runtime.launches_on(lambda main_grad, grad: main_grad.device)
def accumulate_(main_grad: Tensor, grad: Tensor) -> None:
    """``main_grad += grad`` in fp32 (``grad`` fp32/fp16/bf16 with as many elements), one launch."""
    if main_grad.dtype != torch.float32 or not main_grad.is_contiguous():
        raise ValueError("main_grad must be a contiguous fp32 tensor")
    if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"grad has dtype {grad.dtype}; accumulate_ takes fp32, fp16 and bf16 grads")
    if grad.numel() != main_grad.numel() or grad.device != main_grad.device:
        raise ValueError(f"grad ({grad.numel()} elements on {grad.device}) does not match main_grad "
                         f"({main_grad.numel()} elements on {main_grad.device})")
    numel = main_grad.numel()
    if numel == 0:
        return
    if not grad.is_contiguous():
        grad = grad.contiguous()
    is_bf16 = grad.dtype == torch.bfloat16
    _runtime.launch(_accumulate_kernel, (triton.cdiv(numel, _runtime.ACCUMULATE_BLOCK),))(
        main_grad, grad.view(torch.int16) if is_bf16 else grad, numel,
        GRAD_IS_BF16=is_bf16, BLOCK=_runtime.ACCUMULATE_BLOCK, num_warps=_runtime.NUM_WARPS)
