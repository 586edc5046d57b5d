"""Pure-PyTorch passes: the executable form of DESIGN §2, the oracle every other backend is
tested against, and the fallback on any device.

Nothing here reads a device value on the host. A skipped step is expressed
with ``torch.where(skip, old, new)`` so that the same code is correct, and sync-free, on a GPU;
the price is temporaries, which is fine for an oracle and a fallback.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _compact
from ._batch import Batch
from ._contract import (FACTOR, MASTER_ENCODINGS, SKIP, SUMSQ, compact_modes, finish_, inv_scale_of,
                        master_encoding)

NAME = "reference"


def supports(device: torch.device) -> str | None:
    return None


def accumulate_(main_grad: Tensor, grad: Tensor) -> None:
    """``main_grad += grad`` with fp32 math (type promotion upcasts fp16/bf16 ``grad``)."""
    main_grad.add_(grad)


def grad_stats_(batch: Batch, grad_scale: Tensor | None, found_inf: Tensor | None,
                max_grad_norm: float | None, stats: Tensor, scratch=None, *, check_nonfinite: bool = True) -> None:
    """Sum of squares and non-finite flag of the unscaled grads ``u = g / grad_scale`` (``batch.grads``)
    in one pass (unscale first, as torch does), then the finish: see ``_backends.Backend`` for ``stats``."""
    grads = batch.grads
    inv_scale = inv_scale_of(grad_scale)
    sumsq = torch.zeros((), dtype=torch.float32, device=stats.device)
    bad = torch.zeros((), dtype=torch.bool, device=stats.device)
    for grad in grads:
        u = grad.to(_math_dtype(grad.dtype)).reshape(-1)  # fp64 grads: fp64 sum (the fp32 sumsq may overflow to inf)
        if inv_scale is not None:
            u = u * inv_scale
        sumsq.add_(torch.dot(u, u))
        bad |= ~torch.isfinite(u).all()
    stats[SUMSQ] = sumsq
    stats[SKIP] = bad.float()
    finish_(stats, grad_scale, found_inf, max_grad_norm, check_nonfinite=check_nonfinite)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for fp16/bf16/fp32 tensors, fp64 for fp64 ones (as torch.optim.AdamW)."""
    return torch.promote_types(dtype, torch.float32)


COMPACT_MODES = frozenset({"split16", "split8", "bf16", "int8", "int4", "sr"})  # every encoding of ``_compact``


def adamw_update_(batch: Batch, stats: Tensor, *, scratch=None, grad_scale: Tensor | None = None,
                  rounding_seed: int | None = None) -> None:
    """One AdamW step per tensor; see ``_backends.Backend`` for the contract of every argument (no scratch needed).

    Compact tensors (told by their dtypes: docs/design.md §9) step through
    ``_compact.compact_adamw_step_``, the specification of every encoding; the others through the fp32 step below.
    """
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters = (
        batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, batch.max_exp_avg_sqs, batch.steps, batch.masters)
    group_ids, groups, moment_scales = batch.group_ids, batch.groups, batch.moment_scales
    keep = stats[SKIP] != 0
    factor = stats[FACTOR]
    inv_scale = inv_scale_of(grad_scale)
    for i in range(len(params)):
        scales = moment_scales[i] if moment_scales is not None else None
        if is_compact(params[i], exp_avgs[i], masters[i], scales, rounding_seed is not None):
            index = i if batch.index is None else batch.index[i]  # [note: rounding bits] in _contract
            base = 0 if batch.element_base is None else batch.element_base[i]
            _compact_one(index, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], steps[i], masters[i],
                         scales, groups[group_ids[i]], factor, stats[SKIP], rounding_seed, base)
        else:
            _adamw_one(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], steps[i], masters[i],
                       groups[group_ids[i]], factor, keep)
        if inv_scale is not None:  # the unscaled gradient, in the grad's dtype (RNE), as torch's fused AdamW leaves it
            grads[i].copy_(torch.where(keep, grads[i], (grads[i].to(_math_dtype(grads[i].dtype)) * inv_scale).to(grads[i].dtype)))


def is_compact(param: Tensor, exp_avg: Tensor, master: Tensor | None, scales, stochastic: bool) -> bool:
    """Whether a tensor's step needs an encoding of ``_compact`` (not the plain fp32-state step)."""
    return scales is not None or bool(compact_modes(param, exp_avg, master, stochastic))


def _compact_one(i, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, master, scales, h, factor, skip,
                 rounding_seed, element_base) -> None:
    """One tensor on compact state: the lists' tensors under ``_compact``'s keys, then its step (in place)."""
    state = {"step": step}
    moments = (exp_avg, exp_avg_sq, max_exp_avg_sq) if h.amsgrad else (exp_avg, exp_avg_sq)
    for n, (name, value) in enumerate(zip(_compact.MOMENTS, moments)):
        if scales is None:
            state[name] = value
        else:
            state[name + "_codes"], state[name + "_scales"] = value, scales[n]
    if master is not None:
        state[MASTER_ENCODINGS[master_encoding(master)][2]] = master
    _compact.compact_adamw_step_(param, grad, state, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                                 weight_decay=h.weight_decay, amsgrad=h.amsgrad, maximize=h.maximize, factor=factor,
                                 skip=skip, stochastic_rounding=rounding_seed is not None, rounding_seed=rounding_seed,
                                 rounding_index=i, element_base=element_base)


def _adamw_one(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, master, h, factor, keep) -> None:
    """The fp32-state step: the spec's one AdamW body (``_compact.adamw_math``) on the weights in their math dtype."""
    weights = master if master is not None else param
    w_new, m_new, v_new, v_max_new, step_new = _compact.adamw_math(
        weights.to(_math_dtype(weights.dtype)), grad, factor, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr=h.lr,
        beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, amsgrad=h.amsgrad, maximize=h.maximize)
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


def scaler_update_(found_inf: Tensor, scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                   skipped_steps: Tensor, consecutive_skips: Tensor, watch: Tensor | None, *, growth_factor: float,
                   backoff_factor: float, growth_interval: int, hysteresis: int, min_scale: float | None) -> None:
    """GradScaler.update's rules on the device (see ``ampfused.GradScaler``); ``watch`` (fp64 [2] or
    None) receives ``[consecutive_skips, scale]`` after the update, for the lazy collapse check."""
    found = found_inf.reshape(-1).sum() != 0
    skipped_steps.add_(found.long())
    consecutive_skips.copy_(torch.where(found, consecutive_skips + 1, 0))
    hysteresis_left = torch.where(found, hysteresis_tracker - 1, hysteresis_tracker)
    back_off = found & (hysteresis_left <= 0)
    good_steps = torch.where(found, 0, growth_tracker + 1)
    grow = good_steps == growth_interval
    grown = (scale.double() * growth_factor).float()  # in double, rounded once: as torch's _amp_update_scale_
    backed_off = (scale.double() * backoff_factor).float()
    if min_scale is not None:
        backed_off = torch.clamp(backed_off, min=min_scale)
    scale.copy_(torch.where(back_off, backed_off, torch.where(grow & torch.isfinite(grown), grown, scale)))
    growth_tracker.copy_(torch.where(grow, 0, good_steps))
    hysteresis_tracker.copy_(torch.where(grow, hysteresis, hysteresis_left))
    if watch is not None:
        watch.copy_(torch.stack([consecutive_skips.double().reshape(()), scale.double().reshape(())]))
