"""The update pass's row table: every tensor of a step checked, one int64 row per tensor.

A row holds ``ampfused._contract.UPDATE_TENSOR``'s fields in its order (the ``U_`` columns):
addresses, element count, dtype and encoding codes, group index, alignment and the tensor's index
in the step's lists (the key of its rounding bits). ``adamw.adamw_update_`` builds the table once
per set of lists and keeps it in the caller's scratch memo; a warm step only rewrites the grad
addresses ([note: host time] in ``ampfused/_plan.py``), so nothing here runs then.
"""
from __future__ import annotations

import operator
from itertools import chain

import torch

from . import _runtime, _tables
from ._contract_generated import (
    DTYPE_CODE, EXP_AVG_KIND_OF_DTYPE, EXP_AVG_SQ_DTYPE_OF_KIND, FLAG_AMSGRAD, SCALE_BLOCK, MASTER_F32, MOMENT_BF16,
    MASTER_KIND_OF_DTYPE, MASTER_NEEDS, MASTER_PARAM_DTYPES, MOMENT_DTYPE_NAMES, MOMENT_INT4, MOMENT_INT8,
    MOMENT_KIND_OF_DTYPES,
    U_ALIGNED, U_EXP_AVG, U_EXP_AVG_SCALES, U_EXP_AVG_SQ, U_EXP_AVG_SQ_SCALES, U_GRAD, U_GRAD_DTYPE, U_GROUP, U_INDEX,
    U_MASTER, U_MASTER_KIND, U_MAX_EXP_AVG_SQ, U_MAX_EXP_AVG_SQ_SCALES, U_MOMENT_KIND, U_NUMEL, U_PARAM, U_PARAM_DTYPE,
    U_SIZE, U_STEP, MASTER_SPLIT16, MASTER_SPLIT8, U_ELEMENT_BASE, U_ROW_NUMEL)

# the stored dtype of each split master, which picks the launch's compact variant
MASTER_SPLIT16_DTYPE, MASTER_SPLIT8_DTYPE = (
    next(dtype for dtype, kind in MASTER_KIND_OF_DTYPE.items() if kind == code) for code in (MASTER_SPLIT16, MASTER_SPLIT8))


def tables_of(lists, grads, group_of, group_keys, device, scratch):
    """(layout, row table, the grads the kernel reads, compact variant) of one update, every tensor
    checked; memoized in ``scratch`` when the kernel reads the grads as they are."""
    params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, moment_scales, rounding_index, element_base = lists
    if rounding_index is None:  # the random bits' key ([note: rounding bits]): the position in the step's full lists
        rounding_index = range(len(params))
    if element_base is None:  # ... and the element's index in the whole tensor (a DTensor shard's from its offset)
        element_base = (0,) * len(params)
    if moment_scales is None:
        moment_scales = [None] * len(params)
    elif len(moment_scales) != len(params):
        raise ValueError(f"moment_scales has {len(moment_scales)} entries for {len(params)} params")
    laid_out = [_tables.as_layout_of(g, p) for g, p in zip(grads, params)]
    numels = tuple(work_numel(p, m) for p, m in zip(params, exp_avgs))
    layout = _tables.layout("update", numels, device, _runtime.CHUNK)
    scales = [(0, 0, 0) if s is None else tuple(0 if t is None else t.data_ptr() for t in s) for s in moment_scales]
    key = (group_of, tuple((p.data_ptr(), p.dtype, g.data_ptr(), g.dtype) for p, g in zip(params, laid_out)),
           tuple((t.data_ptr(), t.dtype) for t in chain(exp_avgs, exp_avg_sqs, steps)),
           tuple((0, None) if t is None else (t.data_ptr(), t.dtype) for t in chain(max_exp_avg_sqs, masters)),
           tuple(scales), tuple(rounding_index), tuple(element_base))
    rows = _tables.row_table("update", (numels, key), device, lambda: _build_rows(
        params, laid_out, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, moment_scales, rounding_index,
        element_base, group_of, group_keys, device))
    state_kinds = {EXP_AVG_KIND_OF_DTYPE[t.dtype] for t in exp_avgs}
    master_dtypes = {t.dtype for t in masters if t is not None}
    variant = (MASTER_SPLIT16_DTYPE in master_dtypes, MASTER_SPLIT8_DTYPE in master_dtypes, int(MOMENT_BF16) in state_kinds,
               int(MOMENT_INT8) in state_kinds, int(MOMENT_INT4) in state_kinds,
               any(p.dtype == torch.bfloat16 and master is None for p, master in zip(params, masters)))
    if scratch is not None and all(map(operator.is_, laid_out, grads)):  # (a copy would move every step)
        source = rows.source
        other_aligned = torch.ones(rows.n_tensors, dtype=torch.int64)
        for column, tensors in ((U_PARAM, params), (U_EXP_AVG, exp_avgs), (U_EXP_AVG_SQ, exp_avg_sqs),
                                (U_MAX_EXP_AVG_SQ, max_exp_avg_sqs), (U_MASTER, masters)):
            modulus = torch.tensor([1 if t is None else 4 * t.element_size() for t in tensors])
            other_aligned &= (source[:, int(column)] % modulus == 0).long()
        scratch.memo[("update", device)] = (lists, layout, group_of, _tables.ScratchRows(
            rows, source, list(grads), int(U_GRAD), int(U_ALIGNED), other_aligned, device, scratch.memo), variant)
    return layout, rows, laid_out, variant


# The compact encodings ([note: one encoding decision] in ampfused/_contract.py): state dtypes -> row
# codes ((exp_avg, exp_avg_sq / max_exp_avg_sq dtypes) for the moments), and the params a split master completes
_STATE_KINDS = MOMENT_KIND_OF_DTYPES
_MASTER_KINDS = MASTER_KIND_OF_DTYPE
_SPLIT_PARAMS = MASTER_PARAM_DTYPES
_SQUARE_DTYPES = tuple(set(EXP_AVG_SQ_DTYPE_OF_KIND.values()))  # the dtypes exp_avg_sq / max_exp_avg_sq buffers take
_FP32 = (torch.float32,)  # the step counts and the int8 / int4 block scales
_SCALE_BLOCK = int(SCALE_BLOCK)
_BLOCKWISE = (int(MOMENT_INT8), int(MOMENT_INT4))  # the moment kinds of codes and block scales


def row_numel(p) -> int:
    """Elements per row of ``p``'s block grid (``ampfused._contract.block_rows``): a dim-0 slice, or all of a 0-d or 1-d tensor."""
    return p.numel() if p.dim() < 2 or p.shape[0] == 0 else p.numel() // p.shape[0]


def work_numel(p, exp_avg) -> int:
    """The elements the chunk layout counts for ``p``: its own, or for int8 / int4 moments whose rows
    are no whole number of blocks those of its rows padded to whole blocks ([note: blocks in rows]:
    the kernel steps such a tensor one block at a time and maps the padded count back)."""
    row = row_numel(p)
    if EXP_AVG_KIND_OF_DTYPE.get(exp_avg.dtype) not in _BLOCKWISE or row % _SCALE_BLOCK == 0 or row == p.numel():
        return p.numel()
    return p.numel() // row * (-(-row // _SCALE_BLOCK) * _SCALE_BLOCK)


def _compact_columns(i, p, m, v, vmax, master, scales, device):
    """(master kind, state kind, three scale addresses) of tensor ``i``, its compact state checked."""
    kind = _STATE_KINDS.get((m.dtype, v.dtype))
    if kind is None or (vmax is not None and vmax.dtype != v.dtype):
        raise TypeError(f"exp_avgs[{i}] / exp_avg_sqs[{i}] / max_exp_avg_sqs[{i}] have dtypes {m.dtype} / {v.dtype} / "
                        f"{None if vmax is None else vmax.dtype}; the Triton kernels take {MOMENT_DTYPE_NAMES} "
                        "(one encoding per tensor)")
    if master is not None and master.dtype in _SPLIT_PARAMS and p.dtype not in _SPLIT_PARAMS[master.dtype]:
        raise TypeError(f"masters[{i}] is {MASTER_NEEDS[master.dtype]}, but params[{i}] is {p.dtype}")
    addrs = [0, 0, 0]
    if kind in _BLOCKWISE:
        if scales is None or len(scales) != 3 or (scales[2] is None) != (vmax is None):
            encoding = "int8" if kind == int(MOMENT_INT8) else "int4"
            raise ValueError(f"params[{i}] has {encoding} moments: moment_scales[{i}] must be (exp_avg_scales, "
                             "exp_avg_sq_scales, max_exp_avg_sq_scales or None when there is no max_exp_avg_sq)")
        row = row_numel(p)
        blocks = p.numel() // max(row, 1) * -(-row // _SCALE_BLOCK)  # [note: blocks in rows]
        for j, t in enumerate(scales):
            if t is not None:
                _tables.check(t, f"moment_scales[{i}][{j}]", device, _FP32)
                if t.numel() != blocks:
                    raise ValueError(f"moment_scales[{i}][{j}] has {t.numel()} elements; rows of {row} elements make "
                                     f"{blocks} blocks of at most {_SCALE_BLOCK}")
                addrs[j] = t.data_ptr()
    elif scales is not None:
        raise ValueError(f"moment_scales[{i}] is given, but the moments of params[{i}] are not int8 or int4 codes")
    return _MASTER_KINDS[master.dtype] if master is not None else int(MASTER_F32), kind, addrs


def _build_rows(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, moment_scales, rounding_index,
                element_base, group_of, group_keys, device):
    low = DTYPE_CODE
    rows = []
    for i, p in enumerate(params):
        g, m, v, vmax, master, step = grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], masters[i], steps[i]
        _tables.check(p, f"params[{i}]", device, low)  # (grads come checked: ampfused._args.check_grad)
        packed = EXP_AVG_KIND_OF_DTYPE.get(m.dtype) == int(MOMENT_INT4)  # [note: int4 packing]: element k in byte k >> 1
        if packed and (p.dim() == 0 or p.shape[-1] % 2 or not p.is_contiguous()):
            raise ValueError(f"params[{i}] has int4 moments, whose codes the kernels address as packed pairs of a "
                             f"contiguous param with an even last dimension; it is {tuple(p.shape)} with strides "
                             f"{p.stride()}")
        for what, t, dtypes in ((f"exp_avgs[{i}]", m, EXP_AVG_KIND_OF_DTYPE), (f"exp_avg_sqs[{i}]", v, _SQUARE_DTYPES),
                                (f"max_exp_avg_sqs[{i}]", vmax, _SQUARE_DTYPES), (f"masters[{i}]", master, _MASTER_KINDS)):
            if t is not None:
                _tables.check(t, what, device, dtypes)
                numel = p.numel() // 2 if t is not master and packed else p.numel()
                if t.numel() != numel:
                    raise ValueError(f"{what} has {t.numel()} elements for a param of {p.numel()}"
                                     + (" (int4 codes: two per byte, packed_shape)" if packed else ""))
        compact = _compact_columns(i, p, m, v, vmax, master, moment_scales[i], device)
        _tables.check(step, f"steps[{i}]", device, _FP32)
        if step.numel() != 1:
            raise ValueError(f"steps[{i}] must be 0-d")
        if group_keys[group_of[i]].flags & int(FLAG_AMSGRAD) and vmax is None:
            raise ValueError(f"params[{i}] is in an amsgrad group but max_exp_avg_sqs[{i}] is None")
        for what, t in ((f"exp_avgs[{i}]", m), (f"exp_avg_sqs[{i}]", v), (f"max_exp_avg_sqs[{i}]", vmax), (f"masters[{i}]", master)):
            if t is not None and not _tables.same_flat_layout(t, p):
                raise ValueError(f"{what} is not laid out in memory as params[{i}] (both contiguous, or equal strides)")
        state_addrs = [0 if t is None else t.data_ptr() for t in (m, v, vmax, master)]
        aligned = _tables.aligned([p.data_ptr()], p.element_size()) & _tables.aligned([g.data_ptr()], g.element_size())
        for t in (m, v, vmax, master):
            if t is not None:
                aligned &= _tables.aligned([t.data_ptr()], t.element_size())
        row = [0] * int(U_SIZE)
        for column, addr in zip((U_PARAM, U_GRAD, U_EXP_AVG, U_EXP_AVG_SQ, U_MAX_EXP_AVG_SQ, U_MASTER, U_STEP),
                                (p.data_ptr(), g.data_ptr(), *state_addrs, step.data_ptr())):
            row[column] = addr
        row[U_NUMEL], row[U_PARAM_DTYPE], row[U_GRAD_DTYPE] = p.numel(), low[p.dtype], low[g.dtype]
        row[U_GROUP], row[U_ALIGNED], row[U_INDEX] = group_of[i], aligned, rounding_index[i]
        row[U_ROW_NUMEL], row[U_ELEMENT_BASE] = row_numel(p), element_base[i]
        row[U_MASTER_KIND], row[U_MOMENT_KIND], scale_addrs = compact
        row[U_EXP_AVG_SCALES], row[U_EXP_AVG_SQ_SCALES], row[U_MAX_EXP_AVG_SQ_SCALES] = scale_addrs
        rows.append(row)
    return rows
