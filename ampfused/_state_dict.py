"""FusedAmpAdamW's state dicts: torch.optim.AdamW's format both ways (and the compact form of DESIGN §9),
validated before any write.

:func:`validate` is pure: it reads a state dict against the optimizer's groups and raises before
anything changes. :func:`apply` then writes it: group options, and state copied into fresh flat
buffers (``_state``), fp32 whatever the param dtype (torch's base class would cast it to the param
dtype); master weights missing from the dict, or not fp32 (``[note: stale masters]``), are taken from
the params at the next step.
"""
from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from itertools import chain
from typing import NamedTuple

import torch
from torch.optim import Optimizer

from . import _compact, _dtensor
from ._contract import SCALE_BLOCK as BLOCK
from ._contract import KERNEL_DTYPES, MASTER_ENCODINGS, MASTER_LOW16_LEGACY_DTYPE, moment_encoding
from ._state import MOMENT_KEYS, is_tensor_key, master_of, state_shape

# [note: implementation keys] torch.optim.AdamW's param groups carry these; code that indexes them
# must find values that describe this optimizer: always fused, capturable (no host sync in step()),
# decoupled weight decay, never differentiable. state_dict() writes torch's defaults instead, so a
# checkpoint loads into torch.optim.AdamW and runs there as a fresh AdamW would.
IMPLEMENTATION_KEYS = dict(foreach=False, fused=True, capturable=True, differentiable=False, decoupled_weight_decay=True)
TORCH_IMPLEMENTATION_DEFAULTS = dict(foreach=None, fused=None, capturable=False, differentiable=False, decoupled_weight_decay=True)


class Checked(NamedTuple):
    """A state dict that :func:`validate` accepted, with what :func:`apply` needs of it."""

    saved_groups: list
    saved_state: dict
    param_of: dict  # saved param id -> the optimizer's param
    amsgrad_of: dict  # saved param id -> its saved group's amsgrad
    steps: dict  # saved param id -> 0-d fp32 step


def state_dict(opt: Optimizer) -> dict:
    """torch's state dict of ``opt`` with torch.optim.AdamW's implementation defaults in its groups."""
    if opt._state_room.masters_pending:
        with torch.no_grad():
            opt._state_room.copy_pending_masters()
    result = Optimizer.state_dict(opt)
    for group in result["param_groups"]:
        group.update(TORCH_IMPLEMENTATION_DEFAULTS)
    return result


def validate(param_groups: list, state_dict: dict, keys_of=None) -> Checked:
    """Check ``state_dict`` against ``param_groups`` without writing anything; raises ValueError.

    ``keys_of(p, amsgrad)``: the state keys and dtypes of ``p`` in the optimizer's modes
    (``_state.StateRoom.keys``). [note: two forms] An entry with a compact key (``_compact``) is the
    compact form and must be exactly the optimizer's (keys, dtypes, shapes): it loads bitwise. Any
    other entry is torch's fp32 form (torch.optim.AdamW's, ampfused's fp32 mode's) and is encoded into
    the optimizer's modes at the load.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(param_groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
    param_of = dict(zip(chain.from_iterable(s["params"] for s in saved_groups), chain.from_iterable(g["params"] for g in param_groups)))
    amsgrad_of = {p: s.get("amsgrad", False) for s in saved_groups for p in s["params"]}
    saved_state = {key: _current_format(values) for key, values in state_dict["state"].items()}
    steps = {}
    for key, values in saved_state.items():
        if key not in param_of:
            raise ValueError(f"loaded state dict has state for parameter index {key!r}, which no parameter group lists")
        if not isinstance(values, dict):
            raise ValueError(f"state of parameter {key} is a {type(values).__name__}, not a dict of tensors: "
                             "not an AdamW state dict")
        if not values:  # opt.state is a defaultdict: reading opt.state[p] of a param
            continue    # that never stepped leaves {}, which torch saves and loads as "no state yet"
        p = param_of[key]
        _check_tensors(key, values)
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in values and k + "_codes" not in values]
        if missing:
            raise ValueError(f"state of parameter {key} lacks {missing}: not an AdamW state dict")
        if any(_compact.is_compact_key(k) for k in values):
            _check_compact_entry(key, p, values, keys_of)
        for name in MOMENT_KEYS:
            if name in values:  # [distributed] sharded state must come as DTensors
                _dtensor.check_state(p, values[name], f"state {name!r} of parameter {key}")
            if name in values and tuple(values[name].shape) != tuple(p.shape):
                raise ValueError(
                    f"state {name!r} of parameter {key} has shape {tuple(values[name].shape)} but the parameter has "
                    f"shape {tuple(p.shape)}: the state dict belongs to another model or optimizer")
        step = torch.as_tensor(values["step"], dtype=torch.float32)  # torch saves 0-d or 1-element steps
        if step.numel() != 1:
            raise ValueError(f"state 'step' of parameter {key} has shape {tuple(step.shape)}; expected a scalar")
        steps[key] = step.reshape(())
    return Checked(saved_groups, saved_state, param_of, amsgrad_of, steps)


def _check_tensors(key, values: dict) -> None:
    """Every state entry this optimizer reads is a tensor (``step`` may be a number, as older torch saved it)."""
    for name, value in values.items():
        if name == "step":
            if not isinstance(value, (torch.Tensor, int, float)):
                raise ValueError(f"state 'step' of parameter {key} is a {type(value).__name__} ({value!r}); "
                                 "expected a tensor or a number")
        elif is_tensor_key(name) and not isinstance(value, torch.Tensor):
            raise ValueError(f"state {name!r} of parameter {key} is a {type(value).__name__}, not a tensor: "
                             "the state dict is damaged or not an AdamW state dict")


def _current_format(values):
    """An entry with split16 low halves saved as int16 (before they travelled as bf16 bit patterns:
    [note: split16 dtype] in ``_contract.py``) with the same bits viewed as today's dtype (a new dict;
    the caller's is not modified). Anything else as it is."""
    low = values.get("master_low16") if isinstance(values, dict) else None
    if isinstance(low, torch.Tensor) and low.dtype == MASTER_LOW16_LEGACY_DTYPE and not _dtensor.is_dtensor(low):
        return {**values, "master_low16": low.view(MASTER_ENCODINGS["split16"][0])}
    return values


def _describe(keys) -> str:
    return ", ".join(f"{k} ({str(d).replace('torch.', '')})" for k, d in sorted(keys.items()))


def _check_compact_entry(key, p, values: dict, keys_of) -> None:
    """A compact-form entry must be the optimizer's own mode for ``p``: same keys, dtypes and shapes."""
    saved = {k: v.dtype for k, v in values.items() if k != "step" and isinstance(v, torch.Tensor)}
    amsgrad = any(k.startswith("max_exp_avg_sq") for k in saved)
    wanted = keys_of(p, amsgrad) if keys_of is not None and p.dtype in KERNEL_DTYPES else {}
    if saved != wanted:
        raise ValueError(
            f"state of parameter {key} is compact state of another mode than this optimizer keeps for a {p.dtype} "
            f"parameter of shape {tuple(p.shape)}: saved {_describe(saved)}; expected {_describe(wanted) or 'no compact state'}. "
            "Load it into an optimizer with the master_weights/state_dtype it was saved with, or expand it with "
            "ampfused.checkpoint.to_torch_state_dict(state_dict, params) and load that: every mode takes the fp32 form "
            "(a torch.distributed.checkpoint of another mode: load it with ampfused.checkpoint.dcp_load)")
    codes = values.get("exp_avg_codes")
    moment_mode = moment_encoding(codes) if codes is not None else "fp32"  # (the optimizer's own: checked above)
    for name, value in values.items():
        if name == "step" or not isinstance(value, torch.Tensor):
            continue
        _dtensor.check_state(p, value, f"state {name!r} of parameter {key}")
        shape = state_shape(p, name, moment_mode)
        if name.endswith("_scales") and value.dim() == 1 and len(shape) == 2 and value.numel() == -(-p.numel() // BLOCK):
            raise ValueError(
                f"state {name!r} of parameter {key} has the int8 scales of compact format 1 (blocks of the flattened "
                f"tensor, {value.numel()} of them), but blocks now start at every row ({shape}: [note: blocks in rows]): "
                "expand the state dict with ampfused.checkpoint.to_torch_state_dict(state_dict, params), which reads "
                "both formats, and load that (every mode takes the fp32 form)")
        if tuple(value.shape) != shape:
            raise ValueError(f"state {name!r} of parameter {key} has shape {tuple(value.shape)}, expected {shape}: "
                             "the state dict belongs to another model or optimizer")


@torch.no_grad()
def apply(opt: Optimizer, checked: Checked) -> None:
    """Write a validated state dict into ``opt``: group options, then fresh flat state filled from it."""
    for group, saved in zip(opt.param_groups, checked.saved_groups):
        group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
        group.update(IMPLEMENTATION_KEYS)
        group["betas"] = tuple(group["betas"])
    opt.state = defaultdict(dict)
    room = opt._state_room
    room.layout()
    room.masters_pending = []
    stale = []  # saved ids whose master_param was not fp32: see [note: stale masters]
    for key, values in checked.saved_state.items():
        if not values:  # a param that never stepped (the check above)
            continue
        p = checked.param_of[key]
        room.init(p, bool(checked.amsgrad_of[key]))
        state = opt.state[p]
        state["step"].copy_(checked.steps[key])
        if any(_compact.is_compact_key(k) for k in values):  # the optimizer's own compact form: bitwise
            for name, value in values.items():
                if name != "step" and name in state:
                    _dtensor.copy_state_(state[name], value)
            continue
        for name in _compact.MOMENTS:  # torch's fp32 form, encoded into this optimizer's modes
            if name in values and name in state:
                _dtensor.copy_state_(state[name], values[name])  # fp32, or RNE to bf16 moments
            elif name in values and name + "_codes" in state:
                quantize = _compact.quantize4 if room.moment_mode(p) == "int4" else _compact.quantize
                codes, scales = quantize(_dtensor.local(values[name]).to(p.device, torch.float32),
                                         "signed" if name == "exp_avg" else "sqrt")
                _dtensor.copy_local_(state[name + "_codes"], codes)  # (local shards: codes and scales of whole rows)
                _dtensor.copy_local_(state[name + "_scales"], scales)
        master = values.get("master_param")
        keeps_master = master_of(state) is not None
        if master is not None and master.dtype != torch.float32:  # [note: stale masters]
            stale += [key] if keeps_master else []
            master = None
        elif master is not None and keeps_master and _held_by_param_dtype(master, p.dtype):
            master = None  # nothing the param does not hold: it may be a stale one DCP cast back to fp32
        if "master_param" in state:
            if master is not None:
                _dtensor.copy_state_(state["master_param"], master)
            else:
                room.masters_pending.append(p)  # see [note: masters of a torch checkpoint] in _state
        elif master is not None and keeps_master:
            # a split master from an fp32 one: the param becomes RNE(master), the stored bits its remainder
            master = _dtensor.local(master).to(p.device, torch.float32)
            if "master_low16" in state:
                param, bits = _compact.split16(master)
                _dtensor.copy_local_(state["master_low16"], bits)
            else:
                param, bits = _compact.split8(master, p.dtype)
                _dtensor.copy_local_(state["master_residual8"], bits)
            _dtensor.copy_local_(p, param)
        # (no master in the dict: a split master's stored bits stay zero, the master is the param exactly)
    if stale:
        warnings.warn(stale_master_message(stale, "load_state_dict"), UserWarning, stacklevel=3)


# [note: stale masters] A master is fp32 by definition (DESIGN §2.5). A master_param of another dtype
# was carried along by an optimizer that does not keep masters: torch.optim.AdamW's load_state_dict
# casts every floating-point state entry to the param's dtype and keeps keys it does not know, so a
# bf16 model trained on with stock AdamW hands back the master of the day it was loaded, never
# updated since. Taking it would throw those steps away; the param is the current weight, so the
# master comes from it (at the next step, whichever of model and optimizer was loaded first).
#
# A stale master can also come back as fp32: DCP copies a checkpoint's bf16 master_param into the fp32
# tensor the loading optimizer asked for, before this code sees it. Such a master has no bits below the
# param's precision. Neither has any master this optimizer wrote that is worth keeping: it always keeps
# p = RNE(master), so a master the param's dtype represents exactly *is* its param. Taking those from
# the param is therefore never wrong, and catches the cast stale ones (silently: they cannot be told apart).
def _held_by_param_dtype(master, dtype: torch.dtype) -> bool:
    """Every element of ``master`` (this rank's shard) is exactly representable in ``dtype`` (one host read)."""
    local = _dtensor.local(master)
    return dtype in KERNEL_DTYPES and dtype != torch.float32 and torch.equal(local, local.to(dtype).to(torch.float32))


def stale_master_message(where, call: str) -> str:
    """The one warning for masters that are not fp32 (``where``: the state-dict ids or FQNs concerned)."""
    where = list(where)
    shown = ", ".join(map(str, where[:4])) + (", ..." if len(where) > 4 else "")
    return (f"{call}: the master_param of {len(where)} parameter(s) ({shown}) is not float32, so it is not a master "
            "this optimizer wrote: another optimizer carried it along (torch.optim.AdamW casts state it does not know "
            "to the param's dtype and never updates it). Taking it would undo the steps taken since; the masters "
            "are taken from the parameters instead")
