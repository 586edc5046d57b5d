"""Pure-PyTorch passes: the executable form of DESIGN §2, the oracle every other backend is
tested against, and the fallback on any device.

[note: no host sync] Nothing here reads a device value on the host. A skipped step is expressed
with ``torch.where(skip, old, new)`` so that the same code is correct, and sync-free, on a GPU;
the price is temporaries, which is fine for an oracle and a fallback.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

NAME = "reference"


def supports(device: torch.device) -> str | None:
    return None


def accumulate_(main_grad: Tensor, grad: Tensor) -> None:
    """``main_grad += grad`` with fp32 math (type promotion upcasts fp16/bf16 ``grad``)."""
    main_grad.add_(grad)


def grad_stats_(grads: Sequence[Tensor], inv_scale: Tensor | None, sumsq: Tensor) -> None:
    """``sumsq += sum((g * inv_scale)^2)`` over all grads, in fp32 (unscale first, as torch does)."""
    for grad in grads:
        unscaled = grad.float() if inv_scale is None else grad.float() * inv_scale
        sumsq.add_(torch.dot(unscaled.reshape(-1), unscaled.reshape(-1)))


def adamw_update_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, hypers, factor: Tensor, skip: Tensor) -> None:
    """One AdamW step per tensor; see ``_backends`` for the contract of every argument."""
    keep = skip != 0
    for i in range(len(params)):
        _adamw_one(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], steps[i], masters[i], hypers[i], factor, keep)


def _adamw_one(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, master, h, factor, keep) -> None:
    weights = master if master is not None else param
    w = weights.float()
    g = grad.float() * factor
    if h.maximize:
        g = g.neg()
    lr = h.lr.to(device=param.device, dtype=torch.float64, non_blocking=True) if isinstance(h.lr, Tensor) else h.lr

    # Same operation order as torch.optim.AdamW; the scalars are computed in float64 from the
    # device step counter, as torch computes them in Python floats from its host counter.
    step_new = step + 1
    bias_correction1 = 1 - torch.pow(h.beta1, step_new.double())
    bias_correction2_sqrt = (1 - torch.pow(h.beta2, step_new.double())).sqrt()
    step_size = lr / bias_correction1

    w_new = w * (1 - lr * h.weight_decay)
    m_new = exp_avg.lerp(g, 1 - h.beta1)
    v_new = exp_avg_sq.mul(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    if h.amsgrad:
        v_max_new = torch.maximum(max_exp_avg_sq, v_new)
        denom = (v_max_new.sqrt() / bias_correction2_sqrt).add_(h.eps)
    else:
        denom = (v_new.sqrt() / bias_correction2_sqrt).add_(h.eps)
    # torch's addcdiv_(m, denom, value=-step_size) computes (value * m) / denom, then adds
    w_new.add_(m_new.mul(-step_size).div_(denom))

    # Commit: every write selects the old value when the step is skipped, so skipped steps leave
    # state bitwise unchanged.
    exp_avg.copy_(torch.where(keep, exp_avg, m_new))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, v_new))
    if h.amsgrad:
        max_exp_avg_sq.copy_(torch.where(keep, max_exp_avg_sq, v_max_new))
    if master is not None:
        master.copy_(torch.where(keep, master, w_new))
    # Low-precision params get the round-to-nearest-even of the fp32 result (Tensor.to rounds RNE).
    param.copy_(torch.where(keep, param, w_new.to(param.dtype)))
    step.copy_(torch.where(keep, step, step_new))


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
