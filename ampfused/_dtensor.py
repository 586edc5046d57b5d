"""DTensor (FSDP2) params: the passes run on local shards, the stats are summed over the mesh.

:func:`localize` gives the backends the local tensors and a ``reduce_stats`` callback that
all-reduces the stats between the stats pass and the finish; state is exposed as DTensors over the
local flat views, as DCP needs. What is summed over which mesh dimension, and why:
docs/distributed.md ("FSDP2"). Nothing here imports ``torch.distributed.tensor`` unless a param is
a DTensor.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._reducers import MeshReducer

StatsReducer = Callable[[Tensor, "Tensor | None"], "tuple[Tensor, Tensor | None]"]


_DTENSOR: type | None = None


def _dtensor_type():
    # only a module that is already imported can have made a DTensor: no import cost otherwise
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return _DTENSOR


def is_dtensor(t) -> bool:
    cls = _DTENSOR or _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor | None) -> Tensor | None:
    """The local shard of a DTensor (the tensor itself, aliasing its storage); anything else as is.

    [note: _local_tensor] The step's lists read DTensor's private ``_local_tensor``, not the public
    ``to_local()``: ``to_local()`` makes a new (autograd) view object at every call, and the step's
    caches (``_plan``, the backends' memos) compare the local tensors by identity from step to step,
    so each step would rebuild its tables. Writes that run once (state loads, master copies) use
    ``to_local()`` (:func:`copy_local_`).
    """
    return t._local_tensor if is_dtensor(t) else t


def local_tensors(ts: Sequence[Tensor]) -> list[Tensor]:
    cls = _DTENSOR or _dtensor_type()
    if cls is None:
        return list(ts)
    return [t._local_tensor if isinstance(t, cls) else t for t in ts]  # see [note: _local_tensor]


def like_param(view: Tensor, p: Tensor, shape: tuple | None = None) -> Tensor:
    """``view`` (local, optimizer-owned) as state of ``p``: a DTensor over ``view`` when ``p`` is one,
    placed as ``p`` is; of ``p``'s global shape and strides, or of the contiguous global ``shape``
    (the int8 scales, ``[rows, blocks per row]``, sharded by rows as ``p``: [note: blocks in rows])."""
    if not is_dtensor(p):
        return view
    from torch.distributed.tensor import DTensor

    if shape is None:
        return DTensor.from_local(view, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return DTensor.from_local(view, p.device_mesh, p.placements, shape=torch.Size(shape), stride=tuple(stride),
                              run_check=False)


def check_rows_sharded(p: Tensor, what: str) -> None:
    """Refuse a DTensor param whose shards are not whole rows (a placement other than ``Shard(0)`` and
    ``Replicate``): ``what`` needs each shard to be a run of the whole tensor's rows."""
    for d, placement in enumerate(p.placements):
        if placement.is_shard() and placement.dim != 0:
            raise ValueError(
                f"{what} needs parameters sharded by rows (Shard(0), as FSDP2's fully_shard does), but a parameter of "
                f"shape {tuple(p.shape)} has placement {placement!r} on mesh dim {d}: use state_dtype=torch.bfloat16 "
                "and stochastic_rounding=False for tensor-parallel parameters, or one optimizer per kind")


def element_bases(params: Sequence[Tensor]) -> list[int] | None:
    """The index in its whole tensor of each DTensor param's first local element (Shard(0): the
    first local row's offset times the row length), or None when every one is 0 (plain tensors)."""
    if not any(is_dtensor(p) for p in params):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bases = []
    for p in params:
        if not is_dtensor(p) or p.dim() == 0:
            bases.append(0)
            continue
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        bases.append(sum(o * s for o, s in zip(offset, p.stride())))
    return bases if any(bases) else None


def local_scales(moment_scales: Sequence | None) -> list | None:
    """The per-tensor scale tuples of a step (``None``, or ``None`` entries) with local shards."""
    if moment_scales is None:
        return None
    return [None if s is None else tuple(local_tensors(s)) for s in moment_scales]


def check_state(p: Tensor, value: Tensor, what: str) -> None:
    """Refuse, before any write, a state tensor that cannot be copied into ``p``'s state."""
    if is_dtensor(p) and not is_dtensor(value):
        raise ValueError(
            f"{what} is a plain tensor but the parameter is a DTensor: load sharded optimizer state through "
            "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict (it distributes full state dicts)")
    if is_dtensor(value) and not is_dtensor(p):
        raise ValueError(f"{what} is a DTensor but the parameter is a plain tensor: the state dict belongs to a sharded model")


def copy_state_(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for optimizer state, shard by shard when ``dst`` is a DTensor (see :func:`check_state`)."""
    if is_dtensor(dst):
        if src.device_mesh != dst.device_mesh or tuple(src.placements) != tuple(dst.placements):
            src = src.redistribute(dst.device_mesh, dst.placements)
        copy_local_(dst, src)
    else:
        dst.copy_(src)


@torch.no_grad()
def copy_local_(dst: Tensor, src: Tensor) -> None:
    """``dst``'s local shard (or ``dst``) ``= src``'s (or ``src``), through the public ``to_local()``
    (under no_grad: a param's ``to_local()`` is differentiable)."""
    dst = dst.to_local() if is_dtensor(dst) else dst
    dst.copy_(src.to_local() if is_dtensor(src) else src)


def check_params(params: Sequence[Tensor]) -> None:
    """Refuse what the global stats cannot serve, before anything is built (see :func:`_plan`)."""
    _plan(params)


def localize(params: list[Tensor], grads: list[Tensor], *lists: list) -> tuple[list, StatsReducer | None]:
    """Local shards of ``params``, ``grads`` and the state ``lists``; and the stats reducer.

    Plain params come back unchanged with ``None`` for the reducer. Every DTensor grad must have
    the placements of its param (a Partial grad's local sum of squares is not its shard's).
    """
    plan = _plan(params)
    if plan is None:
        return [params, grads, *lists], None
    cls = _DTENSOR
    for i, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(g, cls) or g.placements != p.placements or (g.device_mesh is not p.device_mesh and g.device_mesh != p.device_mesh):
            placements = tuple(g.placements) if is_dtensor(g) else "a plain tensor"
            raise RuntimeError(
                f"gradient {i} of a DTensor parameter with placements {tuple(p.placements)} is {placements}: "
                "FusedAmpAdamW steps on local shards and needs each gradient sharded like its parameter")
    out = [[p._local_tensor for p in params], [g._local_tensor for g in grads]]  # [note: _local_tensor]
    out += [local_tensors(ts) for ts in lists]  # None entries pass through
    return out, plan


def _plan(params: Sequence[Tensor]) -> StatsReducer | None:
    """None for plain params; for DTensors on one mesh, the reducer over their sharded dims."""
    dtensors = [p for p in params if is_dtensor(p)]
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        raise ValueError(
            f"{len(dtensors)} of {len(params)} parameters are DTensors and the others plain tensors: FusedAmpAdamW computes "
            "one global gradient norm per optimizer and cannot tell whether a plain tensor's gradient is replicated or "
            "local; shard every parameter (fully_shard the root module too) or use one optimizer per kind")
    mesh = dtensors[0].device_mesh
    sharded = _sharded_dims(dtensors[0])
    placements = dtensors[0].placements
    for p in dtensors[1:]:
        if p.device_mesh is mesh and p.placements == placements:  # the common case, FSDP2: one mesh, Shard(0)
            continue
        if p.device_mesh != mesh or _sharded_dims(p) != sharded:
            raise ValueError(
                f"DTensor parameters on different meshes or sharded over different mesh dimensions ({mesh} "
                f"{dtensors[0].placements} and {p.device_mesh} {p.placements}): the sum of squares would be "
                "reduced over different groups; use one FusedAmpAdamW per mesh/placement kind")
    if not sharded:
        return None  # replicated everywhere: every rank already has the whole gradient
    return MeshReducer([mesh.get_group(d) for d in sharded])


def _sharded_dims(p: Tensor) -> tuple[int, ...]:
    dims = []
    for d, placement in enumerate(p.placements):
        if placement.is_shard():
            dims.append(d)
        elif not placement.is_replicate():
            raise ValueError(f"DTensor parameter with placement {placement} on mesh dim {d}: only Shard and Replicate params are supported")
    return tuple(dims)
