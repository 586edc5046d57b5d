"""The functional core of FusedAmpAdamW and the one place that dispatches to a backend.

A step is two passes that talk through one small device vector, ``stats`` (fp32 [STATS_SIZE]):

1. **stats** -- ``sumsq = sum((g / S)^2)`` and a flag for any inf/NaN element, over every gradient
   of every group, then, in the same launch, the **finish**: ``norm = sqrt(sumsq)``,
   ``skip = flag or found_inf``, ``factor = min(1, c / (norm + 1e-6)) / S``;
2. **update** -- AdamW on every tensor with ``g * factor``, a no-op when ``skip`` is set.

Nothing in between runs on the host or launches anything: a step is two launches on a GPU.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from . import _backends, _dtensor
from ._flat import SUPPORTED_DTYPES

CLIP_EPS = 1e-6  # the epsilon torch.nn.utils.clip_grad_norm_ adds to the norm
# Slots of the stats vector (kernels/stats.py and csrc/ops_common.h spell them again).
NORM, SKIP, FACTOR, SUMSQ = 0, 1, 2, 3
STATS_SIZE = 4


class Hyper(NamedTuple):
    """Hyperparameters of one param group, shared by all tensors of the group."""

    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool


def _per_tensor(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} tensors")
        return list(value)
    return [value] * n


def fused_amp_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor | None],
    state_steps: list[Tensor],
    master_params: list[Tensor | None] | None = None,
    *,
    lr: float | Tensor | Sequence,
    beta1: float | Sequence[float],
    beta2: float | Sequence[float],
    eps: float | Sequence[float],
    weight_decay: float | Sequence[float],
    amsgrad: bool | Sequence[bool] = False,
    maximize: bool | Sequence[bool] = False,
    max_grad_norm: float | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Functional form of :class:`ampfused.FusedAmpAdamW`: one fused AMP AdamW step.

    All lists are parallel (one entry per tensor). Hyperparameters are a scalar for all tensors or a
    sequence with one entry per tensor. ``state_steps`` are 0-d fp32 tensors on the params' device.
    ``max_exp_avg_sqs`` / ``master_params`` entries may be ``None`` (no AMSGrad / fp32 param).
    ``grad_scale`` is the loss scale the grads carry, ``found_inf`` a device flag from an earlier
    inf check (non-zero skips the step).

    Returns ``(grad_norm, skipped)``: the L2 norm of the unscaled grads before clipping (non-finite
    when the step was skipped) and a 0-d fp32 flag, both on the device; nothing is synchronized.
    """
    n = len(params)
    lists = (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
    if any(len(x) != n for x in lists) or (master_params is not None and len(master_params) != n):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps and master_params must have equal lengths")
    if master_params is None:
        master_params = [None] * n
    columns = [
        _per_tensor(v, n, name)
        for v, name in ((lr, "lr"), (beta1, "beta1"), (beta2, "beta2"), (eps, "eps"), (weight_decay, "weight_decay"), (amsgrad, "amsgrad"), (maximize, "maximize"))
    ]
    hypers = [Hyper(*row) for row in zip(*columns)]
    for i, h in enumerate(hypers):  # validate everything before the first write
        if h.amsgrad and max_exp_avg_sqs[i] is None:
            raise ValueError(f"amsgrad is set for tensor {i} but max_exp_avg_sqs[{i}] is None")
    if n == 0:
        return torch.zeros(()), torch.zeros(())
    module = _backends.resolve(backend, params[0].device)[0]
    # [distributed] DTensor lists: local shards, and the all-reduce of the stats over their mesh
    (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params), reduce_stats = _dtensor.localize(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params)
    return run_step(module, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, hypers, max_grad_norm=max_grad_norm, grad_scale=grad_scale, found_inf=found_inf,
                    reduce_stats=reduce_stats)


def wide_indices(params: Sequence[Tensor]) -> list[int]:
    """Indices of the float64/complex tensors, which the reference passes serve ([note: wide params])."""
    return [i for i, p in enumerate(params) if p.dtype not in SUPPORTED_DTYPES]


def run_step(backend, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, hypers, *, max_grad_norm, grad_scale, found_inf,
             reduce_stats=None, wide: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Stats pass (finish included), update pass. No host synchronization; ``(grad_norm, skipped)``
    are 0-d views of one fresh device vector.

    ``reduce_stats(sumsq, flag) -> (sumsq, flag)``, when given, turns this rank's sum of squares and
    skip flag into the global ones (``ampfused.distributed``: one all-reduce over the shards' mesh);
    the finish then runs again on them, so every rank takes the same decision. ``wide``: the
    indices of the float64/complex tensors (computed when None).
    """
    device = params[0].device
    if grad_scale is not None and (grad_scale.device != device or grad_scale.dtype != torch.float32):
        grad_scale = grad_scale.to(device=device, dtype=torch.float32)
    if found_inf is not None and not isinstance(found_inf, Tensor):
        # a plain number (torch.amp.GradScaler passes 0 when it checked no grads)
        found_inf = torch.ones((), dtype=torch.float32, device=device) if found_inf else None
    elif found_inf is not None and (found_inf.device != device or found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        found_inf = found_inf.to(device=device, dtype=torch.float32).sum()
    lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, hypers)
    if wide is None:  # (FusedAmpAdamW passes its plan's cached indices: reading p.dtype costs host time)
        wide = wide_indices(params)
    if wide:  # [note: wide params] the kernels' share, and the rest for the reference passes
        lists, wide_lists = _split(lists, wide)
    stats = torch.empty(STATS_SIZE, dtype=torch.float32, device=device)
    if lists[0]:
        backend.grad_stats_(lists[1], grad_scale, found_inf, max_grad_norm, stats)
    else:
        stats.zero_()
    if wide:
        from . import reference

        wide_stats = torch.empty_like(stats)
        reference.grad_stats_(wide_lists[1], grad_scale, found_inf, max_grad_norm, wide_stats)
        stats[SUMSQ] += wide_stats[SUMSQ]
        stats[SKIP] = torch.maximum(stats[SKIP], wide_stats[SKIP])  # both hold found_inf already
        reference.finish_(stats, grad_scale, None, max_grad_norm)
    if reduce_stats is not None:  # [distributed] local shards' stats -> global (one small all-reduce)
        sumsq, flag = reduce_stats(stats[SUMSQ], stats[SKIP])  # SKIP already holds found_inf
        stats[SUMSQ], stats[SKIP] = sumsq, flag
        from .reference import finish_  # the finish's spec (reference imports this module's slot names)

        finish_(stats, grad_scale, None, max_grad_norm)
    if lists[0]:
        backend.adamw_update_(*lists, stats)
    if wide:
        reference.adamw_update_(*wide_lists, stats)
    return stats[NORM], stats[SKIP]


def _split(lists, wide: list[int]):
    """(the lists without the ``wide`` indices, the ``wide`` entries with complex tensors as view_as_real)."""
    wide_set = set(wide)
    rest = tuple([x[i] for i in range(len(x)) if i not in wide_set] for x in lists)
    as_real = lambda t: torch.view_as_real(t) if isinstance(t, Tensor) and t.is_complex() else t  # noqa: E731
    tensors = tuple([as_real(x[i]) for i in wide] for x in lists[:7])
    return rest, (*tensors, [lists[7][i] for i in wide])
