r"""Compact optimizer state: the executable specification of every encoding (DESIGN §9).

Pure PyTorch, element-wise and vectorized; ``csrc/compact_math.h`` and ``kernels/compact.py`` are
the same functions for one element and are tested bitwise against this file. Integer work is done
on the fp32 bit pattern ``u`` (as int64, so nothing overflows); ``RNE`` is round to nearest even.

**split16** (bf16 params, 2 B/param): the fp32 master ``m`` is kept as the param ``p = RNE_bf16(m)``
plus the low 16 bits of ``m`` (``master_low16``, their bits as bfloat16: [note: split16 dtype] in ``_contract.py``). The param says whether rounding went up,
except at an exact tie (low half ``0x8000``), where two masters share one param. [note: tie rule]
There the stored master is nudged one fp32 ulp toward the param (low half ``0x7FFF`` when ``p``
rounded down, ``0x8001`` when it rounded up), so ``p`` stays ``RNE(master)``::

    split16(m): hi = RNE16(u); lo = u & 0xFFFF; at a tie lo = 0x7FFF if hi == u >> 16 else 0x8001
    join16(p, lo) = ((p_bits - (lo > 0x8000)) << 16) | lo

``join16(split16(m)) == m`` bitwise for every fp32 ``m`` but ties (moved by 1 fp32 ulp, 2^-24
relative) and NaN (stays a NaN); masters whose param overflows to ``inf`` are kept exactly.

**split8** (bf16 and fp16 params, 1 B/param; FlashOptim-style ULP-scaled correction): ``p =
RNE(m)`` and the rounding error ``e = m - p`` (exact in fp32, ``|e| <= ulp(p)/2``) in int8 units of
``ulp(p)/256`` (``master_residual8``)::

    split8(m): q = clamp(RNE(e / (ulp(p)/256)), -127, 127)    (0 when e is not finite)
    join8(p, q) = p + q * ulp(p)/256   (exact in fp32; p itself when q == 0, keeping -0/inf/NaN)

``ulp(p) = 2^(E - mantissa_bits)`` with ``E`` the exponent of ``p`` (the smallest normal exponent
for zeros and subnormals). Error bound: ``|join8(split8(m)) - m| <= ulp(p)/512`` whenever
``|e| <= 255/512 ulp(p)`` and ``<= ulp(p)/256`` always (the clamp at ±127 keeps ``RNE(join8) ==
p``), i.e. about 2^-16 (bf16) / 2^-19 (fp16) relative, 2^-15 / 2^-18 at worst. Masters whose param
overflows (``|m| >= 65520`` for fp16) decode to the param's ``±inf``.
FlashOptim spreads 255 codes over ``[-ulp/2, ulp/2]`` (uniform ``ulp/508``, but a rounded decode);
a power-of-two unit makes ``join8`` exact and idempotent (``split8(join8(p, q)) == (p, q)``), the
same bits on every backend, at the price of the ``ulp/256`` band next to the clamp.

**bf16 rounding** of moments (and of params without a master): ``RNE16(u) = (u + 0x7FFF + lsb) >> 16``
(``Tensor.to(torch.bfloat16)``), or stochastically from 16 uniform random bits ``r``:
``SR16(u, r) = (u + r) >> 16``, unbiased (``E[SR] = x``); it never rounds a finite value to
``inf`` unless RNE does (it truncates to the largest finite bf16 instead), and NaN stays a quiet NaN.
The bits come from one counter-based hash of (seed, tensor index, element index), the same on
every backend (:func:`random_words`, [note: rounding bits] in ``_contract.py``); a step's seed is
drawn on the host from torch's generator, so ``torch.manual_seed`` reproduces a run.

**int8 moments** (``state_dtype="int8"``): blocks of ``BLOCK = 256`` consecutive elements within a
row (a dim-0 slice; the last block of a row may be short: [note: blocks in rows] in ``_contract.py``,
so a ``Shard(0)`` shard holds whole blocks), an fp32 scale per block, and a float-like 8-bit code of ``y = x / scale`` -- a piecewise
linear log compander (as A-law's segments): constant relative error over a wide range, linear near 0.

- ``exp_avg``: scale = block ``max|m|``; int8 code ``±k``, ``k = 8f + t`` (4-bit exponent ``f``,
  3-bit mantissa ``t``), ``|y| = (8 + t) 2^(f - 18)`` for ``f >= 1``, ``t 2^-17`` for ``f = 0``;
  ``k = 120`` is 1. Per block: ``|m' - m| <= 2^-4 |m| + 2^-18 max|m|`` (plus fp32 rounding).
- ``exp_avg_sq`` / ``max_exp_avg_sq``: companded by a square root first: scale = block
  ``max sqrt(v)``; uint8 code ``k = 16f + t`` of ``sqrt(v) / scale``, ``(16 + t) 2^(f - 19)``
  (``t 2^-18`` for ``f = 0``; ``k = 240`` is 1); ``v' = (code value * scale)^2``. Per block:
  ``|sqrt(v') - sqrt(v)| <= 2^-5 sqrt(v) + 2^-19 max sqrt(v)``, i.e. ``v`` within about 2^-4 relative.

[note: float-like grids] bitsandbytes' dynamic map reaches further (1e-7) but needs a 256-entry
table and a search to encode; FlashOptim's grids (softsign of m, linear in sqrt(v), groups of 32) have
an absolute resolution of about 1/254 of the block maximum, while Adam divides every element by its
own ``sqrt(v)``, so small elements of a block matter as much as large ones. These grids keep a
constant relative error over 2^14 and encode with integer operations only, exactly on every backend.
Codes are RNE of ``y`` to the grid (ties to the even code). A block with a non-finite element
decodes to NaN (its scale is not finite). Tensors under ``SMALL_TENSOR_NUMEL`` elements keep fp32
moments (as bitsandbytes keeps small tensors in 32 bits): their scales would cost more than they save;
so do 1-D tensors (biases, norms' weights), whose blocks a shard boundary could cut.

**int4 moments** (``state_dtype="int4"``): the same blocks and fp32 scales as int8 (scale = block
``max |m|`` / block ``max sqrt(v)``, so a ``Shard(0)`` shard holds whole blocks), 4-bit codes packed two
per byte ([note: int4 packing] in ``_contract.py``). A code is the index of one of 16 levels in units of
the scale ([note: int4 grids])::

    y = m / scale  (exp_avg)   or   sqrt(v) / scale  (exp_avg_sq, max_exp_avg_sq; sqrt correctly rounded)
    code(y) = #{i : y > BOUNDS[i]}       (15 ascending bounds: the fp32 midpoints of the levels;
                                          a non-finite y counts as 0)
    m' = LEVELS[code] * scale            v' = (LEVELS[code] * scale)^2

[note: int4 grids] exp_avg takes sign + E2M1 magnitudes with 1 on top, widened by two powers of two
(``INT4_SIGNED_LEVELS``: 0 and +-{1, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0625}); sqrt(exp_avg_sq) an E3M1 grid without 0
(``INT4_SQRT_LEVELS``: ``2^-e`` and ``0.75 2^-e``, ``e = 0 .. 7``), so ``v`` never decodes to 0 in a
block whose maximum is not 0 (unless ``(0.0059 scale)^2`` underflows fp32, a block of ``v`` under
2^-134): the "zero-point problem" of Li et al. (2023), where a ``v'`` of 0 under a non-zero ``m'`` sends
the update to ``m' / eps``. The smallest level bounds an element's update to about
``|m'| / (0.0059 max sqrt(v))``. Why these two: docs/results/int4-grids.md. Encoding is comparisons
and decoding a 16-entry lookup, exact on every backend (the bounds are fp32 constants, ``y`` one
correctly rounded division); ties (``y`` equal to a bound) take the lower level. A block with a
non-finite element has a non-finite scale and decodes to non-finite values.

**Compact state keys** (``opt.state[p]`` and ``state_dict()["state"][i]``):

==========================  ==========================  =============================================
key                         dtype, shape                when
==========================  ==========================  =============================================
``step``                    fp32, 0-d                   always (as torch)
``master_param``            fp32, p's shape             ``master_weights="fp32"``, fp16/bf16 ``p``
``master_low16``            bf16 bits, p's shape            ``"split16"``: low 16 bits of the master
``master_residual8``        int8, p's shape             ``"split8"``: ``e`` in ``ulp(p)/256``
``exp_avg`` (``_sq``,       fp32 or bf16, p's shape     ``state_dtype`` fp32 / bf16; fp32 for tensors
``max_exp_avg_sq``)                                     under ``SMALL_TENSOR_NUMEL`` with ``"int8"``
``exp_avg_codes``           int8, p's shape             ``"int8"`` (and ``exp_avg_scales``, fp32 [r, nb])
``exp_avg_sq_codes``        uint8, p's shape            ``"int8"`` (and ``exp_avg_sq_scales``)
``max_exp_avg_sq_codes``    uint8, p's shape            ``"int8"``, amsgrad (and ``..._scales``)
``exp_avg_codes`` (and the  uint8, p's shape with the   ``"int4"``: two codes per byte (and the same
others of int8)             last dimension halved       ``..._scales`` as int8)
==========================  ==========================  =============================================

``r = p.shape[0]`` rows, ``nb = ceil(numel / r / BLOCK)`` blocks per row (``_contract.scales_shape``;
format 2: before it the scales were one flat vector, ``[ceil(numel / BLOCK)]``, of blocks that ignored
rows). No master key on a 16-bit param means ``master_weights=False``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._contract import SCALE_BLOCK as BLOCK
from ._contract import (INT4_SIGNED_BOUNDS, INT4_SIGNED_LEVELS, INT4_SQRT_BOUNDS, INT4_SQRT_LEVELS, ROUNDING_SEED_BITS, SIGNED_MANT, SIGNED_ONE, SMALL_TENSOR_NUMEL, SQRT_MANT, SQRT_ONE, SR_KEY_SALT,
                        SR_MIX_MUL1, SR_MIX_MUL2, SR_WORD0_SALT, SR_WORD1_SALT, MASTER_ENCODINGS, check_master_weights,
                        block_rows, dtype_names, encoding_for, master_mismatch, moment_encoding, packed_shape, scales_shape)
from ._layout import is_dense

__all__ = [
    "BLOCK", "SMALL_TENSOR_NUMEL", "split16", "join16", "split8", "join8", "round_bf16", "stochastic_round_bf16",
    "random_words", "element_index", "draw_rounding_seed", "quantize", "dequantize", "quantize4", "dequantize4", "pack4", "unpack4", "adamw_math", "is_compact_key", "init_state", "encode_state", "decode_state", "compact_adamw_step_",
]

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEYS = {mode: key for mode, (_, _, key, _) in MASTER_ENCODINGS.items()}
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
_EXPONENT_BIAS = {torch.bfloat16: 127, torch.float16: 15}


# ------------------------------------------------------------------ bit helpers

def _bits(x: Tensor) -> Tensor:
    """fp32 -> its bit pattern as a non-negative int64."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(u: Tensor) -> Tensor:
    u = u & 0xFFFFFFFF
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def _bits16(p: Tensor) -> Tensor:
    return p.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _from_bits16(h: Tensor, dtype: torch.dtype) -> Tensor:
    h = h & 0xFFFF
    return torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(dtype)


def _pow2(k: Tensor) -> Tensor:
    """2^k as fp32 for integer ``k`` in [-126, 127], built from its bits (exact)."""
    return _from_bits((k + 127) << 23)


def _scale_pow2(x: Tensor, k: Tensor) -> Tensor:
    """``x * 2^k`` in two exact-range factors (``k`` may be outside fp32's exponent range)."""
    half = k >> 1  # floor(k / 2), as the native versions compute it
    return x * _pow2(half) * _pow2(k - half)


def _is_nan_bits(u: Tensor) -> Tensor:
    return (u & 0x7FFFFFFF) > 0x7F800000


def _rne16_bits(u: Tensor) -> Tensor:
    """High half of RNE_bf16 of the fp32 bits ``u`` (NaN -> quiet NaN), as torch's ``.to(bfloat16)``."""
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return torch.where(_is_nan_bits(u), (u >> 16) | 0x40, rounded)


# ------------------------------------------------------------------ split16

def split16(master: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 master -> (bf16 param ``RNE(master)``, its low bits as ``master_low16``'s dtype), with the tie rule."""
    u = _bits(master)
    hi = _rne16_bits(u)
    lo = u & 0xFFFF
    tie = (lo == 0x8000) & ~_is_nan_bits(u)
    lo = torch.where(tie, torch.where(hi == (u >> 16), 0x7FFF, 0x8001), lo)
    lo = torch.where(_is_nan_bits(u), 0, lo)
    return _from_bits16(hi, torch.bfloat16).view(master.shape), _from_bits16(lo, MASTER_ENCODINGS["split16"][0]).view(master.shape)


def _check_param(mode: str, dtype: torch.dtype) -> None:
    """TypeError unless a ``mode`` master completes a param of ``dtype`` (``_contract.MASTER_PARAM_DTYPES``)."""
    why = master_mismatch(mode, dtype)
    if why is not None:
        raise TypeError(f"{why}, not {dtype_names([dtype])}")


def join16(param: Tensor, low: Tensor) -> Tensor:
    """(bf16 param, low bits: ``master_low16``, or their int16 form) -> fp32 master; ``join16(*split16(m)) == m`` but at ties and NaN."""
    _check_param("split16", param.dtype)
    hi = _bits16(param)
    lo = _bits16(low)
    hi = torch.where(lo > 0x8000, hi - 1, hi)
    return _from_bits((hi << 16) | lo).view(param.shape)


# ------------------------------------------------------------------ split8

def _ulp_exponent(p: Tensor) -> Tensor:
    """``log2(ulp(p))`` of a bf16/fp16 tensor (int64); zeros and subnormals take the smallest normal ulp."""
    mant, bias = _MANTISSA_BITS[p.dtype], _EXPONENT_BIAS[p.dtype]
    field = (_bits16(p) >> mant) & (0xFF if p.dtype == torch.bfloat16 else 0x1F)
    return torch.clamp(field, min=1) - bias - mant


def split8(master: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp32 master -> (param ``RNE(master)`` of ``dtype``, int8 residual in units of ``ulp(p)/256``)."""
    _check_param("split8", dtype)
    master = master.to(torch.float32)
    p = master.to(dtype)
    err = master - p.float()  # exact: p is within half a 16-bit ulp of master
    t = _scale_pow2(err, 8 - _ulp_exponent(p))
    q = torch.where(torch.isfinite(t), torch.round(t).clamp(-127, 127), 0.0)
    return p, q.to(torch.int8)


def join8(param: Tensor, residual: Tensor) -> Tensor:
    """(param, int8 residual) -> fp32 master ``p + q ulp(p)/256`` (exact)."""
    _check_param("split8", param.dtype)
    pf = param.float()
    correction = _scale_pow2(residual.float(), _ulp_exponent(param) - 8)
    return torch.where(residual == 0, pf, pf + correction)


# ------------------------------------------------------------------ bf16 rounding

def round_bf16(x: Tensor, stochastic: bool = False, generator: torch.Generator | None = None) -> Tensor:
    """fp32 -> bf16, RNE or stochastic: the low 16 bits of word 0 of :func:`random_words` (tensor
    index 0) under a seed drawn from ``generator`` (or torch's default one)."""
    u = _bits(x)
    if not stochastic:
        return _from_bits16(_rne16_bits(u), torch.bfloat16).view(x.shape)
    word0, _ = random_words(draw_rounding_seed(generator, x.device), 0, element_index(x))
    return _from_bits16(_sr16_bits(u, word0 & 0xFFFF), torch.bfloat16).view(x.shape)


def _sr16_bits(u: Tensor, rand: Tensor) -> Tensor:
    rne = _rne16_bits(u)
    sr = (u + rand) >> 16
    overflow = ((sr & 0x7FFF) == 0x7F80) & ((rne & 0x7FFF) != 0x7F80)  # SR went to inf where RNE stays finite
    sr = torch.where(overflow, u >> 16, sr)
    return torch.where(_is_nan_bits(u), rne, sr)


def stochastic_round_bf16(x: Tensor, rand: Tensor) -> Tensor:
    """fp32 -> bf16 rounded with the given 16-bit random values (int, [0, 65535], ``x``'s shape)."""
    return _from_bits16(_sr16_bits(_bits(x), rand.to(torch.int64).reshape(x.shape)), torch.bfloat16).view(x.shape)


# ------------------------------------------------------------------ the random bits

_U32 = 0xFFFFFFFF


def _mul32(x, m: int):
    """``x * m mod 2^32`` of uint32 values held in int64 (tensors or ints), in 16-bit halves of ``m``
    so that no product overflows int64."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _U32


def _mix32(x):
    """lowbias32, the bijective 32-bit avalanche of the rounding hash ([note: rounding bits])."""
    x = x ^ (x >> 16)
    x = _mul32(x, SR_MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, SR_MIX_MUL2)
    return x ^ (x >> 15)


def random_words(seed: int, index: int, elements: Tensor) -> tuple[Tensor, Tensor]:
    """The two 32-bit random words (int64 in [0, 2^32)) of ``elements`` (int64 element indices) of
    the tensor at ``index`` in a step's full lists: the one stochastic-rounding hash, [note:
    rounding bits] in ``_contract.py`` (the kernels compute it bit for bit)."""
    word = (1 << ROUNDING_SEED_BITS) - 1
    key = _mix32((index + SR_KEY_SALT) & _U32)
    key = _mix32(key ^ (seed & word))
    key = _mix32(key ^ ((seed >> ROUNDING_SEED_BITS) & word))
    y = _mix32((elements & _U32) ^ _mix32(key ^ (elements >> 32)))
    return _mix32(y ^ SR_WORD0_SALT), _mix32(y ^ SR_WORD1_SALT)


def element_index(t: Tensor, base: int = 0) -> Tensor:
    """The index of each element of ``t`` (int64, ``t``'s shape) as the kernels count it: ``base`` (a
    shard's offset in its whole tensor) plus its offset in ``t``'s memory for a dense tensor, its
    row-major position otherwise (which only the reference passes serve)."""
    k = torch.arange(base, base + t.numel(), dtype=torch.int64, device=t.device)
    if t.is_contiguous() or not is_dense(t):
        return k.view(t.shape)
    return k.as_strided(t.shape, t.stride())


def draw_rounding_seed(generator: torch.Generator | None = None, device="cpu") -> int:
    """A rounding seed (the hash takes its low ``2 * ROUNDING_SEED_BITS`` bits) from ``generator``
    (on ``device``) or torch's default CPU generator."""
    if generator is not None:
        device = generator.device
    elif torch.device(device).type != "cpu":
        device = "cpu"  # torch's default CPU generator: no device sync
    return int(torch.randint(1 << (2 * ROUNDING_SEED_BITS), (1,), generator=generator, device=device).item())


# ------------------------------------------------------------------ int8 blockwise moments

# (mantissa bits, code of 1.0) of the two 8-bit grids: sign + E4M3 for exp_avg, E4M4 for sqrt(v)
_GRIDS = {"signed": (SIGNED_MANT, SIGNED_ONE), "sqrt": (SQRT_MANT, SQRT_ONE)}


def _encode_unit(y: Tensor, mant: int) -> Tensor:
    """|y| in [0, 1] -> grid code k (int64): RNE of |y| to (2^mant + t) 2^(f - 15 - mant), or t 2^(-14 - mant) for f = 0."""
    a = y.abs()
    u = _bits(a)
    drop = 23 - mant
    normal = ((u + ((1 << (drop - 1)) - 1) + ((u >> drop) & 1)) >> drop) - ((127 - 15) << mant)
    sub = torch.round(a * float(2 ** (14 + mant))).to(torch.int64)
    return torch.where(a >= 2.0 ** -14, normal, sub)


def _decode_unit(k: Tensor, mant: int) -> Tensor:
    f = k >> mant
    t = k & ((1 << mant) - 1)
    normal = _from_bits(((f + 112) << 23) | (t << (23 - mant)))
    return torch.where(f == 0, t.float() * 2.0 ** (-14 - mant), normal)


def _blocks(x: Tensor) -> Tensor:
    """``x`` (fp32, in row-major order) as ``[blocks, BLOCK]``: each row ([note: blocks in rows] in
    ``_contract.py``) cut into blocks, its last one padded with zeros."""
    rows, row_numel = block_rows(x.shape)
    flat = x.reshape(rows, row_numel).to(torch.float32)
    pad = (-row_numel) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def _unblock(blocks: Tensor, shape) -> Tensor:
    """:func:`_blocks`' inverse: the padding dropped, ``shape`` restored."""
    rows, row_numel = block_rows(shape)
    return blocks.reshape(rows, -1)[:, :row_numel].reshape(shape)


def quantize(x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """fp32 moment -> (codes of ``x``'s shape, fp32 per-block scales of ``scales_shape(x.shape)``);
    ``kind`` "signed" (exp_avg) or "sqrt" (exp_avg_sq, max_exp_avg_sq; ``x >= 0``)."""
    mant, one = _GRIDS[kind]
    blocks = _blocks(x)
    if kind == "sqrt":
        blocks = blocks.double().sqrt().float()  # correctly rounded, as sqrtf and the kernels' sqrt_rn
    scales = blocks.abs().amax(dim=1)
    y = blocks / scales[:, None]
    k = torch.where(torch.isfinite(y), _encode_unit(y, mant), 0).clamp(max=one)
    if kind == "signed":
        k = torch.where(y < 0, -k, k)
    codes = _unblock(k, x.shape)
    return codes.to(torch.int8 if kind == "signed" else torch.uint8), scales.view(scales_shape(x.shape))


def dequantize(codes: Tensor, scales: Tensor, kind: str) -> Tensor:
    """(codes, scales) -> fp32 moment of ``codes``' shape (see the module docstring for the maps).
    Scales of compact format 1 (one flat vector: blocks of the flattened tensor, which ignored rows)
    decode too, so ``ampfused.checkpoint.to_torch_state_dict`` converts such a checkpoint."""
    if scales.dim() == 1 and codes.dim() >= 2 and scales.numel() == -(-codes.numel() // BLOCK):
        return dequantize(codes.reshape(-1), scales, kind).view(codes.shape)  # format 1: one row
    if tuple(scales.shape) != scales_shape(codes.shape):
        raise ValueError(f"{tuple(scales.shape)} scales for codes of shape {tuple(codes.shape)}: the block grid "
                         f"([note: blocks in rows]) has {scales_shape(codes.shape)}")
    mant, _ = _GRIDS[kind]
    k = codes.to(torch.int64)
    value = _decode_unit(k.abs(), mant)
    if kind == "signed":
        value = torch.where(k < 0, -value, value)
    out = _blocks(value) * scales.reshape(-1, 1)
    if kind == "sqrt":
        out = out * out
    return _unblock(out, codes.shape)


# ------------------------------------------------------------------ int4 blockwise moments

# the levels and bounds of the two 4-bit grids ([note: int4 grids])
INT4_GRIDS = {"signed": (INT4_SIGNED_LEVELS, INT4_SIGNED_BOUNDS), "sqrt": (INT4_SQRT_LEVELS, INT4_SQRT_BOUNDS)}


def pack4(codes: Tensor) -> Tensor:
    """4-bit codes (integers in [0, 15], last dimension even) -> uint8 bytes of ``packed_shape``:
    element 2i in the low nibble of byte i, 2i + 1 in the high one ([note: int4 packing])."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).view(packed_shape(codes.shape))


def unpack4(packed: Tensor) -> Tensor:
    """:func:`pack4`'s inverse: the codes as int64, the last dimension doubled."""
    b = packed.to(torch.int64)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize4(x: Tensor, kind: str, bounds=None) -> tuple[Tensor, Tensor]:
    """fp32 moment (last dimension even) -> (packed uint8 codes of ``packed_shape(x.shape)``, fp32
    per-block scales of ``scales_shape(x.shape)``); ``kind`` "signed" (exp_avg) or "sqrt" (exp_avg_sq,
    max_exp_avg_sq; ``x >= 0``). ``bounds`` (15 ascending fp32 values) replace the grid's, and
    :func:`dequantize4`'s ``levels`` its levels, for studies of other grids."""
    bounds = INT4_GRIDS[kind][1] if bounds is None else bounds
    blocks = _blocks(x)
    if kind == "sqrt":
        blocks = blocks.double().sqrt().float()  # correctly rounded, as sqrtf and the kernels' sqrt_rn
    scales = blocks.abs().amax(dim=1)
    y = blocks / scales[:, None]
    y = torch.where(torch.isfinite(y), y, 0.0)
    b = torch.tensor(bounds, dtype=torch.float32, device=x.device)
    k = (y[..., None] > b).sum(dim=-1)
    return pack4(_unblock(k, x.shape)), scales.view(scales_shape(x.shape))


def dequantize4(codes: Tensor, scales: Tensor, kind: str, levels=None) -> Tensor:
    """(packed codes, scales) -> fp32 moment of the unpacked shape (``codes``' last dimension doubled);
    ``levels`` (16 fp32 values) replace the grid's."""
    shape = tuple(codes.shape[:-1]) + (2 * codes.shape[-1],)
    if tuple(scales.shape) != scales_shape(shape):
        raise ValueError(f"{tuple(scales.shape)} scales for int4 codes of a {tuple(shape)} moment: the block grid "
                         f"([note: blocks in rows]) has {scales_shape(shape)}")
    table = torch.tensor(INT4_GRIDS[kind][0] if levels is None else levels, dtype=torch.float32, device=codes.device)
    out = _blocks(table[unpack4(codes)]) * scales.reshape(-1, 1)
    if kind == "sqrt":
        out = out * out
    return _unblock(out, shape)


# ------------------------------------------------------------------ per-tensor state

def is_compact_key(key: str) -> bool:
    """Whether a state key exists only in compact state (torch and ampfused's fp32 mode never write it)."""
    return key in ("master_low16", "master_residual8") or key.endswith(("_codes", "_scales"))


def _master_mode(param: Tensor, state: dict) -> str:
    for mode, (_, _, key, _) in MASTER_ENCODINGS.items():
        if key in state:
            return mode
    return "none" if param.dtype in _MANTISSA_BITS else "fp32"


def _check_modes(param: Tensor, master_weights: str, state_dtype) -> None:
    if master_weights not in ("fp32", "split16", "split8", "none"):
        raise ValueError(f'master_weights must be "fp32", "split16", "split8" or "none", got {master_weights!r}')
    if state_dtype not in (torch.float32, torch.bfloat16, "int8", "int4"):
        raise ValueError(f'state_dtype must be torch.float32, torch.bfloat16, "int8" or "int4", got {state_dtype!r}')
    check_master_weights(param, master_weights)  # the optimizer's rule and message (a split master's params)


def _encode_moment(state: dict, key: str, value: Tensor, mode: str, rand16: Tensor | None = None) -> None:
    """Store the fp32 moment ``value`` under ``key`` in moment mode ``mode`` (``_contract.MOMENT_ENCODINGS``;
    bf16: stochastically with the 16-bit ``rand16``, or RNE without)."""
    if mode == "int8":
        state[key + "_codes"], state[key + "_scales"] = quantize(value, "signed" if key == "exp_avg" else "sqrt")
    elif mode == "int4":
        state[key + "_codes"], state[key + "_scales"] = quantize4(value, "signed" if key == "exp_avg" else "sqrt")
    elif mode == "bf16":
        state[key] = round_bf16(value) if rand16 is None else stochastic_round_bf16(value, rand16)
    else:
        state[key] = value.to(torch.float32).clone()


def _decode_moment(state: dict, key: str) -> Tensor | None:
    if key + "_codes" in state:
        decode = dequantize4 if moment_encoding(state["exp_avg_codes"]) == "int4" else dequantize
        return decode(state[key + "_codes"], state[key + "_scales"], "signed" if key == "exp_avg" else "sqrt")
    return state[key].float() if key in state else None


def _encode_master(state: dict, param: Tensor, master: Tensor, mode: str) -> Tensor:
    """Store ``master`` in ``mode``; returns the param value that goes with it."""
    if mode == "split16":
        p, state["master_low16"] = split16(master)
    elif mode == "split8":
        p, state["master_residual8"] = split8(master, param.dtype)
    else:
        p = master.to(param.dtype)
        if mode == "fp32":
            state["master_param"] = master.clone()
    return p


def _decode_master(state: dict, param: Tensor) -> Tensor:
    mode = _master_mode(param, state)
    if mode == "split16":
        return join16(param, state["master_low16"])
    if mode == "split8":
        return join8(param, state["master_residual8"])
    if mode == "fp32" and "master_param" in state:
        return state["master_param"].float()
    return param.float()


def init_state(param: Tensor, master_weights: str = "fp32", state_dtype=torch.float32, amsgrad: bool = False) -> dict:
    """Fresh compact state of ``param`` (zero moments; master from the param, as ampfused's fp32 mode)."""
    zeros = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    fp32_state = {"step": torch.zeros((), dtype=torch.float32, device=param.device), "exp_avg": zeros, "exp_avg_sq": zeros}
    if amsgrad:
        fp32_state["max_exp_avg_sq"] = zeros
    return encode_state(param, fp32_state, master_weights, state_dtype)


@torch.no_grad()
def encode_state(param: Tensor, fp32_state: dict, master_weights: str = "fp32", state_dtype=torch.float32) -> dict:
    """A torch-format state (fp32 ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``/``step``, optional fp32
    ``master_param``) -> the compact state of the given modes. ``master_weights`` applies to fp16/bf16
    params only. In the split modes the param is set to ``RNE(master)`` in place (a no-op for
    ampfused's fp32 mode, which keeps that invariant; a torch state has no master: ``param.float()``)."""
    _check_modes(param, master_weights, state_dtype)
    master_mode, moment_mode = encoding_for(param, master_weights, state_dtype)  # [note: one encoding decision]
    state = {"step": fp32_state["step"].detach().to(device=param.device, dtype=torch.float32).clone()}
    for key in MOMENTS:
        if key in fp32_state:
            _encode_moment(state, key, fp32_state[key].detach().float().to(param.device), moment_mode)
    if master_mode != "none":
        master = fp32_state.get("master_param")
        master = param.float() if master is None else master.detach().float().to(param.device)
        p = _encode_master(state, param, master, master_mode)
        if master_mode in ("split16", "split8"):
            param.copy_(p)
    return state


def decode_state(state: dict, param: Tensor | None = None) -> dict:
    """Compact state -> torch-format fp32 state (``step``, moments; ``master_param`` too when ``param``
    is a 16-bit param with a master), as ``torch.optim.AdamW`` and ampfused's fp32 mode load it."""
    out = {"step": state["step"]}
    for key in MOMENTS:
        value = _decode_moment(state, key)
        if value is not None:
            out[key] = value
    if param is not None and param.dtype in _MANTISSA_BITS and _master_mode(param, state) != "none":
        out["master_param"] = _decode_master(state, param.detach())
    return out


# ------------------------------------------------------------------ the step

def adamw_math(w: Tensor, grad: Tensor, factor: Tensor | None, exp_avg: Tensor, exp_avg_sq: Tensor,
               max_exp_avg_sq: Tensor | None, step: Tensor, *, lr, beta1: float, beta2: float, eps: float,
               weight_decay: float, amsgrad: bool, maximize: bool):
    """The one AdamW body of the specification, on decoded values (``w`` in its math dtype, the
    moments in it too): ``(w, exp_avg, exp_avg_sq, max_exp_avg_sq or None, step)`` after one step,
    new tensors, nothing written. torch.optim.AdamW's single-tensor operation order; the scalars
    in float64 from the device step counter, as torch computes them in Python floats from its host
    counter. ``reference.adamw_update_`` and :func:`compact_adamw_step_` decode, call this, and
    commit (or encode)."""
    g = grad.to(w.dtype)
    if factor is not None:
        g = g * factor
    if maximize:
        g = g.neg()
    if isinstance(lr, Tensor):
        lr = lr.to(device=w.device, dtype=torch.float64, non_blocking=True)
    step_new = step + 1
    bias_correction1 = 1 - torch.pow(beta1, step_new.double())
    bias_correction2_sqrt = (1 - torch.pow(beta2, step_new.double())).sqrt()
    step_size = lr / bias_correction1
    w_new = w * (1 - lr * weight_decay)
    m_new = exp_avg.lerp(g, 1 - beta1)
    v_new = exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
    v_max_new = None
    if amsgrad:
        v_max_new = torch.maximum(max_exp_avg_sq, v_new)
        denom = (v_max_new.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (v_new.sqrt() / bias_correction2_sqrt).add_(eps)
    # torch's addcdiv_(m, denom, value=-step_size) computes (value * m) / denom, then adds
    w_new.add_(m_new.mul(-step_size).div_(denom))
    return w_new, m_new, v_new, v_max_new, step_new


@torch.no_grad()
def compact_adamw_step_(param: Tensor, grad: Tensor, state: dict, *, lr, beta1: float, beta2: float, eps: float,
                        weight_decay: float, amsgrad: bool = False, maximize: bool = False, factor: Tensor | None = None,
                        skip: Tensor | None = None, stochastic_rounding: bool = False,
                        generator: torch.Generator | None = None, rounding_seed: int | None = None,
                        rounding_index: int = 0, element_base: int = 0) -> None:
    """One AdamW step of one tensor on compact state: decode -> :func:`adamw_math` -> encode.

    With ``split16`` masters and fp32 moments the result is the fp32-master step bit for bit (but
    for the tie rule). ``factor`` (0-d fp32: clip coefficient / loss scale) multiplies the grad; when
    the 0-d ``skip`` is non-zero every buffer (param, master, moments, scales, step) keeps its bits.
    Modes are read from the state's keys (see the module docstring). ``stochastic_rounding`` rounds
    the bf16 writes without an exact master (bf16 moments, a bf16 param without master) with the
    bits of :func:`random_words` for ``rounding_seed`` (drawn from ``generator``, or torch's default
    one, when None) and ``rounding_index``, the tensor's position in the step's full lists; a shard
    of a larger tensor counts its elements from ``element_base``, its offset there.
    """
    keep = torch.zeros((), dtype=torch.bool, device=param.device) if skip is None else (skip != 0)
    mode = _master_mode(param, state)
    w = _decode_master(state, param)
    exp_avg, exp_avg_sq = _decode_moment(state, "exp_avg"), _decode_moment(state, "exp_avg_sq")
    max_exp_avg_sq = _decode_moment(state, "max_exp_avg_sq") if amsgrad else None
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad is set but the state has no max_exp_avg_sq")
    w_new, m_new, v_new, v_max_new, step_new = adamw_math(
        w, grad, factor, exp_avg, exp_avg_sq, max_exp_avg_sq, state["step"], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)

    # [note: rounding bits] word 0: exp_avg (low half), exp_avg_sq (high); word 1: max_exp_avg_sq, the param
    rand = [None] * 4
    if stochastic_rounding:
        seed = draw_rounding_seed(generator, param.device) if rounding_seed is None else rounding_seed
        word0, word1 = random_words(seed, rounding_index, element_index(param, element_base))
        rand = [word0 & 0xFFFF, word0 >> 16, word1 & 0xFFFF, word1 >> 16]
    # Encode into a scratch dict, then commit every buffer with where(skip, old, new).
    moment_mode = moment_encoding(state["exp_avg_codes"] if "exp_avg_codes" in state else state["exp_avg"])
    new = {"step": step_new}
    _encode_moment(new, "exp_avg", m_new, moment_mode, rand[0])
    _encode_moment(new, "exp_avg_sq", v_new, moment_mode, rand[1])
    if amsgrad:
        _encode_moment(new, "max_exp_avg_sq", v_max_new, moment_mode, rand[2])
    if param.dtype == torch.float32:
        p_new = w_new
    elif mode == "none" and param.dtype == torch.bfloat16:
        p_new = round_bf16(w_new) if rand[3] is None else stochastic_round_bf16(w_new, rand[3])
    else:
        p_new = _encode_master(new, param, w_new, mode)
    for key, value in new.items():
        state[key].copy_(torch.where(keep, state[key], value))
    param.copy_(torch.where(keep, param, p_new))
