// The element-wise math of one AdamW step, shared by the CPU and the CUDA kernels.
//
// Both builds compile this header: nvcc sees __host__ __device__ functions, the
// host compiler sees plain inline C++ (AMPFUSED_HD expands to `inline`). The kernels differ only
// in how they walk memory; what happens to one element is written here once.
//
// The order of operations is the one of torch.optim.AdamW's single-tensor
// path as ampfused/reference.py spells it, so that the CPU kernels reproduce the reference bitwise:
//   w  = w * (1 - lr*wd)
//   m  = lerp(m, g, 1 - beta1)              ATen's vectorized lerp: fma(coeff, g - m, base)
//   v  = fma((1 - beta2) * g, g, v * beta2)  ATen's addcmul as its kernels are compiled (contracted)
//   vh = amsgrad ? max(vmax, v) : v
//   w  = w + (m * -step_size) / (sqrt(vh) / sqrt(bias_correction2) + eps)
// Scalars are computed in double (as Python floats are) and rounded to float once. The CPU files are
// compiled with -ffp-contract=off and the device code uses __fmul_rn/__fadd_rn, so no compiler
// fuses a multiply-add that torch does not fuse; the two fmas torch does take are explicit.
#pragma once

#include <cmath>
#include <cstdint>

#include "contract.h"  // the stats slots and kClipEps

#if defined(__CUDACC__)
#define AMPFUSED_HD __host__ __device__ __forceinline__
#else
#define AMPFUSED_HD inline __attribute__((always_inline))
#endif

// [note: no contraction] nvcc contracts a*b + c into one fma by default (--fmad=true), in double
// too; the host builds are compiled with -ffp-contract=off. Every product that feeds a sum in code
// both sides compile is written with these, so each rounds where torch rounds, by construction
// (tests/contract/sm90_compile.py compiles each scalar routine alone and finds no contracted fma).
#if defined(__CUDA_ARCH__)
#define AMPFUSED_MUL(a, b) __fmul_rn((a), (b))
#define AMPFUSED_ADD(a, b) __fadd_rn((a), (b))
#define AMPFUSED_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define AMPFUSED_DMUL(a, b) __dmul_rn((a), (b))
#define AMPFUSED_DSUB(a, b) __dsub_rn((a), (b))
#else
#define AMPFUSED_MUL(a, b) ((a) * (b))
#define AMPFUSED_ADD(a, b) ((a) + (b))
#define AMPFUSED_DMUL(a, b) ((a) * (b))
#define AMPFUSED_DSUB(a, b) ((a) - (b))
#if defined(__FMA__) || defined(__aarch64__) || defined(AMPFUSED_HAVE_FMA)
// ATen's Vectorized<float>::fmadd is a hardware fma wherever the ISA has one ... (AMPFUSED_HAVE_FMA:
// set by the per-ISA CPU files, since g++ does not update __FMA__ after `#pragma GCC target`)
#define AMPFUSED_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
// ... and a*b + c (two roundings) in its baseline build: never a libm call in a hot loop.
#define AMPFUSED_FMA(a, b, c) ((a) * (b) + (c))
#endif
#endif

namespace ampfused {

// [note: explicit finiteness] Whether a float is finite is asked of its exponent bits (all ones:
// inf or NaN), never as `x - x == 0`: that identity holds only while no compiler contracts the
// product that made x into an fma (ptxas does, for the Triton kernels' `u - u`), and a fast-math
// flag could fold it away.
AMPFUSED_HD bool is_finite_f32(float x) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(x);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
#endif
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// Per-tensor scalars of one step, rounded to float exactly where torch rounds them.
struct AdamWScalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_coeff;     // 1 - beta1 when it is < 0.5 (lerp from m), else (1 - beta1) - 1 (lerp from g)
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  float inv_bc2_sqrt;   // RN(1 / bc2_sqrt), for div_by_constant
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
  int lerp_from_m;      // which lerp form ATen takes (|weight| < 0.5)
};

// beta ** t for the integer-valued step t, as Python's float pow rounds it (which torch uses).
// The CUDA pow (__internal_accurate_pow, ~2 ulp) is a long fp64 routine;
// on the device the power is taken by squaring in double-double (~2^-100 relative: every product
// keeps its rounding error, from one fma), then rounded once to double, i.e. the correctly rounded
// beta ** t that glibc's pow returns on the host, but for a tie at 2^-100. Steps are whole numbers
// (the kernels add 1.0); the host keeps std::pow. The update computes this once per block and chunk.
AMPFUSED_HD double pow_step(double beta, float t) {
#if defined(__CUDA_ARCH__)
  double hi = 1.0, lo = 0.0, base_hi = beta, base_lo = 0.0;
  for (int64_t n = static_cast<int64_t>(t); n > 0; n >>= 1) {
    if (n & 1) {  // (hi, lo) *= (base_hi, base_lo)
      const double p = __dmul_rn(hi, base_hi);
      const double e = __dadd_rn(__fma_rn(hi, base_hi, -p), __fma_rn(hi, base_lo, __dmul_rn(lo, base_hi)));
      hi = __dadd_rn(p, e);
      lo = __dsub_rn(e, __dsub_rn(hi, p));
    }
    const double p = __dmul_rn(base_hi, base_hi);
    const double e = __dadd_rn(__fma_rn(base_hi, base_hi, -p), __dmul_rn(2.0, __dmul_rn(base_hi, base_lo)));
    base_hi = __dadd_rn(p, e);
    base_lo = __dsub_rn(e, __dsub_rn(base_hi, p));
  }
  return __dadd_rn(hi, lo);
#else
  return std::pow(beta, static_cast<double>(t));
#endif
}

// t is the new step count (old step + 1), as the float the step tensor will hold.
AMPFUSED_HD AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, float t) {
  AdamWScalars s;
  const double bias_correction1 = 1.0 - pow_step(beta1, t);
  const double bias_correction2 = 1.0 - pow_step(beta2, t);
  const float weight = static_cast<float>(1.0 - beta1);
  s.decay = static_cast<float>(AMPFUSED_DSUB(1.0, AMPFUSED_DMUL(lr, weight_decay)));  // the product rounded first
  s.lerp_from_m = fabsf(weight) < 0.5f;
  s.lerp_coeff = s.lerp_from_m ? weight : weight - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(sqrt(bias_correction2));
  s.inv_bc2_sqrt = 1.0f / s.bc2_sqrt;  // a float division: correctly rounded, as div_by_constant needs
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  return s;
}

#if !defined(__CUDA_ARCH__) && (defined(__FMA__) || defined(__aarch64__) || defined(AMPFUSED_HAVE_FMA)) && \
    !defined(AMPFUSED_DIVIDER)
#define AMPFUSED_EXACT_DIV_BY_CONSTANT 1
// [note: division by a constant] a / c, correctly rounded, from y = RN(1/c) without the divider,
// which the CPU update is bound by (two divisions and a sqrt per element) where the divider is
// slow (Intel's). On AMD family 19h the divider is fast and the FMAs cost two slots each, so the
// builds for it (AMPFUSED_DIVIDER: kernels_avx2_div.cpp, kernels_avx512_div.cpp) divide, which is
// faster there (cycles and ns per element: docs/results/cpu-loops.md). Bitwise the same either way. q0 = RN(a*y) is within
// 1.5 ulp of a/c; one FMA correction brings it within 1 ulp, and then Markstein's theorem (y within
// half an ulp of 1/c, q within 1 ulp of a/c, a - c*q exact in an FMA) makes the second correction
// RN(a/c). It needs a - c*q not to underflow: here a = sqrt(v) >= 2^-74.5 or 0, c in (0, 1]. Zeros, inf
// and NaN take a*y (+-0, inf, NaN). tests/contract/test_passes.py checks every fp32 mantissa against `a / c`.
AMPFUSED_HD float div_by_constant(float a, float c, float y) {
  float q = a * y;
  q = __builtin_fmaf(__builtin_fmaf(-q, c, a), y, q);
  q = __builtin_fmaf(__builtin_fmaf(-q, c, a), y, q);
  return is_finite_f32(a) && a != 0.0f ? q : a * y;  // 0, inf, NaN: a * y keeps their sign and value
}
#endif

// adamw_element's body depends on how its file is built (FMA or two
// roundings, the divider or div_by_constant), and several CPU ISA files include it; each variant
// lives in its own inline namespace, so the linker can never merge two builds' copies under one
// name (it is always inlined today; this keeps that safe if it ever is not).
#if defined(__CUDACC__)
#define AMPFUSED_MATH_VARIANT math_cuda
#elif defined(AMPFUSED_EXACT_DIV_BY_CONSTANT)
#define AMPFUSED_MATH_VARIANT math_fma_markstein
#elif defined(__FMA__) || defined(__aarch64__) || defined(AMPFUSED_HAVE_FMA)
#define AMPFUSED_MATH_VARIANT math_fma_divider
#else
#define AMPFUSED_MATH_VARIANT math_two_roundings
#endif
inline namespace AMPFUSED_MATH_VARIANT {
// One element: w (fp32 weight or master), g (unscaled, clipped, maximize-negated grad), moments.
template <bool AMSGRAD>
AMPFUSED_HD void adamw_element(float& w, float g, float& m, float& v, float& vmax, const AdamWScalars& s) {
  w = AMPFUSED_MUL(w, s.decay);
  const float base = s.lerp_from_m ? m : g;
  m = AMPFUSED_FMA(s.lerp_coeff, AMPFUSED_ADD(g, -m), base);
  v = AMPFUSED_FMA(AMPFUSED_MUL(s.one_minus_beta2, g), g, AMPFUSED_MUL(v, s.beta2));
  float vh = v;
  if (AMSGRAD) {
    // torch.maximum: NaN wins
    vmax = (vmax < v || v != v) ? v : vmax;
    vh = vmax;
  }
#if defined(__CUDA_ARCH__)
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vh), s.bc2_sqrt), s.eps);
  w = __fadd_rn(w, __fdiv_rn(__fmul_rn(m, s.neg_step_size), denom));
#elif defined(AMPFUSED_EXACT_DIV_BY_CONSTANT)
  const float denom = div_by_constant(std::sqrt(vh), s.bc2_sqrt, s.inv_bc2_sqrt) + s.eps;
  w = w + (m * s.neg_step_size) / denom;
#else
  const float denom = std::sqrt(vh) / s.bc2_sqrt + s.eps;
  w = w + (m * s.neg_step_size) / denom;
#endif
}
}  // inline namespace AMPFUSED_MATH_VARIANT

// ------------------------------------------------------------------ the finish of the stats pass

// 1 / scale exactly as torch.amp.GradScaler computes it (in double, rounded to float); 1 without a scale.
AMPFUSED_HD float inv_scale_of(const float* grad_scale) {
  return grad_scale == nullptr ? 1.0f : static_cast<float>(1.0 / static_cast<double>(*grad_scale));
}

// Skip only on elements: `bad` says whether any unscaled element was inf/NaN; a finite sum
// that overflowed is not one: its norm is inf and, with clipping, the coefficient 0 (as torch).
// Writes every slot of the stats vector (contract.h); reference.finish_ is the specification.
// check_nonfinite = false (skip_nonfinite=False without a scaler): only found_inf skips.
AMPFUSED_HD void finish_stats(float sumsq, bool bad, const float* found_inf, float inv_scale, bool clip, float max_norm,
                              float* stats, bool check_nonfinite = true) {
#if defined(__CUDA_ARCH__)
  const float norm = __fsqrt_rn(sumsq);
#else
  const float norm = std::sqrt(sumsq);
#endif
  const bool skip = (check_nonfinite && bad) || (found_inf != nullptr && *found_inf != 0.0f);
  float factor = inv_scale;
  if (clip) {
    // torch: (max_norm / (norm + 1e-6)).clamp(max=1), where float / tensor is reciprocal() * max_norm
    const float coef = AMPFUSED_MUL(1.0f / AMPFUSED_ADD(norm, kClipEps), max_norm);
    factor = AMPFUSED_MUL(factor, coef < 1.0f || coef != coef ? coef : 1.0f);
  }
  stats[kStatsNorm] = skip && is_finite_f32(norm) ? INFINITY : norm;
  stats[kStatsSkip] = skip ? 1.0f : 0.0f;
  stats[kStatsFactor] = factor;
  stats[kStatsSumsq] = sumsq;
}

// ------------------------------------------------------------------ GradScaler.update

struct ScalerRules {
  double growth_factor, backoff_factor;  // torch multiplies the fp32 scale by the double factor
  float min_scale;                       // used when has_min_scale
  int64_t growth_interval;
  int32_t hysteresis;
  bool has_min_scale;
};

// One GradScaler.update (reference.scaler_update_ is the specification); watch gets
// [consecutive skips, scale] for the scaler's lazy collapse check (nullptr: none).
AMPFUSED_HD void scaler_update(float found_inf, float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                               int64_t* skipped_steps, int64_t* consecutive_skips, double* watch, const ScalerRules& r) {
  const bool found = found_inf != 0.0f;
  *skipped_steps += found ? 1 : 0;
  *consecutive_skips = found ? *consecutive_skips + 1 : 0;
  const int32_t hysteresis_left = found ? *hysteresis_tracker - 1 : *hysteresis_tracker;
  const bool back_off = found && hysteresis_left <= 0;
  const int32_t good_steps = found ? 0 : *growth_tracker + 1;
  const bool grow = good_steps == r.growth_interval;
  const float s = *scale;
  // torch's _amp_update_scale_ computes float * double in double
  // and rounds the result to float once: RN(s * 0.3), not RN(s * RN_float(0.3)).
#if defined(__CUDA_ARCH__)
  const float grown = static_cast<float>(__dmul_rn(static_cast<double>(s), r.growth_factor));
  float backed_off = static_cast<float>(__dmul_rn(static_cast<double>(s), r.backoff_factor));
#else
  const float grown = static_cast<float>(static_cast<double>(s) * r.growth_factor);
  float backed_off = static_cast<float>(static_cast<double>(s) * r.backoff_factor);
#endif
  if (r.has_min_scale) backed_off = backed_off < r.min_scale ? r.min_scale : backed_off;  // NaN stays NaN, as clamp
  *scale = back_off ? backed_off : (grow && is_finite_f32(grown) ? grown : s);
  *growth_tracker = grow ? 0 : good_steps;
  *hysteresis_tracker = grow ? r.hysteresis : hysteresis_left;
  if (watch != nullptr) {
    watch[0] = static_cast<double>(*consecutive_skips);
    watch[1] = static_cast<double>(*scale);
  }
}

}  // namespace ampfused
