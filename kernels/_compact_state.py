"""Loads and stores of compact optimizer state for the update pass (DESIGN §9).

The update kernel's compact variants (``adamw.py``) decode a block of state to fp32, run the fp32
math unchanged, and encode it back with the functions of ``compact.py`` (tested bitwise against
``ampfused/_compact.py``). Which encoding a tensor uses is a per-row code of the row table, uniform
within a program; which encodings a launch can meet are constexprs, so a launch without compact
tensors compiles to the plain kernel.

[note: int8 blocks] int8 moments have one scale per INT8_BLOCK consecutive elements. Chunks and
blocks start on multiples of it within a tensor, so a block of the int8 variant is a [BLOCK // INT8_BLOCK, INT8_BLOCK]
tile of whole scale blocks: decode with the old scales, update, take the new block maxima along
axis 1 (NaN-propagating, as ``amax``), encode, store codes and scales. Elements past the end of the
tensor count as 0, as the specification's padding.

Stochastic rounding takes 16 bits per write from the one counter-based hash of (seed,
tensor index, element index), [note: rounding bits] in ``ampfused/_contract.py``: a per-program key
(``rounding_key``), then two words per element (``random_words``). Integer-only, so the interpreter
gives the GPU's bits, and the reference, CPU and CUDA backends draw the same ones.
"""
import triton
import triton.language as tl

from . import compact as K
from ._contract_generated import (DTYPE_BF16, DTYPE_F16, MASTER_SPLIT16, MOMENT_BF16, MOMENT_F32, SR_KEY_SALT, SR_MIX_MUL1,
                                  SR_MIX_MUL2, SR_WORD0_SALT, SR_WORD1_SALT)
from ._memory import store_f32


@triton.jit
def mix32(x):
    """lowbias32: a bijective avalanche of uint32 ``x``."""
    x = x ^ (x >> 16)
    x = x * SR_MIX_MUL1
    x = x ^ (x >> 15)
    x = x * SR_MIX_MUL2
    return x ^ (x >> 15)


@triton.jit
def rounding_key(seed_lo, seed_hi, tensor, start):
    """Per-program key of the random bits: (seed words, the tensor's index in the step's lists, high word of the element index)."""
    key = mix32(tensor.to(tl.uint32) + SR_KEY_SALT)
    key = mix32(key ^ seed_lo.to(tl.uint32))
    key = mix32(key ^ seed_hi.to(tl.uint32))
    return mix32(key ^ (start >> 32).to(tl.uint32))


@triton.jit
def random_words(offs, key, SECOND: tl.constexpr):
    """(word0, word1) of 32 random bits for elements ``offs``; word1 only when SECOND (else 0)."""
    y = mix32(offs.to(tl.uint32) ^ key)
    word0 = mix32(y ^ SR_WORD0_SALT)
    word1 = word0 * 0
    if SECOND:
        word1 = mix32(y ^ SR_WORD1_SALT)
    return word0, word1


@triton.jit
def _typed_ptr(addr, DTYPE: tl.constexpr, ALIGN_BYTES: tl.constexpr, ALIGNED: tl.constexpr):
    """``addr`` as a pointer to DTYPE, hinted ALIGN_BYTES-aligned (4-element vectors) when ALIGNED."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, ALIGN_BYTES)
    return ptr


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _load_bf16(addr, offs, mask, ALIGNED: tl.constexpr):
    bits_ptr = _typed_ptr(addr, tl.uint16, 8, ALIGNED)
    return (tl.load(bits_ptr + offs, mask=mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_int8(addr, scale_addr, offs, mask, groups, group_mask, ALIGNED: tl.constexpr, SIGNED: tl.constexpr):
    if SIGNED:
        code_ptr = _typed_ptr(addr, tl.int8, 4, ALIGNED)
    else:
        code_ptr = _typed_ptr(addr, tl.uint8, 4, ALIGNED)
    code = tl.load(code_ptr + offs, mask=mask).to(tl.int32)
    scale = tl.load(scale_addr.to(tl.pointer_type(tl.float32)) + groups, mask=group_mask)[:, None]
    if SIGNED:
        x = K.decode_exp_avg(code, scale)
    else:
        x = K.decode_exp_avg_sq(code, scale)
    return x


@triton.jit
def load_moment(addr, kind, scale_addr, offs, mask, groups, group_mask, ALIGNED: tl.constexpr, BF16: tl.constexpr,
                INT8: tl.constexpr, SIGNED: tl.constexpr):
    """fp32 values of a moment stored as fp32, bf16 (``BF16``) or int8 codes + scales (``INT8``)."""
    if kind == MOMENT_F32:
        x = tl.load(_typed_ptr(addr, tl.float32, 16, ALIGNED) + offs, mask=mask)
    else:
        if BF16 and INT8:
            if kind == MOMENT_BF16:
                x = _load_bf16(addr, offs, mask, ALIGNED)
            else:
                x = _load_int8(addr, scale_addr, offs, mask, groups, group_mask, ALIGNED, SIGNED)
        elif BF16:
            x = _load_bf16(addr, offs, mask, ALIGNED)
        else:
            x = _load_int8(addr, scale_addr, offs, mask, groups, group_mask, ALIGNED, SIGNED)
    return x


@triton.jit
def _store_bf16(addr, offs, mask, x, rand, ALIGNED: tl.constexpr, SR: tl.constexpr):
    bits_ptr = _typed_ptr(addr, tl.uint16, 8, ALIGNED)
    if SR:
        bits = K.bf16_sr_bits(x, rand)
    else:
        bits = K.bf16_rne_bits(x)
    tl.store(bits_ptr + offs, bits.to(tl.uint16), mask=mask)


@triton.jit
def _store_int8(addr, scale_addr, offs, mask, groups, group_mask, x, ALIGNED: tl.constexpr, SIGNED: tl.constexpr):
    if SIGNED:
        magnitude = tl.abs(x)
    else:
        magnitude = tl.abs(tl.sqrt_rn(x))
    if mask is not None:
        magnitude = tl.where(mask, magnitude, 0.0)
    scale = tl.reduce(magnitude, 1, _max_nan)
    tl.store(scale_addr.to(tl.pointer_type(tl.float32)) + groups, scale, mask=group_mask)
    if SIGNED:
        tl.store(_typed_ptr(addr, tl.int8, 4, ALIGNED) + offs, K.encode_exp_avg(x, scale[:, None]).to(tl.int8), mask=mask)
    else:
        tl.store(_typed_ptr(addr, tl.uint8, 4, ALIGNED) + offs, K.encode_exp_avg_sq(x, scale[:, None]).to(tl.uint8),
                 mask=mask)


@triton.jit
def store_moment(addr, kind, scale_addr, offs, mask, groups, group_mask, x, rand, ALIGNED: tl.constexpr,
                 BF16: tl.constexpr, INT8: tl.constexpr, SIGNED: tl.constexpr, SR: tl.constexpr):
    """Store fp32 ``x`` in the moment's encoding; bf16 rounds stochastically with the low 16 bits of
    ``rand`` when SR; int8 takes new block maxima as scales ([note: int8 blocks])."""
    if kind == MOMENT_F32:
        tl.store(_typed_ptr(addr, tl.float32, 16, ALIGNED) + offs, x, mask=mask)
    else:
        if BF16 and INT8:
            if kind == MOMENT_BF16:
                _store_bf16(addr, offs, mask, x, rand, ALIGNED, SR)
            else:
                _store_int8(addr, scale_addr, offs, mask, groups, group_mask, x, ALIGNED, SIGNED)
        elif BF16:
            _store_bf16(addr, offs, mask, x, rand, ALIGNED, SR)
        else:
            _store_int8(addr, scale_addr, offs, mask, groups, group_mask, x, ALIGNED, SIGNED)


@triton.jit
def _join8(bits, residual, param_dtype):
    if param_dtype == DTYPE_F16:
        w = K.join8(bits, residual, True)
    else:
        w = K.join8(bits, residual, False)
    return w


@triton.jit
def _split_ptrs(param_addr, master_addr, ALIGNED: tl.constexpr):
    """The 16-bit param's bits and the master's int16 low half / int8 residual (one of the two is used)."""
    return (_typed_ptr(param_addr, tl.uint16, 8, ALIGNED), _typed_ptr(master_addr, tl.uint16, 8, ALIGNED),
            _typed_ptr(master_addr, tl.int8, 4, ALIGNED))


@triton.jit
def load_split_master(param_addr, param_dtype, master_addr, kind, offs, mask, ALIGNED: tl.constexpr,
                      SPLIT16: tl.constexpr, SPLIT8: tl.constexpr):
    """fp32 master joined from the 16-bit param and its int16 low half (split16) or int8 residual (split8)."""
    bits_ptr, low_ptr, residual_ptr = _split_ptrs(param_addr, master_addr, ALIGNED)
    bits = tl.load(bits_ptr + offs, mask=mask).to(tl.uint32)
    if SPLIT16 and SPLIT8:
        if kind == MASTER_SPLIT16:
            w = K.join16(bits, tl.load(low_ptr + offs, mask=mask).to(tl.uint32))
        else:
            w = _join8(bits, tl.load(residual_ptr + offs, mask=mask).to(tl.int32), param_dtype)
    elif SPLIT16:
        w = K.join16(bits, tl.load(low_ptr + offs, mask=mask).to(tl.uint32))
    else:
        w = _join8(bits, tl.load(residual_ptr + offs, mask=mask).to(tl.int32), param_dtype)
    return w


@triton.jit
def _store_split16(bits_ptr, low_ptr, offs, mask, w):
    hi, lo = K.split16(w)
    tl.store(bits_ptr + offs, hi.to(tl.uint16), mask=mask)
    tl.store(low_ptr + offs, lo.to(tl.uint16), mask=mask)


@triton.jit
def _store_split8(bits_ptr, residual_ptr, param_dtype, offs, mask, w):
    if param_dtype == DTYPE_F16:
        bits, q = K.split8(w, True)
    else:
        bits, q = K.split8(w, False)
    tl.store(bits_ptr + offs, bits.to(tl.uint16), mask=mask)
    tl.store(residual_ptr + offs, q.to(tl.int8), mask=mask)


@triton.jit
def store_split_master(param_addr, param_dtype, master_addr, kind, offs, mask, w, ALIGNED: tl.constexpr,
                       SPLIT16: tl.constexpr, SPLIT8: tl.constexpr):
    """Split the fp32 master ``w`` into the 16-bit param and its low half / residual, and store both."""
    bits_ptr, low_ptr, residual_ptr = _split_ptrs(param_addr, master_addr, ALIGNED)
    if SPLIT16 and SPLIT8:
        if kind == MASTER_SPLIT16:
            _store_split16(bits_ptr, low_ptr, offs, mask, w)
        else:
            _store_split8(bits_ptr, residual_ptr, param_dtype, offs, mask, w)
    elif SPLIT16:
        _store_split16(bits_ptr, low_ptr, offs, mask, w)
    else:
        _store_split8(bits_ptr, residual_ptr, param_dtype, offs, mask, w)


@triton.jit
def store_state(offs, mask, ALIGNED: tl.constexpr, SPLIT16: tl.constexpr, SPLIT8: tl.constexpr, BF16_STATE: tl.constexpr,
                INT8_STATE: tl.constexpr, SR: tl.constexpr, w, m, v, v_max, param_addr, param_dtype, exp_avg_ptr,
                exp_avg_sq_ptr, max_sq_ptr, master_ptr, has_master, amsgrad, exp_avg_addr, exp_avg_sq_addr, max_sq_addr,
                master_addr, master_kind, state_kind, exp_avg_scales, exp_avg_sq_scales, max_sq_scales, key, groups,
                group_mask):
    """The update's writes in the compact variants: moments in their encoding, the param with its
    master (split or fp32), or alone (stochastically rounded when SR and bf16). The kernel sends
    split-master tensors only to SPLIT16/SPLIT8 blocks (adamw.py, [note: split masters per program])."""
    if SR:
        word0, word1 = random_words(offs, key, True)
    else:
        word0 = 0
        word1 = 0
    if BF16_STATE or INT8_STATE:
        store_moment(exp_avg_addr, state_kind, exp_avg_scales, offs, mask, groups, group_mask, m, word0, ALIGNED,
                     BF16_STATE, INT8_STATE, True, SR)
        store_moment(exp_avg_sq_addr, state_kind, exp_avg_sq_scales, offs, mask, groups, group_mask, v, word0 >> 16,
                     ALIGNED, BF16_STATE, INT8_STATE, False, SR)
        if amsgrad:
            store_moment(max_sq_addr, state_kind, max_sq_scales, offs, mask, groups, group_mask, v_max, word1,
                         ALIGNED, BF16_STATE, INT8_STATE, False, SR)
    else:
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if amsgrad:
            tl.store(max_sq_ptr + offs, v_max, mask=mask)
    if SPLIT16 or SPLIT8:
        store_split_master(param_addr, param_dtype, master_addr, master_kind, offs, mask, w, ALIGNED, SPLIT16, SPLIT8)
    elif has_master:
        tl.store(master_ptr + offs, w, mask=mask)
        store_f32(param_addr, param_dtype, offs, w, mask, ALIGNED)
    else:
        if SR:
            if param_dtype == DTYPE_BF16:  # bf16 without a master: stochastic rounding
                _store_bf16(param_addr, offs, mask, w, word1 >> 16, ALIGNED, True)
            else:
                store_f32(param_addr, param_dtype, offs, w, mask, ALIGNED)
        else:
            store_f32(param_addr, param_dtype, offs, w, mask, ALIGNED)
