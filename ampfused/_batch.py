"""The step's record: one update's tensors and group rows, as every backend's passes take them.

A plan (``_plan.StepPlan``) builds one :class:`Batch` and patches it per step; the functional API
builds one per call. Its group rows (:class:`Hyper`) are converted from the group dicts once; how a
kernel reads a row's lr is classified once, per group (:func:`lr_kind`). The record layouts the
kernels read (``UPDATE_TENSOR``, ``UPDATE_GROUP``) and every code are in ``_contract.py``.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ._contract import FLAG_AMSGRAD, FLAG_MAXIMIZE, LR_F32, LR_KIND_OF_DTYPE, LR_VALUE


class Hyper(NamedTuple):
    """One group row: the hyperparameters of one param group, shared by all tensors of the group.

    Converted from a group dict when its values change (``_plan.GroupRows``), or per call (``functional.group_hypers``):
    floats and bools, ``lr`` a float or a 1-element tensor (read on the device: no sync). Backends
    read these fields as they are.
    """

    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool

    @property
    def flags(self) -> int:
        return (FLAG_AMSGRAD if self.amsgrad else 0) | (FLAG_MAXIMIZE if self.maximize else 0)


def check_tensor_lr(lr: Tensor) -> None:
    """torch's rule for a tensor lr: one element, of any shape."""
    if lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")


def row_lr(lr: float | Tensor) -> float | Tensor:
    """A group row's lr: a float, or a tensor lr as a 0-d view of itself (same storage, so in-place
    updates and CUDA-graph replays still read it), as torch's ``_to_scalar`` squeezes one before the
    step: a ``[1, 1]`` lr then broadcasts into a 1-d param instead of widening it."""
    if isinstance(lr, Tensor):
        check_tensor_lr(lr)  # the functional API and a group["lr"] set after construction come here unchecked
        return lr if lr.dim() == 0 else lr.view(())
    return float(lr)


def lr_kind(lr: float | Tensor, device: torch.device) -> int:
    """[note: lr kinds] How the kernels of a step on ``device`` read a group row's lr (``Hyper.lr``).

    ``LR_VALUE``: a number, or a one-element tensor in host memory while the step runs off the CPU
    (read on the host: no device sync). Otherwise a tensor read when the kernel runs, so in-place
    scheduler updates and CUDA-graph replays see its current value with no sync: the
    ``LR_KIND_OF_DTYPE`` kind of its dtype, or ``LR_F32`` for one on another device or of a dtype the
    kernels do not read: the backend reads a float32 copy it makes on ``device`` (on the stream, no
    sync) and keeps alive as long as its launch (a captured CUDA graph replays into it).
    """
    if not isinstance(lr, Tensor):
        return LR_VALUE
    check_tensor_lr(lr)
    if lr.device.type == "cpu" and device.type != "cpu":
        return LR_VALUE
    return LR_KIND_OF_DTYPE.get(lr.dtype, LR_F32) if lr.device == device else LR_F32


class Batch:
    """[note: batch] One update's tensors and group rows, in the spec's order: what every backend's
    passes take (``Backend.grad_stats_`` reads ``grads`` only).

    Parallel per-tensor lists (``None`` entries in ``max_exp_avg_sqs`` / ``masters`` where a param
    has no AMSGrad buffer / no master), ``group_ids[i]`` the index of tensor ``i``'s row in
    ``groups``, and ``moment_scales`` the int8 block scales of compact tensors (``None``, or ``None``
    entries, for others; see ``Backend.adamw_update_``). The optimizer's plan builds one per plan
    and a step patches only ``grads`` and ``groups``; the other lists keep their identity, which is
    what a backend's host memo keys on ([note: host time] in ``_plan.py``). ``parts`` caches what
    ``functional.run_step`` derives from it (the reference passes' share, see [note: wide params]).
    ``index``: each tensor's position in the step's full lists (``None``: ``0..n-1``), what keys its
    stochastic-rounding bits ([note: rounding bits]), so a share of a split step draws the same bits.
    ``element_base``: each tensor's first element's index in its whole tensor (``None``: all 0): a
    DTensor's local shard counts its random bits from its offset, as the unsharded tensor does.
    ``lr_kinds[j]``: how the kernels read ``groups[j].lr`` (:func:`lr_kind`), set with ``groups``:
    the one place a tensor lr is classified, which every kernel backend reads.
    """

    __slots__ = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps", "masters", "group_ids",
                 "_groups", "lr_kinds", "moment_scales", "index", "element_base", "parts")

    def __init__(self, params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor | None], steps: Sequence[Tensor],
                 masters: Sequence[Tensor | None], group_ids: Sequence[int], groups: Sequence[Hyper],
                 moment_scales: Sequence | None = None, index: Sequence[int] | None = None,
                 element_base: Sequence[int] | None = None):
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = params, grads, exp_avgs, exp_avg_sqs
        self.max_exp_avg_sqs, self.steps, self.masters = max_exp_avg_sqs, steps, masters
        self.group_ids, self.groups, self.moment_scales, self.index = group_ids, groups, moment_scales, index
        self.element_base = element_base
        self.parts: dict = {}

    @property
    def groups(self) -> Sequence[Hyper]:
        return self._groups

    @groups.setter
    def groups(self, groups: Sequence[Hyper]) -> None:
        device = self.params[0].device if len(self.params) else torch.device("cpu")
        self._groups, self.lr_kinds = groups, [lr_kind(h.lr, device) for h in groups]  # per group, never per tensor

    def drop_grads(self) -> None:
        """Forget the grads, here and in ``parts``, until a step patches new ones in (a plan holds
        no grad between steps: [note: grads released] in ``_plan.py``)."""
        self.grads = None
        for part in self.parts.values():
            for b in part:
                if isinstance(b, Batch):
                    b.grads = None

    @classmethod
    def of_grads(cls, grads: Sequence[Tensor]) -> "Batch":
        """A batch for the stats pass alone: its grads, no update lists."""
        return cls([], grads, [], [], [], [], [], [], [])
