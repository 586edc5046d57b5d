"""The compact-state encodings as Triton device functions, for the update pass's compact variants.

``ampfused/_compact.py`` is the specification and ``csrc/compact_math.h`` the C++ twin; each
function here works element-wise on a block and is tested bitwise against the specification
(``tests/compact/test_compact_native.py``). Bit patterns travel as uint32 (16-bit values in the low half),
codes as int32; callers load and store them in their storage dtypes.

Rounding to an integer is ``(a + 1.5 * 2^23) - 1.5 * 2^23``, which is
round-to-nearest-even for ``|a| < 2^22`` in any IEEE fp32 adder, the interpreter's included; every
use here has ``|a| <= 2^8``. bf16 rounding is done on the bits (see ``_memory.py``), fp16 rounding
by the cast, which is RNE on the GPU and in the interpreter alike. Every product
that feeds an addition here (``join8``'s ``p + q 2^k``, the scalings before ``_rint``) is exact,
so the fma the compiler contracts it into gives the same bits: callers may keep fp fusion on.
"""
import triton
import triton.language as tl

from ._contract_generated import (INT4_SIGNED_BOUNDS, INT4_SIGNED_LEVELS, INT4_SQRT_BOUNDS, INT4_SQRT_LEVELS, SIGNED_MANT,
                                  SIGNED_ONE, SQRT_MANT, SQRT_ONE)

RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23


@triton.jit
def _rint(a):
    return (a + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def _is_finite(x):
    return (x.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _pow2(k):
    """2^k (fp32) for int32 ``k`` in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_pow2(x, k):
    half = k >> 1
    return x * _pow2(half) * _pow2(k - half)


@triton.jit
def bf16_rne_bits(x):
    """fp32 -> bf16 bits (uint32), round to nearest even; NaN -> quiet NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, (bits >> 16) | 0x40, rounded)


@triton.jit
def bf16_sr_bits(x, rand16):
    """fp32 -> bf16 bits, stochastic rounding with 16 random bits (uint32 ``rand16``)."""
    bits = x.to(tl.uint32, bitcast=True)
    rne = bf16_rne_bits(x)
    sr = (bits + (rand16 & 0xFFFF)) >> 16
    overflow = ((sr & 0x7FFF) == 0x7F80) & ((rne & 0x7FFF) != 0x7F80)
    sr = tl.where(overflow, bits >> 16, sr)
    return tl.where(x != x, rne, sr)


@triton.jit
def param16_bits(x, FP16: tl.constexpr):
    """fp32 -> RNE bits (uint32) of the 16-bit param dtype."""
    if FP16:
        return x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        return bf16_rne_bits(x)


@triton.jit
def param16_float(bits, FP16: tl.constexpr):
    """16-bit param bits (uint32) -> fp32, exactly."""
    if FP16:
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def split16(master):
    """fp32 master -> (bf16 param bits, low 16 bits), both uint32, with the tie rule."""
    bits = master.to(tl.uint32, bitcast=True)
    hi = bf16_rne_bits(master)
    lo = bits & 0xFFFF
    tie_lo = tl.where(hi == (bits >> 16), 0x7FFF, 0x8001).to(tl.uint32)
    lo = tl.where(lo == 0x8000, tie_lo, lo)
    lo = tl.where(master != master, 0, lo)
    return hi, lo


@triton.jit
def join16(hi, lo):
    """(bf16 param bits, low bits) -> fp32 master."""
    hi = tl.where(lo > 0x8000, hi - 1, hi)
    return (((hi & 0xFFFF) << 16) | lo).to(tl.float32, bitcast=True)


@triton.jit
def _ulp_exponent(bits, FP16: tl.constexpr):
    """log2(ulp(p)) (int32) from 16-bit param bits; zeros and subnormals take the smallest normal ulp."""
    if FP16:
        field = ((bits >> 10) & 0x1F).to(tl.int32)
        return tl.maximum(field, 1) - 25
    else:
        field = ((bits >> 7) & 0xFF).to(tl.int32)
        return tl.maximum(field, 1) - 134


@triton.jit
def split8(master, FP16: tl.constexpr):
    """fp32 master -> (param bits uint32, residual int32 in [-127, 127], units of ulp(p)/256)."""
    bits = param16_bits(master, FP16)
    err = master - param16_float(bits, FP16)
    t = _scale_pow2(err, 8 - _ulp_exponent(bits, FP16))
    q = tl.minimum(tl.maximum(_rint(tl.where(_is_finite(t), t, 0.0)), -127.0), 127.0)
    return bits, q.to(tl.int32)


@triton.jit
def join8(bits, residual, FP16: tl.constexpr):
    """(param bits, int32 residual) -> fp32 master, exactly ``p + q ulp(p)/256``."""
    p = param16_float(bits, FP16)
    correction = _scale_pow2(residual.to(tl.float32), _ulp_exponent(bits, FP16) - 8)
    return tl.where(residual == 0, p, p + correction)


@triton.jit
def _encode_unit(y, MANT: tl.constexpr):
    """|y| in [0, 1] -> grid code (int32): RNE of the fp32 bits to MANT mantissa bits, rebiased, or
    RNE(|y| 2^(14 + MANT)) below 2^-14. (Constants spelled out: the interpreter cannot shift by a constexpr.)"""
    a = tl.abs(y)
    bits = a.to(tl.uint32, bitcast=True)
    if MANT == SIGNED_MANT:
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20).to(tl.int32) - 896  # 112 << 3
        sub = _rint(a * 131072.0).to(tl.int32)  # 2^17
    else:
        normal = ((bits + 0x3FFFF + ((bits >> 19) & 1)) >> 19).to(tl.int32) - 1792  # 112 << 4
        sub = _rint(a * 262144.0).to(tl.int32)  # 2^18
    return tl.where(a >= 6.103515625e-05, normal, sub)


@triton.jit
def _decode_unit(k, MANT: tl.constexpr):
    """Grid code (int32) -> its value in [0, 1], exactly."""
    if MANT == SIGNED_MANT:
        f = k >> 3
        t = k & 7
        normal = (((f + 112) << 23) | (t << 20)).to(tl.float32, bitcast=True)
        sub = t.to(tl.float32) * 7.62939453125e-06  # 2^-17
    else:
        f = k >> 4
        t = k & 15
        normal = (((f + 112) << 23) | (t << 19)).to(tl.float32, bitcast=True)
        sub = t.to(tl.float32) * 3.814697265625e-06  # 2^-18
    return tl.where(f == 0, sub, normal)


@triton.jit
def encode_exp_avg(m, scale):
    """exp_avg -> int32 code in [-120, 120] given the block's ``max |m|``."""
    y = tl.div_rn(m, scale)
    k = tl.minimum(_encode_unit(tl.where(_is_finite(y), y, 0.0), SIGNED_MANT), SIGNED_ONE)
    return tl.where(y < 0, -k, k)


@triton.jit
def decode_exp_avg(code, scale):
    v = _decode_unit(tl.abs(code), SIGNED_MANT)
    return tl.where(code < 0, -v, v) * scale


@triton.jit
def encode_exp_avg_sq(v, scale):
    """exp_avg_sq -> int32 code in [0, 240] given the block's ``max sqrt(v)``."""
    y = tl.div_rn(tl.sqrt_rn(v), scale)
    return tl.minimum(_encode_unit(tl.where(_is_finite(y), y, 0.0), SQRT_MANT), SQRT_ONE)


@triton.jit
def decode_exp_avg_sq(code, scale):
    r = _decode_unit(code, SQRT_MANT) * scale
    return r * r


@triton.jit
def _int4_code(y, BOUNDS: tl.constexpr):
    """The number of the 15 ascending ``BOUNDS`` strictly below ``y`` (int32; a non-finite ``y`` counts as 0)."""
    y = tl.where(_is_finite(y), y, 0.0)
    code = (y > BOUNDS[0]).to(tl.int32)
    for j in tl.static_range(1, 15):
        code += (y > BOUNDS[j]).to(tl.int32)
    return code


@triton.jit
def _int4_level(code, LEVELS: tl.constexpr):
    """``LEVELS[code]`` for int32 ``code`` in [0, 15]: a chain of selects, one running value per element."""
    level = tl.where(code == 1, LEVELS[1], LEVELS[0])
    for j in tl.static_range(2, 16):
        level = tl.where(code == j, LEVELS[j], level)
    return level


@triton.jit
def encode_exp_avg4(m, scale):
    """exp_avg -> 4-bit code (int32 in [0, 15]) given the block's ``max |m|`` ([note: int4 grids])."""
    return _int4_code(tl.div_rn(m, scale), INT4_SIGNED_BOUNDS)


@triton.jit
def decode_exp_avg4(code, scale):
    return _int4_level(code, INT4_SIGNED_LEVELS) * scale


@triton.jit
def encode_exp_avg_sq4(root, scale):
    """exp_avg_sq -> 4-bit code given ``root`` = ``sqrt_rn(v)`` (the block maximum's operand, so taken
    once by the caller) and the block's ``max sqrt(v)``."""
    return _int4_code(tl.div_rn(root, scale), INT4_SQRT_BOUNDS)


@triton.jit
def decode_exp_avg_sq4(code, scale):
    r = _int4_level(code, INT4_SQRT_LEVELS) * scale
    return r * r
