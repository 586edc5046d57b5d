"""Device-side tables that let one launch reach every tensor of a step.

[note: pointer tables] A pass gets three small int64 device tables instead of one argument per tensor:

* a *row table*, one row per tensor: raw addresses (``data_ptr()``) of the user's param and grad and
  of the optimizer-owned views (``exp_avg``, ..., 0 for a missing one), the element count, dtype
  codes and the index of the tensor's hyperparameter row;
* a *chunk table*, one row per program: ``(tensor index, first element)``. Tensor ``i`` gets
  ``ceil(numel_i / CHUNK)`` programs, so the grid is the total chunk count, any mix of sizes
  balances, and 300 tiny tensors are 300 programs of one launch;
* a *group table* (``adamw.py``), one row per distinct hyperparameter set.

Kernels turn an address back into a typed pointer with ``addr.to(tl.pointer_type(tl.float32))``;
the Triton 3.6 interpreter supports that cast (loads and stores through it work on CPU tensors),
so CI exercises exactly the code the GPU runs.

Building a table costs a host->device copy, so tables are cached, keyed on everything their content
is made of (addresses, element counts, dtypes, group indices). The hot path only collects that key:
no host sync, no per-tensor work beyond reading ``data_ptr()``/``numel()``/``dtype``. An address
changes when autograd allocates a new ``p.grad`` somewhere else or the optimizer re-lays out its
state; then the table is rebuilt (a non-blocking copy from pinned memory, no sync).

[note: cuda graphs] A captured graph bakes the table addresses into its kernel arguments, and the
upload copy (when a table is built during capture) re-reads its pinned host source at each replay.
So an entry touched while a stream is capturing is moved out of the small LRU into ``_kept`` and
lives as long as the process: replays never read freed memory.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch
from torch import Tensor

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CACHE_SIZE = 8  # live entries per kind: enough for a few optimizers, small enough to forget stale ones


@dataclass
class Tables:
    """One launch's tables on the device, plus the scratch its "last program" logic needs."""

    rows: Tensor  # int64 [n_tensors, width]
    chunks: Tensor  # int64 [n_programs, 2]: (tensor index, first element)
    n_tensors: int
    n_programs: int
    aligned: bool  # every address is 16-byte aligned: the kernels may use 16-byte vector accesses
    retired: Tensor  # int32 [1], zero between launches: counts finished programs
    partials: Tensor | None  # fp32 [n_programs]: one partial sum per program (stats pass)
    host: Tensor | None  # pinned source of the upload, kept alive for graph replays


_cache: dict[str, OrderedDict] = {}
_kept: dict[Hashable, object] = {}
_built_in_capture: set[Hashable] = set()


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


def make_tables(rows: list[list[int]], numels: Sequence[int], device: torch.device, chunk: int, *, aligned: bool, partials: bool) -> Tables:
    """Upload a row table and its chunk layout in one copy; allocate the launch scratch."""
    host_rows = torch.tensor(rows, dtype=torch.int64)
    host_chunks = chunk_layout(numels, chunk)
    host = torch.cat([host_rows.reshape(-1), host_chunks.reshape(-1)])
    data, pinned = upload(host, device)
    n_rows = host_rows.numel()
    n_programs = host_chunks.shape[0]
    return Tables(
        rows=data[:n_rows].view(len(rows), -1),
        chunks=data[n_rows:].view(n_programs, 2),
        n_tensors=len(rows),
        n_programs=n_programs,
        aligned=aligned,
        retired=torch.zeros(1, dtype=torch.int32, device=device),
        partials=torch.empty(n_programs, dtype=torch.float32, device=device) if partials else None,
        host=pinned,
    )


def all_aligned(addresses, alignment: int = 16) -> bool:
    return all(a % alignment == 0 for a in addresses)


def contiguous(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors as given when contiguous (the optimizer guarantees it), else contiguous copies."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def check(t: Tensor, what: str, device: torch.device, dtypes) -> None:
    """Validate a tensor once, when its table row is built (never on the hot path)."""
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, but the step runs on {device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{what} has dtype {t.dtype}; the Triton kernels take {', '.join(map(str, dtypes))}")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; the Triton kernels address tensors as flat memory")
