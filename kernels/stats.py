"""The stats pass: ``sumsq += sum over every grad of sum((g * inv_scale) ** 2)``, in one launch.

Inf/NaN anywhere make ``sumsq`` non-finite: that is how the step detects a step to skip
(``ampfused.functional.run_step`` finishes norm, skip flag and clip factor on the device).

[note: while] Loops with run-time bounds are ``while`` loops: ``for i in range(a, b)`` with tensor
bounds crashes the Triton 3.6 interpreter under NumPy >= 2.4 (it calls ``int()`` on a 1-element
array), and CI checks these kernels in the interpreter. Compiled, both are the same scf loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _runtime, _tables
from ._memory import load_f32

# row table columns: one row per grad
GRAD_ADDR, NUMEL, DTYPE = map(tl.constexpr, range(3))
ROW = tl.constexpr(3)


@triton.jit
def _grad_stats_kernel(rows, chunks, inv_scale_ptr, sumsq_ptr, partials_ptr, retired_ptr, n_programs,
                       HAS_INV_SCALE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       TABLE_BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    tensor = tl.load(chunks + 2 * pid)
    start = tl.load(chunks + 2 * pid + 1)
    grad_addr = tl.load(rows + tensor * ROW + GRAD_ADDR)
    dtype = tl.load(rows + tensor * ROW + DTYPE)
    end = tl.minimum(start + CHUNK, tl.load(rows + tensor * ROW + NUMEL))
    full_end = start + (end - start) // BLOCK * BLOCK
    inv_scale = 1.0
    if HAS_INV_SCALE:
        inv_scale = tl.load(inv_scale_ptr)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    first = start
    while first < full_end:  # full blocks: no masks (chunks start on BLOCK multiples)
        offs = tl.max_contiguous(tl.multiple_of(first + tl.arange(0, BLOCK), BLOCK), BLOCK)
        u = load_f32(grad_addr, dtype, offs, None, ALIGNED) * inv_scale
        acc += u * u
        first += BLOCK
    if full_end < end:
        offs = full_end + tl.arange(0, BLOCK)
        u = tl.where(offs < end, load_f32(grad_addr, dtype, offs, offs < end, ALIGNED) * inv_scale, 0.0)
        acc += u * u
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))

    # [note: last program reduces] Each program publishes its partial sum, then takes a ticket; the
    # program holding the last ticket adds every partial, in a fixed order, into sumsq. One launch,
    # and the norm is bitwise reproducible (no float atomics). It also resets the ticket counter,
    # so the next launch, or the next replay of a CUDA graph, starts from zero.
    tl.debug_barrier()
    ticket = tl.atomic_add(retired_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == n_programs - 1:
        total = tl.zeros([TABLE_BLOCK], dtype=tl.float32)
        table_first = tl.program_id(0) * 0  # a run-time zero even when n_programs == 1 is specialized to a constant
        while table_first < n_programs:
            idx = table_first + tl.arange(0, TABLE_BLOCK)
            total += tl.load(partials_ptr + idx, mask=idx < n_programs, other=0.0, volatile=True)
            table_first += TABLE_BLOCK
        tl.store(sumsq_ptr, tl.load(sumsq_ptr) + tl.sum(total, axis=0))
        tl.store(retired_ptr, 0)


@_runtime.launches_on(lambda grads, inv_scale, sumsq: sumsq.device)
def grad_stats_(grads, inv_scale: Tensor | None, sumsq: Tensor) -> None:
    """``sumsq += sum_i sum((grads[i].float() * inv_scale) ** 2)``; one launch, no host sync."""
    if not grads:
        return
    grads = _tables.contiguous(grads)
    device = sumsq.device
    key = ("stats", device, tuple((g.data_ptr(), g.numel(), g.dtype) for g in grads))
    tables = _tables.cached("stats", key, device, lambda: _build_tables(grads, device))
    _grad_stats_kernel[(tables.n_programs,)](
        tables.rows, tables.chunks, inv_scale if inv_scale is not None else sumsq, sumsq, tables.partials,
        tables.retired, tables.n_programs, HAS_INV_SCALE=inv_scale is not None, BLOCK=_runtime.BLOCK,
        CHUNK=_runtime.CHUNK, TABLE_BLOCK=_runtime.TABLE_BLOCK, ALIGNED=tables.aligned, num_warps=_runtime.NUM_WARPS)


def _build_tables(grads, device) -> _tables.Tables:
    for i, g in enumerate(grads):
        _tables.check(g, f"grads[{i}]", device, _tables.DTYPE_CODE)
    rows = [[g.data_ptr(), g.numel(), _tables.DTYPE_CODE[g.dtype]] for g in grads]
    aligned = _tables.all_aligned(row[0] for row in rows)
    return _tables.make_tables(rows, [g.numel() for g in grads], device, _runtime.CHUNK, aligned=aligned, partials=True)
