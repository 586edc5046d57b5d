"""Crash-safe checkpoint files: atomic write, checksum, newest-valid lookup, RNG capture.

A checkpoint is the ``torch.save`` bytes of any object followed by a 48-byte trailer
(``MAGIC`` + SHA-256 of the payload). :func:`save` writes it to a temporary file in the same
directory, fsyncs it, ``os.replace``-s it onto the final name and fsyncs the directory, so a
process killed at any moment leaves either the old file or the complete new one. :func:`load`
refuses any file without a matching trailer (a half-written file, a file truncated by a full
disk, a torch.save file from elsewhere) with :class:`CheckpointError`, and :func:`latest`
returns the newest file in a directory that loads.

Example::

    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
            "scheduler": sched.state_dict(), "rng": ampfused.checkpoint.rng_state(), "step": step}
    ampfused.checkpoint.save(ckpt, f"ckpt/step{step:08d}.pt")
    ...
    path = ampfused.checkpoint.latest("ckpt")
    if path is not None:
        ckpt = ampfused.checkpoint.load(path)
        ...; ampfused.checkpoint.set_rng_state(ckpt["rng"])
"""
from __future__ import annotations

import copy
import hashlib
import io
import os
import random
import tempfile

import torch

from . import _compact

__all__ = ["CheckpointError", "save", "load", "latest", "rng_state", "set_rng_state", "to_torch_state_dict", "dcp_load"]

MAGIC = b"AMPFUSED-CKPT-1\n"  # 16 bytes
_TRAILER = len(MAGIC) + 32


class CheckpointError(ValueError):
    """The file is not a complete checkpoint written by :func:`save`."""


def save(obj, path: str | os.PathLike) -> None:
    """Atomically write ``torch.save(obj)`` plus a checksum trailer to ``path``."""
    path = os.fspath(path)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getbuffer()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.write(MAGIC + hashlib.sha256(payload).digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; os.replace is atomic there anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _payload(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _TRAILER or data[-_TRAILER:-32] != MAGIC:
        raise CheckpointError(f"{path} is not a complete ampfused checkpoint (no end marker: written half-way, truncated, or not written by ampfused.checkpoint.save)")
    payload, digest = data[:-_TRAILER], data[-32:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: its checksum does not match its contents")
    return payload


def load(path: str | os.PathLike, map_location=None, weights_only: bool = True):
    """Load a checkpoint written by :func:`save`; raises :class:`CheckpointError` unless it is complete and intact."""
    return torch.load(io.BytesIO(_payload(os.fspath(path))), map_location=map_location, weights_only=weights_only)


def latest(directory: str | os.PathLike, suffix: str = ".pt") -> str | None:
    """Path of the last file (in name order) ending with ``suffix`` in ``directory`` whose trailer and
    checksum are valid, or ``None``. Name checkpoints so that name order is step order (``step00000120.pt``)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    for name in sorted(os.listdir(directory), reverse=True):
        path = os.path.join(directory, name)
        if not name.endswith(suffix) or not os.path.isfile(path):
            continue
        try:
            _payload(path)
        except (CheckpointError, OSError):
            continue
        return path
    return None


def rng_state() -> dict:
    """The states of Python's ``random``, torch's CPU generator and every CUDA generator."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_torch_state_dict(sd: dict, params=None) -> dict:
    """Expand an optimizer state dict with compact state into one ``torch.optim.AdamW.load_state_dict``
    accepts: fp32 ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) for every param.

    ``params``: the optimizer's params in state-dict order (``[p for g in opt.param_groups for p in
    g["params"]]``), or a dict from state-dict index to param. With them, every 16-bit param with a
    master also gets the fp32 ``master_param`` that ampfused's fp32 mode loads (a ``split16``/``split8``
    master is the param plus stored bits, so it cannot be rebuilt without the param); without them
    those masters are dropped, and torch continues from the params. The compact keys (see
    ``ampfused._compact``) are replaced; other entries and ``param_groups`` are copied (every tensor of
    the result is its own, never one of ``sd``'s); ``sd`` is not modified. Example::

        torch_sd = ampfused.checkpoint.to_torch_state_dict(opt.state_dict(), [p for g in opt.param_groups for p in g["params"]])
        torch.optim.AdamW(model.parameters()).load_state_dict(torch_sd)

    Sharded state (FSDP2's DTensors, keyed by FQN as ``get_optimizer_state_dict`` gives it) converts shard
    by shard into DTensors placed like the params: a DCP checkpoint in torch's form, which
    ``torch.optim.AdamW`` loads with plain ``dcp.load`` (FusedAmpAdamW: with :func:`dcp_load`, or plain
    ``dcp.load`` in a mode whose keys are torch's: fp32 masters, fp32 or bf16 moments)::

        model_sd, optim_sd = get_state_dict(model, opt)
        optim_sd = ampfused.checkpoint.to_torch_state_dict(optim_sd, dict(model.named_parameters()))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    """
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise TypeError("to_torch_state_dict expects an optimizer state dict (a dict with 'state' and 'param_groups')")
    order = [index for group in sd["param_groups"] for index in group["params"]]
    if params is None:
        by_index = {}
    elif isinstance(params, dict):
        by_index = dict(params)
    else:
        params = list(params)
        if len(params) != len(order):
            raise ValueError(f"params has {len(params)} entries but the state dict's param_groups list {len(order)} params")
        by_index = dict(zip(order, params))
    state = {}
    for index, entry in sd["state"].items():
        if not entry:  # a param whose (empty) state was only read, never stepped: torch writes {} too
            state[index] = {}
            continue
        param = by_index.get(index)
        if param is not None:
            param = param.detach()
            shape = _param_shape(entry)
            if shape is not None and tuple(shape) != tuple(param.shape):
                raise ValueError(f"param for state {index} has shape {tuple(param.shape)}, its state {tuple(shape)}: params are not in state-dict order")
        kept = {k: v for k, v in entry.items() if not _compact.is_compact_key(k)}
        converted = {**kept, **_decoded(entry, param)}
        # a state dict holds the optimizer's live tensors (as torch's does), and torch's
        # load_state_dict keeps fp32 tensors it loads onto fp32 params as they are: a converted dict
        # loaded in the same process would share (and step) ampfused's counters and moments. Copy them.
        originals = {id(v) for v in entry.values()}
        state[index] = {k: v.clone() if isinstance(v, torch.Tensor) and id(v) in originals else v for k, v in converted.items()}
    return {"state": state, "param_groups": copy.deepcopy(sd["param_groups"])}


def _param_shape(entry: dict) -> tuple | None:
    """The shape of the param an entry belongs to, from its moments, codes or master (int4 codes: the
    last dimension doubled, [note: int4 packing]); None for an entry of only a step."""
    for k, v in entry.items():
        if k != "step" and isinstance(v, torch.Tensor) and not k.endswith("_scales"):
            shape = tuple(v.shape)
            if k.endswith("_codes") and _compact.moment_encoding(entry["exp_avg_codes"]) == "int4":
                shape = shape[:-1] + (2 * shape[-1],)
            return shape
    return None


def _decoded(entry: dict, param) -> dict:
    """``_compact.decode_state`` of one entry; a sharded (DTensor) entry decoded shard by shard, as its
    blocks never straddle a shard, and handed back as DTensors placed like the param."""
    from . import _dtensor

    like = next((v for k, v in entry.items() if _dtensor.is_dtensor(v) and not k.endswith("_scales")), None)
    if like is None:
        return _compact.decode_state(entry, param)
    local = {k: _dtensor.local(v) for k, v in entry.items()}
    decoded = _compact.decode_state(local, None if param is None else _dtensor.local(param))
    shape = _param_shape(entry)  # (int4 codes are not of the param's shape: placed as they are, in that shape)
    shape = None if tuple(like.shape) == shape else shape
    return {k: v if k == "step" else _dtensor.like_param(v, like, shape) for k, v in decoded.items()}


def dcp_load(state_dict: dict, *, checkpoint_id=None, storage_reader=None, planner=None, process_group=None,
             no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` (same arguments) that also loads a checkpoint whose optimizer
    state has other keys than the loading optimizer's: a ``torch.optim.AdamW`` checkpoint into
    ``FusedAmpAdamW`` in any mode, a ``FusedAmpAdamW`` one of any mode into ``torch.optim.AdamW`` (or
    into another mode). Plain ``dcp.load`` asks the checkpoint for exactly the loading optimizer's keys
    and fails with ``Missing key in checkpoint state_dict: ...master_param`` (or ``...exp_avg``).

    Every optimizer state dict nested in ``state_dict`` (what ``get_state_dict`` /
    ``get_optimizer_state_dict`` give) whose keys the checkpoint lacks is loaded in the form the
    checkpoint has and handed on in torch's fp32 form (``step``, fp32 ``exp_avg``/``exp_avg_sq``/
    ``max_exp_avg_sq``, compact moments decoded; an fp32 ``master_param`` when the checkpoint has
    one), which ``set_state_dict`` / ``set_optimizer_state_dict`` then load into either optimizer:
    FusedAmpAdamW encodes it into its modes and takes masters the checkpoint lacks from the params;
    torch.optim.AdamW casts it to the params' dtype. A split master (``split16``/``split8``) is not
    carried into another mode (the master restarts from the param). A ``master_param`` that is not
    fp32 (another optimizer carried it along) is never taken, with one warning. Everything else loads
    exactly as ``dcp.load`` loads it. Example, on any world size::

        model_sd, optim_sd = get_state_dict(model, opt)
        ampfused.checkpoint.dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    """
    from . import _dcp

    _dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader, planner=planner,
              process_group=process_group, no_dist=no_dist)
