"""torch.distributed.checkpoint between optimizers whose state keys differ (``ampfused.checkpoint.dcp_load``).

[note: DCP asks for the loader's keys] DCP's load planner reads exactly the keys of the state dict
being loaded and raises ``Missing key in checkpoint state_dict`` before any optimizer sees anything.
A torch.optim.AdamW checkpoint of a bf16 model has ``exp_avg``/``exp_avg_sq``/``step`` per param; a
FusedAmpAdamW asks for its own keys (``master_param``, ``master_low16``, int8 / int4 codes and scales ...),
and a stock AdamW loading a compact FusedAmpAdamW checkpoint asks for an ``exp_avg`` it does not
have. (``DefaultLoadPlanner(allow_partial_load=True)`` is no answer: the keys it skips keep the
loading optimizer's fresh values, zero int8 moments for a stock checkpoint's.)

:func:`load` reads the checkpoint's metadata first and, for every optimizer state entry whose keys
the checkpoint does not have, asks for the keys it does have instead (tensors shaped, typed and
sharded as saved), then hands the entry on in torch's fp32 form, which ``torch.optim.AdamW`` and
every FusedAmpAdamW mode load (the latter encodes it into its modes; masters missing from it are
taken from the params). Entries whose keys the checkpoint has load exactly as ``dcp.load`` loads them.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import _compact, _dtensor
from ._contract import moment_encoding
from ._state import MOMENT_KEYS, is_tensor_key
from ._state_dict import stale_master_message

CALL = "ampfused.checkpoint.dcp_load"


def load(state_dict: dict, *, checkpoint_id=None, storage_reader=None, planner=None, process_group=None,
         no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` that loads optimizer state across forms (see the module note)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._storage_utils import _storage_setup

    reader = _storage_setup(storage_reader, checkpoint_id, reader=True)  # what dcp.load does with them
    saved = reader.read_metadata().state_dict_metadata
    rewritten, stale = [], []
    for prefix, optim_sd in _optimizer_state_dicts(state_dict):
        for fqn, entry in optim_sd["state"].items():
            request = _request(entry, _saved_entry(saved, f"{prefix}state.{fqn}."), fqn, stale)
            if request is not None:
                template = entry
                entry = optim_sd["state"][fqn] = request
                rewritten.append((entry, template))
    dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    for entry, template in rewritten:
        _to_torch_form(entry, _param_shaped(template))
    if stale:
        warnings.warn(stale_master_message(stale, CALL), UserWarning, stacklevel=3)


def _optimizer_state_dicts(tree, path=()):
    """``(flat key prefix, optimizer state dict)`` of every optimizer state dict nested in ``tree``."""
    if not isinstance(tree, dict):
        return
    if isinstance(tree.get("state"), dict) and isinstance(tree.get("param_groups"), list):
        yield "".join(f"{p}." for p in path), tree  # DCP's flat keys: the path joined by dots
        return
    for key, value in tree.items():
        yield from _optimizer_state_dicts(value, (*path, key))


def _saved_entry(saved: dict, base: str) -> dict:
    """The checkpoint's metadata of one param's state: key -> metadata (an FQN has dots, a state key none)."""
    return {k[len(base):]: md for k, md in saved.items() if k.startswith(base) and "." not in k[len(base):]}


def _request(entry: dict, saved: dict, fqn, stale: list) -> dict | None:
    """What to ask the checkpoint for in place of ``entry``, or None when ``entry``'s own keys do."""
    if not saved or not entry:  # nothing saved for this param (or nothing to load): DCP's own answer
        return None
    master = saved.get("master_param")
    stale_master = master is not None and _dtype(master) != torch.float32  # [note: stale masters] in _state_dict
    wanted = set(entry)
    if wanted <= set(saved) and not (stale_master and "master_param" in wanted):
        return None
    if stale_master and wanted & set(_compact.MASTER_KEYS.values()):  # (only a loader that keeps a master is told)
        stale.append(fqn)
    like = _param_shaped(entry)
    request = {}
    for key, md in saved.items():
        if (key != "step" and not is_tensor_key(key)) or (key == "master_param" and stale_master):
            continue  # (keys no AdamW state has, and a master that is not one)
        size, dtype = tuple(md.size), _dtype(md)
        if key == "step" or like is None:
            request[key] = torch.empty(size, dtype=dtype)
        elif key in entry and tuple(entry[key].shape) == size:
            request[key] = torch.empty_like(entry[key], dtype=dtype)
        elif size == tuple(like.shape):
            request[key] = torch.empty_like(like, dtype=dtype)
        else:  # another shape (scales, int4 codes, when the loader keeps none): sharded on dim 0 like the param
            request[key] = _empty_sharded_like(like, size, dtype)
    return request


def _dtype(md) -> torch.dtype:
    return md.properties.dtype


def _param_shaped(entry: dict) -> Tensor | None:
    """A tensor with the param's shape (and sharding) for ``entry``: a moment or a master of it, else its
    codes; int4 codes hold two elements a byte along the last dimension ([note: int4 packing]), so for
    them an empty tensor of the doubled shape, sharded by rows as they are."""
    tensors = {k: v for k, v in entry.items() if isinstance(v, Tensor) and k != "step" and not k.endswith("_scales")}
    like = next((v for k, v in tensors.items() if not k.endswith("_codes")), None)
    codes = tensors.get("exp_avg_codes")
    if like is not None or codes is None or moment_encoding(codes) != "int4":
        return like if like is not None else next(iter(tensors.values()), None)
    return _empty_sharded_like(codes, (*codes.shape[:-1], 2 * codes.shape[-1]), codes.dtype)


def _empty_sharded_like(like: Tensor, size: tuple, dtype: torch.dtype) -> Tensor:
    if not _dtensor.is_dtensor(like):
        return torch.empty(size, dtype=dtype, device=like.device)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(size, like.device_mesh, like.placements)
    local = torch.empty(local_shape, dtype=dtype, device=like.to_local().device)
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=size, stride=stride, run_check=False)


def _to_torch_form(entry: dict, like: Tensor | None) -> None:
    """An entry as saved -> torch's fp32 form, in place: ``step``, fp32 moments (decoded from compact
    ones, on the local shards), an fp32 ``master_param`` if the checkpoint has one. A split master
    (``master_low16``/``master_residual8``) is dropped: rebuilding it needs the param it completes, so
    the master restarts from the param (it loses what the split bits held, under half a param ulp)."""
    local = {k: _dtensor.local(v) for k, v in entry.items()}
    decoded = _compact.decode_state(local)  # step and fp32 moments
    out = {"step": entry["step"]}
    for key in MOMENT_KEYS:
        value = decoded.get(key) if key != "master_param" else local.get(key)
        if value is not None:
            out[key] = _dtensor.like_param(value.float(), like) if like is not None else value.float()
    entry.clear()
    entry.update(out)
