"""Device-side tables that let one launch reach every tensor of a step.

A pass gets small int64 device tables instead of one argument per tensor:

* a *chunk layout*, one row per CHUNK-sized piece of every tensor: ``(tensor index, first
  element)``. It depends only on the element counts, so it is built once per set of sizes
  (the 7B-shaped model: ~820k rows; its build time: docs/results/host-fresh-grads.md) and kept while sizes stay;
* a *row table*, one row per tensor: raw addresses (``data_ptr()``) of the user's param and grad
  and of the optimizer-owned views (``exp_avg``, ..., 0 for a missing one), the element count,
  dtype codes, a per-tensor alignment flag and the index of the tensor's hyperparameter row. It
  is O(tensors) bytes: when autograd allocates a new ``p.grad`` somewhere else only this table is
  written again (one small non-blocking copy from pinned memory, no sync, no layout rebuild);
* a *group table* (``adamw.py``), one row per distinct hyperparameter set, float lrs excluded
  (they travel as kernel arguments).

Kernels turn an address back into a typed pointer with ``addr.to(tl.pointer_type(tl.float32))``;
the Triton 3.6 interpreter supports that cast (loads and stores through it work on CPU tensors),
so CI exercises exactly the code the GPU runs.

Each kind of table is cached, keyed on everything it is made of. The hot path only collects the
keys: no host sync, no per-tensor work beyond reading ``data_ptr()``/``numel()``/``dtype``.

[note: cuda graphs] A captured graph bakes the table addresses into its kernel arguments, and the
upload copy (when a table is built during capture) re-reads its pinned host source at each replay.
So an entry touched while a stream is capturing is moved out of the small LRU into ``_kept`` and
lives as long as the process: replays never read freed memory.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy
import torch
from torch import Tensor

from ._contract_generated import SCRATCH_BYTES, SCRATCH_PARTIALS, SCRATCH_STATS_COUNTER, SCRATCH_UPDATE_COUNTER
CACHE_SIZE = 8  # live entries per kind: enough for a few optimizers, small enough to forget stale ones


@dataclass
class Layout:
    """The chunk layout of one set of sizes (read-only on the device: shared by every caller)."""

    chunks: Tensor  # int64 [n_chunks, 2]: (tensor index, first element)
    n_chunks: int
    grid: int  # programs launched (a stats launch loops over chunks; an update launch has one per chunk)
    host: Tensor | None  # pinned source of the upload, kept alive for graph replays


@dataclass
class Rows:
    """The row table of one set of addresses."""

    rows: Tensor  # int64 [n_tensors, width]
    n_tensors: int
    host: Tensor | None
    source: Tensor | None = None  # the host rows it was built from


_cache: dict[str, OrderedDict] = {}
_kept: dict[Hashable, object] = {}
_built_in_capture: set[Hashable] = set()
_retained: list = []  # memo tables (ScratchRows) a captured graph uses: never freed

# The caller's launch scratch (ampfused.functional.Scratch; [note: scratch] in ampfused/_contract.py):
# uint8 of SCRATCH_BYTES, zero between launches.


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def cached(kind: str, key: Hashable, device: torch.device, build: Callable[[], object]):
    """The entry for ``key`` in the ``kind`` cache, built on a miss (small LRU, see the module note).

    An entry *built* during a capture holds nothing until that graph first replays (its upload and
    counter reset are only recorded), so eager calls never get it: they build their own.
    """
    now_capturing = capturing(device)
    entry = _kept.get(key)
    if entry is not None and (now_capturing or key not in _built_in_capture):
        return entry
    lru = _cache.setdefault(kind, OrderedDict())
    entry = lru.get(key)
    if entry is None:
        entry = build()
        if now_capturing:
            _kept[key] = entry
            _built_in_capture.add(key)
            return entry
        lru[key] = entry
        while len(lru) > CACHE_SIZE:
            lru.popitem(last=False)
    else:
        lru.move_to_end(key)
    if now_capturing:
        _kept[key] = lru.pop(key)
    return entry


def scratch_views(scratch, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(stats counter int32 [1], update counter int32 [1], partials fp32) of the caller's scratch.

    Without one (the functional API) a fresh zeroed buffer: nothing is shared with another caller.
    """
    if scratch is None:
        return _views_of(torch.zeros(int(SCRATCH_BYTES), dtype=torch.uint8, device=device))
    views = scratch.memo.get(("scratch views", device))
    if views is None:
        views = scratch.memo[("scratch views", device)] = _views_of(scratch.buffer(device))
    return views


def _views_of(buf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    stats, update = int(SCRATCH_STATS_COUNTER), int(SCRATCH_UPDATE_COUNTER)
    return (buf[stats:stats + 4].view(torch.int32), buf[update:update + 4].view(torch.int32),
            buf[int(SCRATCH_PARTIALS):].view(torch.float32))


class ScratchRows:
    """A row table kept in a caller's memo whose address column follows the grads ([note: host time]).

    Built once with every check; afterwards a call with new grads (same dtypes and shapes) reads only
    their ``data_ptr()`` (one C-level ``map``) and, when an address moved, patches the column and
    the alignment flags with tensor ops on the host copy: no Python per tensor.
    """

    def __init__(self, rows: Rows, host: Tensor, grads: list, addr_column: int, aligned_column: int, other_aligned: Tensor,
                 device: torch.device, memo: dict):
        # numpy on the host side: its small ops cost less than torch's (docs/results/host-fresh-grads.md; Triton requires numpy)
        # only their addresses: holding the grads between steps would keep a
        # whole set of gradients alive after zero_grad(set_to_none=True)
        self.rows, self.host, self.memo = rows, host.numpy(), memo
        self.addr_column, self.aligned_column, self.other_aligned = addr_column, aligned_column, other_aligned.numpy()
        self.count = len(grads)
        self.modulus = numpy.array([4 * g.element_size() for g in grads], dtype=numpy.int64)
        self.addresses = list(map(Tensor.data_ptr, grads))
        self.built_in_capture = capturing(device)
        self.device = device

    def for_grads(self, grads: list) -> Rows | None:
        """The table for ``grads``, or None when their count differs. The caller promises the rest
        (dtypes, shapes, strides unchanged: ``ampfused._plan`` checks them), so nothing else is read."""
        now_capturing = capturing(self.device)
        if len(grads) != self.count:
            return None
        addresses = list(map(Tensor.data_ptr, grads))
        if addresses != self.addresses or (self.built_in_capture and not now_capturing):
            column = numpy.array(addresses, dtype=numpy.int64)
            host = self.host.copy()
            host[:, self.addr_column] = column
            host[:, self.aligned_column] = self.other_aligned & (column % self.modulus == 0)
            data, pinned = upload(torch.from_numpy(host), self.device)
            self.rows, self.host, self.addresses = Rows(rows=data, n_tensors=host.shape[0], host=pinned), host, addresses
            self.built_in_capture = now_capturing
        if now_capturing and not any(r is self.rows for r in _retained):
            _retained.append(self.rows)  # a graph replays these addresses: see [note: cuda graphs]
        return self.rows



def clear() -> None:
    """Forget every cached table (tests; entries kept for captured graphs are kept)."""
    _cache.clear()


def upload(host: Tensor, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """(device copy, pinned source or None) of a host tensor, without synchronizing."""
    if device.type == "cpu":
        return host, None
    pinned = host.pin_memory()
    return pinned.to(device, non_blocking=True), pinned


def chunk_layout(numels: Sequence[int], chunk: int) -> Tensor:
    """int64 [n_programs, 2]: (tensor index, first element) of every CHUNK-sized piece of every tensor.

    An all-empty tensor list still gets one (empty) program, so the pass's "last program" work
    (advancing step counters, publishing a sum) runs.
    """
    numels_t = torch.tensor(list(numels), dtype=torch.int64)
    counts = (numels_t + chunk - 1) // chunk
    total = int(counts.sum())
    if total == 0:
        return torch.zeros((1, 2), dtype=torch.int64)
    tensor_index = torch.repeat_interleave(torch.arange(len(numels_t)), counts)
    first_program = torch.cumsum(counts, 0) - counts
    local = torch.arange(total) - first_program[tensor_index]
    return torch.stack([tensor_index, local * chunk], dim=1)


def layout(kind: str, numels: tuple, device: torch.device, chunk: int, grid_of: Callable[[int], int] | None = None) -> Layout:
    """The cached chunk layout of tensors with ``numels`` elements (``grid_of(n_chunks)`` programs)."""
    def build() -> Layout:
        host = chunk_layout(numels, chunk)
        data, pinned = upload(host.reshape(-1), device)
        n_chunks = host.shape[0]
        grid = grid_of(n_chunks) if grid_of else n_chunks
        return Layout(chunks=data.view(n_chunks, 2), n_chunks=n_chunks, grid=grid, host=pinned)

    return cached(kind + "-layout", (kind, "layout", device, chunk, numels), device, build)


def row_table(kind: str, key: Hashable, device: torch.device, build_rows: Callable[[], list]) -> Rows:
    """The cached row table for ``key``; ``build_rows()`` returns its rows (lists of int64)."""
    def build() -> Rows:
        host = torch.tensor(build_rows(), dtype=torch.int64)
        data, pinned = upload(host, device)
        return Rows(rows=data, n_tensors=host.shape[0], host=pinned, source=host)

    return cached(kind + "-rows", (kind, "rows", device, key), device, build)


def aligned(addresses, element_size: int) -> int:
    """1 when every address allows 4-element vectors (16 bytes fp32, 8 bytes fp16/bf16), else 0.

    [note: alignment per tensor] decided for each tensor's row, so one odd view no longer turns
    off vector access for the whole launch.
    """
    return int(all(a % (4 * element_size) == 0 for a in addresses))


def dense_inputs(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors as given when dense (any memory format), else contiguous copies."""
    return [t if dense(t) else t.contiguous() for t in tensors]


def check(t: Tensor, what: str, device: torch.device, dtypes) -> None:
    """Validate a tensor once, when its table row is built (never on the hot path)."""
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, but the step runs on {device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{what} has dtype {t.dtype}; the Triton kernels take {', '.join(map(str, dtypes))}")
    if not dense(t):
        raise ValueError(f"{what} is not dense (it has gaps or overlaps); the Triton kernels address tensors as flat memory")


def dense(t: Tensor) -> bool:
    """No gaps and no overlap: the elements fill ``numel`` consecutive slots from ``data_ptr()``. The kernels'
    copy of ``ampfused._layout.is_dense`` (this package imports nothing of ampfused; a test holds them equal)."""
    if t.is_contiguous():
        return True
    expected = 1  # strides, smallest first, must be the running products of the sizes
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def same_flat_layout(t: Tensor, like: Tensor) -> bool:
    """Element k of ``t``'s memory is element k of ``like``'s (both contiguous, or equal strides); the
    kernels' copy of ``ampfused._layout.same_flat_layout``."""
    return (t.is_contiguous() and like.is_contiguous()) or (t.shape == like.shape and t.stride() == like.stride())


def as_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """``t`` as it is when laid out as ``like``, else a copy in ``like``'s strides (rare)."""
    if same_flat_layout(t, like):
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t.reshape(like.shape))
