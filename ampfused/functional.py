"""The functional core of FusedAmpAdamW and the one place that dispatches to a backend.

A step is two passes that talk through one small device vector, ``stats`` (fp32 [STATS_SIZE]):

1. **stats** -- ``sumsq = sum((g / S)^2)`` and a flag for any inf/NaN element, over every gradient
   of every group, then, in the same launch, the **finish**: ``norm = sqrt(sumsq)``,
   ``skip = flag or found_inf``, ``factor = min(1, c / (norm + CLIP_EPS)) / S``;
2. **update** -- AdamW on every tensor with ``g * factor``, a no-op when ``skip`` is set; after a
   scaled step it also writes the unscaled gradient ``g / S`` back into the grads (torch's fused
   AdamW does the same), unless ``keep_scaled_grads``.

Nothing in between runs on the host or launches anything: a step is two launches on a GPU.
[note: the plain step] With ``skip_nonfinite=False``, no scaler and no clipping, nothing needs the
stats: the update runs alone on a constant stats vector (factor 1, no skip), one pass, as torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import _backends, _compact, _dtensor, reference
from ._args import check_compact_lists, check_flag, check_grad, check_number, per_tensor
from ._batch import Batch, Hyper, row_lr
from ._contract import (FACTOR, NORM, SCRATCH_BYTES, SKIP, STATS_SIZE, SUMSQ, compact_modes, crosses_high_word, finish_,
                        moment_encoding)
from ._layout import is_dense
from ._state import wide_indices

class Scratch:
    """What the passes of one optimizer keep on the device and the host between its steps.

    [note: scratch] The stats and update launches find their last program with a ticket counter
    (zero between launches, reset by that last program) and the stats pass adds per-program
    partials there. Those live in ``buffer(device)``, one per optimizer: two optimizers stepping on
    two streams, or in two replayed CUDA graphs, never share a counter (the read-only chunk layouts
    stay shared). A call without a Scratch (the functional API) gets a fresh zeroed buffer.

    ``memo`` is a dict a backend keeps host-side tables of this caller in. Whoever passes the same
    Scratch again with the same list objects (params, states, steps, masters) promises that every
    grad kept its dtype, shape and strides, so only grad addresses need to be read again
    ([note: host time] in ``_plan.py``); new list objects mean anything may have changed.
    """

    def __init__(self, buffers: dict | None = None):
        self._buffers = {} if buffers is None else buffers  # device -> uint8 [SCRATCH_BYTES], shared by for_new_plan
        self.memo: dict = {}

    def for_new_plan(self) -> "Scratch":
        """The same device buffers with an empty memo (the caller's lists changed)."""
        return Scratch(self._buffers)

    def buffer(self, device: torch.device) -> Tensor:
        buf = self._buffers.get(device)
        if buf is None:
            buf = self._buffers[device] = torch.zeros(SCRATCH_BYTES, dtype=torch.uint8, device=device)
        return buf


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
    skip_nonfinite: bool = True,
    keep_scaled_grads: bool = False,
    backend: str | None = None,
    moment_scales: list | None = None,
    rounding_seed: int | None = None,
) -> tuple[Tensor | None, Tensor]:
    r"""Functional form of :class:`ampfused.FusedAmpAdamW`: one fused AMP AdamW step.

    All lists are parallel (one entry per tensor). Hyperparameters are a scalar for all tensors or a
    sequence with one entry per tensor. ``state_steps`` are 0-d fp32 tensors on the params' device.
    ``max_exp_avg_sqs`` / ``master_params`` entries may be ``None`` (no AMSGrad / fp32 param).
    ``grad_scale`` is the loss scale the grads carry, ``found_inf`` a device flag from an earlier
    inf check (non-zero skips the step). With ``grad_scale``, the grads hold the unscaled
    gradient ``g / grad_scale`` afterwards (as torch's fused AdamW leaves them; a skipped step
    leaves them as they were), unless ``keep_scaled_grads=True``. ``skip_nonfinite=False`` turns
    the inf/NaN guard off when neither ``grad_scale`` nor ``found_inf`` is given: non-finite
    gradients flow into the update as in ``torch.optim.AdamW``.

    Returns ``(grad_norm, skipped)``: the L2 norm of the unscaled grads before clipping (non-finite
    when the step was skipped; ``None`` when nothing computed it: ``skip_nonfinite=False`` without
    scaler and clipping) and a 0-d fp32 flag, both on the device; nothing is synchronized.

    Compact state is told by the dtypes of ``master_params`` and the moments (which dtype means
    which encoding: docs/design.md §9, "told by dtypes"); blockwise moments' fp32 scales come in
    ``moment_scales[i] = (exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales or None)``
    (``None`` entries for other tensors). ``rounding_seed`` (an int) rounds the bf16 writes without an exact master
    stochastically; ``None`` rounds to nearest even.
    """
    check_flag(skip_nonfinite, "skip_nonfinite")
    check_flag(keep_scaled_grads, "keep_scaled_grads")
    n = len(params)
    lists = (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
    if any(len(x) != n for x in lists) or (master_params is not None and len(master_params) != n):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps and master_params must have equal lengths")
    if master_params is None:
        master_params = [None] * n
    columns = [
        per_tensor(v, n, name)
        for v, name in ((lr, "lr"), (beta1, "beta1"), (beta2, "beta2"), (eps, "eps"), (weight_decay, "weight_decay"), (amsgrad, "amsgrad"), (maximize, "maximize"))
    ]
    for value, name in ((lr, "lr"), (beta1, "beta1"), (beta2, "beta2"), (eps, "eps"), (weight_decay, "weight_decay")):
        # a TypeError naming it, not a raw one from a float() in the passes
        for i, v in enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]:
            check_number(v, name if i is None else f"{name}[{i}]", tensor_ok=name != "eps" and name != "weight_decay")
    hypers = [Hyper(*row) for row in zip(*columns)]  # (raw values: group_hypers makes the group rows)
    for i, h in enumerate(hypers):  # validate everything before the first write
        if h.amsgrad and max_exp_avg_sqs[i] is None:
            raise ValueError(f"amsgrad is set for tensor {i} but max_exp_avg_sqs[{i}] is None")
        check_grad(params[i], grads[i])
    check_compact_lists(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, moment_scales, rounding_seed)
    if n == 0:
        return torch.zeros(()), torch.zeros(())
    group_ids, groups = group_hypers(hypers)
    module = _backends.resolve(backend, params[0].device)[0]
    # [distributed] DTensor lists: local shards, and the all-reduce of the stats over their mesh
    bases = _dtensor.element_bases(params)
    (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params), reduce_stats = _dtensor.localize(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params)
    batch = Batch(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, group_ids, groups,
                  _dtensor.local_scales(moment_scales), element_base=bases)
    return run_step(module, batch, StepOptions(
        max_grad_norm=max_grad_norm, grad_scale=grad_scale, found_inf=found_inf, skip_nonfinite=skip_nonfinite,
        keep_scaled_grads=keep_scaled_grads, reduce_stats=reduce_stats, rounding_seed=rounding_seed))


def group_hypers(hypers: Sequence[Hyper]) -> tuple[list[int], list[Hyper]]:
    """``(group_ids, groups)`` of per-tensor hyperparameters: equal ones share a group (a tensor lr by identity).

    [note: groups once] The optimizer's plan passes its param groups as they are; only this
    functional API, which takes per-tensor lists, groups them, so the kernels see a handful of
    groups whether the caller wrote one value per group or per tensor.
    """
    index: dict[tuple, int] = {}
    groups: list[Hyper] = []
    group_ids: list[int] = []
    for h in hypers:
        lr_is_tensor = isinstance(h.lr, Tensor)
        row = Hyper(row_lr(h.lr), float(h.beta1), float(h.beta2), float(h.eps), float(h.weight_decay), bool(h.amsgrad),
                    bool(h.maximize))  # the group row, converted here once
        key = (id(h.lr) if lr_is_tensor else row.lr, lr_is_tensor, *row[1:])  # (the caller's tensor: row.lr is a new view)
        g = index.get(key)
        if g is None:
            g = index[key] = len(groups)
            groups.append(row)
        group_ids.append(g)
    return group_ids, groups


def needs_stats(grad_scale, found_inf, max_grad_norm, skip_nonfinite: bool) -> bool:
    """Whether a step runs the stats pass: for a scaler, for clipping, or for the inf/NaN guard."""
    return skip_nonfinite or grad_scale is not None or found_inf is not None or max_grad_norm is not None


_PLAIN_STATS: dict[torch.device, Tensor] = {}


def _plain_stats(device: torch.device) -> Tensor:
    """The stats vector of a step without stats pass: factor 1, no skip (only ever read)."""
    stats = _PLAIN_STATS.get(device)
    if stats is None:
        stats = torch.zeros(STATS_SIZE, dtype=torch.float32, device=device)
        stats[FACTOR] = 1.0
        stats[NORM] = stats[SUMSQ] = math.nan  # not computed
        _PLAIN_STATS[device] = stats
    return stats


@dataclass(slots=True)
class StepOptions:
    """What one step adds to its :class:`~ampfused._batch.Batch` (see :func:`run_step`)."""

    max_grad_norm: float | None = None
    grad_scale: Tensor | None = None  # the loss scale the grads carry
    found_inf: Tensor | float | None = None  # a device flag (or a plain number) from an earlier inf check
    skip_nonfinite: bool = True
    keep_scaled_grads: bool = False
    reduce_stats: Callable | None = None
    scratch: Scratch | None = None
    rounding_seed: int | None = None


def run_step(backend, batch: Batch, options: StepOptions) -> tuple[Tensor | None, Tensor]:
    """Stats pass (finish included), update pass over a checked ``batch`` (``_batch.Batch`` says
    what it holds). No host synchronization; ``(grad_norm, skipped)`` are 0-d views of one fresh
    device vector (``grad_norm`` is ``None`` and ``skipped`` a read-only zero without stats pass,
    see [note: the plain step]).

    ``options.reduce_stats(sumsq, flag) -> (sumsq, flag)``, when given, turns this rank's sum of
    squares and skip flag into the global ones (``ampfused._reducers``: one all-reduce over the
    shards' mesh or ZeRO's group); the finish then runs again on them, so every rank takes the same
    decision. ``options.scratch``: the caller's :class:`Scratch` (see [note: scratch]); without it
    each launch gets a fresh one. The tensors the reference passes serve (:func:`fallback_indices`)
    and the split of the batch are cached in ``batch.parts``. ``options.rounding_seed``: the
    stochastic-rounding seed (``_backends.Backend.adamw_update_``).
    """
    device = batch.params[0].device
    # the scalar inputs, normalised here once: every backend takes them as they come out
    grad_scale, found_inf = options.grad_scale, options.found_inf
    if grad_scale is not None and (grad_scale.device != device or grad_scale.dtype != torch.float32):
        grad_scale = grad_scale.to(device=device, dtype=torch.float32)
    if found_inf is not None and not isinstance(found_inf, Tensor):
        # a plain number (torch.amp.GradScaler passes 0 when it checked no grads)
        found_inf = torch.ones((), dtype=torch.float32, device=device) if found_inf else None
    elif found_inf is not None and (found_inf.device != device or found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        found_inf = found_inf.to(device=device, dtype=torch.float32).sum()
    max_grad_norm, scratch, seed = options.max_grad_norm, options.scratch, options.rounding_seed
    # the unscaled grads are written back only when the grads carry a scale (not after unscale_)
    unscale_into_grads = None if options.keep_scaled_grads else grad_scale
    # [note: wide params] [note: compact fallback] the kernels' share, and the rest for the reference passes
    share, wide = _shares(backend, batch, seed is not None)
    # only what the backend's share needs: backends without compact modes never see a seed
    share_seed = seed if seed is not None and "sr" in getattr(backend, "COMPACT_MODES", ()) else None
    if not needs_stats(grad_scale, found_inf, max_grad_norm, options.skip_nonfinite):
        stats = _plain_stats(device)  # every rank steps: no stats to all-reduce either
        if share.params:
            backend.adamw_update_(share, stats, scratch=scratch, rounding_seed=share_seed)
        if wide is not None:
            reference.adamw_update_(wide, stats, rounding_seed=seed)
        return None, stats[SKIP]
    # a scaler always skips on inf/NaN: the guard is off only without one
    check_nonfinite = options.skip_nonfinite or grad_scale is not None or found_inf is not None
    stats = torch.empty(STATS_SIZE, dtype=torch.float32, device=device)
    if share.params:
        backend.grad_stats_(share, grad_scale, found_inf, max_grad_norm, stats, scratch=scratch,
                            check_nonfinite=check_nonfinite)
    else:
        stats.zero_()
    if wide is not None:
        wide_stats = torch.empty_like(stats)
        reference.grad_stats_(wide, grad_scale, found_inf, max_grad_norm, wide_stats, check_nonfinite=check_nonfinite)
        stats[SUMSQ] += wide_stats[SUMSQ]
        stats[SKIP] = torch.maximum(stats[SKIP], wide_stats[SKIP])  # both hold found_inf already
        finish_(stats, grad_scale, None, max_grad_norm, check_nonfinite=check_nonfinite)
    if options.reduce_stats is not None:  # [distributed] local shards' stats -> global (one small all-reduce)
        sumsq, flag = options.reduce_stats(stats[SUMSQ], stats[SKIP])  # SKIP already holds found_inf
        stats[SUMSQ], stats[SKIP] = sumsq, flag
        finish_(stats, grad_scale, None, max_grad_norm, check_nonfinite=check_nonfinite)
    if share.params:
        backend.adamw_update_(share, stats, scratch=scratch, grad_scale=unscale_into_grads, rounding_seed=share_seed)
    if wide is not None:
        reference.adamw_update_(wide, stats, grad_scale=unscale_into_grads, rounding_seed=seed)
    return stats[NORM], stats[SKIP]


def rounding_seed(device: torch.device) -> int:
    """The seed of one step's stochastic rounding: drawn on the host from
    torch's default CPU generator, so nothing syncs with the device and ``torch.manual_seed``
    reproduces a run. A CUDA graph would replay the captured seed, so capture is refused."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("stochastic_rounding=True cannot be captured in a CUDA graph: every replay would reuse the "
                           "captured seed (the same random bits each step); capture with stochastic_rounding=False")
    return _compact.draw_rounding_seed()


def fallback_indices(backend, params, exp_avgs, masters, moment_scales=None, stochastic: bool = False,
                     element_base=None) -> list[int]:
    """Indices of the tensors the reference passes serve inside the step: float64/complex ones ([note: wide
    params]), params with gaps ([note: non-dense params]), those whose encodings ``backend`` does not list
    in its ``COMPACT_MODES``, and, rounding stochastically, shards whose elements' indices in their whole
    tensor cross a multiple of 2^32 (``_contract.crosses_high_word``).

    [note: compact fallback] Every mode works on every backend from the day it exists: a backend
    without a native variant hands those tensors to ``reference`` (the specification of every
    encoding) in the same step, under the same stats (one norm, one skip flag), as it does wide params.
    """
    if backend is reference:
        return wide_indices(params)
    served = getattr(backend, "COMPACT_MODES", frozenset())
    wide = set(wide_indices(params)) | {i for i, p in enumerate(params) if not is_dense(p)}
    # int4 codes are packed in the param's row-major order: the kernels step contiguous params only
    wide |= {i for i, (p, m) in enumerate(zip(params, exp_avgs)) if moment_encoding(m) == "int4" and not p.is_contiguous()}
    for i, (p, m, master) in enumerate(zip(params, exp_avgs, masters)):
        if i not in wide and not compact_modes(p, m, master, stochastic) <= served:
            wide.add(i)
    if stochastic and element_base is not None:
        wide |= {i for i, (p, base) in enumerate(zip(params, element_base)) if crosses_high_word(base, p.numel())}
    return sorted(wide)


def _shares(backend, batch: Batch, stochastic: bool) -> tuple[Batch, Batch | None]:
    """(the backend's share of ``batch``, the reference passes' share or None), kept in ``batch.parts``.

    The split is built once per batch, backend and rounding; a later step re-takes only the grads
    and the group rows (what a plan patches into its batch), so the shares keep the identity of
    their other lists (what the backends' memos key on).
    """
    key = (backend.NAME, stochastic)
    entry = batch.parts.get(key)
    if entry is None:
        wide = fallback_indices(backend, batch.params, batch.exp_avgs, batch.masters, batch.moment_scales, stochastic,
                                batch.element_base)
        if not wide:
            entry = batch.parts[key] = ()
        else:
            wide_set = set(wide)
            keep = [i for i in range(len(batch.params)) if i not in wide_set]
            take_keep, take_wide = _taker(keep), _taker(wide)
            lists = (batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, batch.max_exp_avg_sqs, batch.steps,
                     batch.masters)
            scales = batch.moment_scales
            keep_scales = None if scales is None else take_keep(scales)
            if keep_scales is not None and all(x is None for x in keep_scales):
                keep_scales = None  # a backend without int8 moments never sees moment_scales
            full = range(len(batch.params)) if batch.index is None else batch.index
            bases = batch.element_base
            share = Batch(*map(take_keep, lists), take_keep(batch.group_ids), batch.groups, keep_scales, take_keep(full),
                          None if bases is None else take_keep(bases))
            wide_part = Batch(*([_as_real(t) for t in take_wide(x)] for x in lists), take_wide(batch.group_ids),
                              batch.groups, None if scales is None else take_wide(scales), take_wide(full),
                              None if bases is None else take_wide(bases))
            entry = batch.parts[key] = (share, wide_part, take_keep, take_wide)
    if not entry:
        return batch, None
    share, wide_part, take_keep, take_wide = entry
    share.grads = take_keep(batch.grads)
    wide_part.grads = [_as_real(g) for g in take_wide(batch.grads)]
    share.groups = wide_part.groups = batch.groups
    return share, wide_part


def _taker(indices: list[int]):
    """``xs -> [xs[i] for i in indices]`` without a Python call per entry."""
    return lambda xs: list(map(xs.__getitem__, indices))


def _as_real(t):
    """A complex tensor as its fp view (``view_as_real``, [note: wide params]); anything else as it is."""
    return torch.view_as_real(t) if isinstance(t, Tensor) and t.is_complex() else t
