"""The update pass: AdamW on every tensor of every param group, in one launch.

Grads are multiplied by ``stats[FACTOR]`` (clip coefficient / loss scale, written by the stats
pass on the device); when ``stats[SKIP]`` is non-zero every program exits before writing anything.
With ``grad_scale`` (``WRITE_GRAD``) the unscaled gradient ``g * (1 / grad_scale)`` is stored back
into the grad as the block goes (DESIGN §2.7: what torch's fused AdamW leaves in ``p.grad``). Math and order of
operations: ``ampfused.reference._adamw_one``, i.e. torch.optim.AdamW.

Compact state (DESIGN §9: split16 / split8 masters, bf16 / int8 / int4 moments, stochastic rounding) is
read and written by variants of the same kernel: the row table says each tensor's encodings, the
launch's constexprs (``SPLIT16`` .. ``SR``) which encodings it can meet, so a launch without compact
state compiles to the plain kernel; ``_load_state``/``_store_state`` read and write fp32 state here
and hand compact encodings to ``_compact_state``; the fp32 math is shared.

Layout: a row table (one row per tensor) and a chunk table (one row per program) from ``_tables``,
and a group table (one row per distinct hyperparameter set) built here. See ``stats.py`` for why
the loops are ``while`` loops.
"""
from __future__ import annotations

import operator
import struct
from collections import namedtuple
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _runtime, _tables, _update_rows
from . import _compact_state as CS
from ._contract_generated import (
    DTYPE_BF16, DTYPE_F16, FACTOR, FLAG_AMSGRAD, FLAG_MAXIMIZE, G_BETA1, G_BETA2, G_EPS, G_FLAGS, G_LR, G_LR_KIND,
    G_LR_PTR, G_SIZE, G_WEIGHT_DECAY, SCALE_BLOCK, LR_BF16, LR_F16, LR_F32, LR_F64, LR_SLOT, LR_VALUE,
    LR_KIND_OF_DTYPE, MASTER_F32, MOMENT_INT4, MOMENT_INT8, ROUNDING_SEED_BITS, SKIP, U_ELEMENT_BASE, U_ROW_NUMEL,
    U_ALIGNED, U_EXP_AVG, U_EXP_AVG_SCALES, U_EXP_AVG_SQ,
    U_EXP_AVG_SQ_SCALES, U_GRAD, U_GRAD_DTYPE, U_GROUP, U_INDEX, U_MASTER, U_MASTER_KIND, U_MAX_EXP_AVG_SQ,
    U_MAX_EXP_AVG_SQ_SCALES, U_MOMENT_KIND, U_NUMEL, U_PARAM, U_PARAM_DTYPE, U_SIZE, U_STEP)
from ._memory import load_f32, store_f32, typed_ptr

# The row table (one row per tensor: U_ columns), the group table (one row per distinct
# hyperparameter set: G_ columns, floats as fp64 bit patterns) and the lr kinds are
# ampfused._contract's UPDATE_TENSOR, UPDATE_GROUP and LR_ codes (LR_KIND_OF_DTYPE by a tensor lr's dtype).
LR_SLOTS = 4  # distinct float lrs passed as kernel arguments; more go into the group table


# The block of an unaligned tensor has another shape than the aligned block: the compiler gives
# every access of one shape the widest vector layout among them, and the stores of an unaligned
# tensor, which move one element at a time, would then convert each value through shared memory
# (and spill in the block loop). Half a block, still whole int8 scale blocks.
UNALIGNED_BLOCK = tl.constexpr(max(_runtime.UPDATE_BLOCK // 2, int(SCALE_BLOCK)))
# [note: int8 blocks] (in _compact_state): chunks and blocks must hold whole scale blocks
assert _runtime.CHUNK % int(SCALE_BLOCK) == 0 and _runtime.UPDATE_BLOCK % int(SCALE_BLOCK) == 0
assert _runtime.UPDATE_BLOCK % int(UNALIGNED_BLOCK) == 0 and int(UNALIGNED_BLOCK) % int(SCALE_BLOCK) == 0


@triton.jit
def _bias_corrections(beta1, beta2, step):
    """(1 - beta1 ** step, sqrt(1 - beta2 ** step)) in fp64 for an integer-valued fp32 step.

    beta ** step by squaring in fp64: within a few fp64 ulp of torch.pow (so the fp32
    roundings torch applies come out the same) and free of libdevice. An fp32
    exp2(step * log2(beta)) would put a ~1e-4 relative error on 1 - beta2 ** step at step 1, and
    fp64 exp2 needs libdevice.
    """
    exponent = step.to(tl.int64)
    pow1 = beta1 * 0.0 + 1.0
    pow2 = beta2 * 0.0 + 1.0
    while exponent > 0:
        odd = (exponent & 1) == 1
        pow1 = tl.where(odd, pow1 * beta1, pow1)
        pow2 = tl.where(odd, pow2 * beta2, pow2)
        beta1 = beta1 * beta1
        beta2 = beta2 * beta2
        exponent = exponent >> 1
    return 1.0 - pow1, tl.sqrt(1.0 - pow2)


# What the update kernel holds of a tensor: the fields of its row that the blocks read, loaded once
# per program (the block loop could not re-read them: nothing tells the compiler that the stores
# leave the table alone). The param's dtype code travels beside it, as a constexpr where the
# program fixes it ([note: split masters per program]); a tuple would turn it into a run-time value.
Row = namedtuple("Row", ["param", "grad", "grad_dtype", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master",
                         "master_kind", "moment_kind", "exp_avg_scales", "exp_avg_sq_scales", "max_exp_avg_sq_scales"])
# A program's scalars: its group's hyperparameters as the block math uses them, and the stats factor.
Scalars = namedtuple("Scalars", ["amsgrad", "maximize", "factor", "unscale", "decay", "lerp_from_m", "lerp_scale",
                                 "beta2", "one_minus_beta2", "bias_correction2_sqrt", "eps", "neg_step_size"])


@triton.jit
def _load_state(t, param_dtype, offs, mask, first, end, amsgrad, ALIGNED: tl.constexpr, SPLIT16: tl.constexpr,
                SPLIT8: tl.constexpr, BF16_STATE: tl.constexpr, INT8_STATE: tl.constexpr, INT4_STATE: tl.constexpr):
    """(w, m, v, v_max) in fp32 of tensor ``t`` (a :data:`Row`), each in the encoding its row names
    among those the launch can meet (fp32 here, compact ones in ``_compact_state``); v_max is v
    without amsgrad. The kernel sends split-master tensors only to SPLIT16/SPLIT8 blocks
    ([note: split masters per program])."""
    if SPLIT16 or SPLIT8:
        w = CS.load_split_master(t, param_dtype, offs, mask, ALIGNED, SPLIT16, SPLIT8)
    elif t.master != 0:
        w = tl.load(typed_ptr(t.master, tl.float32, 16, ALIGNED) + offs, mask=mask)
    else:
        w = load_f32(t.param, param_dtype, offs, mask, ALIGNED)
    if BF16_STATE or INT8_STATE or INT4_STATE:
        m = CS.load_moment(t.exp_avg, t.moment_kind, t.exp_avg_scales, offs, mask, first, end, ALIGNED, BF16_STATE,
                           INT8_STATE, INT4_STATE, True)
        v = CS.load_moment(t.exp_avg_sq, t.moment_kind, t.exp_avg_sq_scales, offs, mask, first, end, ALIGNED, BF16_STATE,
                           INT8_STATE, INT4_STATE, False)
        if amsgrad:
            v_max = CS.load_moment(t.max_exp_avg_sq, t.moment_kind, t.max_exp_avg_sq_scales, offs, mask, first, end,
                                   ALIGNED, BF16_STATE, INT8_STATE, INT4_STATE, False)
        else:
            v_max = v
    else:
        m = tl.load(typed_ptr(t.exp_avg, tl.float32, 16, ALIGNED) + offs, mask=mask)
        v = tl.load(typed_ptr(t.exp_avg_sq, tl.float32, 16, ALIGNED) + offs, mask=mask)
        if amsgrad:
            v_max = tl.load(typed_ptr(t.max_exp_avg_sq, tl.float32, 16, ALIGNED) + offs, mask=mask)
        else:
            v_max = v
    return w, m, v, v_max


@triton.jit
def _store_state(t, param_dtype, offs, mask, first, end, rk, amsgrad, w, m, v, v_max, ALIGNED: tl.constexpr,
                 SPLIT16: tl.constexpr, SPLIT8: tl.constexpr, BF16_STATE: tl.constexpr, INT8_STATE: tl.constexpr,
                 INT4_STATE: tl.constexpr, SR: tl.constexpr):
    """The update's writes: moments in their encoding, the param with its master (split or fp32),
    or alone (stochastically rounded when SR and bf16), for the block from element ``first``;
    ``rk`` is the program's random key (``_compact_state.RoundingKey``; [note: rounding bits] in
    ampfused/_contract.py)."""
    # the param first: its random word (word1, shared with max_exp_avg_sq) dies before the moments'
    # word0 is made, so a block holds one word at a time
    word1 = 0
    if SR:
        _, word1 = CS.random_words(offs, rk, True)
    if SPLIT16 or SPLIT8:
        CS.store_split_master(t, param_dtype, offs, mask, w, ALIGNED, SPLIT16, SPLIT8)
    elif t.master != 0:
        tl.store(typed_ptr(t.master, tl.float32, 16, ALIGNED) + offs, w, mask=mask)
        store_f32(t.param, param_dtype, offs, w, mask, ALIGNED)
    elif SR:
        if param_dtype == DTYPE_BF16:  # bf16 without a master: stochastic rounding
            CS.store_bf16(t.param, offs, mask, w, word1 >> 16, ALIGNED, True)
        else:
            store_f32(t.param, param_dtype, offs, w, mask, ALIGNED)
    else:
        store_f32(t.param, param_dtype, offs, w, mask, ALIGNED)  # round-to-nearest-even for fp16/bf16
    if BF16_STATE or INT8_STATE or INT4_STATE:
        if amsgrad:
            CS.store_moment(t.max_exp_avg_sq, t.moment_kind, t.max_exp_avg_sq_scales, offs, mask, first, end,
                            v_max, word1, ALIGNED, BF16_STATE, INT8_STATE, INT4_STATE, False, SR)
        word0 = 0
        if SR:
            word0, _ = CS.random_words(offs, rk, False)
        CS.store_moment(t.exp_avg, t.moment_kind, t.exp_avg_scales, offs, mask, first, end, m, word0, ALIGNED,
                        BF16_STATE, INT8_STATE, INT4_STATE, True, SR)
        CS.store_moment(t.exp_avg_sq, t.moment_kind, t.exp_avg_sq_scales, offs, mask, first, end, v, word0 >> 16,
                        ALIGNED, BF16_STATE, INT8_STATE, INT4_STATE, False, SR)
    else:
        tl.store(typed_ptr(t.exp_avg, tl.float32, 16, ALIGNED) + offs, m, mask=mask)
        tl.store(typed_ptr(t.exp_avg_sq, tl.float32, 16, ALIGNED) + offs, v, mask=mask)
        if amsgrad:
            tl.store(typed_ptr(t.max_exp_avg_sq, tl.float32, 16, ALIGNED) + offs, v_max, mask=mask)


@triton.jit
def _adamw_block(offs, mask, first, end, t, s, rk, param_dtype, ALIGNED: tl.constexpr,
                 EMULATE_FMA: tl.constexpr, WRITE_GRAD: tl.constexpr, SPLIT16: tl.constexpr, SPLIT8: tl.constexpr,
                 BF16_STATE: tl.constexpr, INT8_STATE: tl.constexpr, INT4_STATE: tl.constexpr, SR: tl.constexpr):
    """One block of tensor ``t`` (a Row) with scalars ``s``, from element ``first`` to at most
    ``end``: ``mask`` is None for a full block. The state is read and written in the
    encodings the row names (``_compact_state``); the math between is the same for all.

    [note: loads first] Every load is issued before any math, so the block waits for memory once
    (the round trips overlap) instead of once per dependent value.
    """
    g = load_f32(t.grad, t.grad_dtype, offs, mask, ALIGNED)
    w, m, v, v_max = _load_state(t, param_dtype, offs, mask, first, end, s.amsgrad, ALIGNED, SPLIT16, SPLIT8,
                                   BF16_STATE, INT8_STATE, INT4_STATE)
    if WRITE_GRAD:
        store_f32(t.grad, t.grad_dtype, offs, g * s.unscale, mask, ALIGNED)
    g = g * s.factor
    if s.maximize:
        g = g * -1.0  # Triton's unary minus is 0 - x, which loses the sign of zero that torch's neg keeps

    w = w * s.decay
    # exp_avg.lerp_(g, 1 - beta1): torch computes self + w * (end - self) for |w| < 0.5, else
    # end - (end - self) * (1 - w), as one FMA on CPU and GPU.
    # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2): addcmul is fma((1 - beta2) * g, g, v).
    # The interpreter's tl.fma rounds twice; there it is done in fp64 (the fp32 product is exact in
    # fp64), which rounds once up to a double-rounding tie (~2^-29 of the time).
    if s.lerp_from_m:
        lerp_base = m
    else:
        lerp_base = g
    lerp_scale = s.lerp_scale
    if EMULATE_FMA:
        m = (lerp_scale.to(tl.float64) * (g - m).to(tl.float64) + lerp_base.to(tl.float64)).to(tl.float32)
        v = ((s.one_minus_beta2 * g).to(tl.float64) * g.to(tl.float64) + (v * s.beta2).to(tl.float64)).to(tl.float32)
    else:
        m = tl.fma(lerp_scale, g - m, lerp_base)
        v = tl.fma(s.one_minus_beta2 * g, g, v * s.beta2)
    if s.amsgrad:
        v_max = tl.maximum(v_max, v, propagate_nan=tl.PropagateNan.ALL)
        root = tl.sqrt_rn(v_max)
    else:
        root = tl.sqrt_rn(v)
    denom = tl.div_rn(root, s.bias_correction2_sqrt) + s.eps
    w = w + tl.div_rn(m * s.neg_step_size, denom)
    _store_state(t, param_dtype, offs, mask, first, end, rk, s.amsgrad, w, m, v, v_max, ALIGNED, SPLIT16,
                   SPLIT8, BF16_STATE, INT8_STATE, INT4_STATE, SR)


@triton.jit
def _chunk_update(start, end, t, s, rk, param_dtype, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                  EMULATE_FMA: tl.constexpr, WRITE_GRAD: tl.constexpr, SPLIT16: tl.constexpr, SPLIT8: tl.constexpr,
                  BF16_STATE: tl.constexpr, INT8_STATE: tl.constexpr, INT4_STATE: tl.constexpr, SR: tl.constexpr):
    """Elements [start, end) of tensor ``t``: full blocks unmasked (chunks start on BLOCK multiples), then the tail."""
    full_end = start + (end - start) // BLOCK * BLOCK
    first = start
    while first < full_end:
        offs = tl.max_contiguous(tl.multiple_of(first + tl.arange(0, BLOCK), BLOCK), BLOCK)
        _adamw_block(offs, None, first, end, t, s, rk, param_dtype, ALIGNED, EMULATE_FMA, WRITE_GRAD, SPLIT16, SPLIT8,
                     BF16_STATE, INT8_STATE, INT4_STATE, SR)
        first += BLOCK
    if full_end < end:
        offs = full_end + tl.arange(0, BLOCK)
        _adamw_block(offs, offs < end, full_end, end, t, s, rk, param_dtype, ALIGNED, EMULATE_FMA, WRITE_GRAD, SPLIT16,
                     SPLIT8, BF16_STATE, INT8_STATE, INT4_STATE, SR)


@triton.jit
def _program_update(start, end, t, s, rk, aligned, param_dtype, BLOCK: tl.constexpr, EMULATE_FMA: tl.constexpr,
                    WRITE_GRAD: tl.constexpr, SPLIT16: tl.constexpr, SPLIT8: tl.constexpr, BF16_STATE: tl.constexpr,
                    INT8_STATE: tl.constexpr, INT4_STATE: tl.constexpr, SR: tl.constexpr):
    """The program's chunk, with 16-byte alignment hints when its tensor is aligned: a per-tensor
    fact, uniform per program (see [note: alignment per tensor])."""
    if aligned:
        _chunk_update(start, end, t, s, rk, param_dtype, BLOCK, True, EMULATE_FMA, WRITE_GRAD, SPLIT16, SPLIT8,
                      BF16_STATE, INT8_STATE, INT4_STATE, SR)
    else:
        _chunk_update(start, end, t, s, rk, param_dtype, UNALIGNED_BLOCK, False, EMULATE_FMA, WRITE_GRAD, SPLIT16,
                      SPLIT8, BF16_STATE, INT8_STATE, INT4_STATE, SR)


@triton.jit
def _ragged_update(start, end, row_numel, t, s, rk, param_dtype, EMULATE_FMA: tl.constexpr, WRITE_GRAD: tl.constexpr,
                   SPLIT16: tl.constexpr, SPLIT8: tl.constexpr, BF16_STATE: tl.constexpr, INT8_STATE: tl.constexpr,
                   INT4_STATE: tl.constexpr, SR: tl.constexpr):
    """int8 / int4 moments whose rows are no whole number of blocks ([note: blocks in rows]): ``[start, end)``
    counts elements of rows padded to whole blocks; each block is one SCALE_BLOCK tile at its row's
    elements, masked past the row's end, whose scale is the block's index (``first`` of the tile in
    the padded count: the scale index ``_compact_state`` takes)."""
    per_row = (row_numel + SCALE_BLOCK - 1) // SCALE_BLOCK
    lanes = tl.arange(0, SCALE_BLOCK)
    block = start // SCALE_BLOCK
    while block < end // SCALE_BLOCK:
        in_row = block % per_row * SCALE_BLOCK
        offs = block // per_row * row_numel + in_row + lanes
        _adamw_block(offs, lanes < row_numel - in_row, block * SCALE_BLOCK, (block + 1) * SCALE_BLOCK, t, s, rk,
                     param_dtype, False, EMULATE_FMA, WRITE_GRAD, SPLIT16, SPLIT8, BF16_STATE, INT8_STATE, INT4_STATE, SR)
        block += 1


@triton.jit
def _slot_lr(slot, lrs):
    """The fp64 lr of argument slot ``slot``, from its three exact fp32 parts ``lrs[3 * slot:]`` (see ``_split_f64``)."""
    hi = tl.where(slot == 0, lrs[0], tl.where(slot == 1, lrs[3], tl.where(slot == 2, lrs[6], lrs[9])))
    mid = tl.where(slot == 0, lrs[1], tl.where(slot == 1, lrs[4], tl.where(slot == 2, lrs[7], lrs[10])))
    lo = tl.where(slot == 0, lrs[2], tl.where(slot == 1, lrs[5], tl.where(slot == 2, lrs[8], lrs[11])))
    return hi.to(tl.float64) + mid.to(tl.float64) + lo.to(tl.float64)


@triton.jit
def _group_lr(group, lrs):
    """The group's lr in fp64: a value, an argument slot, or a tensor read in its own dtype."""
    lr_kind = tl.load(group + G_LR_KIND)
    lr = tl.load(group + G_LR).to(tl.float64, bitcast=True)
    if lr_kind == LR_F32:
        lr = tl.load(tl.load(group + G_LR_PTR).to(tl.pointer_type(tl.float32))).to(tl.float64)
    elif lr_kind == LR_F64:
        lr = tl.load(tl.load(group + G_LR_PTR).to(tl.pointer_type(tl.float64)))
    elif lr_kind == LR_F16:
        lr = tl.load(tl.load(group + G_LR_PTR).to(tl.pointer_type(tl.float16))).to(tl.float64)
    elif lr_kind == LR_BF16:  # exact widening by bits (see _memory.py)
        bits = tl.load(tl.load(group + G_LR_PTR).to(tl.pointer_type(tl.uint16)))
        lr = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(tl.float64)
    elif lr_kind == LR_SLOT:
        lr = _slot_lr(tl.load(group + G_LR_PTR), lrs)
    return lr


@triton.jit
def _scalars(row, groups, stats_ptr, grad_scale_ptr, lrs, WRITE_GRAD: tl.constexpr):
    """The Scalars of the program's tensor: in fp64, as torch computes them from Python floats or
    fp64 tensors, then rounded to fp32 where torch's fp32 kernels round them."""
    group = groups + tl.load(row + U_GROUP) * G_SIZE
    lr = _group_lr(group, lrs)
    beta1 = tl.load(group + G_BETA1).to(tl.float64, bitcast=True)
    beta2 = tl.load(group + G_BETA2).to(tl.float64, bitcast=True)
    eps = tl.load(group + G_EPS).to(tl.float64, bitcast=True).to(tl.float32)
    weight_decay = tl.load(group + G_WEIGHT_DECAY).to(tl.float64, bitcast=True)
    flags = tl.load(group + G_FLAGS)
    step = tl.load(tl.load(row + U_STEP).to(tl.pointer_type(tl.float32))) + 1.0
    bias_correction1, bias_correction2_sqrt = _bias_corrections(beta1, beta2, step)
    factor = tl.load(stats_ptr + FACTOR)
    unscale = factor * 0.0 + 1.0  # a run-time 1.0: a tuple would make a constant a run-time value anyway
    if WRITE_GRAD:  # torch's reciprocal of the scale: in fp64, rounded to fp32
        unscale = (1.0 / tl.load(grad_scale_ptr).to(tl.float64)).to(tl.float32)
    lerp_weight = (1.0 - beta1).to(tl.float32)
    lerp_from_m = lerp_weight < 0.5
    lerp_scale = tl.where(lerp_from_m, lerp_weight, lerp_weight - 1.0)
    return Scalars((flags & FLAG_AMSGRAD) != 0, (flags & FLAG_MAXIMIZE) != 0, factor, unscale,
                   (1.0 - lr * weight_decay).to(tl.float32), lerp_from_m, lerp_scale, beta2.to(tl.float32),
                   (1.0 - beta2).to(tl.float32), bias_correction2_sqrt.to(tl.float32), eps,
                   (lr / bias_correction1 * -1.0).to(tl.float32))  # neg_step_size: -0.0 when lr == 0, as in torch


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])  # a new seed every step must not recompile
def _adamw_update_kernel(rows, chunks, groups, stats_ptr, grad_scale_ptr, retired_ptr, n_tensors, lrs, seed_lo, seed_hi,
                         BLOCK: tl.constexpr, CHUNK: tl.constexpr, TABLE_BLOCK: tl.constexpr, EMULATE_FMA: tl.constexpr,
                         WRITE_GRAD: tl.constexpr = False, SPLIT16: tl.constexpr = False, SPLIT8: tl.constexpr = False,
                         BF16_STATE: tl.constexpr = False, CODE_BITS: tl.constexpr = 0, SR: tl.constexpr = False):
    """One program per chunk (``chunks``: tensor index, first element); ``lrs``: the float lrs of the
    argument slots, three fp32 parts each ([note: group table]). The compact constexprs say which
    encodings the launch can meet (``CODE_BITS``: the blockwise codes, 8 for int8, 4 for int4, 12 for
    both): a launch without compact state compiles to the plain kernel."""
    INT8_STATE: tl.constexpr = (CODE_BITS & 8) != 0
    INT4_STATE: tl.constexpr = (CODE_BITS & 4) != 0
    # early exit: a skipped step writes nothing at all (state stays bitwise unchanged)
    if tl.load(stats_ptr + SKIP) == 0:
        pid = tl.program_id(0)
        tensor = tl.load(chunks + 2 * pid)
        start = tl.load(chunks + 2 * pid + 1)
        row = rows + tensor * U_SIZE
        s = _scalars(row, groups, stats_ptr, grad_scale_ptr, lrs, WRITE_GRAD)
        t = Row(tl.load(row + U_PARAM), tl.load(row + U_GRAD), tl.load(row + U_GRAD_DTYPE), tl.load(row + U_EXP_AVG),
                tl.load(row + U_EXP_AVG_SQ), tl.load(row + U_MAX_EXP_AVG_SQ), tl.load(row + U_MASTER),
                tl.load(row + U_MASTER_KIND), tl.load(row + U_MOMENT_KIND), tl.load(row + U_EXP_AVG_SCALES),
                tl.load(row + U_EXP_AVG_SQ_SCALES), tl.load(row + U_MAX_EXP_AVG_SQ_SCALES))
        numel = tl.load(row + U_NUMEL)
        row_numel = tl.load(row + U_ROW_NUMEL)
        # [note: blocks in rows] int8 / int4 blocks start at every row: rows that are no whole number
        # of blocks are chunked in rows padded to whole blocks (see _update_rows.work_numel) and stepped
        # one block at a time (_ragged_update); everything else in the tensor's own elements
        blockwise = (INT8_STATE and t.moment_kind == MOMENT_INT8) or (INT4_STATE and t.moment_kind == MOMENT_INT4)
        ragged = blockwise and row_numel % SCALE_BLOCK != 0 and row_numel != numel
        padded_row = (row_numel + SCALE_BLOCK - 1) // SCALE_BLOCK * SCALE_BLOCK
        end = tl.minimum(start + CHUNK, numel)
        first = start
        if ragged:
            end = tl.minimum(start + CHUNK, numel // row_numel * padded_row)
            first = start // padded_row * row_numel + start % padded_row
        rk = CS.no_rounding_key(start * 0)
        if SR:  # [note: rounding bits] in ampfused/_contract.py: the tensor's position in the step, the element's in the tensor
            rk = CS.rounding_key(seed_lo, seed_hi, tl.load(row + U_INDEX), first, tl.load(row + U_ELEMENT_BASE))
        aligned = tl.load(row + U_ALIGNED) != 0
        param_dtype = tl.load(row + U_PARAM_DTYPE)
        # [note: split masters per program] a tensor's master is split or not, and its param fp16
        # or bf16, for the whole program: deciding both here (the dtype code becomes a constexpr)
        # keeps those branches, and the registers they hold, out of the block loop. The split
        # loops are compiled only for launches with split masters.
        if (INT8_STATE or INT4_STATE) and ragged:
            if (SPLIT16 or SPLIT8) and t.master_kind != MASTER_F32:
                if SPLIT8 and param_dtype == DTYPE_F16:
                    _ragged_update(start, end, row_numel, t, s, rk, DTYPE_F16, EMULATE_FMA, WRITE_GRAD, False, SPLIT8,
                                   BF16_STATE, INT8_STATE, INT4_STATE, SR)
                else:
                    _ragged_update(start, end, row_numel, t, s, rk, DTYPE_BF16, EMULATE_FMA, WRITE_GRAD, SPLIT16, SPLIT8,
                                   BF16_STATE, INT8_STATE, INT4_STATE, SR)
            else:
                _ragged_update(start, end, row_numel, t, s, rk, param_dtype, EMULATE_FMA, WRITE_GRAD, False, False,
                               BF16_STATE, INT8_STATE, INT4_STATE, SR)
        elif (SPLIT16 or SPLIT8) and t.master_kind != MASTER_F32:
            if SPLIT8 and param_dtype == DTYPE_F16:  # fp16: split8 only
                _program_update(start, end, t, s, rk, aligned, DTYPE_F16, BLOCK, EMULATE_FMA, WRITE_GRAD, False,
                                SPLIT8, BF16_STATE, INT8_STATE, INT4_STATE, SR)
            else:
                _program_update(start, end, t, s, rk, aligned, DTYPE_BF16, BLOCK, EMULATE_FMA, WRITE_GRAD, SPLIT16,
                                SPLIT8, BF16_STATE, INT8_STATE, INT4_STATE, SR)
        else:
            _program_update(start, end, t, s, rk, aligned, param_dtype, BLOCK, EMULATE_FMA, WRITE_GRAD, False, False,
                            BF16_STATE, INT8_STATE, INT4_STATE, SR)

        # Steps advance last: every program of a tensor reads its step counter above, so no
        # program may advance it early: each takes a ticket when done, and the program holding the
        # last ticket advances every counter and resets the ticket counter for the next launch.
        tl.debug_barrier()
        ticket = tl.atomic_add(retired_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            table_first = tl.program_id(0) * 0  # a run-time zero even when n_tensors == 1 is specialized to a constant
            while table_first < n_tensors:
                idx = table_first + tl.arange(0, TABLE_BLOCK)
                in_range = idx < n_tensors
                step_ptrs = tl.load(rows + idx.to(tl.int64) * U_SIZE + U_STEP, mask=in_range, other=0).to(tl.pointer_type(tl.float32))
                tl.store(step_ptrs, tl.load(step_ptrs, mask=in_range, other=0.0, volatile=True) + 1.0, mask=in_range)
                table_first += TABLE_BLOCK
            tl.store(retired_ptr, 0)


def _split_f64(x: float) -> tuple[float, float, float]:
    """Three fp32 values whose fp64 sum is exactly ``x`` (72 bits of mantissa hold its 53).

    Triton passes Python floats as fp32 kernel arguments; an lr that a
    scheduler changes every step travels this way, so no table is uploaded for it.
    """
    hi = _f32(x)
    mid = _f32(x - hi)
    return hi, mid, _f32(x - hi - mid)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0] if abs(x) < 3.4e38 else x


@_runtime.launches_on(lambda batch, stats, **kwargs: stats.device)
def adamw_update_(batch, stats: Tensor, *, scratch=None, grad_scale: Tensor | None = None,
                  rounding_seed: int | None = None) -> None:
    """One AdamW step over every tensor of ``batch`` in one launch; see ``ampfused._backends.Backend`` for
    the contract (``batch`` is an ``ampfused._batch.Batch``, read by its fields: this package
    imports nothing of ampfused).

    Compact state (``COMPACT_MODES``) is told by the dtypes of ``masters`` and the moments
    (docs/design.md §9, "told by dtypes"; read here through MASTER_KIND_OF_DTYPE; int4 codes need the
    param contiguous), with block scales in ``moment_scales[i]``.
    ``rounding_seed`` (an int) rounds the bf16 writes without an exact master stochastically.
    ``grad_scale`` comes as the caller normalised it (a 1-element fp32 tensor on the params' device).
    ``scratch``: the caller's counters, and a memo of its tables: while it passes the same lists,
    a step reads the grads' addresses and the group values only ([note: host time] in ``ampfused/_plan.py``).
    """
    params, grads = batch.params, batch.grads
    if not params:
        return
    device = params[0].device
    group_of, group_keys, slot_lrs, keep_alive = _group_rows(batch.group_ids, batch.groups, batch.lr_kinds, device)
    lists = (params, batch.exp_avgs, batch.exp_avg_sqs, batch.max_exp_avg_sqs, batch.steps, batch.masters,
             batch.moment_scales, batch.index, batch.element_base)
    memo = scratch.memo.get(("update", device)) if scratch is not None else None
    rows = None
    if memo is not None and memo[2] == group_of and all(map(operator.is_, memo[0], lists)):
        rows = memo[3].for_grads(grads)
    kernel_grads = grads  # a memoized table reads the grads as they are
    if rows is not None:
        layout, variant = memo[1], memo[4]
    else:
        layout, rows, kernel_grads, variant = _update_rows.tables_of(lists, grads, group_of, group_keys, device, scratch)  # (copies live past the launch)
    split16, split8, bf16_state, int8_state, int4_state, bare_bf16 = variant
    stochastic = rounding_seed is not None and (bf16_state or bare_bf16)
    seed = int(rounding_seed) if stochastic else 0
    groups = _tables.cached("groups", ("groups", device, group_keys), device,
                            lambda: _build_group_table(group_keys, device, keep_alive))
    lr_args = [part for lr in slot_lrs + [0.0] * (LR_SLOTS - len(slot_lrs)) for part in _split_f64(lr)]
    _, counter, _ = _tables.scratch_views(scratch, device)
    _runtime.launch(_adamw_update_kernel, (layout.n_chunks,))(
        rows.rows, layout.chunks, groups[0], stats, grad_scale if grad_scale is not None else stats, counter,
        rows.n_tensors, tuple(lr_args), seed & _SEED_WORD, (seed >> int(ROUNDING_SEED_BITS)) & _SEED_WORD,
        BLOCK=_runtime.UPDATE_BLOCK, CHUNK=_runtime.CHUNK, TABLE_BLOCK=_runtime.TABLE_BLOCK,
        EMULATE_FMA=device.type == "cpu", WRITE_GRAD=grad_scale is not None, num_warps=_runtime.NUM_WARPS,
        **_compact_constexprs(split16, split8, bf16_state, int8_state, int4_state, stochastic),
        **({"maxnreg": _runtime.UPDATE_MAXNREG} if _runtime.UPDATE_MAXNREG else {}),
        # No implicit FMA: torch runs decay, moments and update as separate rounding ops; the
        # kernel uses tl.fma exactly where torch's kernels fuse (lerp, addcmul) and nowhere else.
        # Fusion off is also what keeps `beta * 0.0 + 1.0` (a run-time fp64 one) exact; the kernel
        # tests no finiteness itself (stats[SKIP] comes from the stats pass). tests/contract/sm90_compile.py
        # checks that its PTX has only .rn (never contracted) fp mul/add/sub.
        enable_fp_fusion=False)
    if grad_scale is not None:  # a re-laid-out copy got the unscaled gradient: hand it to the caller's grad
        for g, kernel_grad in zip(grads, kernel_grads):
            if kernel_grad is not g:
                g.copy_(kernel_grad.reshape(g.shape))


_SEED_WORD = (1 << int(ROUNDING_SEED_BITS)) - 1  # [note: rounding bits]: int32 arguments, no recompile per seed


def _compact_constexprs(split16, split8, bf16_state, int8_state, int4_state, stochastic) -> dict:
    """The launch's compact constexprs, only those set: a plain launch passes none and compiles as
    the kernel without compact state."""
    flags = {name: True for name, on in dict(SPLIT16=split16, SPLIT8=split8, BF16_STATE=bf16_state, SR=stochastic).items() if on}
    code_bits = (8 if int8_state else 0) | (4 if int4_state else 0)
    return {**flags, "CODE_BITS": code_bits} if code_bits else flags


def _group_rows(group_ids, groups, lr_kinds, device):
    """(group index of every tensor, the distinct group keys, the float lrs of the argument slots,
    tensors those keys point into).

    [note: group table] A group key is the *value* of a hyperparameter set, without a float lr:
    the first LR_SLOTS distinct float lrs (or lr tensors on the CPU, read on the host: no device
    sync) are kernel arguments, so a scheduler that assigns a new float every step uploads
    nothing; only further distinct float lrs are part of the key (a rare re-upload, no sync). An
    lr tensor on the params' device is in the key as its address: the kernel reads its current
    value, so in-place scheduler updates and CUDA-graph replays see the new value. The caller's
    groups map onto the keys one to one unless two have equal keys (then their rows are shared);
    Python per group, never per tensor ([note: host time]).
    """
    index_of_key: dict[tuple, int] = {}
    slot_of_lr: dict[float, int] = {}
    keep_alive: list[Tensor] = []
    key_index = [index_of_key.setdefault(_group_key(h, kind, device, keep_alive, slot_of_lr), len(index_of_key))
                 for h, kind in zip(groups, lr_kinds)]
    group_of = tuple(group_ids) if len(index_of_key) == len(groups) else tuple(map(key_index.__getitem__, group_ids))
    return group_of, tuple(index_of_key), list(slot_of_lr), keep_alive


def _group_key(h, kind, device, keep_alive, slot_of_lr) -> tuple:
    """The group row of ``h``, its lr read as ``kind`` (the batch's ``lr_kinds``: [note: lr kinds] in ampfused/_batch.py)."""
    lr = h.lr
    if kind != int(LR_VALUE):
        # read in its own dtype by the kernel: no cast temporary, which a captured CUDA graph would
        # replay into after the table cache dropped it. Where the tensor is not what its kind reads
        # (on another device, or of a dtype the kernels do not read: lr_kind chose LR_F32), the kernel
        # reads a float32 copy on the device, which lives as long as the table.
        if lr.device != device or LR_KIND_OF_DTYPE.get(lr.dtype) != kind:
            lr = lr.to(device=device, dtype=torch.float32)
            keep_alive.append(lr)
        value, addr = 0.0, lr.data_ptr()
    else:
        value, addr = float(lr), 0  # a number, or a tensor in host memory: no device sync
        slot = slot_of_lr.get(value)
        if slot is None and len(slot_of_lr) < LR_SLOTS:
            slot = slot_of_lr[value] = len(slot_of_lr)
        if slot is not None:
            kind, value, addr = int(LR_SLOT), 0.0, slot
    # the caller's group row is converted already (ampfused._batch.Hyper): its values go in as they are
    return GroupRow(value, h.beta1, h.beta2, h.eps, h.weight_decay, addr, kind, h.flags)


class GroupRow(NamedTuple):
    """One row of the group table: ``ampfused._contract.UPDATE_GROUP``'s fields, in its order (the
    lr resolved to its kind: a slot, a tensor's address, or the value)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    lr_ptr: int
    lr_kind: int
    flags: int


def _build_group_table(keys, device, keep_alive):
    host = torch.empty(len(keys), int(G_SIZE), dtype=torch.int64)
    floats = torch.tensor([k[:5] for k in keys], dtype=torch.float64).view(torch.int64)
    for j, column in enumerate((G_LR, G_BETA1, G_BETA2, G_EPS, G_WEIGHT_DECAY)):
        host[:, int(column)] = floats[:, j]
    ints = torch.tensor([k[5:] for k in keys], dtype=torch.int64)
    for j, column in enumerate((G_LR_PTR, G_LR_KIND, G_FLAGS)):
        host[:, int(column)] = ints[:, j]
    table, pinned = _tables.upload(host, device)
    return table, pinned, keep_alive
