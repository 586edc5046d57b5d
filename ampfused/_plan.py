"""The tensor lists of FusedAmpAdamW.step(): which params step, checked once, cached while unchanged."""
from __future__ import annotations

import operator
from itertools import chain, compress, repeat

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _dtensor
from ._args import check_grad, check_group_flags, check_hyperparameters, check_no_overlap
from ._batch import Batch, Hyper, row_lr
from ._layout import is_dense
from ._state import master_of, moment_key, scales_of, wide_indices


def grads_to_step(param_groups, param_dtypes: dict, device) -> list[tuple[Tensor, Tensor, dict]]:
    """(param, p.grad, group) for every param that has a gradient, every one checked before any write.

    A gradient whose strides differ from its param's is replaced, in ``p.grad``, by a copy in the
    param's strides (so an ``unscale_`` reaches what the step reads, and the passes see one layout).
    """
    if device is not None and device.type == "meta":
        raise RuntimeError("FusedAmpAdamW cannot step parameters on the meta device (they hold no data): "
                           "materialize the model first (e.g. model.to_empty(device=...) and initialize it)")
    out = []
    for group in param_groups:
        for p in group["params"]:
            if p.dtype != param_dtypes[p] or p.device != device:
                raise RuntimeError(
                    f"a parameter changed from {param_dtypes[p]} on {device} to {p.dtype} on {p.device} "
                    "after the optimizer was built (e.g. model.half() afterwards): build the optimizer after converting the model")
            grad = p.grad
            if grad is None:
                continue
            if grad is not getattr(p, "main_grad", None):  # main_grad is valid by construction
                dense = is_dense(p)
                if not dense:  # (p.data replaced by a slice after construction: refused only where it overlaps)
                    try:
                        check_no_overlap(p, "a parameter")
                    except ValueError as exc:
                        raise RuntimeError(f"{exc} (it became so after the optimizer was built)") from None
                check_grad(p, grad)
                # [note: non-dense params] in _args: the reference passes read any grad layout
                if dense and grad.stride() != p.stride():
                    p.grad = grad = torch.empty_like(p, dtype=grad.dtype).copy_(grad)
            out.append((p, grad, group))
    return out


class StepPlan:
    """The tensor lists of a step, kept while the params, their grads and the groups are unchanged.

    [note: host time] Validation, lazy state and the per-tensor lists cost Python per param; a
    training loop steps the same params every step, with grads that differ at most in their addresses
    (new tensors after ``zero_grad(set_to_none=True)``). So a warm step only re-reads, with C-level
    maps, ``opt.state``'s entries and their values (by identity), every param's address, shape and
    strides, and which params have a grad and its dtype, shape and strides. Anything else -- a
    ``p.data`` swap, a grad of another layout or on another param, a changed ``amsgrad``, an edited
    params list, a reset ``opt.state`` entry, a tensor assigned in one (``opt.state[p]["exp_avg"] =
    t``, which the state room then copies into its flat storage) -- rebuilds the plan through the
    validating path. Hyperparameters are compared per group at every step, and a changed group's
    row is checked and rebuilt (:class:`GroupRows`).

    The plan builds one :class:`~ampfused._batch.Batch` ([note: batch]) and a step patches its
    grads and group rows in (:meth:`batch_for_step`): the backends' memos and the reference
    passes' share (``batch.parts``) live as long as the plan.

    [note: grads released] Between steps the plan holds no reference to the grads (``release_grads``,
    called when the step is done): ``zero_grad(set_to_none=True)`` then frees them, as with torch's
    optimizers, instead of keeping a whole set of gradients alive through the next forward and
    backward and freeing it inside the next ``step()`` (what that cost at 50M params:
    docs/results/large-tensors.md, finding 1). A plan needs no grad's identity: it takes any grads that have the
    params and the layouts of the ones it checked.
    """

    def __init__(self, param_groups, work, state, scratch, rows: GroupRows):
        self.scratch = scratch  # functional.Scratch: the optimizer's launch scratch, a memo for this plan's tables
        self.groups = [(g, g["params"], len(g["params"]), g["amsgrad"]) for g in param_groups]
        self.all_params = [p for g in param_groups for p in g["params"]]
        self.has_grad = [p.grad is not None for p in self.all_params]  # which params step
        self.params = [p for p, _, _ in work]
        self.grads = [grad for _, grad, _ in work]
        self.grad_layouts = _layouts(self.grads)  # what the checked grads look like: fresh ones must match
        self.param_layouts = _shapes_and_strides(self.params)  # a p.data swap keeping the address may change them
        # a DTensor's data_ptr() is 0: its local shard's stands for it
        self.data_ptrs = [p.data_ptr() or _dtensor.local(p).data_ptr() for p in self.params]
        self.state = state
        self.states = states = [state[p] for p in self.params]
        # opt.state as it was checked, and every stepping param's entry, read back by identity (C-level maps)
        self.state_keys, self.state_values = list(state), list(state.values())
        self.entry_values = _entry_values(states)
        # [note: compact state] int8 moments step as their codes (their scales ride in moment_scales)
        self.exp_avgs = [s[moment_key(s, "exp_avg")] for s in states]
        self.exp_avg_sqs = [s[moment_key(s, "exp_avg_sq")] for s in states]
        self.max_exp_avg_sqs = [s.get(moment_key(s, "max_exp_avg_sq")) if g["amsgrad"] else None
                                for s, (_, _, g) in zip(states, work)]
        self.steps = [s["step"] for s in states]
        self.masters = [master_of(s) for s in states]
        scales = [scales_of(s, g["amsgrad"]) for s, (_, _, g) in zip(states, work)]
        self.moment_scales = scales if any(x is not None for x in scales) else None
        self.wide = wide_indices(self.params)  # float64/complex: the reference passes' share
        self.rows = rows  # the stepping groups' rows, checked (see [note: group rows])
        self.group_ids = rows.group_ids
        self.is_dtensor = bool(self.params) and _dtensor.is_dtensor(self.params[0])  # all or none (add_param_group)
        self.batch: Batch | None = None if self.is_dtensor else Batch(
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs, self.steps, self.masters,
            self.group_ids, [], self.moment_scales)
        self.local_params: list | None = None  # [distributed] the local shards self.batch was built from

    def still_valid(self, param_groups, state) -> bool:
        """True when this plan serves the coming step (its grads list refreshed); False to rebuild it."""
        if len(param_groups) != len(self.groups):
            return False
        # opt.state emptied, replaced, a param's entry deleted, cleared or swapped (a reset of Adam): lazy state again,
        # or a value assigned in an entry (opt.state[p]["exp_avg"] = t): the state room copies it in
        if (state is not self.state or len(state) != len(self.state_keys)
                or not all(map(operator.is_, state, self.state_keys))
                or not all(map(operator.is_, state.values(), self.state_values))):
            return False
        values = _entry_values(self.states)
        if len(values) != len(self.entry_values) or not all(map(operator.is_, values, self.entry_values)):
            return False
        for group, (g, params, n, amsgrad) in zip(param_groups, self.groups):
            if group is not g or group["params"] is not params or len(params) != n or group["amsgrad"] != amsgrad:
                return False
        data_ptrs = list(map(Tensor.data_ptr, self.params))
        if data_ptrs != self.data_ptrs and [p.data_ptr() or _dtensor.local(p).data_ptr() for p in self.params] != self.data_ptrs:
            return False
        if _shapes_and_strides(self.params) != self.param_layouts:
            return False
        # any grads (new tensors after zero_grad(set_to_none=True) + backward, or the same ones, whose
        # ``p.grad.data = ...`` may have changed) serve when the same params have them, in the layouts checked
        grads = list(map(_GRAD, self.all_params))
        has_grad = list(map(operator.is_not, grads, repeat(None)))
        if has_grad != self.has_grad:
            return False  # another set of params has gradients
        fresh = list(compress(grads, has_grad))
        if _layouts(fresh) != self.grad_layouts:
            return False
        self.grads = fresh
        return True

    def batch_for_step(self, groups: list[Hyper]):
        """(this step's batch: the plan's, with the grads and the group rows (``self.rows.current()``,
        read before any write) patched in; the stats reducer of DTensor lists, else None).
        [distributed] DTensors step on their local shards, and the stats cover the mesh."""
        if not self.is_dtensor:
            batch = self.batch
            batch.grads, batch.groups = self.grads, groups
            return batch, None
        (params, grads), reduce_stats = _dtensor.localize(self.params, self.grads)  # (checks the grads' placements)
        if self.batch is None or not all(map(operator.is_, params, self.local_params)):
            local = _dtensor.local_tensors
            self.batch = Batch(params, grads, local(self.exp_avgs), local(self.exp_avg_sqs), local(self.max_exp_avg_sqs),
                               self.steps, local(self.masters), self.group_ids, groups,
                               _dtensor.local_scales(self.moment_scales), element_base=_dtensor.element_bases(self.params))
            self.local_params = params
        self.batch.grads, self.batch.groups = grads, groups
        return self.batch, reduce_stats

    def release_grads(self) -> None:
        """The step is done: hold no grad until the next one (see [note: grads released])."""
        self.grads = None
        if self.batch is not None:
            self.batch.drop_grads()


class GroupRows:
    """[note: group rows] The rows of the param groups that step, each checked when it is built.

    Schedulers and trainers edit ``param_groups`` between steps, and a user may too
    (``group["betas"] = (0.9, 1.5)``, ``group["lr"] = "3e-4"``): a group's values are checked with
    the constructor's rules and messages, naming the group, whenever its row is rebuilt, and
    :meth:`current` runs before the step writes anything. A row is rebuilt only when a value
    of its group is another object than the one it was built from (a scheduler's new ``lr`` float
    rebuilds one row); a warm step whose groups did not change compares a few identities per group
    and converts nothing. Tensor betas are re-read whenever their version changes (torch reads them
    as floats at every step), through a cache, so without an in-place change nothing syncs.
    """

    def __init__(self, param_groups, work):
        # [note: groups once] the param groups with work, in order, and each tensor's index among them
        index: dict[int, int] = {}
        self.groups = []
        for _, _, g in work:
            if id(g) not in index:
                index[id(g)] = len(self.groups)
                self.groups.append(g)
        self.group_ids = [index[id(g)] for _, _, g in work]
        self.positions = [next(i for i, pg in enumerate(param_groups) if pg is g) for g in self.groups]  # for messages
        self.values: list[tuple | None] = [None] * len(self.groups)
        self.rows: list[Hyper | None] = [None] * len(self.groups)
        self.current()  # every row checked now: a plan is built only over valid groups

    def current(self) -> list[Hyper]:
        """Every stepping group's row, rebuilt (and checked) where the group's values changed."""
        for i, group in enumerate(self.groups):
            values = _group_values(group)
            old = self.values[i]
            if old is None or len(old) != len(values) or not all(map(operator.is_, values, old)) or _has_tensor(group["betas"]):
                self.rows[i] = _checked_row(values, self.positions[i])
                self.values[i] = values
        return self.rows


def _group_values(group: dict) -> tuple:
    """The values a group row is built from; a list of betas edited in place shows in its elements."""
    betas = group["betas"]
    values = (group["lr"], betas, group["eps"], group["weight_decay"], group["amsgrad"], group["maximize"])
    return values + tuple(betas) if isinstance(betas, (tuple, list)) else values


def _has_tensor(betas) -> bool:
    return isinstance(betas, (tuple, list)) and any(isinstance(b, Tensor) for b in betas)


def _checked_row(values: tuple, position: int) -> Hyper:
    """A group row, after the constructor's checks of its values (its message, naming the group)."""
    lr, betas, eps, weight_decay, amsgrad, maximize = values[:6]
    try:
        check_hyperparameters(lr, betas, eps, weight_decay, read_beta=_as_float)
        check_group_flags(amsgrad, maximize)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} in param_groups[{position}] (changed after the optimizer was built)") from None
    beta1, beta2 = (float(_as_float(b)) for b in betas)
    return Hyper(row_lr(lr), beta1, beta2, float(eps), float(weight_decay), bool(amsgrad), bool(maximize))


_TENSOR_HYPERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor beta -> (its _version, its value)


def _as_float(value):
    """A tensor beta (torch takes them) as a float, read from the device only when it changed: no sync per step."""
    if not isinstance(value, Tensor):
        return value
    cached = _TENSOR_HYPERS.get(value)
    if cached is None or cached[0] != value._version:
        cached = _TENSOR_HYPERS[value] = (value._version, float(value))
    return cached[1]


_DTYPE, _GRAD, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("grad"), operator.attrgetter("shape")


def _entry_values(states: list) -> list:
    """Every value of every state entry, in order (a cleared, grown or reassigned entry changes the list)."""
    return list(chain.from_iterable(map(dict.values, states)))


def _strides(tensors: list) -> list | None:
    """The strides of every tensor, None when all are contiguous (one C-level bool per tensor)."""
    return None if all(map(Tensor.is_contiguous, tensors)) else list(map(Tensor.stride, tensors))


def _shapes_and_strides(tensors: list) -> tuple:
    """The shape of every tensor, and its strides where any is not contiguous (C-level maps)."""
    return list(map(_SHAPE, tensors)), _strides(tensors)


def _layouts(tensors: list) -> tuple | None:
    """Dtype, shape and strides of every tensor (grads), read with C-level maps (no Python call per tensor).

    zero_grad(set_to_none=True) gives new grad tensors every step; a plan takes
    them when they look like the grads it checked -- then only their addresses are new, which the
    backends' tables read from ``data_ptr()`` -- else the step re-validates through ``_args.check_grad``.
    torch's ``p.grad`` setter and autograd refuse a grad of another size or device than its param,
    but a ``p.grad.data = ...`` assignment does not, and may change the dtype, shape and strides of
    the same tensor; dtype is read also because ``Tensor.grad_dtype`` may allow another.
    """
    try:
        return list(map(_DTYPE, tensors)), _shapes_and_strides(tensors)
    except RuntimeError:  # a sparse grad has no strides: check_grad names the problem
        return None
