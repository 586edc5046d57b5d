// The CPU hot loops. Included by exactly one file per ISA, after that file set the target and
// AMPFUSED_ISA; everything here lands in namespace ampfused::cpu::AMPFUSED_ISA so variants
// compiled for different ISAs never share a symbol.
//
// Each loop body is branch-free per element (selects only), reads and
// writes through __restrict pointers, and keeps its dtype/master/amsgrad decisions as template
// parameters, so GCC/Clang vectorize it at -O3. sqrt vectorizes only with -fno-math-errno, which
// build_extension.py passes. Reductions keep 16 float lanes by hand: the compiler may not reorder
// a float sum itself.
#ifndef AMPFUSED_ISA
#error "define AMPFUSED_ISA before including kernels_impl.h"
#endif

#include <type_traits>

#include "../adamw_math.h"
#include "../dtypes.h"
#include "cpu_kernels.h"

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {

// ------------------------------------------------------------------ block conversions
// [note: fp16 by blocks] With F16C (AMPFUSED_F16C, the AVX2 and AVX-512 builds) fp16 data is
// converted 8 elements per instruction into a float block in L1 (kConvert elements, 1-2 KB), and the
// loop body runs on floats; the conversions are exact (half -> float) and round to nearest even
// (float -> half), bitwise what dtypes.h's formulas and torch give. fp32 and bf16 loops read their
// data directly (GCC vectorizes bf16's shift).
constexpr int64_t kConvert = 512;

template <typename T> struct Converted { static constexpr bool value = false; };
#if defined(AMPFUSED_F16C)
template <> struct Converted<Half> { static constexpr bool value = true; };
#endif

// dst[i] = float(src[i]) for i < n
template <typename T>
AMPFUSED_HD void widen(float* __restrict dst, const T* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(AMPFUSED_F16C)
  if constexpr (Converted<T>::value) {
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// dst[i] = T(src[i]) for i < n, rounded to nearest even
template <typename T>
AMPFUSED_HD void narrow(T* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(AMPFUSED_F16C)
  if constexpr (Converted<T>::value) {
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// ------------------------------------------------------------------ accumulate

template <typename G>
void accumulate_t(float* __restrict dst, const G* __restrict src, int64_t n) {
  if constexpr (Converted<G>::value) {
    float buf[kConvert];
    for (int64_t b = 0; b < n; b += kConvert) {
      const int64_t len = n - b < kConvert ? n - b : kConvert;
      widen(buf, src + b, len);
      float* __restrict d = dst + b;
      for (int64_t i = 0; i < len; ++i) d[i] = d[i] + buf[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + to_float(src[i]);
  }
}

void accumulate(float* dst, const void* src, int32_t src_dtype, int64_t n) {
  switch (src_dtype) {
    case kF32: return accumulate_t(dst, static_cast<const float*>(src), n);
    case kF16: return accumulate_t(dst, static_cast<const Half*>(src), n);
    default: return accumulate_t(dst, static_cast<const BFloat16*>(src), n);
  }
}

// `d += u - u` is 0 for every finite u and NaN from the first inf/NaN on,
// so the flag costs one subtract and add per element. The identity holds because build_extension.py
// compiles every CPU file with -ffp-contract=off (no fma can absorb the product into u - u: see
// [note: explicit finiteness] in adamw_math.h for what happens otherwise); the GPU kernels test the
// exponent bits instead.
//
// The sum of squares and the flag are taken in the same loop, on the
// 16 lanes as native vectors (Vec: one zmm, two ymm or four xmm): each element is loaded once,
// and the pass streams at the speed of a plain read (torch.sum's). As plain float[16] arrays GCC
// transposes the lanes per vector, and a separate flag loop re-reads the block
// (docs/results/cpu-loops.md). Lane k adds elements k, k+16, ... of the block in order.
constexpr int kLanes = 16;
constexpr int64_t kSumBlock = 2048;  // float partials stay short; blocks are summed in double
#if !defined(AMPFUSED_VECTOR_BYTES)
#define AMPFUSED_VECTOR_BYTES 16  // the baseline build: SSE2 (set by the AVX2 / AVX-512 files)
#endif
// the 16 lanes as native vectors (1 zmm, 2 ymm or 4 xmm), so that they stay in registers
typedef float Vec __attribute__((vector_size(AMPFUSED_VECTOR_BYTES)));
constexpr int kVecLanes = AMPFUSED_VECTOR_BYTES / sizeof(float);
constexpr int kVecs = kLanes / kVecLanes;

// one kSumBlock block of g: its float sum of squares (16 lanes, then in order), and d += u - u
template <typename T>
AMPFUSED_HD float sumsq_block(const T* __restrict g, float inv, float& bad) {
  Vec acc[kVecs] = {};
  Vec d[kVecs] = {};
  for (int64_t j = 0; j < kSumBlock; j += kLanes) {
    float ub[kLanes];  // converted by a loop the compiler vectorizes, then moved into registers
    for (int k = 0; k < kLanes; ++k) ub[k] = to_float(g[j + k]) * inv;
    for (int v = 0; v < kVecs; ++v) {
      Vec u;
      std::memcpy(&u, ub + v * kVecLanes, sizeof u);
      acc[v] += u * u;
      d[v] += u - u;
    }
  }
  float block = 0.f;
  for (int k = 0; k < kLanes; ++k) {
    block += acc[k / kVecLanes][k % kVecLanes];
    bad += d[k / kVecLanes][k % kVecLanes];
  }
  return block;
}

template <typename G>
SumSq sumsq_t(const G* __restrict g, int64_t n, float inv) {
  double total = 0.0;
  float bad = 0.f;
  int64_t i = 0;
  for (; i + kSumBlock <= n; i += kSumBlock) {
    if constexpr (Converted<G>::value) {
      float buf[kSumBlock];  // 8 KB: stays in L1 for the block's two loops
      widen(buf, g + i, kSumBlock);
      total += sumsq_block(static_cast<const float*>(buf), inv, bad);
    } else {
      total += sumsq_block(g + i, inv, bad);
    }
  }
  float tail = 0.f;
  for (; i < n; ++i) {
    const float u = to_float(g[i]) * inv;
    tail += u * u;
    bad += u - u;
  }
  return SumSq{total + tail, bad != 0.f};
}

SumSq sumsq(const void* grad, int32_t dtype, int64_t n, float inv_scale) {
  switch (dtype) {
    case kF32: return sumsq_t(static_cast<const float*>(grad), n, inv_scale);
    case kF16: return sumsq_t(static_cast<const Half*>(grad), n, inv_scale);
    default: return sumsq_t(static_cast<const BFloat16*>(grad), n, inv_scale);
  }
}

// The update of n elements; P and G are the types as the loop reads them (float for a block that
// was widened, see [note: fp16 by blocks]); with WRITE_GRAD, g_out[i] gets the unscaled gradient.
template <typename P, typename G, bool MASTER, bool AMSGRAD, bool WRITE_GRAD>
AMPFUSED_HD void update_span(P* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
                             float* __restrict vmax, float* __restrict master, G* __restrict g_out,
                             const AdamWScalars& s, float factor, float unscale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float w = MASTER ? master[i] : to_float(p[i]);
    float mi = m[i];
    float vi = v[i];
    float vmaxi = AMSGRAD ? vmax[i] : 0.f;
    const float gi = to_float(g[i]);
    adamw_element<AMSGRAD>(w, gi * factor, mi, vi, vmaxi, s);
    if (WRITE_GRAD) g_out[i] = from_float<G>(gi * unscale);
    m[i] = mi;
    v[i] = vi;
    if (AMSGRAD) vmax[i] = vmaxi;
    if (MASTER) master[i] = w;
    p[i] = from_float<P>(w);
  }
}

template <typename P, typename G, bool MASTER, bool AMSGRAD, bool WRITE_GRAD>
void update_t(const UpdateRange& r) {
  const int64_t n = r.end - r.begin;
  P* __restrict p = static_cast<P*>(r.param) + r.begin;
  const G* __restrict g = static_cast<const G*>(r.grad) + r.begin;
  float* __restrict m = r.exp_avg + r.begin;
  float* __restrict v = r.exp_avg_sq + r.begin;
  float* __restrict vmax = AMSGRAD ? r.max_exp_avg_sq + r.begin : nullptr;
  float* __restrict master = MASTER ? r.master + r.begin : nullptr;
  G* __restrict g_out = WRITE_GRAD ? static_cast<G*>(r.grad_out) + r.begin : nullptr;
  const AdamWScalars s = *r.scalars;
  const float factor = r.factor;
  const float unscale = r.unscale;
  if constexpr (Converted<P>::value || Converted<G>::value) {
    // fp16 param or grad: by blocks through float buffers (the other side is read directly)
    using PBlock = std::conditional_t<Converted<P>::value, float, P>;
    using GBlock = std::conditional_t<Converted<G>::value, float, G>;
    float pbuf[kConvert], gbuf[kConvert], gobuf[kConvert];
    for (int64_t b = 0; b < n; b += kConvert) {
      const int64_t len = n - b < kConvert ? n - b : kConvert;
      PBlock* pb;
      const GBlock* gb;
      GBlock* gob = nullptr;
      if constexpr (Converted<P>::value) {
        if (!MASTER) widen(pbuf, p + b, len);  // with a master, p is only written
        pb = pbuf;
      } else {
        pb = p + b;
      }
      if constexpr (Converted<G>::value) {
        widen(gbuf, g + b, len);
        gb = gbuf;
        if (WRITE_GRAD) gob = gobuf;
      } else {
        gb = g + b;
        if (WRITE_GRAD) gob = g_out + b;
      }
      update_span<PBlock, GBlock, MASTER, AMSGRAD, WRITE_GRAD>(pb, gb, m + b, v + b, AMSGRAD ? vmax + b : nullptr,
                                                               MASTER ? master + b : nullptr, gob, s, factor, unscale,
                                                               len);
      if constexpr (Converted<P>::value) narrow(p + b, pbuf, len);
      if constexpr (Converted<G>::value) {
        if (WRITE_GRAD) narrow(g_out + b, gobuf, len);
      }
    }
  } else {
    update_span<P, G, MASTER, AMSGRAD, WRITE_GRAD>(p, g, m, v, vmax, master, g_out, s, factor, unscale, n);
  }
}

template <typename P, typename G, bool WRITE_GRAD>
void update_pgw(const UpdateRange& r) {
  const bool master = r.master != nullptr, ams = r.max_exp_avg_sq != nullptr;
  if (master) {
    ams ? update_t<P, G, true, true, WRITE_GRAD>(r) : update_t<P, G, true, false, WRITE_GRAD>(r);
  } else {
    ams ? update_t<P, G, false, true, WRITE_GRAD>(r) : update_t<P, G, false, false, WRITE_GRAD>(r);
  }
}

template <typename P, typename G>
void update_pg(const UpdateRange& r) {
  r.grad_out != nullptr ? update_pgw<P, G, true>(r) : update_pgw<P, G, false>(r);
}

template <typename P>
void update_p(const UpdateRange& r) {
  switch (r.grad_dtype) {
    case kF32: return update_pg<P, float>(r);
    case kF16: return update_pg<P, Half>(r);
    default: return update_pg<P, BFloat16>(r);
  }
}

void update(const UpdateRange& r) {
  switch (r.param_dtype) {
    case kF32: return update_p<float>(r);
    case kF16: return update_p<Half>(r);
    default: return update_p<BFloat16>(r);
  }
}

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
