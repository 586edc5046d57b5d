// The element-wise encodings of compact optimizer state, shared by the CPU and the CUDA kernels.
//
// ampfused/_compact.py is the specification: every function here is its counterpart for one
// element and is tested bitwise against it (tests/compact/test_compact_native.py, through
// tests/compact/compact_shim.cpp). The encodings, with u the fp32 bit pattern and RNE round-to-nearest-even:
//
//   split16 (bf16 params)   p = RNE16(u), low = u & 0xFFFF; at a tie (low 0x8000) low becomes 0x7FFF
//                           when p rounded down, 0x8001 when it rounded up (one fp32 ulp toward p,
//                           so p stays RNE(master)); join16 = ((p - (low > 0x8000)) << 16) | low.
//   split8 (bf16/fp16)      p = RNE(m), q = clamp(RNE((m - p) / (ulp(p)/256)), -127, 127);
//                           join8 = p + q * ulp(p)/256, exact; |join8 - m| <= ulp(p)/256.
//   bf16 rounding           RNE16(u) = (u + 0x7FFF + lsb) >> 16; SR16(u, r) = (u + r) >> 16 for 16
//                           random bits r, truncated instead where RNE stays finite but SR overflows.
//   int8 moments            y = x / scale (block max |m|, or block max sqrt(v) after sqrt(v)); the code
//                           k is RNE of |y| on a float-like grid: (2^M + t) 2^(f - 15 - M), t 2^(-14 - M)
//                           for f = 0, k = (f << M) | t; exp_avg: M = 3 and a sign (int8 +-k, k <= 120),
//                           exp_avg_sq: M = 4 (uint8 k <= 240); non-finite y gives code 0.
//   int4 moments            y as for int8 (non-finite y counts as 0); the code is the number of the
//                           grid's 15 fp32 bounds strictly below y, and decodes to LEVELS[code] * scale
//                           (squared for exp_avg_sq); two codes a byte, element 2i in the low nibble.
//
// Every step is an integer operation or one correctly rounded fp32 operation
// (division, sqrt, product), and scalings by powers of two are split in two exact factors, so
// compilers and devices agree bit for bit. The only products that feed an addition (join8's
// p + q * 2^k) are exact, so contracting them into an fma changes nothing either.
#pragma once

#include <cmath>
#include <cstdint>

#include "adamw_math.h"  // AMPFUSED_HD

namespace ampfused {
namespace compact {

// kBlock, kSmallTensorNumel and the grids (kSignedMant/kSignedOne, kSqrtMant/kSqrtOne, the int4
// kInt4*Levels / kInt4*Bounds tables): contract_generated.h

AMPFUSED_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

AMPFUSED_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

AMPFUSED_HD bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// 2^k for integer k in [-126, 127], from its bits.
AMPFUSED_HD float pow2(int k) { return float_of(static_cast<uint32_t>(k + 127) << 23); }

// x * 2^k in two exact-range factors (k may lie outside fp32's exponent range); floor(k / 2) as
// an arithmetic shift, as the specification computes it.
AMPFUSED_HD float scale_pow2(float x, int k) {
  const int half = k >> 1;
  return x * pow2(half) * pow2(k - half);
}

// ------------------------------------------------------------------ bf16 / fp16 rounding

AMPFUSED_HD uint16_t bf16_rne_bits(float x) {
  const uint32_t u = bits_of(x);
  if (is_nan_bits(u)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Stochastic rounding with 16 uniform random bits in the low half of `rand16`.
AMPFUSED_HD uint16_t bf16_sr_bits(float x, uint32_t rand16) {
  const uint32_t u = bits_of(x);
  const uint16_t rne = bf16_rne_bits(x);
  if (is_nan_bits(u)) return rne;
  uint32_t sr = (u + (rand16 & 0xFFFFu)) >> 16;
  if ((sr & 0x7FFFu) == 0x7F80u && (rne & 0x7FFFu) != 0x7F80u) sr = u >> 16;  // never overflow where RNE does not
  return static_cast<uint16_t>(sr);
}

AMPFUSED_HD float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// fp32 -> fp16 bits, RNE with subnormals (as c10::Half); NaN -> a quiet NaN.
AMPFUSED_HD uint16_t fp16_rne_bits(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                              // normal: >= 2^-14
    const uint32_t r = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    return static_cast<uint16_t>(sign | r);
  }
  const float scaled = float_of(a) * 16777216.0f;  // |x| * 2^24, exact: the subnormal count (RNE below)
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(rintf(scaled)));
}

AMPFUSED_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (e == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    return float_of(sign | bits_of(v));
  }
  if (e == 0x1F) return float_of(sign | 0x7F800000u | (mant << 13));
  return float_of(sign | ((e + 112u) << 23) | (mant << 13));
}

// ------------------------------------------------------------------ split16

AMPFUSED_HD void split16(float master, uint16_t& param_bits, uint16_t& low) {
  const uint32_t u = bits_of(master);
  param_bits = bf16_rne_bits(master);
  uint32_t lo = u & 0xFFFFu;
  if (is_nan_bits(u)) {
    lo = 0;
  } else if (lo == 0x8000u) {  // [note: tie rule] one fp32 ulp toward the param
    lo = param_bits == (u >> 16) ? 0x7FFFu : 0x8001u;
  }
  low = static_cast<uint16_t>(lo);
}

AMPFUSED_HD float join16(uint16_t param_bits, uint16_t low) {
  const uint32_t hi = static_cast<uint32_t>(param_bits) - (low > 0x8000u ? 1u : 0u);
  return float_of(((hi & 0xFFFFu) << 16) | low);
}

// ------------------------------------------------------------------ split8

// log2(ulp(p)) of a 16-bit param; zeros and subnormals take the smallest normal exponent.
AMPFUSED_HD int ulp_exponent16(uint16_t param_bits, bool fp16) {
  const int mant = fp16 ? 10 : 7, bias = fp16 ? 15 : 127;
  const int field = fp16 ? (param_bits >> 10) & 0x1F : (param_bits >> 7) & 0xFF;
  return (field < 1 ? 1 : field) - bias - mant;
}

AMPFUSED_HD float param16_to_float(uint16_t bits, bool fp16) { return fp16 ? fp16_to_float(bits) : bf16_to_float(bits); }

AMPFUSED_HD void split8(float master, bool fp16, uint16_t& param_bits, int8_t& residual) {
  param_bits = fp16 ? fp16_rne_bits(master) : bf16_rne_bits(master);
  const float err = master - param16_to_float(param_bits, fp16);  // exact
  const float t = scale_pow2(err, 8 - ulp_exponent16(param_bits, fp16));
  float q = 0.0f;
  if (is_finite_f32(t)) {
    q = rintf(t);
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  }
  residual = static_cast<int8_t>(q);
}

AMPFUSED_HD float join8(uint16_t param_bits, bool fp16, int8_t residual) {
  const float p = param16_to_float(param_bits, fp16);
  if (residual == 0) return p;
  // exact; unfused all the same, as every sum in device code ([note: no contraction] in adamw_math.h)
  return AMPFUSED_ADD(p, scale_pow2(static_cast<float>(residual), ulp_exponent16(param_bits, fp16) - 8));
}

// ------------------------------------------------------------------ int8 moments

// |y| in [0, 1] -> grid code (see the top of the file); MANT mantissa bits.
template <int MANT>
AMPFUSED_HD int encode_unit(float y) {
  const float a = fabsf(y);
  if (a >= 6.103515625e-05f) {  // 2^-14: RNE of the fp32 bits to MANT mantissa bits, rebiased
    const uint32_t u = bits_of(a);
    constexpr int kDrop = 23 - MANT;
    return static_cast<int>(((u + ((1u << (kDrop - 1)) - 1u) + ((u >> kDrop) & 1u)) >> kDrop) - (112u << MANT));
  }
  return static_cast<int>(rintf(a * static_cast<float>(1 << (14 + MANT))));  // exact scaling, RNE
}

template <int MANT>
AMPFUSED_HD float decode_unit(int k) {
  const int f = k >> MANT, t = k & ((1 << MANT) - 1);
  if (f == 0) return static_cast<float>(t) * pow2(-14 - MANT);
  return float_of((static_cast<uint32_t>(f + 112) << 23) | (static_cast<uint32_t>(t) << (23 - MANT)));
}

// exp_avg: scale = max |m| over the element's block.
AMPFUSED_HD int8_t encode_exp_avg(float m, float scale) {
#if defined(__CUDA_ARCH__)
  const float y = __fdiv_rn(m, scale);
#else
  const float y = m / scale;
#endif
  if (!is_finite_f32(y)) return 0;
  int k = encode_unit<kSignedMant>(y);
  k = k > kSignedOne ? kSignedOne : k;
  return static_cast<int8_t>(y < 0.0f ? -k : k);
}

AMPFUSED_HD float decode_exp_avg(int8_t code, float scale) {
  const int c = code;
  const float v = decode_unit<kSignedMant>(c < 0 ? -c : c);
  return (c < 0 ? -v : v) * scale;
}

// exp_avg_sq / max_exp_avg_sq: scale = max sqrt(v) over the element's block.
AMPFUSED_HD uint8_t encode_exp_avg_sq(float v, float scale) {
#if defined(__CUDA_ARCH__)
  const float y = __fdiv_rn(__fsqrt_rn(v), scale);
#else
  const float y = std::sqrt(v) / scale;
#endif
  if (!is_finite_f32(y)) return 0;
  const int k = encode_unit<kSqrtMant>(y);
  return static_cast<uint8_t>(k > kSqrtOne ? kSqrtOne : k);
}

AMPFUSED_HD float decode_exp_avg_sq(uint8_t code, float scale) {
  const float r = decode_unit<kSqrtMant>(code) * scale;
  return r * r;
}

// ------------------------------------------------------------------ int4 moments

// The number of the 15 ascending bounds b strictly below y (a non-finite y counts as 0), bit by bit:
// x > b[i] holds for a prefix of the bounds, so code bit 3 is x > b[7], bit 2 is x > b[3] or b[11]
// (by bit 3), and so on: 4 comparisons against bounds picked by selects among constants, where
// counting compares 15 times, and no indexed load.
AMPFUSED_HD int int4_code(float y, const float (&b)[15]) {
  const float x = is_finite_f32(y) ? y : 0.0f;
  const bool h8 = x > b[7];
  const bool h4 = x > (h8 ? b[11] : b[3]);
  const bool h2 = x > (h8 ? (h4 ? b[13] : b[9]) : (h4 ? b[5] : b[1]));
  const float low = h4 ? (h2 ? b[6] : b[4]) : (h2 ? b[2] : b[0]);
  const float high = h4 ? (h2 ? b[14] : b[12]) : (h2 ? b[10] : b[8]);
  const bool h1 = x > (h8 ? high : low);
  return (h8 ? 8 : 0) | (h4 ? 4 : 0) | (h2 ? 2 : 0) | (h1 ? 1 : 0);
}

// exp_avg: scale = max |m| over the element's block.
AMPFUSED_HD int encode4_exp_avg(float m, float scale) {
#if defined(__CUDA_ARCH__)
  return int4_code(__fdiv_rn(m, scale), kInt4SignedBounds);
#else
  return int4_code(m / scale, kInt4SignedBounds);
#endif
}

AMPFUSED_HD float decode4_exp_avg(int code, float scale) { return kInt4SignedLevels[code] * scale; }

// exp_avg_sq / max_exp_avg_sq: scale = max sqrt(v) over the element's block.
AMPFUSED_HD int encode4_exp_avg_sq(float v, float scale) {
#if defined(__CUDA_ARCH__)
  return int4_code(__fdiv_rn(__fsqrt_rn(v), scale), kInt4SqrtBounds);
#else
  return int4_code(std::sqrt(v) / scale, kInt4SqrtBounds);
#endif
}

AMPFUSED_HD float decode4_exp_avg_sq(int code, float scale) {
  const float r = kInt4SqrtLevels[code] * scale;
  return r * r;
}

// The codes of elements 2i (low nibble) and 2i + 1 (high nibble) in byte i ([note: int4 packing] in _contract.py).
AMPFUSED_HD uint8_t pack4(int even, int odd) { return static_cast<uint8_t>(even | (odd << 4)); }
AMPFUSED_HD int unpack4_even(uint8_t byte) { return byte & 0xF; }
AMPFUSED_HD int unpack4_odd(uint8_t byte) { return byte >> 4; }

}  // namespace compact
}  // namespace ampfused
