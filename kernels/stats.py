"""The stats pass and its finish, in one launch (``ampfused.reference.grad_stats_`` is the spec).

Every program loops over chunks of the gradients and keeps the sum of ``u * u`` and a flag of
non-finite ``u``. The last program to finish adds the partials in a fixed order and writes the
stats vector: norm, skip flag, factor (loss scale and clip coefficient), sum of squares.

``u`` is inf/NaN exactly when its fp32 exponent bits are all ones: an
integer test on the bits of the rounded product, which no compiler can contract. A float test
such as ``bad += u - u`` is not: with fp fusion on, ``x * inv_scale - u`` became
``fma(x, inv_scale, -u)``, the product's rounding error, non-zero for almost every element once
the scale is not a power of two (every step skipped on a GPU, never in the interpreter). Fusion
stays on here for ``acc += u * u`` (an fma, as the CUDA kernel's), which feeds only the norm.
tests/contract/sm90_compile.py checks the compiled PTX for this.

Loops with run-time bounds are ``while`` loops: ``for i in range(a, b)`` with tensor
bounds crashes the Triton 3.6 interpreter under NumPy >= 2.4 (it calls ``int()`` on a 1-element
array), and CI checks these kernels in the interpreter. Compiled, both are the same scf loop.
"""
from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _runtime, _tables
from ._contract_generated import CLIP_EPS, DTYPE_CODE, FACTOR, NORM, S_ALIGNED, S_DTYPE, S_GRAD, S_NUMEL, S_SIZE, SKIP, SUMSQ
from ._memory import load_f32

EXPONENT_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _chunk_sums(addr, dtype, start, end, inv_scale, acc, bad, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    full_end = start + (end - start) // BLOCK * BLOCK
    first = start
    while first < full_end:  # full blocks: no masks (chunks start on BLOCK multiples)
        offs = tl.max_contiguous(tl.multiple_of(first + tl.arange(0, BLOCK), BLOCK), BLOCK)
        u = load_f32(addr, dtype, offs, None, ALIGNED) * inv_scale
        acc += u * u
        bad = bad | ((u.to(tl.uint32, bitcast=True) & EXPONENT_BITS) == EXPONENT_BITS).to(tl.int32)
        first += BLOCK
    if full_end < end:
        offs = full_end + tl.arange(0, BLOCK)
        u = tl.where(offs < end, load_f32(addr, dtype, offs, offs < end, ALIGNED) * inv_scale, 0.0)
        acc += u * u
        bad = bad | ((u.to(tl.uint32, bitcast=True) & EXPONENT_BITS) == EXPONENT_BITS).to(tl.int32)
    return acc, bad


@triton.jit
def _grad_stats_kernel(rows, chunks, grad_scale_ptr, found_inf_ptr, stats_ptr, partials_ptr, retired_ptr, n_chunks,
                       max_grad_norm, HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, CLIP: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNK: tl.constexpr, TABLE_BLOCK: tl.constexpr,
                       CHECK_NONFINITE: tl.constexpr = True):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    inv_scale = 1.0
    if HAS_SCALE:  # torch's reciprocal: in fp64, rounded to fp32
        inv_scale = (1.0 / tl.load(grad_scale_ptr).to(tl.float64)).to(tl.float32)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)  # 1 once a lane has seen a non-finite element
    c = pid
    while c < n_chunks:
        tensor = tl.load(chunks + 2 * c)
        start = tl.load(chunks + 2 * c + 1)
        row = rows + tensor * S_SIZE
        addr = tl.load(row + S_GRAD)
        dtype = tl.load(row + S_DTYPE)
        end = tl.minimum(start + CHUNK, tl.load(row + S_NUMEL))
        if tl.load(row + S_ALIGNED) != 0:  # uniform per program: no divergence
            acc, bad = _chunk_sums(addr, dtype, start, end, inv_scale, acc, bad, BLOCK, True)
        else:
            acc, bad = _chunk_sums(addr, dtype, start, end, inv_scale, acc, bad, BLOCK, False)
        c += n_programs
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))
    tl.store(partials_ptr + n_programs + pid, tl.max(bad, axis=0).to(tl.float32))  # 0.0 or 1.0

    # Each program publishes its partials, then takes a ticket; the
    # program holding the last ticket adds every partial in a fixed order (no float atomics, so
    # the norm is bitwise reproducible), runs the finish (reference.finish_) and resets the ticket
    # counter, so the next launch, or the next replay of a CUDA graph, starts from zero.
    tl.debug_barrier()
    ticket = tl.atomic_add(retired_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == n_programs - 1:
        idx = tl.arange(0, TABLE_BLOCK)  # the grid is at most TABLE_BLOCK programs (_runtime.persistent_grid)
        in_grid = idx < n_programs
        sumsq = tl.sum(tl.load(partials_ptr + idx, mask=in_grid, other=0.0, volatile=True), axis=0)
        flag = tl.sum(tl.load(partials_ptr + n_programs + idx, mask=in_grid, other=0.0, volatile=True), axis=0)
        norm = tl.sqrt_rn(sumsq)
        if CHECK_NONFINITE:
            skip = flag != 0.0  # NaN != 0 as well
        else:  # skip_nonfinite=False without a scaler: only found_inf skips (a sum of squares is never < 0)
            skip = sumsq < 0.0
        if HAS_FOUND_INF:
            skip = skip | (tl.load(found_inf_ptr) != 0.0)
        factor = inv_scale
        if CLIP:  # torch: (max_norm / (norm + 1e-6)).clamp(max=1), float / tensor being reciprocal() * max_norm
            coef = tl.div_rn(1.0, norm + CLIP_EPS) * max_grad_norm
            factor = factor * tl.where((coef < 1.0) | (coef != coef), coef, 1.0)
        finite_norm = (norm == norm) & (tl.abs(norm) != float("inf"))
        tl.store(stats_ptr + NORM, tl.where(skip & finite_norm, float("inf"), norm))
        tl.store(stats_ptr + SKIP, tl.where(skip, 1.0, 0.0))
        tl.store(stats_ptr + FACTOR, factor)
        tl.store(stats_ptr + SUMSQ, sumsq)
        tl.store(retired_ptr, 0)


@_runtime.launches_on(lambda batch, grad_scale, found_inf, max_grad_norm, stats, scratch=None, **kwargs: stats.device)
def grad_stats_(batch, grad_scale: Tensor | None, found_inf: Tensor | None, max_grad_norm: float | None,
                stats: Tensor, scratch=None, *, check_nonfinite: bool = True) -> None:
    """Sum of squares, non-finite flag and finish of ``batch.grads`` into ``stats``; one launch, no host sync.

    ``scratch``: the caller's counters and partials, and a memo of its tables (``_tables.ScratchRows``).
    """
    grads = batch.grads
    device = stats.device
    memo = scratch.memo.get(("stats", device)) if scratch is not None else None
    rows = memo[1].for_grads(grads) if memo is not None else None
    if rows is not None:
        layout = memo[0]
    else:
        layout, rows, grads = _tables_of(grads, device, scratch)  # (copies live past the launch)
    counter, _, partials = _tables.scratch_views(scratch, device)
    _runtime.launch(_grad_stats_kernel, (layout.grid,))(
        rows.rows, layout.chunks, grad_scale if grad_scale is not None else stats,
        found_inf if found_inf is not None else stats, stats, partials, counter, layout.n_chunks,
        float(max_grad_norm) if max_grad_norm is not None else 0.0,
        HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None, CLIP=max_grad_norm is not None,
        BLOCK=_runtime.BLOCK, CHUNK=_runtime.CHUNK, TABLE_BLOCK=_runtime.TABLE_BLOCK, CHECK_NONFINITE=bool(check_nonfinite),
        num_warps=_runtime.NUM_WARPS)


def _tables_of(grads, device, scratch):
    """(layout, row table, grads as the kernel reads them), checked; memoized in ``scratch`` when the
    kernel reads them as they are."""
    dense = _tables.dense_inputs(grads)
    numels = tuple(g.numel() for g in dense)
    layout = _tables.layout("stats", numels, device, _runtime.CHUNK, lambda n: _runtime.persistent_grid(n, device))
    key = tuple((g.data_ptr(), g.dtype) for g in dense)
    rows = _tables.row_table("stats", (numels, key), device, lambda: _build_rows(dense, device))
    if scratch is not None and all(map(operator.is_, dense, grads)):  # (a copy would move every step)
        other_aligned = torch.ones(rows.n_tensors, dtype=torch.int64)
        scratch.memo[("stats", device)] = (layout, _tables.ScratchRows(rows, rows.source, list(grads), int(S_GRAD),
                                                                        int(S_ALIGNED), other_aligned, device,
                                                                        scratch.memo))
    return layout, rows, dense


def _build_rows(grads, device) -> list:
    """One row per grad (the grads come checked: ``ampfused._args.check_grad``)."""
    rows = []
    for g in grads:
        row = [0] * int(S_SIZE)
        row[S_GRAD], row[S_NUMEL], row[S_DTYPE] = g.data_ptr(), g.numel(), DTYPE_CODE[g.dtype]
        row[S_ALIGNED] = _tables.aligned([g.data_ptr()], g.element_size())
        rows.append(row)
    return rows or [[0] * int(S_SIZE)]
