"""The cached tensor lists of FusedAmpAdamW.step() (see the class note)."""
from __future__ import annotations

import operator

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _dtensor, functional
from ._flat import SUPPORTED_DTYPES


class StepPlan:
    """The tensor lists of a step, kept while the params, their grads and the groups are unchanged.

    [note: host time] Validation, lazy state and the per-tensor lists cost Python per param; a
    training loop steps the same params with the same grad tensors every step (fp32 ``p.grad`` that
    autograd accumulates into in place, or our fp32 ``main_grad``), so a step only re-reads
    ``p.grad`` and ``p.data_ptr()`` of every param and compares identities. Anything else -- a new
    grad tensor, a ``p.data`` swap, a changed ``amsgrad``, an edited params list, a reset ``opt.state``
    -- rebuilds the plan
    through the validating path. Hyperparameters are read per group at every step.
    """

    def __init__(self, param_groups, work, state):
        self.groups = [(g, g["params"], len(g["params"]), g["amsgrad"]) for g in param_groups]
        self.all_params = [p for g in param_groups for p in g["params"]]
        self.all_grads = [p.grad for p in self.all_params]
        self.params = [p for p, _, _ in work]
        self.grads = [grad for _, grad, _ in work]
        # a DTensor's data_ptr() is 0: its local shard's stands for it
        self.data_ptrs = [p.data_ptr() or _dtensor.local(p).data_ptr() for p in self.params]
        self.state = state
        self.states = states = [state[p] for p in self.params]
        self.exp_avgs = [s["exp_avg"] for s in states]
        self.exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        self.max_exp_avg_sqs = [s.get("max_exp_avg_sq") if g["amsgrad"] else None for s, (_, _, g) in zip(states, work)]
        self.steps = [s["step"] for s in states]
        self.masters = [s.get("master_param") for s in states]
        self.wide = functional.wide_indices(self.params)  # float64/complex: the reference passes' share
        counts: dict[int, int] = {}
        for _, _, g in work:
            counts[id(g)] = counts.get(id(g), 0) + 1
        self.counts = [(g, counts.get(id(g), 0)) for g in param_groups]

    def still_valid(self, param_groups, state) -> bool:
        """True when this plan serves the coming step (its grads list refreshed); False to rebuild it."""
        if len(param_groups) != len(self.groups):
            return False
        # opt.state emptied, replaced, a param's entry deleted or cleared (a reset of Adam): lazy state again
        if state is not self.state or not all(map(operator.is_, map(state.get, self.params), self.states)) or not all(self.states):
            return False
        for group, (g, params, n, amsgrad) in zip(param_groups, self.groups):
            if group is not g or group["params"] is not params or len(params) != n or group["amsgrad"] != amsgrad:
                return False
        if [p.data_ptr() or _dtensor.local(p).data_ptr() for p in self.params] != self.data_ptrs:
            return False
        grads = [p.grad for p in self.all_params]
        if all(map(operator.is_, grads, self.all_grads)):
            return True
        # new grad tensors for the same params (zero_grad(set_to_none=True) + backward): check them only
        if [g is None for g in grads] != [g is None for g in self.all_grads]:
            return False  # another set of params has gradients
        fresh = [g for g in grads if g is not None]
        if any(g is not old and not _plain_grad_for(p, g) for p, g, old in zip(self.params, fresh, self.grads)):
            return False
        self.all_grads, self.grads = grads, fresh
        return True

    def hypers(self) -> list:
        hypers = []
        for group, n in self.counts:
            if n:
                beta1, beta2 = (_as_float(b) for b in group["betas"])
                hypers += [functional.Hyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                                            group["amsgrad"], group["maximize"])] * n
        return hypers


_TENSOR_HYPERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor beta -> (its _version, its value)


def _as_float(value):
    """A tensor beta (torch takes them) as a float, read from the device only when it changed: no sync per step."""
    if not isinstance(value, Tensor):
        return value
    cached = _TENSOR_HYPERS.get(value)
    if cached is None or cached[0] != value._version:
        cached = _TENSOR_HYPERS[value] = (value._version, float(value))
    return cached[1]


def _plain_grad_for(p: Tensor, grad: Tensor) -> bool:
    """A grad the plan can take as is: what autograd produces for ``p`` (anything else goes through check_grad)."""
    return (grad.layout is torch.strided and grad.shape == p.shape and (grad.dtype == p.dtype or (grad.dtype in SUPPORTED_DTYPES and p.dtype in SUPPORTED_DTYPES))
            and grad.device == p.device and grad.stride() == p.stride())
