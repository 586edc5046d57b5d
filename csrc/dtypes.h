// Element types the kernels read and write, and their float conversions (host and device).
//
// fp16/bf16 values travel as uint16_t bit patterns so that this header
// needs neither ATen nor cuda_fp16.h on the host side; the conversions round to nearest even, as
// Tensor.to() does. On the host, fp16 goes through c10-free bit manipulation (see "fp16 on the host" below).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "adamw_math.h"  // AMPFUSED_HD
#include "contract.h"    // the dtype codes kF32, kF16, kBF16

namespace ampfused {

struct Half { uint16_t x; };
struct BFloat16 { uint16_t x; };

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr int32_t value = kF32; };
template <> struct DTypeOf<Half> { static constexpr int32_t value = kF16; };
template <> struct DTypeOf<BFloat16> { static constexpr int32_t value = kBF16; };

AMPFUSED_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

AMPFUSED_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

AMPFUSED_HD float to_float(float x) { return x; }
AMPFUSED_HD float to_float(BFloat16 x) { return bits_to_float(static_cast<uint32_t>(x.x) << 16); }

// fp16 on the host: the conversions below are branch-free integer/float formulas, bitwise
// equal to F16C's vcvtph2ps / vcvtps2ph (round to nearest even), which torch's CPU conversions use.
// The AVX2/AVX-512 hot loops convert whole blocks with those instructions instead (kernels_impl.h:
// GCC vectorizes these formulas poorly, and `_Float16` casts compile to one scalar conversion per
// element); the formulas serve the baseline build and the tails of blocks.
AMPFUSED_HD float to_float(Half x) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.x));
#else
  // IEEE half -> float (the FP16 library's fp16_ieee_to_fp32_value). No intermediate is an fp32
  // denormal, so the result is exact also when the caller runs with flush-to-zero /
  // denormals-are-zero (torch.set_flush_denormal(True)): fp16 subnormals are normal fp32 values.
  const uint32_t w = static_cast<uint32_t>(x.x) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 1.925929944387236e-34f;  // 2^-112
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const float mag = two_w < (1u << 27) ? denormalized : normalized;
  return bits_to_float(sign | float_to_bits(mag));
#endif
}

template <typename T> AMPFUSED_HD T from_float(float f);

template <> AMPFUSED_HD float from_float<float>(float f) { return f; }

template <> AMPFUSED_HD BFloat16 from_float<BFloat16>(float f) {
  const uint32_t u = float_to_bits(f);
  BFloat16 out;
  if (f != f) {
    out.x = 0x7fc0u;  // canonical NaN, as c10::BFloat16
  } else {
    out.x = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return out;
}

template <> AMPFUSED_HD Half from_float<Half>(float f) {
  Half out;
#if defined(__CUDA_ARCH__)
  out.x = __half_as_ushort(__float2half_rn(f));
#else
  // float -> half, round to nearest even (the classic fp16_ieee_from_fp32_value).
  const float scale_to_inf = 5.192296858534828e+33f;   // 2^112
  const float scale_to_zero = 7.703719777548943e-34f;  // 2^-110
  float base = (f < 0 ? -f : f) * scale_to_inf * scale_to_zero;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  // NaN keeps its sign and the top 9 bits of its payload, quieted: what F16C's vcvtps2ph (and so
  // torch's `.to(torch.float16)` on x86) gives, so the baseline build matches the F16C builds bitwise
  const uint32_t nan_bits = 0x7e00u | ((w >> 13) & 0x03ffu);
  out.x = static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? nan_bits : nonsign));
#endif
  return out;
}

}  // namespace ampfused
