// The CPU update of tensors with compact state (DESIGN §9): split16 / split8 masters, bf16 and
// int8 moments, stochastic rounding. Included by each ISA file right after kernels_impl.h (whose
// widen/narrow it uses), into the same namespace; ops_cpu.cpp sends a range here when contract.h's
// is_compact says so, in the same parallel loop as the fp32 ranges.
//
// A range is walked in blocks of kConvert elements through float buffers
// in L1, one phase per job: decode the weights (join16 / join8, or the param; an fp32 master is
// stepped in place), the AdamW math with the moments read and written in their encoding (int8
// codes 256 elements at a time: [note: int8 by blocks]), then encode the weights (split16 /
// split8, or the param RNE or stochastically rounded). Each phase is a
// branch-free loop templated on its own choices only (param type x master kind, moment kind x
// amsgrad x rounding), so few instantiations cover every combination and each one vectorizes.
// The math is adamw_element, the fp32 path's, so split16 reproduces the fp32-master step bitwise.
#ifndef AMPFUSED_ISA
#error "include compact_update.h from an ISA file, after kernels_impl.h"
#endif

#include "../compact_math.h"
#include "../compact_random.h"

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {
namespace compact_loop {

using compact::element_hash;
using compact::random_word;

// The master encodings with a fixed element type (kMasterF32 without a master is kNone).
constexpr int kNone = -1;

// What every element loop reads from its range, gathered once: the step's
// scalars, the gradient factor, the moment buffers (cast by the caller's moment kind) and the
// stochastic-rounding key of elements at + j, counted from the whole tensor's first element
// (element_base + at + j; compact_random.h).
struct Setup {
  AdamWScalars s;
  float factor;
  void* m;
  void* v;
  void* vmax;  // nullptr without AMSGrad
  uint32_t k0, key;

  Setup(const UpdateRange& r, int64_t at)
      : s(*r.scalars), factor(r.factor), m(r.exp_avg), v(r.exp_avg_sq), vmax(r.max_exp_avg_sq),
        k0(static_cast<uint32_t>(r.element_base + at)), key(r.rounding_key) {}

  // random word 0 (exp_avg low half, exp_avg_sq high half) or 1 (max_exp_avg_sq low half, the
  // param high half) of element at + j
  AMPFUSED_HD uint32_t bits(int64_t j, int word) const {
    return random_word(element_hash(k0 + static_cast<uint32_t>(j), key), word);
  }
};

using LoadFn = float* (*)(float*, const UpdateRange&, int64_t, int64_t);  // returns where the weights are
using StepFn = void (*)(float*, const float*, const UpdateRange&, int64_t, int64_t);
using StoreFn = void (*)(const float*, float*, const UpdateRange&, int64_t, int64_t);

// compact::split16 with its tie rule as one integer step: at a tie (low half 0x8000) the master
// moves one fp32 ulp toward RNE's side (down when the high half is even, up when odd), and then
// rounding half up is RNE and carries the same high half (bitwise compact::split16; fewer vector
// operations than its branches become).
AMPFUSED_HD void split16_bits(float w, uint16_t& param_bits, uint16_t& low) {
  const uint32_t u = compact::bits_of(w);
  const uint32_t lsb = (u >> 16) & 1u;
  const uint32_t moved = (u & 0xFFFFu) == 0x8000u ? u + 2u * lsb - 1u : u;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  param_bits = static_cast<uint16_t>(nan ? (u >> 16) | 0x40u : (moved + 0x8000u) >> 16);
  low = static_cast<uint16_t>(nan ? 0u : moved & 0xFFFFu);
}

// ------------------------------------------------------------------ phase 1: decode the weights

// The weights of elements at..at+n as floats: an fp32 master is stepped where it lies (no copy),
// the others are decoded into w.
template <typename P, int MK>
float* load_weights(float* __restrict w, const UpdateRange& r, int64_t at, int64_t n) {
  const P* __restrict p = static_cast<const P*>(r.param) + at;
  if constexpr (MK == kMasterF32) {
    return r.master + at;
  } else if constexpr (MK == kMasterSplit16) {
    const uint16_t* __restrict low = reinterpret_cast<const uint16_t*>(r.master) + at;
    for (int64_t j = 0; j < n; ++j) w[j] = compact::join16(p[j].x, low[j]);
  } else {
    widen(w, p, n);  // the param itself (exact), F16C for fp16 where the build has it
    if constexpr (MK == kMasterSplit8) {
      constexpr bool kFp16 = std::is_same<P, Half>::value;
      const int8_t* __restrict q = reinterpret_cast<const int8_t*>(r.master) + at;
      for (int64_t j = 0; j < n; ++j) {
        // join8 of compact_math.h on the widened param: p + q ulp(p)/256 (exact); for q == 0 the
        // correction is -0, so p + (-0) keeps p bit for bit (-0, inf, NaN too) with no branch: a
        // conditional float add is not if-converted under trapping math, and the loop would not vectorize
        const int qj = q[j];
        const float fix = compact::scale_pow2(static_cast<float>(qj), compact::ulp_exponent16(p[j].x, kFp16) - 8);
        w[j] = w[j] + compact::float_of(compact::bits_of(fix) | (qj == 0 ? 0x80000000u : 0u));
      }
    }
  }
  return w;
}

// ------------------------------------------------------------------ phase 2: the AdamW math

template <bool BF16, bool SR>
AMPFUSED_HD void put_moment(void* base, int64_t j, float x, uint32_t rand16) {
  if constexpr (BF16) {
    static_cast<uint16_t*>(base)[j] = SR ? compact::bf16_sr_bits(x, rand16) : compact::bf16_rne_bits(x);
  } else {
    static_cast<float*>(base)[j] = x;
  }
}

template <bool BF16>
AMPFUSED_HD float get_moment(const void* base, int64_t j) {
  if constexpr (BF16) {
    return compact::bf16_to_float(static_cast<const uint16_t*>(base)[j]);
  } else {
    return static_cast<const float*>(base)[j];
  }
}

// The math of element j (global index at + j) on moments of type M (float or bf16 bits): read,
// adamw_element, write back (bf16: RNE or stochastic); w in and out.
template <bool BF16, bool AMSGRAD, bool SR>
AMPFUSED_HD void step_element(float& w, float g, const Setup& st, int64_t j) {
  using M = std::conditional_t<BF16, uint16_t, float>;
  M* __restrict m = static_cast<M*>(st.m);
  M* __restrict v = static_cast<M*>(st.v);
  M* __restrict vmax = static_cast<M*>(st.vmax);
  float mi = get_moment<BF16>(m, j);
  float vi = get_moment<BF16>(v, j);
  float vmaxi = AMSGRAD ? get_moment<BF16>(vmax, j) : 0.f;
  adamw_element<AMSGRAD>(w, g * st.factor, mi, vi, vmaxi, st.s);
  const uint32_t bits_a = SR ? st.bits(j, 0) : 0u;
  put_moment<BF16, SR>(m, j, mi, bits_a & 0xFFFFu);
  put_moment<BF16, SR>(v, j, vi, bits_a >> 16);
  if (AMSGRAD) put_moment<BF16, SR>(vmax, j, vmaxi, SR ? st.bits(j, 1) & 0xFFFFu : 0u);
}

// w: the decoded weights in, the new weights out; g: the raw gradient (times the factor here).
template <bool BF16, bool AMSGRAD, bool SR>
void step_moments(float* __restrict w, const float* __restrict g, const UpdateRange& r, int64_t at, int64_t n) {
  using M = std::conditional_t<BF16, uint16_t, float>;
  Setup st(r, at);
  st.m = static_cast<M*>(st.m) + at;
  st.v = static_cast<M*>(st.v) + at;
  if (AMSGRAD) st.vmax = static_cast<M*>(st.vmax) + at;
  for (int64_t j = 0; j < n; ++j) step_element<BF16, AMSGRAD, SR>(w[j], g[j], st, j);
}

// ------------------------------------------------------------------ phase 2 with int8 moments

// [note: int8 by blocks] A range and each walk through it start and end on block boundaries
// (ops_cpu.cpp range_end, whole_blocks; blocks within rows), so each block is stepped whole: decode its codes with the old
// scale, the math (the new fp32 moments into L1 buffers, with their running maxima), then the
// new scales (max |m|, max sqrt(v): the specification's amax, NaN included, from the bit patterns
// of non-negative floats, whose order is their value's) and the codes of the new moments. sqrt(v)
// is correctly rounded, as the specification's float64 sqrt rounded to fp32.
AMPFUSED_HD uint32_t abs_bits(float x) { return compact::bits_of(x) & 0x7FFFFFFFu; }

// Branch-free twins of compact_math.h's int8 codecs (the same bits, selects instead of early
// returns, so that the block loops vectorize; tests/compact/test_update_matches_spec.py holds them to the
// specification). unit_code: |y| to its grid code, 0 for a non-finite y.
template <int MANT, int ONE>
AMPFUSED_HD uint32_t unit_code(float y) {
  constexpr int kDrop = 23 - MANT;
  const uint32_t u = abs_bits(y);
  const uint32_t normal = ((u + ((1u << (kDrop - 1)) - 1u) + ((u >> kDrop) & 1u)) >> kDrop) - (112u << MANT);
  // below 2^-14, k = RNE(|y| 2^(14 + MANT)): adding 2^(9 - MANT), whose ulp is the grid step
  // 2^(-14 - MANT), rounds |y| to the grid (RNE) and leaves the count in the low mantissa bits
  // (every |y| < 2^-14 checked against rintf for both grids)
  constexpr float kShift = static_cast<float>(1 << 9) / static_cast<float>(1 << MANT);
  const uint32_t sub = compact::bits_of(compact::float_of(u) + kShift) - compact::bits_of(kShift);
  uint32_t k = u >= 0x38800000u ? normal : sub;  // |y| >= 2^-14: RNE of the fp32 bits to MANT mantissa bits
  k = k > static_cast<uint32_t>(ONE) ? static_cast<uint32_t>(ONE) : k;
  return u >= 0x7F800000u ? 0u : k;
}

// The grid value of code k from its bits: for f >= 1 the code shifted into an fp32 mantissa and
// exponent (rebiased by 112) is the value; for f = 0 the same bits with the exponent of f = 1 are
// 2^-14 + t 2^(-14 - MANT), and subtracting 2^-14 leaves t 2^(-14 - MANT), exactly (Sterbenz). No
// subnormal is read (DAZ-safe), and the subtraction is unconditional (a float operation under a
// condition stays a branch and the loop would not vectorize): 0 for f >= 1.
template <int MANT>
AMPFUSED_HD float unit_value(uint32_t k) {
  const bool sub = k < (1u << MANT);
  const uint32_t bits = (k << (23 - MANT)) + ((sub ? 113u : 112u) << 23);
  return compact::float_of(bits) - (sub ? 6.103515625e-05f : 0.0f);  // 2^-14
}

AMPFUSED_HD int8_t signed_code(float y) {
  const uint32_t k = unit_code<compact::kSignedMant, compact::kSignedOne>(y);
  return static_cast<int8_t>(compact::bits_of(y) >> 31 ? 0u - k : k);
}

AMPFUSED_HD float decode_signed(int8_t code, float scale) {
  const int32_t c = code;
  const float v = unit_value<compact::kSignedMant>(static_cast<uint32_t>(c < 0 ? -c : c));
  return compact::float_of(compact::bits_of(v) | (c < 0 ? 0x80000000u : 0u)) * scale;
}

// exp_avg_sq / max_exp_avg_sq: the code of root = sqrt(v), and v back from a code
AMPFUSED_HD uint8_t sqrt_code(float y) {
  return static_cast<uint8_t>(unit_code<compact::kSqrtMant, compact::kSqrtOne>(y));
}

AMPFUSED_HD float decode_sqrt(uint8_t code, float scale) {
  const float r = unit_value<compact::kSqrtMant>(code) * scale;
  return r * r;
}

// The codes of one block's new moments: one loop per moment (each vectorizes on its own).
template <typename C, C (*CODE)(float)>
void encode_block(C* __restrict out, const float* __restrict x, int64_t len, float scale) {
  for (int64_t j = 0; j < len; ++j) out[j] = CODE(x[j] / scale);
}

// The elements from `at` (a block boundary) to the end of the last whole block within `limit` of
// them: where a walk through int8 moments may stop ([note: blocks in rows] in _contract.py).
inline int64_t whole_blocks(const UpdateRange& r, int64_t at, int64_t limit) {
  const int64_t row = r.row_numel;
  if (!ragged_rows(r)) return r.end - at < limit ? r.end - at : limit;
  int64_t n = 0;
  for (;;) {
    const int64_t rest = row - (at + n) % row;
    const int64_t len = rest < compact::kBlock ? rest : compact::kBlock;
    if (at + n >= r.end || n + len > limit) return n;
    n += len;
  }
}

template <bool AMSGRAD>
void step_int8(float* __restrict w, const float* __restrict g, const UpdateRange& r, int64_t at, int64_t n) {
  const Setup st(r, at);
  int8_t* __restrict mc = static_cast<int8_t*>(st.m) + at;
  uint8_t* __restrict vc = static_cast<uint8_t*>(st.v) + at;
  uint8_t* __restrict xc = AMSGRAD ? static_cast<uint8_t*>(st.vmax) + at : nullptr;
  float* __restrict m_scale = r.exp_avg_scales;
  float* __restrict v_scale = r.exp_avg_sq_scales;
  float* __restrict x_scale = AMSGRAD ? r.max_exp_avg_sq_scales : nullptr;
  float mb[compact::kBlock], vb[compact::kBlock], xb[compact::kBlock];
  // blocks within rows ([note: blocks in rows]): block `blk` of row e / row_numel, cut short at the row's end
  const int64_t row = r.row_numel, per_row = (row + compact::kBlock - 1) / compact::kBlock;
  for (int64_t b = 0, len = 0; b < n; b += len) {
    const int64_t e = at + b, in_row = e % row;
    len = row - in_row < compact::kBlock ? row - in_row : compact::kBlock;
    len = n - b < len ? n - b : len;
    const int64_t blk = e / row * per_row + in_row / compact::kBlock;
    const float ms = m_scale[blk], vs = v_scale[blk], xs = AMSGRAD ? x_scale[blk] : 0.f;
    uint32_t m_max = 0, v_max = 0, x_max = 0;
    for (int64_t j = 0; j < len; ++j) {
      float mi = decode_signed(mc[b + j], ms);
      float vi = decode_sqrt(vc[b + j], vs);
      float xi = AMSGRAD ? decode_sqrt(xc[b + j], xs) : 0.f;
      adamw_element<AMSGRAD>(w[b + j], g[b + j] * st.factor, mi, vi, xi, st.s);
      mb[j] = mi;
      vb[j] = std::sqrt(vi);
      m_max = m_max > abs_bits(mi) ? m_max : abs_bits(mi);
      v_max = v_max > abs_bits(vb[j]) ? v_max : abs_bits(vb[j]);
      if (AMSGRAD) {
        xb[j] = std::sqrt(xi);
        x_max = x_max > abs_bits(xb[j]) ? x_max : abs_bits(xb[j]);
      }
    }
    const float m_new = compact::float_of(m_max), v_new = compact::float_of(v_max), x_new = compact::float_of(x_max);
    encode_block<int8_t, &signed_code>(mc + b, mb, len, m_new);
    encode_block<uint8_t, &sqrt_code>(vc + b, vb, len, v_new);
    if (AMSGRAD) encode_block<uint8_t, &sqrt_code>(xc + b, xb, len, x_new);
    m_scale[blk] = m_new;
    v_scale[blk] = v_new;
    if (AMSGRAD) x_scale[blk] = x_new;
  }
}

// ------------------------------------------------------------------ phase 3: encode the weights

template <typename P, int MK, bool SR>
void store_weights(const float* __restrict w, float* __restrict tmp, const UpdateRange& r, int64_t at, int64_t n) {
  P* __restrict p = static_cast<P*>(r.param) + at;
  if constexpr (MK == kMasterSplit16) {
    uint16_t* __restrict low = reinterpret_cast<uint16_t*>(r.master) + at;
    for (int64_t j = 0; j < n; ++j) split16_bits(w[j], p[j].x, low[j]);
  } else if constexpr (MK == kMasterSplit8) {
    constexpr bool kFp16 = std::is_same<P, Half>::value;
    int8_t* __restrict q = reinterpret_cast<int8_t*>(r.master) + at;
    narrow(p, w, n);    // p = RNE(w), as split8's param
    widen(tmp, p, n);   // and back, exactly, for the residual
    for (int64_t j = 0; j < n; ++j) {
      const float t = compact::scale_pow2(w[j] - tmp[j], 8 - compact::ulp_exponent16(p[j].x, kFp16));  // exact
      float c = rintf(t);
      c = c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c);
      q[j] = static_cast<int8_t>(is_finite_f32(t) ? c : 0.0f);
    }
  } else {
    // (an fp32 master was stepped in place: w is the master)
    if constexpr (SR && MK == kNone && std::is_same<P, BFloat16>::value) {
      // a bf16 param without a master: stochastic (the param's stream, see compact_random.h)
      const Setup st(r, at);
      for (int64_t j = 0; j < n; ++j) p[j].x = compact::bf16_sr_bits(w[j], st.bits(j, 1) >> 16);
    } else if constexpr (MK == kNone && std::is_same<P, BFloat16>::value) {
      for (int64_t j = 0; j < n; ++j) p[j].x = compact::bf16_rne_bits(w[j]);  // as round_bf16 (NaN stays quiet)
    } else {
      narrow(p, w, n);  // RNE, as the fp32 path writes the param
    }
  }
}

// The unscaled gradient written back (with a grad scale), as the fp32 path does.
template <typename G>
void store_unscaled(const float* __restrict g, float* __restrict tmp, const UpdateRange& r, int64_t at, int64_t n) {
  G* __restrict out = static_cast<G*>(r.grad_out) + at;
  const float unscale = r.unscale;
  if constexpr (std::is_same<G, float>::value) {
    for (int64_t j = 0; j < n; ++j) out[j] = g[j] * unscale;
  } else {
    for (int64_t j = 0; j < n; ++j) tmp[j] = g[j] * unscale;
    narrow(out, tmp, n);
  }
}

// ------------------------------------------------------------------ split16 in one loop

// [note: fused split16] The mode that must be as fast as the fp32-master step gets the three phases
// in one loop: join16, the math and split16 per element, with no weight buffer in between.
template <bool BF16, bool AMSGRAD, bool SR>
void split16_step(float* __restrict /*unused*/, const float* __restrict g, const UpdateRange& r, int64_t at, int64_t n) {
  using M = std::conditional_t<BF16, uint16_t, float>;
  uint16_t* __restrict p = static_cast<uint16_t*>(r.param) + at;
  uint16_t* __restrict low = reinterpret_cast<uint16_t*>(r.master) + at;
  Setup st(r, at);
  st.m = static_cast<M*>(st.m) + at;
  st.v = static_cast<M*>(st.v) + at;
  if (AMSGRAD) st.vmax = static_cast<M*>(st.vmax) + at;
  for (int64_t j = 0; j < n; ++j) {
    float w = compact::join16(p[j], low[j]);
    step_element<BF16, AMSGRAD, SR>(w, g[j], st, j);
    split16_bits(w, p[j], low[j]);
  }
}

template <bool BF16>
StepFn split16_for_m(bool amsgrad, bool sr) {
  if (amsgrad) return sr ? &split16_step<BF16, true, true> : &split16_step<BF16, true, false>;
  return sr ? &split16_step<BF16, false, true> : &split16_step<BF16, false, false>;
}

float* no_weights(float* w, const UpdateRange&, int64_t, int64_t) { return w; }
void no_store(const float*, float*, const UpdateRange&, int64_t, int64_t) {}

// ------------------------------------------------------------------ choosing the phases

template <typename P, int MK>
LoadFn pick_load() { return &load_weights<P, MK>; }

template <typename P>
LoadFn load_for(int mk) {
  switch (mk) {
    case kMasterF32: return pick_load<P, kMasterF32>();
    case kNone: return pick_load<P, kNone>();
    default: break;
  }
  if constexpr (std::is_same<P, BFloat16>::value) {
    if (mk == kMasterSplit16) return pick_load<P, kMasterSplit16>();
  }
  if constexpr (!std::is_same<P, float>::value) {
    if (mk == kMasterSplit8) return pick_load<P, kMasterSplit8>();
  }
  return nullptr;
}

template <typename P, bool SR>
StoreFn store_for_sr(int mk) {
  switch (mk) {
    case kMasterF32: return &store_weights<P, kMasterF32, SR>;
    case kNone: return &store_weights<P, kNone, SR>;
    default: break;
  }
  if constexpr (std::is_same<P, BFloat16>::value) {
    if (mk == kMasterSplit16) return &store_weights<P, kMasterSplit16, SR>;
  }
  if constexpr (!std::is_same<P, float>::value) {
    if (mk == kMasterSplit8) return &store_weights<P, kMasterSplit8, SR>;
  }
  return nullptr;
}

template <typename P>
StoreFn store_for(int mk, bool sr) { return sr ? store_for_sr<P, true>(mk) : store_for_sr<P, false>(mk); }

template <bool BF16>
StepFn step_for_m(bool amsgrad, bool sr) {
  if (amsgrad) return sr ? &step_moments<BF16, true, true> : &step_moments<BF16, true, false>;
  return sr ? &step_moments<BF16, false, true> : &step_moments<BF16, false, false>;
}

template <typename G>
void grad_block(const UpdateRange& r, int64_t at, int64_t n, float* buf, const float*& out) {
  if constexpr (std::is_same<G, float>::value) {
    out = static_cast<const float*>(r.grad) + at;
  } else {
    widen(buf, static_cast<const G*>(r.grad) + at, n);
    out = buf;
  }
}

}  // namespace compact_loop

void compact_update(const UpdateRange& r) {
  using namespace compact_loop;
  // SR applies to bf16 writes without an exact master: bf16 moments, and a bf16 param without one
  const bool sr = r.stochastic != 0;
  const int mk = r.master == nullptr ? kNone : r.master_kind;
  LoadFn load = nullptr;
  StoreFn store = nullptr;
  switch (r.param_dtype) {
    case kF32: load = load_for<float>(mk); store = store_for<float>(mk, false); break;
    case kF16: load = load_for<Half>(mk); store = store_for<Half>(mk, false); break;
    default: load = load_for<BFloat16>(mk); store = store_for<BFloat16>(mk, sr); break;
  }
  const bool amsgrad = r.max_exp_avg_sq != nullptr;
  StepFn step = r.moment_kind == kMomentBF16 ? step_for_m<true>(amsgrad, sr) : step_for_m<false>(amsgrad, false);
  if (r.moment_kind == kMomentInt8) {  // [note: int8 by blocks]: codes are never rounded stochastically
    step = amsgrad ? &step_int8<true> : &step_int8<false>;
  } else if (mk == kMasterSplit16) {  // [note: fused split16]
    load = &no_weights;
    store = &no_store;
    step = r.moment_kind == kMomentBF16 ? split16_for_m<true>(amsgrad, sr) : split16_for_m<false>(amsgrad, false);
  }
  StoreFn unscaled = nullptr;
  if (r.grad_out != nullptr) {
    unscaled = r.grad_dtype == kF32 ? &store_unscaled<float> : r.grad_dtype == kF16 ? &store_unscaled<Half>
                                                                                    : &store_unscaled<BFloat16>;
  }
  if (load == nullptr || store == nullptr) return;  // unreachable: collect_update checked the pairs
  float wbuf[kConvert], gbuf[kConvert], tmp[kConvert];
  const bool int8 = r.moment_kind == kMomentInt8;
  for (int64_t at = r.begin, n = 0; at < r.end; at += n) {
    n = int8 ? whole_blocks(r, at, kConvert) : (r.end - at < kConvert ? r.end - at : kConvert);
    const float* g;
    switch (r.grad_dtype) {
      case kF32: grad_block<float>(r, at, n, gbuf, g); break;
      case kF16: grad_block<Half>(r, at, n, gbuf, g); break;
      default: grad_block<BFloat16>(r, at, n, gbuf, g); break;
    }
    float* w = load(wbuf, r, at, n);
    step(w, g, r, at, n);
    store(w, tmp, r, at, n);
    if (unscaled != nullptr) unscaled(g, tmp, r, at, n);
  }
}

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
