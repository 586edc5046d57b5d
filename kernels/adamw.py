"""The step's two passes, each one launch over every tensor of every param group.

``grad_stats_``  : sum of squares of the unscaled grads (inf/NaN make it non-finite).
``adamw_update_``: AdamW on fp32 values with ``g * factor``; a no-op when ``skip`` is set.

Layout: per-tensor row table + per-program chunk table (``_tables``), per-group hyperparameter table
(below). Math and operation order: ``ampfused.reference._adamw_one`` (= torch.optim.AdamW).

[note: while] Loops with run-time bounds are written as ``while`` loops: ``for i in range(a, b)``
with tensor bounds crashes the Triton 3.6 interpreter under NumPy >= 2.4 (it calls ``int()`` on a
1-element array), and CI checks these kernels in the interpreter. Compiled, both are an scf loop.
"""
from __future__ import annotations

from itertools import chain

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _runtime, _tables
from ._memory import block_offsets, load_f32, store_f32, typed

# Table columns (tl.constexpr so the kernels can name them; the builders below write rows in this order).
# update pass, one row per tensor: addresses first (0 = tensor absent), then sizes and codes
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ, MASTER, STEP, NUMEL, PARAM_DTYPE, GRAD_DTYPE, GROUP = map(tl.constexpr, range(11))
UPDATE_ROW = tl.constexpr(11)
# stats pass, one row per tensor
S_GRAD, S_NUMEL, S_DTYPE = map(tl.constexpr, range(3))
STATS_ROW = tl.constexpr(3)
# group table, one row per distinct hyperparameter set: fp64 bit patterns, then the lr source and flags
G_LR, G_BETA1, G_BETA2, G_EPS, G_WD, G_LR_ADDR, G_LR_KIND, G_FLAGS = map(tl.constexpr, range(8))
GROUP_ROW = tl.constexpr(8)
LR_VALUE, LR_FP32_ADDR, LR_FP64_ADDR = map(tl.constexpr, range(3))  # lr from the table / an fp32 / fp64 tensor
AMSGRAD, MAXIMIZE = tl.constexpr(1), tl.constexpr(2)


# ---------------------------------------------------------------------------------- stats pass

@triton.jit
def _grad_stats_kernel(rows, chunks, inv_scale_ptr, sumsq_ptr, partials_ptr, retired_ptr, n_programs,
                       HAS_INV_SCALE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       TABLE_BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    tensor = tl.load(chunks + 2 * pid)
    start = tl.load(chunks + 2 * pid + 1)
    grad_addr = tl.load(rows + tensor * STATS_ROW + S_GRAD)
    numel = tl.load(rows + tensor * STATS_ROW + S_NUMEL)
    dtype = tl.load(rows + tensor * STATS_ROW + S_DTYPE)
    end = tl.minimum(start + CHUNK, numel)
    full_end = start + (end - start) // BLOCK * BLOCK
    inv_scale = 1.0
    if HAS_INV_SCALE:
        inv_scale = tl.load(inv_scale_ptr)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    first = start
    while first < full_end:  # [note: while] see the module docstring
        u = load_f32(grad_addr, dtype, block_offsets(first, BLOCK), None, False, ALIGNED) * inv_scale
        acc += u * u
        first += BLOCK
    if full_end < end:
        offs = full_end + tl.arange(0, BLOCK)
        u = load_f32(grad_addr, dtype, offs, offs < end, True, ALIGNED) * inv_scale
        acc += u * u
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))

    # [note: last program reduces] Each program publishes its partial, then takes a ticket; the
    # program holding the last ticket sums every partial in a fixed order and adds the total into
    # sumsq. One launch, and the norm is bitwise reproducible (no float atomics). It resets the
    # counter, so the next launch (or graph replay) starts from zero.
    tl.debug_barrier()
    ticket = tl.atomic_add(retired_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == n_programs - 1:
        total = tl.zeros([TABLE_BLOCK], dtype=tl.float32)
        idx = tl.arange(0, TABLE_BLOCK)
        while tl.min(idx, axis=0) < n_programs:
            total += tl.load(partials_ptr + idx, mask=idx < n_programs, other=0.0, volatile=True)
            idx += TABLE_BLOCK
        tl.store(sumsq_ptr, tl.load(sumsq_ptr) + tl.sum(total, axis=0))
        tl.store(retired_ptr, 0)


def grad_stats_(grads, inv_scale: Tensor | None, sumsq: Tensor) -> None:
    """``sumsq += sum_i sum((grads[i].float() * inv_scale) ** 2)``, one launch, no host sync."""
    if not grads:
        return
    grads = _tables.contiguous(grads)
    device = sumsq.device
    key = ("stats", device, tuple((g.data_ptr(), g.numel(), g.dtype) for g in grads))
    tables = _tables.cached("stats", key, device, lambda: _build_stats_tables(grads, device))
    _grad_stats_kernel[(tables.n_programs,)](
        tables.rows, tables.chunks, inv_scale if inv_scale is not None else sumsq, sumsq, tables.partials,
        tables.retired, tables.n_programs, HAS_INV_SCALE=inv_scale is not None,
        BLOCK=_runtime.BLOCK, CHUNK=_runtime.CHUNK, TABLE_BLOCK=_runtime.TABLE_BLOCK, ALIGNED=tables.aligned,
        num_warps=_runtime.NUM_WARPS)


def _build_stats_tables(grads, device) -> _tables.Tables:
    for g in grads:
        _check(g, "grad", device, _tables.DTYPE_CODE)
    rows = [[g.data_ptr(), g.numel(), _tables.DTYPE_CODE[g.dtype]] for g in grads]
    aligned = _tables.all_aligned(r[0] for r in rows)
    return _tables.make_tables(rows, [g.numel() for g in grads], device, _runtime.CHUNK, aligned=aligned, partials=True)


# ---------------------------------------------------------------------------------- update pass

@triton.jit
def _pow_by_squaring(base, exponent):
    """``base ** exponent`` in fp64 for an integer exponent >= 0 (no libdevice pow/exp2 in fp64)."""
    result = base * 0.0 + 1.0
    while exponent > 0:
        result = tl.where((exponent & 1) == 1, result * base, result)
        base = base * base
        exponent = exponent >> 1
    return result


@triton.jit
def _fma(a, b, c, EMULATE_FMA: tl.constexpr):
    """a * b + c rounded once. The interpreter's tl.fma rounds twice, so there it is computed in
    fp64 (the fp32 product is exact in fp64; the sum is rounded to fp64 then fp32)."""
    if EMULATE_FMA:
        r = (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        r = tl.fma(a, b, c)
    return r


@triton.jit
def _adamw_block(offs, mask, MASKED: tl.constexpr, ALIGNED: tl.constexpr, EMULATE_FMA: tl.constexpr,
                 param_addr, param_dtype, grad_addr, grad_dtype, exp_avg_addr, exp_avg_sq_addr, max_sq_addr, master_addr,
                 factor, maximize, amsgrad, decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                 neg_step_size):
    g = load_f32(grad_addr, grad_dtype, offs, mask, MASKED, ALIGNED) * factor
    if maximize:
        g = -g
    if master_addr != 0:
        w = load_f32(master_addr, 0, offs, mask, MASKED, ALIGNED)
    else:
        w = load_f32(param_addr, param_dtype, offs, mask, MASKED, ALIGNED)
    m = load_f32(exp_avg_addr, 0, offs, mask, MASKED, ALIGNED)
    v = load_f32(exp_avg_sq_addr, 0, offs, mask, MASKED, ALIGNED)

    w = w * decay
    # torch's lerp: self + w * (end - self) for |w| < 0.5, else end - (end - self) * (1 - w), as one FMA
    if lerp_weight < 0.5:
        m = _fma(lerp_weight, g - m, m, EMULATE_FMA)
    else:
        m = _fma(lerp_weight - 1.0, g - m, g, EMULATE_FMA)
    # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2): torch's addcmul is fma((1 - beta2) * g, g, v)
    v = _fma(one_minus_beta2 * g, g, v * beta2, EMULATE_FMA)
    if amsgrad:
        v_max = tl.maximum(load_f32(max_sq_addr, 0, offs, mask, MASKED, ALIGNED), v, propagate_nan=tl.PropagateNan.ALL)
        store_f32(max_sq_addr, 0, offs, v_max, mask, MASKED, ALIGNED)
        root = tl.sqrt_rn(v_max)
    else:
        root = tl.sqrt_rn(v)
    denom = tl.div_rn(root, bias_correction2_sqrt) + eps
    w = w + tl.div_rn(m * neg_step_size, denom)

    store_f32(exp_avg_addr, 0, offs, m, mask, MASKED, ALIGNED)
    store_f32(exp_avg_sq_addr, 0, offs, v, mask, MASKED, ALIGNED)
    if master_addr != 0:
        store_f32(master_addr, 0, offs, w, mask, MASKED, ALIGNED)
    store_f32(param_addr, param_dtype, offs, w, mask, MASKED, ALIGNED)


@triton.jit
def _adamw_update_kernel(rows, chunks, groups, factor_ptr, skip_ptr, retired_ptr, n_tensors, n_programs,
                         BLOCK: tl.constexpr, CHUNK: tl.constexpr, TABLE_BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                         EMULATE_FMA: tl.constexpr):
    # early exit: a skipped step writes nothing at all (state stays bitwise unchanged)
    if tl.load(skip_ptr) == 0:
        pid = tl.program_id(0)
        tensor = tl.load(chunks + 2 * pid)
        start = tl.load(chunks + 2 * pid + 1)
        row = rows + tensor * UPDATE_ROW
        group = groups + tl.load(row + GROUP) * GROUP_ROW

        # Per-tensor scalars, in fp64 as torch computes them (from Python floats / fp64 tensors)
        # and rounded to fp32 where torch's fp32 kernels round them.
        lr_kind = tl.load(group + G_LR_KIND)
        lr = tl.load(group + G_LR).to(tl.float64, bitcast=True)
        if lr_kind == LR_FP32_ADDR:
            lr = tl.load(typed(tl.load(group + G_LR_ADDR), tl.float32, False)).to(tl.float64)
        elif lr_kind == LR_FP64_ADDR:
            lr = tl.load(typed(tl.load(group + G_LR_ADDR), tl.float64, False))
        beta1 = tl.load(group + G_BETA1).to(tl.float64, bitcast=True)
        beta2 = tl.load(group + G_BETA2).to(tl.float64, bitcast=True)
        eps = tl.load(group + G_EPS).to(tl.float64, bitcast=True).to(tl.float32)
        weight_decay = tl.load(group + G_WD).to(tl.float64, bitcast=True)
        flags = tl.load(group + G_FLAGS)
        amsgrad = (flags & AMSGRAD) != 0
        maximize = (flags & MAXIMIZE) != 0
        step = tl.load(typed(tl.load(row + STEP), tl.float32, False)) + 1.0
        # [note: pow] beta ** step by squaring in fp64: within a few fp64 ulp of torch.pow and free
        # of libdevice; fp32 exp2(step * log2(beta)) would put a ~1e-4 relative error on
        # 1 - beta2 ** step at step 1 (and fp64 exp2 needs libdevice).
        bias_correction1 = 1.0 - _pow_by_squaring(beta1, step.to(tl.int64))
        bias_correction2_sqrt = tl.sqrt(1.0 - _pow_by_squaring(beta2, step.to(tl.int64))).to(tl.float32)
        neg_step_size = (-(lr / bias_correction1)).to(tl.float32)
        decay = (1.0 - lr * weight_decay).to(tl.float32)
        lerp_weight = (1.0 - beta1).to(tl.float32)
        one_minus_beta2 = (1.0 - beta2).to(tl.float32)
        beta2 = beta2.to(tl.float32)
        factor = tl.load(factor_ptr)

        param_addr = tl.load(row + PARAM)
        param_dtype = tl.load(row + PARAM_DTYPE)
        grad_addr = tl.load(row + GRAD)
        grad_dtype = tl.load(row + GRAD_DTYPE)
        exp_avg_addr = tl.load(row + EXP_AVG)
        exp_avg_sq_addr = tl.load(row + EXP_AVG_SQ)
        max_sq_addr = tl.load(row + MAX_EXP_AVG_SQ)
        master_addr = tl.load(row + MASTER)
        end = tl.minimum(start + CHUNK, tl.load(row + NUMEL))
        full_end = start + (end - start) // BLOCK * BLOCK
        first = start
        while first < full_end:
            _adamw_block(block_offsets(first, BLOCK), None, False, ALIGNED, EMULATE_FMA, param_addr, param_dtype, grad_addr,
                         grad_dtype, exp_avg_addr, exp_avg_sq_addr, max_sq_addr, master_addr, factor, maximize,
                         amsgrad, decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size)
            first += BLOCK
        if full_end < end:
            offs = full_end + tl.arange(0, BLOCK)
            _adamw_block(offs, offs < end, True, ALIGNED, EMULATE_FMA, param_addr, param_dtype, grad_addr,
                         grad_dtype, exp_avg_addr, exp_avg_sq_addr, max_sq_addr, master_addr, factor, maximize,
                         amsgrad, decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size)

        # [note: steps advance last] every program of a tensor reads its step counter above, so no
        # program may advance it early: the program holding the last ticket advances them all.
        tl.debug_barrier()
        ticket = tl.atomic_add(retired_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_programs - 1:
            idx = tl.arange(0, TABLE_BLOCK).to(tl.int64)
            while tl.min(idx, axis=0) < n_tensors:
                in_range = idx < n_tensors
                step_ptrs = tl.load(rows + idx * UPDATE_ROW + STEP, mask=in_range, other=0).to(tl.pointer_type(tl.float32))
                tl.store(step_ptrs, tl.load(step_ptrs, mask=in_range, other=0.0, volatile=True) + 1.0, mask=in_range)
                idx += TABLE_BLOCK
            tl.store(retired_ptr, 0)


def adamw_update_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, hypers, factor: Tensor, skip: Tensor) -> None:
    """One AdamW step over every tensor in one launch; see ``ampfused._backends`` for the contract."""
    if not params:
        return
    device = params[0].device
    grads = _tables.contiguous(grads)
    group_of, group_keys, keep_alive = _group_rows(hypers, device)
    key = ("update", device, group_of,
           tuple((p.data_ptr(), p.numel(), p.dtype, g.data_ptr(), g.dtype) for p, g in zip(params, grads)),
           tuple(t.data_ptr() for t in chain(exp_avgs, exp_avg_sqs, steps)),
           tuple(0 if t is None else t.data_ptr() for t in chain(max_exp_avg_sqs, masters)))
    tables = _tables.cached("update", key, device, lambda: _build_update_tables(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, group_of, group_keys, device))
    groups = _tables.cached("groups", ("groups", device, group_keys), device,
                            lambda: _build_group_table(group_keys, device, keep_alive))
    _adamw_update_kernel[(tables.n_programs,)](
        tables.rows, tables.chunks, groups[0], factor, skip, tables.retired, tables.n_tensors, tables.n_programs,
        BLOCK=_runtime.BLOCK, CHUNK=_runtime.CHUNK, TABLE_BLOCK=_runtime.TABLE_BLOCK, ALIGNED=tables.aligned,
        EMULATE_FMA=device.type == "cpu", num_warps=_runtime.NUM_WARPS,
        # [note: no implicit FMA] torch runs decay, moments and update as separate rounding ops; the
        # kernel uses tl.fma exactly where torch's kernels fuse (lerp, addcmul) and nowhere else.
        enable_fp_fusion=False)


def _group_rows(hypers, device):
    """(group index of every tensor, the distinct group keys, tensors those keys point into).

    [note: group table] A group key is the *value* of a hyperparameter set, with an lr tensor on
    the params' device as its address: the kernel reads its current value, so LR schedulers that
    update it in place need no re-upload and CUDA graphs see the new value at each replay. A float
    lr (or an lr tensor on the CPU, read on the host: no device sync) is part of the key, so a
    scheduler that assigns a new float makes a new key, whose tiny table is uploaded without a sync.
    """
    key_of_hyper: dict[int, tuple] = {}
    index_of_key: dict[tuple, int] = {}
    keep_alive: list[Tensor] = []
    group_of = []
    for h in hypers:
        key = key_of_hyper.get(id(h))
        if key is None:
            key = key_of_hyper[id(h)] = _group_key(h, device, keep_alive)
        group_of.append(index_of_key.setdefault(key, len(index_of_key)))
    return tuple(group_of), tuple(index_of_key), keep_alive


def _group_key(h, device, keep_alive) -> tuple:
    lr = h.lr
    kind, value, addr = int(LR_VALUE), lr, 0
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        if lr.device.type == "cpu" and device.type != "cpu":
            value = float(lr)  # a host read of host memory: no device sync
        else:
            if lr.device != device or lr.dtype not in (torch.float32, torch.float64):
                lr = lr.to(device=device, dtype=torch.float32)  # rare: keep the copy alive with the table
                keep_alive.append(lr)
            kind, value, addr = int(LR_FP64_ADDR if lr.dtype == torch.float64 else LR_FP32_ADDR), 0.0, lr.data_ptr()
    flags = (int(AMSGRAD) if h.amsgrad else 0) | (int(MAXIMIZE) if h.maximize else 0)
    return (kind, float(value), addr, float(h.beta1), float(h.beta2), float(h.eps), float(h.weight_decay), flags)


def _build_group_table(keys, device, keep_alive):
    floats = torch.tensor([[k[1], k[3], k[4], k[5], k[6]] for k in keys], dtype=torch.float64).view(torch.int64)
    ints = torch.tensor([[k[2], k[0], k[7]] for k in keys], dtype=torch.int64)
    table, pinned = _tables.upload(torch.cat([floats, ints], dim=1).contiguous(), device)
    return table, pinned, keep_alive


def _build_update_tables(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, group_of, group_keys, device):
    low = _tables.DTYPE_CODE
    fp32 = {torch.float32: 0}
    rows = []
    for i, p in enumerate(params):
        g, m, v, vmax, master, step = grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], masters[i], steps[i]
        _check(p, f"params[{i}]", device, low)
        _check(g, f"grads[{i}]", device, low)
        for what, t in ((f"exp_avgs[{i}]", m), (f"exp_avg_sqs[{i}]", v), (f"max_exp_avg_sqs[{i}]", vmax), (f"masters[{i}]", master)):
            if t is not None:
                _check(t, what, device, fp32)
                if t.numel() != p.numel():
                    raise ValueError(f"{what} has {t.numel()} elements for a param of {p.numel()}")
        _check(step, f"steps[{i}]", device, fp32)
        if g.numel() != p.numel() or step.numel() != 1:
            raise ValueError(f"grads[{i}] must match params[{i}] ({p.numel()} elements) and steps[{i}] must be 0-d")
        if group_keys[group_of[i]][7] & int(AMSGRAD) and vmax is None:
            raise ValueError(f"params[{i}] is in an amsgrad group but max_exp_avg_sqs[{i}] is None")
        rows.append([p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if vmax is None else vmax.data_ptr(),
                     0 if master is None else master.data_ptr(), step.data_ptr(), p.numel(), low[p.dtype], low[g.dtype],
                     group_of[i]])
    aligned = _tables.all_aligned(a for r in rows for a in r[:6])
    return _tables.make_tables(rows, [p.numel() for p in params], device, _runtime.CHUNK, aligned=aligned, partials=False)


def _check(t: Tensor, what: str, device: torch.device, dtypes) -> None:
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, but the step runs on {device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{what} has dtype {t.dtype}; the Triton kernels take {', '.join(map(str, dtypes))}")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; the Triton kernels address tensors as flat memory")
