"""Loads and stores of the update pass's compact optimizer state (DESIGN §9), and the rounding bits.

The update kernel (``adamw.py``) reads a block of state through the tensor's row (``adamw.Row``),
decoded to fp32 here when it is compact, runs the fp32 math, and encodes it back with the functions
of ``compact.py`` (tested bitwise against ``ampfused/_compact.py``). Which encoding a tensor uses is
a per-row code of the row table, uniform within a program; which encodings a launch can meet are
constexprs, so a launch without compact tensors compiles to the plain kernel and never comes here.

[note: int8 blocks] int8 moments have one scale per SCALE_BLOCK consecutive elements. Chunks and
blocks start on multiples of it within a tensor, so a block holds whole scale blocks: decode with
the old scales (each element reads its own), update, take the new block maxima (NaN-propagating,
as ``amax``) over a [BLOCK // SCALE_BLOCK, SCALE_BLOCK] view, encode, store codes and scales.
Elements past the end of the tensor count as 0, as the specification's padding. The block itself
stays 1-D with the contiguity hints of every other block: a 2-D tile carries none, and the
compiler then moves every tensor of the launch with scalar accesses.

[note: int4 blocks] int4 moments have int8's blocks and scales, and two codes a byte ([note: int4
packing] in ``ampfused/_contract.py``). Blocks, chunks and rows start on even elements, so a block's
codes are whole bytes: a full block's are the BLOCK / 2 bytes from element ``first`` / 2, which each
thread moves in one access (its 4 elements' 2 bytes); a masked block (a tail, a block of a ragged
row, whose elements do not follow ``first``) addresses them from its even lanes. The bytes are split
into nibbles and joined in element order (element 2i the low nibble of byte i), stored the other way
round; ``compact.py`` decodes and encodes the codes.

Stochastic rounding takes 16 bits per write from the one counter-based hash of (seed,
tensor index, element index in the whole tensor), [note: rounding bits] in ``ampfused/_contract.py``:
a per-program key (``rounding_key``), then two words per element (``random_words``). Integer-only, so the interpreter
gives the GPU's bits, and the reference, CPU and CUDA backends draw the same ones.
"""
from collections import namedtuple

import triton
import triton.language as tl

from . import compact as K
from ._contract_generated import (DTYPE_F16, SCALE_BLOCK, MASTER_SPLIT16, MOMENT_BF16, MOMENT_F32, MOMENT_INT8,
                                  SR_KEY_SALT, SR_MIX_MUL1, SR_MIX_MUL2, SR_WORD0_SALT, SR_WORD1_SALT)
from ._memory import typed_ptr


@triton.jit
def mix32(x):
    """lowbias32: a bijective avalanche of uint32 ``x``."""
    x = x ^ (x >> 16)
    x = x * SR_MIX_MUL1
    x = x ^ (x >> 15)
    x = x * SR_MIX_MUL2
    return x ^ (x >> 15)


# A program's stochastic-rounding key: the key of the high word of its elements' indices in the whole
# tensor (one for the whole program: a tensor whose local elements' indices cross a multiple of 2^32
# steps in the reference passes: fallback_indices in ampfused/functional.py), and the low word of the local
# tensor's first element's index there (a DTensor shard's offset, ``U_ELEMENT_BASE``).
RoundingKey = namedtuple("RoundingKey", ["key", "base_lo"])


@triton.jit
def rounding_key(seed_lo, seed_hi, tensor, start, base):
    """The :data:`RoundingKey` of a program whose elements start at local element ``start``: from
    (seed words, the tensor's index in the step's lists, high word of the global element index)."""
    key = mix32(tensor.to(tl.uint32) + SR_KEY_SALT)
    key = mix32(key ^ seed_lo.to(tl.uint32))
    key = mix32(key ^ seed_hi.to(tl.uint32))
    return RoundingKey(mix32(key ^ ((base + start) >> 32).to(tl.uint32)), base.to(tl.uint32))


@triton.jit
def no_rounding_key(zero):
    return RoundingKey(zero.to(tl.uint32), zero.to(tl.uint32))


@triton.jit
def random_words(offs, rk, SECOND: tl.constexpr):
    """(word0, word1) of 32 random bits for local elements ``offs`` under the :data:`RoundingKey` ``rk``;
    word1 only when SECOND (else 0)."""
    y = mix32((offs.to(tl.uint32) + rk.base_lo) ^ rk.key)
    word0 = mix32(y ^ SR_WORD0_SALT)
    word1 = word0 * 0
    if SECOND:
        word1 = mix32(y ^ SR_WORD1_SALT)
    return word0, word1


@triton.jit
def _load_bf16(addr, offs, mask, ALIGNED: tl.constexpr):
    bits_ptr = typed_ptr(addr, tl.uint16, 8, ALIGNED)
    return (tl.load(bits_ptr + offs, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _block_scales(scale_addr, offs, first, end):
    """Each element's scale: the block's scale blocks' scales as scalars, spread by a select (a
    per-element gather would hold a 64-bit address per element: [note: int8 blocks])."""
    scale_ptr = scale_addr.to(tl.pointer_type(tl.float32)) + first // SCALE_BLOCK
    scale = tl.load(scale_ptr)
    for j in tl.static_range(1, offs.shape[0] // SCALE_BLOCK):
        scale = tl.where(offs >= first + j * SCALE_BLOCK,
                         tl.load(scale_ptr + j, mask=first + j * SCALE_BLOCK < end, other=0.0), scale)
    return scale


@triton.jit
def _load_int8(addr, scale_addr, offs, mask, first, end, ALIGNED: tl.constexpr, SIGNED: tl.constexpr):
    if SIGNED:
        code = tl.load(typed_ptr(addr, tl.int8, 4, ALIGNED) + offs, mask=mask).to(tl.int32)
    else:
        code = tl.load(typed_ptr(addr, tl.uint8, 4, ALIGNED) + offs, mask=mask).to(tl.int32)
    scale = _block_scales(scale_addr, offs, first, end)
    if SIGNED:
        x = K.decode_exp_avg(code, scale)
    else:
        x = K.decode_exp_avg_sq(code, scale)
    return x


@triton.jit
def _even_lanes(x):
    """Lanes 0, 2, 4, .. of the block ``x``: those that start the pairs of int4 codes."""
    even, _ = tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))
    return even


@triton.jit
def _packed_ptrs(addr, offs, mask, first, ALIGNED: tl.constexpr):
    """Pointers to the bytes that hold the block's int4 codes ([note: int4 blocks]); a masked block
    masks them with ``_even_lanes(mask)``."""
    if mask is None:  # a full block: elements first .. first + BLOCK, bytes from first / 2
        PAIRS: tl.constexpr = offs.shape[0] // 2
        byte = tl.max_contiguous(tl.multiple_of(first // 2 + tl.arange(0, PAIRS), PAIRS), PAIRS)
    else:  # a tail or a ragged row's block: its pairs' even elements (rows are of even length)
        byte = _even_lanes(offs) // 2
    return typed_ptr(addr, tl.uint8, 2, ALIGNED) + byte


@triton.jit
def _load_int4(addr, scale_addr, offs, mask, first, end, ALIGNED: tl.constexpr, SIGNED: tl.constexpr):
    ptrs = _packed_ptrs(addr, offs, mask, first, ALIGNED)
    if mask is None:
        packed = tl.load(ptrs).to(tl.int32)
    else:
        packed = tl.load(ptrs, mask=_even_lanes(mask)).to(tl.int32)
    code = tl.reshape(tl.join(packed & 15, packed >> 4), offs.shape)  # element 2i: low nibble of byte i
    scale = _block_scales(scale_addr, offs, first, end)
    if SIGNED:
        x = K.decode_exp_avg4(code, scale)
    else:
        x = K.decode_exp_avg_sq4(code, scale)
    return x


@triton.jit
def _load_blockwise(addr, kind, scale_addr, offs, mask, first, end, ALIGNED: tl.constexpr, INT8: tl.constexpr,
                    INT4: tl.constexpr, SIGNED: tl.constexpr):
    if INT8 and INT4:
        if kind == MOMENT_INT8:
            x = _load_int8(addr, scale_addr, offs, mask, first, end, ALIGNED, SIGNED)
        else:
            x = _load_int4(addr, scale_addr, offs, mask, first, end, ALIGNED, SIGNED)
    elif INT8:
        x = _load_int8(addr, scale_addr, offs, mask, first, end, ALIGNED, SIGNED)
    else:
        x = _load_int4(addr, scale_addr, offs, mask, first, end, ALIGNED, SIGNED)
    return x


@triton.jit
def load_moment(addr, kind, scale_addr, offs, mask, first, end, ALIGNED: tl.constexpr, BF16: tl.constexpr,
                INT8: tl.constexpr, INT4: tl.constexpr, SIGNED: tl.constexpr):
    """fp32 values of a moment stored as fp32, bf16 (``BF16``), int8 (``INT8``) or int4 (``INT4``)
    codes + scales of the block from element ``first`` (elements from ``end`` on are masked)."""
    if kind == MOMENT_F32:
        x = tl.load(typed_ptr(addr, tl.float32, 16, ALIGNED) + offs, mask=mask)
    else:
        if BF16 and (INT8 or INT4):
            if kind == MOMENT_BF16:
                x = _load_bf16(addr, offs, mask, ALIGNED)
            else:
                x = _load_blockwise(addr, kind, scale_addr, offs, mask, first, end, ALIGNED, INT8, INT4, SIGNED)
        elif BF16:
            x = _load_bf16(addr, offs, mask, ALIGNED)
        else:
            x = _load_blockwise(addr, kind, scale_addr, offs, mask, first, end, ALIGNED, INT8, INT4, SIGNED)
    return x


@triton.jit
def store_bf16(addr, offs, mask, x, rand, ALIGNED: tl.constexpr, SR: tl.constexpr):
    bits_ptr = typed_ptr(addr, tl.uint16, 8, ALIGNED)
    if SR:
        bits = K.bf16_sr_bits(x, rand)
    else:
        bits = K.bf16_rne_bits(x)
    tl.store(bits_ptr + offs, bits.to(tl.uint16), mask=mask)


@triton.jit
def _new_scales(scale_addr, first, end, value):
    """Store the block's new scales, the maxima of ``|value|`` over its scale blocks, and return each
    element's. The block's [GROUPS, SCALE_BLOCK] view only for the maxima ([note: int8 blocks])."""
    # With the sign bit cleared, the int32 bit patterns are the magnitudes', which order as the
    # floats do, NaN above inf (clearing it here rather than with abs, whose sign on a NaN PTX leaves
    # unspecified): their integer maximum is amax's NaN-propagating one, and a built-in max, which
    # the interpreter runs as one numpy reduce instead of a Python call per element
    GROUPS: tl.constexpr = value.shape[0] // SCALE_BLOCK
    bits = tl.reshape(value.to(tl.int32, bitcast=True) & 0x7FFFFFFF, (GROUPS, SCALE_BLOCK))
    scale = tl.max(bits, 1).to(tl.float32, bitcast=True)
    blocks = tl.arange(0, GROUPS)
    tl.store(scale_addr.to(tl.pointer_type(tl.float32)) + first // SCALE_BLOCK + blocks, scale,
             mask=first + blocks * SCALE_BLOCK < end)
    return tl.reshape(tl.broadcast_to(scale[:, None], (GROUPS, SCALE_BLOCK)), (GROUPS * SCALE_BLOCK,))


@triton.jit
def _store_int8(addr, scale_addr, offs, mask, first, end, x, ALIGNED: tl.constexpr, SIGNED: tl.constexpr):
    if SIGNED:
        value = x
    else:
        value = tl.sqrt_rn(x)
    if mask is not None:
        value = tl.where(mask, value, 0.0)
    scale = _new_scales(scale_addr, first, end, value)
    if SIGNED:
        tl.store(typed_ptr(addr, tl.int8, 4, ALIGNED) + offs, K.encode_exp_avg(x, scale).to(tl.int8), mask=mask)
    else:
        tl.store(typed_ptr(addr, tl.uint8, 4, ALIGNED) + offs, K.encode_exp_avg_sq(x, scale).to(tl.uint8), mask=mask)


@triton.jit
def _store_int4(addr, scale_addr, offs, mask, first, end, x, ALIGNED: tl.constexpr, SIGNED: tl.constexpr):
    if SIGNED:
        value = x
    else:
        value = tl.sqrt_rn(x)
    if mask is not None:
        value = tl.where(mask, value, 0.0)
    scale = _new_scales(scale_addr, first, end, value)
    if SIGNED:
        code = K.encode_exp_avg4(value, scale)
    else:
        code = K.encode_exp_avg_sq4(value, scale)
    even, odd = tl.split(tl.reshape(code, (offs.shape[0] // 2, 2)))
    packed = (even | (odd << 4)).to(tl.uint8)
    if mask is None:
        tl.store(_packed_ptrs(addr, offs, mask, first, ALIGNED), packed)
    else:
        tl.store(_packed_ptrs(addr, offs, mask, first, ALIGNED), packed, mask=_even_lanes(mask))


@triton.jit
def _store_blockwise(addr, kind, scale_addr, offs, mask, first, end, x, ALIGNED: tl.constexpr, INT8: tl.constexpr,
                     INT4: tl.constexpr, SIGNED: tl.constexpr):
    if INT8 and INT4:
        if kind == MOMENT_INT8:
            _store_int8(addr, scale_addr, offs, mask, first, end, x, ALIGNED, SIGNED)
        else:
            _store_int4(addr, scale_addr, offs, mask, first, end, x, ALIGNED, SIGNED)
    elif INT8:
        _store_int8(addr, scale_addr, offs, mask, first, end, x, ALIGNED, SIGNED)
    else:
        _store_int4(addr, scale_addr, offs, mask, first, end, x, ALIGNED, SIGNED)


@triton.jit
def store_moment(addr, kind, scale_addr, offs, mask, first, end, x, rand, ALIGNED: tl.constexpr,
                 BF16: tl.constexpr, INT8: tl.constexpr, INT4: tl.constexpr, SIGNED: tl.constexpr, SR: tl.constexpr):
    """Store fp32 ``x`` in the moment's encoding; bf16 rounds stochastically with the low 16 bits of
    ``rand`` when SR; int8 / int4 take new block maxima as scales (the block's, from element ``first``)."""
    if kind == MOMENT_F32:
        tl.store(typed_ptr(addr, tl.float32, 16, ALIGNED) + offs, x, mask=mask)
    else:
        if BF16 and (INT8 or INT4):
            if kind == MOMENT_BF16:
                store_bf16(addr, offs, mask, x, rand, ALIGNED, SR)
            else:
                _store_blockwise(addr, kind, scale_addr, offs, mask, first, end, x, ALIGNED, INT8, INT4, SIGNED)
        elif BF16:
            store_bf16(addr, offs, mask, x, rand, ALIGNED, SR)
        else:
            _store_blockwise(addr, kind, scale_addr, offs, mask, first, end, x, ALIGNED, INT8, INT4, SIGNED)


@triton.jit
def _join8(bits, residual, param_dtype):
    if param_dtype == DTYPE_F16:
        w = K.join8(bits, residual, True)
    else:
        w = K.join8(bits, residual, False)
    return w


@triton.jit
def load_split_master(t, param_dtype, offs, mask, ALIGNED: tl.constexpr, SPLIT16: tl.constexpr, SPLIT8: tl.constexpr):
    """fp32 master joined from the 16-bit param and its low half (split16) or int8 residual (split8)."""
    bits = tl.load(typed_ptr(t.param, tl.uint16, 8, ALIGNED) + offs, mask=mask).to(tl.uint32)
    if SPLIT16 and SPLIT8:
        if t.master_kind == MASTER_SPLIT16:
            w = K.join16(bits, tl.load(typed_ptr(t.master, tl.uint16, 8, ALIGNED) + offs, mask=mask).to(tl.uint32))
        else:
            w = _join8(bits, tl.load(typed_ptr(t.master, tl.int8, 4, ALIGNED) + offs, mask=mask).to(tl.int32),
                       param_dtype)
    elif SPLIT16:
        w = K.join16(bits, tl.load(typed_ptr(t.master, tl.uint16, 8, ALIGNED) + offs, mask=mask).to(tl.uint32))
    else:
        w = _join8(bits, tl.load(typed_ptr(t.master, tl.int8, 4, ALIGNED) + offs, mask=mask).to(tl.int32), param_dtype)
    return w


@triton.jit
def _store_split16(t, offs, mask, w, ALIGNED: tl.constexpr):
    hi, lo = K.split16(w)
    tl.store(typed_ptr(t.param, tl.uint16, 8, ALIGNED) + offs, hi.to(tl.uint16), mask=mask)
    tl.store(typed_ptr(t.master, tl.uint16, 8, ALIGNED) + offs, lo.to(tl.uint16), mask=mask)


@triton.jit
def _store_split8(t, param_dtype, offs, mask, w, ALIGNED: tl.constexpr):
    if param_dtype == DTYPE_F16:
        bits, q = K.split8(w, True)
    else:
        bits, q = K.split8(w, False)
    tl.store(typed_ptr(t.param, tl.uint16, 8, ALIGNED) + offs, bits.to(tl.uint16), mask=mask)
    tl.store(typed_ptr(t.master, tl.int8, 4, ALIGNED) + offs, q.to(tl.int8), mask=mask)


@triton.jit
def store_split_master(t, param_dtype, offs, mask, w, ALIGNED: tl.constexpr, SPLIT16: tl.constexpr, SPLIT8: tl.constexpr):
    """fp32 ``w`` split into the 16-bit param and its low half (split16) or int8 residual (split8)."""
    if SPLIT16 and SPLIT8:
        if t.master_kind == MASTER_SPLIT16:
            _store_split16(t, offs, mask, w, ALIGNED)
        else:
            _store_split8(t, param_dtype, offs, mask, w, ALIGNED)
    elif SPLIT16:
        _store_split16(t, offs, mask, w, ALIGNED)
    else:
        _store_split8(t, param_dtype, offs, mask, w, ALIGNED)
