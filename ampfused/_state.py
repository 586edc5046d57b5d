"""The optimizer's state room: flat buffers, per-param views, layout changes, lazy state.

``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param`` (and, in
``_main_grad``, ``main_grad``) each live in one fp32 buffer per device; ``optimizer.state[p]`` holds
views with the shapes torch.optim.AdamW uses. Every view starts on a 128-byte boundary so that
vectorized kernels never straddle two params in one access and every view is 16-byte aligned. The
step counters live in one fp32 vector, ``state[p]["step"]`` a 0-d view of it.

A view gets the strides of its param (``channels_last`` included), as
``torch.zeros_like(p, memory_format=torch.preserve_format)`` would: any dense, non-overlapping
tensor covers one block of ``numel`` elements, and with equal strides element ``i`` of that block is
the same logical element in param, grad and every state tensor, so the passes stay element-wise
over flat memory.

The compact encodings (DESIGN §9, ``_compact``) plug in here: the buffers' dtype and what a view is
are decided here (:func:`state_keys`), and nowhere else.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import Tensor

from . import _compact, _dtensor
from ._args import LOW_PRECISION
from ._contract import KERNEL_DTYPES, MASTER_ENCODINGS, MOMENT_ENCODINGS, encoding_for, packed_shape, scales_shape
from ._layout import is_dense

ALIGN_BYTES = 128
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")  # the fp32 modes' (torch's) keys
MOMENTS = _compact.MOMENTS


def wide_indices(params: Sequence[Tensor]) -> list[int]:
    """Indices of the float64/complex tensors, which the reference passes serve ([note: wide params] in ``_args``)."""
    return [i for i, p in enumerate(params) if p.dtype not in KERNEL_DTYPES]


def dense_strides(t: Tensor) -> tuple[int, ...]:
    """The strides a dense copy of ``t`` gets: its own when it is dense, else contiguous ones."""
    return tuple(t.stride()) if is_dense(t) else tuple(torch.empty(t.shape, device="meta").stride())


def aligned_offsets(numels: Sequence[int], element_size: int = 4) -> tuple[list[int], int]:
    """Start offset (in elements) of each chunk, each a multiple of ALIGN_BYTES; and the total size."""
    align = max(1, ALIGN_BYTES // element_size)
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


class FlatBuffer:
    """One zero-initialised buffer holding a chunk shaped (and strided) like each of ``like``.

    ``data`` is the whole buffer (what a collective reduces at once), ``views[i]`` the chunk of ``like[i]``.
    """

    def __init__(self, like: Sequence[Tensor], device: torch.device, dtype: torch.dtype = torch.float32):
        element_size = torch.empty((), dtype=dtype).element_size()
        self.offsets, total = aligned_offsets([t.numel() for t in like], element_size)
        # allocators guarantee less than 128 bytes on some devices (64 on CPU): over-allocate and shift
        raw = torch.zeros(total + ALIGN_BYTES // element_size, dtype=dtype, device=device)
        shift = (-raw.data_ptr() % ALIGN_BYTES) // element_size
        self.data = raw[shift : shift + total]
        base = self.data.storage_offset()
        self.views = [self.data.as_strided(t.shape, dense_strides(t), base + o) for o, t in zip(self.offsets, like)]

    def __len__(self) -> int:
        return len(self.views)


def uses_master(p: Tensor, master_weights) -> bool:
    """Whether ``p`` gets a master (fp32 or split; ``master_weights``: the optimizer's option as given)."""
    return p.dtype in LOW_PRECISION and master_weights is not False


def state_keys(p: Tensor, mode: str, moments, amsgrad: bool) -> dict[str, torch.dtype]:
    """The flat state of a kernel-dtype ``p`` under the optimizer's modes: key -> dtype (``_compact``'s keys).

    ``mode``/``moments``: ``_args.master_mode`` / ``_args.state_encoding`` of the options. Shapes:
    :func:`state_shape`.
    """
    names = MOMENTS if amsgrad else MOMENTS[:2]
    master_mode, moment_mode = encoding_for(p, mode, moments)  # [note: one encoding decision] in _contract
    dtypes = MOMENT_ENCODINGS[moment_mode][0]
    keys = {}
    for name in names:
        dtype = dtypes[0] if name == "exp_avg" else dtypes[1]
        if moment_mode in ("int8", "int4"):
            keys[name + "_codes"], keys[name + "_scales"] = dtype, torch.float32
        else:
            keys[name] = dtype
    if master_mode != "none":
        dtype, _, key, _ = MASTER_ENCODINGS[master_mode]
        keys[key] = dtype
    return keys


def moment_key(state: dict, name: str) -> str:
    """The key holding moment ``name`` (``exp_avg``, ...) in ``state``: itself, or its int8 / int4 codes."""
    return name if name in state or name + "_codes" not in state else name + "_codes"


def master_of(state: dict) -> Tensor | None:
    """The master tensor of a state (fp32, split16 low bits or int8 residual), None without master."""
    for _, _, key, _ in MASTER_ENCODINGS.values():
        if key in state:
            return state[key]
    return None


def scales_of(state: dict, amsgrad: bool) -> tuple | None:
    """``(exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales or None)`` of int8 / int4 moments, else None."""
    if "exp_avg_scales" not in state:
        return None
    return state["exp_avg_scales"], state["exp_avg_sq_scales"], state.get("max_exp_avg_sq_scales") if amsgrad else None


def is_tensor_key(key: str) -> bool:
    """A state key whose value is a tensor: torch's moments and master, or a compact encoding's."""
    return key in MOMENT_KEYS or _compact.is_compact_key(key)


def state_shape(p: Tensor, key: str, moment_mode: str) -> tuple[int, ...]:
    """The shape of ``p``'s state tensor under ``key`` when its moments are in ``moment_mode``: ``p``'s,
    one fp32 scale per block (``[rows, blocks per row]``: ``_contract.scales_shape``), or for int4
    codes ``p``'s with the last dimension halved (``_contract.packed_shape``)."""
    if key.endswith("_scales"):
        return scales_shape(p.shape)
    if key.endswith("_codes") and moment_mode == "int4":
        return packed_shape(p.shape)
    return tuple(p.shape)


def _state_view(view: Tensor, p: Tensor, key: str, moment_mode: str) -> Tensor:
    """The flat ``view`` as ``p``'s state under ``key``: a DTensor placed like ``p`` for a DTensor param
    (the scales and int4 codes too: sharded by rows as the param, [note: blocks in rows] in ``_contract.py``)."""
    shape = state_shape(p, key, moment_mode)
    return _dtensor.like_param(view, p, None if shape == tuple(p.shape) else shape)


def _same_memory(value, view: Tensor) -> bool:
    """``value`` is ``view`` or a DTensor over it (``_dtensor.like_param``)."""
    if not isinstance(value, Tensor):
        return False
    local = _dtensor.local(value)
    return (local.data_ptr() == view.data_ptr() and local.shape == view.shape and local.stride() == view.stride()
            and local.dtype == view.dtype)


def _like(p: Tensor, key: str, moment_mode: str) -> Tensor:
    """A meta tensor with the shape and strides the flat view of ``key`` takes for ``p`` (its local shard)."""
    shape = state_shape(p, key, moment_mode)
    return p if shape == tuple(p.shape) else torch.empty(shape, device="meta")


class StateRoom:
    """The flat state of one optimizer, laid out over its param groups and filled lazily.

    Holds its optimizer weakly (the optimizer's finalizers must run when the user drops it) and reads
    ``param_groups``, ``state``, its device and modes (``_master_mode``, ``_moments``) from it at each layout.
    [note: compact state] each key of ``state_keys`` has one dtype, so a flat buffer per key is a flat
    buffer per dtype; int8 codes and their scales get buffers (and 128-byte aligned views) of their own.
    """

    def __init__(self, owner):
        self._owner = weakref.ref(owner)
        self.flat: dict[str, FlatBuffer] | None = None  # built at the first step
        self.steps: Tensor | None = None
        self.index: dict[Tensor, int] = {}
        self.slots: dict[str, dict] = {}
        self.amsgrad: set = set()  # ids of the params laid out with AMSGrad state
        self.masters_pending: list[Tensor] = []  # loaded without master_param: copied from p at the next step

    def kept_bytes(self, main_grad_flat=None) -> int:
        """Bytes of the storages behind every state tensor (flat buffers with their padding, step
        counters, int8 scales) and of ``main_grad_flat`` (the fp32 gradient storage), each counted once."""
        opt = self._owner()
        tensors = [_dtensor.local(t) for state in opt.state.values() for t in state.values() if isinstance(t, Tensor)]
        if main_grad_flat is not None:
            tensors.append(main_grad_flat.data)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def invalidate(self) -> None:
        """New params: the flat state is laid out again at the next step."""
        self.flat = None

    def keys(self, p: Tensor, amsgrad: bool) -> dict[str, torch.dtype]:
        opt = self._owner()
        return state_keys(p, opt._master_mode, opt._moments, amsgrad)

    def moment_mode(self, p: Tensor) -> str:
        """The encoding of ``p``'s moments under the optimizer's options (``_contract.encoding_for``)."""
        opt = self._owner()
        return encoding_for(p, opt._master_mode, opt._moments)[1]

    def layout(self) -> None:
        """Allocate flat state for every param (old contents copied) and re-point the state views."""
        opt = self._owner()
        device = opt._device
        params = [p for g in opt.param_groups for p in g["params"]]
        amsgrad = {id(p) for g in opt.param_groups if g["amsgrad"] for p in g["params"]}
        local = _dtensor.local_tensors  # [distributed] flat storage holds DTensor params' local shards
        members: dict[str, list] = {}
        dtypes: dict[str, torch.dtype] = {}
        for p in params:
            if p.dtype not in KERNEL_DTYPES:
                continue
            for key, dtype in self.keys(p, id(p) in amsgrad).items():
                members.setdefault(key, []).append(p)
                dtypes[key] = dtype
        flat = {key: FlatBuffer([_like(t, key, self.moment_mode(p)) for t, p in zip(local(ps), ps)], device, dtypes[key])
                for key, ps in members.items()}
        steps = torch.zeros(len(params), dtype=torch.float32, device=device)
        index = {p: i for i, p in enumerate(params)}
        slots = {key: {p: i for i, p in enumerate(ps)} for key, ps in members.items()}
        slots.setdefault("max_exp_avg_sq", {}).update((p, None) for p in params if id(p) in amsgrad and p.dtype not in KERNEL_DTYPES)
        for p, state in opt.state.items():
            if not state:
                continue
            steps[index[p]].copy_(torch.as_tensor(state["step"]).reshape(()))  # (a number or [n] the user assigned)
            state["step"] = steps[index[p]]
            if p.dtype not in KERNEL_DTYPES:  # [note: wide params] their state keeps its own tensors
                continue
            for key in list(state):
                if key != "step" and key in slots and p in slots[key]:
                    view = flat[key].views[slots[key][p]]
                    view.copy_(_dtensor.local(state[key]))
                    state[key] = _state_view(view, p, key, self.moment_mode(p))
        self.flat, self.steps, self.index, self.slots, self.amsgrad = flat, steps, index, slots, amsgrad
        opt._plan = None  # the cached lists hold the old views

    def view(self, key: str, p: Tensor) -> Tensor:
        """State ``key`` of ``p`` over the flat storage (a DTensor over the local view for a DTensor param)."""
        if p.dtype not in KERNEL_DTYPES:  # [note: wide params] a tensor of its own, in the param's dtype
            return torch.zeros_like(p, memory_format=torch.preserve_format)
        return _state_view(self.flat[key].views[self.slots[key][p]], p, key, self.moment_mode(p))

    def init(self, p: Tensor, amsgrad: bool) -> None:
        """Lazy per-param state, as torch.optim.AdamW creates it at a param's first step.

        Zero moments (zero codes and scales decode to zero); an fp32 master copied from ``p``, a split
        master's stored bits zero (the master is ``p`` exactly). A param whose group turned ``amsgrad``
        on after it was stepped keeps its state and only gains a zero ``max_exp_avg_sq`` (where
        torch.optim.AdamW would raise a KeyError).
        """
        opt = self._owner()
        if self.flat is None or p not in self.index or (amsgrad and id(p) not in self.amsgrad) or self._laid_out_for_another_shape(p):
            self.layout()
        state = opt.state[p]
        wide = p.dtype not in KERNEL_DTYPES
        keys = {k: None for k in MOMENTS[:2]} if wide else self.keys(p, False)
        if not state:
            state["step"] = self.steps[self.index[p]].zero_()
            for key in keys:
                state[key] = self.view(key, p).zero_()
            if "master_param" in state:
                _dtensor.copy_local_(state["master_param"], p)
        if amsgrad and moment_key(state, "max_exp_avg_sq") not in state:
            extra = {"max_exp_avg_sq": None} if wide else {k: v for k, v in self.keys(p, True).items() if k not in keys}
            for key in extra:
                state[key] = self.view(key, p).zero_()

    def _laid_out_for_another_shape(self, p: Tensor) -> bool:
        """``p``'s flat views are not those of its shape (its ``p.data`` replaced, its state reset since):
        another shape, or other keys (int8 moments start at SMALL_TENSOR_NUMEL elements)."""
        if p.dtype not in KERNEL_DTYPES:
            return False
        keys = list(self.keys(p, False))
        if any(p not in self.slots.get(key, {}) for key in keys):
            return True
        view = self.flat[keys[0]].views[self.slots[keys[0]][p]]  # exp_avg (or its codes)
        return tuple(view.shape) != state_shape(_dtensor.local(p), keys[0], self.moment_mode(p))

    def check_entry(self, p: Tensor, state: dict | None) -> None:
        """A state entry a step can take, whatever the user assigned in it: its tensors under this
        optimizer's keys for ``p`` (``state_keys``), of ``p``'s shape (the int8 scales: one per block),
        and a one-element ``step``. Raises before anything is created or moved."""
        if not state:
            return
        step = state.get("step")
        if step is None:
            raise RuntimeError("opt.state[p] has no 'step' but other state: to start the parameter afresh, "
                               "reset its whole state (del opt.state[p])")
        if isinstance(step, Tensor) and step.numel() != 1:
            raise RuntimeError(f"opt.state[p]['step'] has {step.numel()} elements: a step count is one number")
        allowed = self.keys(p, True) if p.dtype in KERNEL_DTYPES else MOMENTS
        for key, value in state.items():
            if not is_tensor_key(key):  # step, and keys of the user's own
                continue
            what = f"opt.state[p][{key!r}]"
            if not isinstance(value, Tensor):
                raise TypeError(f"{what} is a {type(value).__name__}, not a tensor")
            _dtensor.check_state(p, value, what)
            shape = state_shape(p, key, self.moment_mode(p))
            if tuple(value.shape) != shape:
                raise RuntimeError(
                    f"{what} has shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}: it takes "
                    f"shape {tuple(shape)} (after p.data = ... of another shape, reset its state first: "
                    "del opt.state[p], as torch.optim.AdamW needs too)")
            if key not in allowed:
                raise RuntimeError(
                    f"{what}: this optimizer keeps this parameter's state under {', '.join(map(repr, allowed))} "
                    "(its master_weights and state_dtype); assign those, or reset the state: del opt.state[p]")

    def _holds_foreign_tensors(self, p: Tensor, state: dict) -> bool:
        """``state`` holds a value that is not its place in the flat storage: the user assigned it
        (``opt.state[p]["exp_avg"] = torch.zeros_like(p)``, ``state["step"] = torch.tensor(0.)``), as
        torch.optim.AdamW lets one reset a moment. A layout copies it in and points the state at the
        flat view again, so the step reads and writes what ``opt.state`` shows."""
        if self.flat is None or p not in self.index:
            return True
        if not _same_memory(state["step"], self.steps[self.index[p]]):
            return True
        if p.dtype not in KERNEL_DTYPES:  # [note: wide params] their state keeps its own tensors
            return False
        for key, value in state.items():
            slot = self.slots.get(key, {}).get(p)
            if slot is not None and not _same_memory(value, self.flat[key].views[slot]):
                return True
        return False

    def prepare(self, work) -> None:
        """Lazy state for every ``(param, grad, group)`` about to step; state follows a param's memory format."""
        state_of = self._owner().state
        for p, _, _ in work:  # checked before any state is created or moved
            self.check_entry(p, state_of.get(p))
        for p, _, group in work:  # may re-lay out the flat state: finish before the plan takes views
            state = state_of[p]
            if not state or (group["amsgrad"] and moment_key(state, "max_exp_avg_sq") not in state):
                self.init(p, group["amsgrad"])
            # memory format changed: state follows the param (a param with gaps keeps contiguous state)
            elif state[moment_key(state, "exp_avg")].stride() != p.stride() and is_dense(p):
                self.layout()
            elif self._holds_foreign_tensors(p, state):  # the copy in: tensors the user assigned
                self.layout()

    def copy_pending_masters(self) -> None:
        """[note: masters of a torch checkpoint] masters a load left out are taken from p at the next
        step (or state_dict()), not at the load: a script may load the model's weights after the optimizer's."""
        state_of = self._owner().state
        for p in self.masters_pending:
            state = state_of.get(p)
            if state and "master_param" in state:  # (not if the state was reset since the load)
                _dtensor.copy_local_(state["master_param"], p)
        self.masters_pending = []
