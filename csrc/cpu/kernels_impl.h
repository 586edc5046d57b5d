// The CPU hot loops. Included by exactly one file per ISA, after that file set the target and
// AMPFUSED_ISA; everything here lands in namespace ampfused::cpu::AMPFUSED_ISA so variants
// compiled for different ISAs never share a symbol.
//
// [note: auto-vectorization] Each loop body is branch-free per element (selects only), reads and
// writes through __restrict pointers, and keeps its dtype/master/amsgrad decisions as template
// parameters, so GCC/Clang vectorize it at -O3. sqrt vectorizes only with -fno-math-errno, which
// build_extension.py passes. Reductions keep 16 float lanes by hand: the compiler may not reorder
// a float sum itself.
#ifndef AMPFUSED_ISA
#error "define AMPFUSED_ISA before including kernels_impl.h"
#endif

#include "../adamw_math.h"
#include "../dtypes.h"
#include "cpu_kernels.h"

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {

template <typename G>
void accumulate_t(float* __restrict dst, const G* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + to_float(src[i]);
}

void accumulate(float* dst, const void* src, int32_t src_dtype, int64_t n) {
  switch (src_dtype) {
    case kF32: return accumulate_t(dst, static_cast<const float*>(src), n);
    case kF16: return accumulate_t(dst, static_cast<const Half*>(src), n);
    default: return accumulate_t(dst, static_cast<const BFloat16*>(src), n);
  }
}

// [note: non-finite lanes] `d += u - u` is 0 for every finite u and NaN from the first inf/NaN on,
// so the flag costs one subtract and add per element. It runs as a second loop over the block
// (8 KB for fp32, still in L1): fused into the sum-of-squares loop, GCC 12 vectorizes the pair of
// lane arrays with a transpose per vector and the pass ran 4.5x slower (4.5 vs 1.0 ms per 4M fp32
// elements on AVX-512). The identity holds because build_extension.py compiles every CPU file with
// -ffp-contract=off (no fma can absorb the product into u - u: see [note: explicit finiteness] in
// adamw_math.h for what happens otherwise); the GPU kernels test the exponent bits instead.
template <typename G>
SumSq sumsq_t(const G* __restrict g, int64_t n, float inv) {
  constexpr int kLanes = 16;
  constexpr int64_t kBlock = 2048;  // float partials stay short; blocks are summed in double
  double total = 0.0;
  float bad = 0.f;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float acc[kLanes] = {};
    float d[kLanes] = {};
    for (int64_t j = 0; j < kBlock; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float u = to_float(g[i + j + k]) * inv;
        acc[k] += u * u;
      }
    }
    for (int64_t j = 0; j < kBlock; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float u = to_float(g[i + j + k]) * inv;
        d[k] += u - u;
      }
    }
    float block = 0.f;
    for (int k = 0; k < kLanes; ++k) {
      block += acc[k];
      bad += d[k];
    }
    total += block;
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

template <typename P, typename G, bool MASTER, bool AMSGRAD, bool WRITE_GRAD>
void update_t(const UpdateRange& r) {
  const int64_t n = r.end - r.begin;
  P* __restrict p = static_cast<P*>(r.param) + r.begin;
  const G* __restrict g = static_cast<const G*>(r.grad) + r.begin;
  float* __restrict m = r.exp_avg + r.begin;
  float* __restrict v = r.exp_avg_sq + r.begin;
  float* __restrict vmax = AMSGRAD ? r.max_exp_avg_sq + r.begin : nullptr;
  float* __restrict master = MASTER ? r.master + r.begin : nullptr;
  const AdamWScalars s = *r.scalars;
  const float factor = r.factor;
  G* __restrict g_out = WRITE_GRAD ? static_cast<G*>(r.grad_out) + r.begin : nullptr;
  const float unscale = r.unscale;
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

// Test-only: of every fp32 a = 2^exponent * (1 + m/2^23), how many a / c the update's division by
// its per-tensor constant gets wrong (see [note: division by a constant]; 0 with a plain division).
int64_t division_mismatches(float c, int32_t exponent) {
  const float y = 1.0f / c;
  int64_t bad = 0;
  for (uint32_t m = 0; m < (1u << 23); ++m) {
    const uint32_t bits = (static_cast<uint32_t>(exponent + 127) << 23) | m;
    float a;
    std::memcpy(&a, &bits, sizeof a);
#if defined(AMPFUSED_EXACT_DIV_BY_CONSTANT)
    const float q = div_by_constant(a, c, y);
#else
    const float q = a / c;
    (void)y;
#endif
    bad += q != a / c;
  }
  return bad;
}

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
