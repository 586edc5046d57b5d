// The CPU update of tensors with compact state (DESIGN §9): split16 / split8 masters, bf16, int8
// and int4 moments, stochastic rounding. Included by each ISA file right after kernels_impl.h (whose
// widen/narrow it uses), into the same namespace; ops_cpu.cpp sends a range here when contract.h's
// is_compact says so, in the same parallel loop as the fp32 ranges.
//
// A range is walked in blocks of kConvert elements through float buffers
// in L1, one phase per job: decode the weights (join16 / join8, or the param; an fp32 master is
// stepped in place), the AdamW math with the moments read and written in their encoding (int8
// and int4 codes 256 elements at a time: [note: int8 by blocks], [note: int4 by blocks]), then encode the weights (split16 /
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
// them: where a walk through int8 or int4 moments may stop ([note: blocks in rows] in _contract.py).
inline int64_t whole_blocks(const UpdateRange& r, int64_t at, int64_t limit) {
  const int64_t row = r.row_numel;
  // rows of whole blocks, or one row: every kBlock-th element starts a block (contract.h's ragged_rows, for both kinds)
  if (row % compact::kBlock == 0 || row == r.numel) return r.end - at < limit ? r.end - at : limit;
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

// ------------------------------------------------------------------ phase 2 with int4 moments

// [note: int4 by blocks] As [note: int8 by blocks], with the codes two per byte (element 2i in the
// low nibble of byte i, [note: int4 packing]): every block starts at an even element, so the codes
// of elements at..at+n are the bytes at/2..(at+n)/2. A block is walked in three loops through L1
// buffers: decode (a 16-level lookup: one permute of the level table per vector), the math (the
// loop of step_int8, on floats), encode (y = x / scale, the count of bounds below y by a binary
// search over the ascending table, and the nibbles packed). The tables are the generated ones; any
// ascending 15 bounds and 16 levels work.
constexpr bool ascending(const float* x, int n) { return n < 2 || (x[0] < x[1] && ascending(x + 1, n - 1)); }
static_assert(ascending(compact::kInt4SignedBounds, 15) && ascending(compact::kInt4SqrtBounds, 15),
              "the int4 encoders search the bounds: they must ascend");

// GCC 12 warns of the undefined source operand inside its own AVX-512 intrinsics (GCC bug 105593)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// out[j] = levels[code of element j] * scale (SQUARE: its square) for the len (even) elements whose codes are `codes`
template <bool SQUARE>
void decode4_block(float* __restrict out, const uint8_t* __restrict codes, int64_t len, const float* levels,
                   float scale) {
  int64_t j = 0;
#if AMPFUSED_VECTOR_BYTES >= 64
  // 8 bytes zero-extended to 8 qwords; q | q << 28 holds byte i's low nibble in dword 2i's low bits
  // and its high nibble in dword 2i + 1's: vpermps reads only an index's low 4 bits
  const __m512 table = _mm512_loadu_ps(levels), s = _mm512_set1_ps(scale);
  for (; j + 16 <= len; j += 16) {
    const __m512i q = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j / 2)));
    __m512 x = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_or_si512(q, _mm512_slli_epi64(q, 28)), table), s);
    if constexpr (SQUARE) x = _mm512_mul_ps(x, x);
    _mm512_storeu_ps(out + j, x);
  }
#elif AMPFUSED_VECTOR_BYTES >= 32
  // the same with 4 bytes; the 16 levels are two 8-level halves, chosen by the index's bit 3 (moved to the sign bit)
  const __m256 low = _mm256_loadu_ps(levels), high = _mm256_loadu_ps(levels + 8), s = _mm256_set1_ps(scale);
  for (; j + 8 <= len; j += 8) {
    int32_t four;
    std::memcpy(&four, codes + j / 2, 4);
    const __m256i q = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(four));
    const __m256i idx = _mm256_or_si256(q, _mm256_slli_epi64(q, 28));
    const __m256 pick = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    __m256 x = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx), _mm256_permutevar8x32_ps(high, idx), pick);
    x = _mm256_mul_ps(x, s);
    if constexpr (SQUARE) x = _mm256_mul_ps(x, x);
    _mm256_storeu_ps(out + j, x);
  }
#endif
  for (; j < len; j += 2) {  // the baseline build, and the last elements of a row shorter than a vector
    const uint8_t byte = codes[j / 2];
    const float a = levels[byte & 0xF] * scale, b = levels[byte >> 4] * scale;
    out[j] = SQUARE ? a * a : a;
    out[j + 1] = SQUARE ? b * b : b;
  }
}

// The code of y: the number of the 15 ascending bounds strictly below it, a non-finite y counted as 0.
AMPFUSED_HD uint32_t code4(float y, const float* bounds) {
  const float x = abs_bits(y) < 0x7F800000u ? y : 0.0f;
  uint32_t k = 0;
  for (int i = 0; i < 15; ++i) k += x > bounds[i] ? 1u : 0u;
  return k;
}

// The packed codes of x[j] / scale for the len (even) elements of one block.
void encode4_block(uint8_t* __restrict codes, const float* __restrict x, int64_t len, const float* bounds,
                   float scale) {
  int64_t j = 0;
  // scale is the block's max |x|: where it is finite and not 0, every |y| <= 1 is finite (no select needed)
  [[maybe_unused]] const bool bounded = abs_bits(scale) - 1u < 0x7F800000u - 1u;
#if AMPFUSED_VECTOR_BYTES >= 64
  // binary search: k grows by 8, 4, 2, 1 where y is above bound k + step - 1 (bound 7 first, then
  // indices up to 14, read by a permute of the table); each k dword pair becomes one byte (k_odd << 4 | k_even) by a qword
  // shift and vpmovqb
  const __m512 table = _mm512_maskz_loadu_ps(0x7FFF, bounds), s = _mm512_set1_ps(scale), middle = _mm512_set1_ps(bounds[7]);
  const __m512i inf_bits = _mm512_set1_epi32(0x7F800000), magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  for (; j + 16 <= len; j += 16) {
    __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + j), s);
    if (!bounded) {
      const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), magnitude);
      y = _mm512_maskz_mov_ps(_mm512_cmplt_epi32_mask(a, inf_bits), y);
    }
    __m512i k = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, middle, _CMP_GT_OQ), _mm512_set1_epi32(8));
    for (int step = 4; step >= 1; step /= 2) {
      const __m512i step_v = _mm512_set1_epi32(step);
      const __m512 bound = _mm512_permutexvar_ps(_mm512_add_epi32(k, _mm512_set1_epi32(step - 1)), table);
      k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(y, bound, _CMP_GT_OQ), k, step_v);
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + j / 2),
                     _mm512_cvtepi64_epi8(_mm512_or_si512(k, _mm512_srli_epi64(k, 28))));
  }
#elif AMPFUSED_VECTOR_BYTES >= 32
  // 15 comparisons (a 16-entry permute is two on AVX2); each k dword pair becomes one byte by a
  // qword shift, and the 4 bytes are gathered by one byte shuffle per 128-bit lane
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i inf_bits = _mm256_set1_epi32(0x7F800000), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i gather = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (; j + 8 <= len; j += 8) {
    __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + j), s);
    if (!bounded) {
      const __m256i a = _mm256_and_si256(_mm256_castps_si256(y), magnitude);
      y = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_cmpgt_epi32(inf_bits, a)));
    }
    __m256i k = _mm256_setzero_si256();
    for (int i = 0; i < 15; ++i) {  // a true comparison is all ones: -1
      k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(bounds[i]), _CMP_GT_OQ)));
    }
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_or_si256(k, _mm256_srli_epi64(k, 28)), gather);
    const int32_t four = _mm_cvtsi128_si32(_mm_or_si128(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)));
    std::memcpy(codes + j / 2, &four, 4);
  }
#endif
  for (; j < len; j += 2) {  // the baseline build, and the last elements of a row shorter than a vector
    codes[j / 2] = static_cast<uint8_t>(code4(x[j] / scale, bounds) | code4(x[j + 1] / scale, bounds) << 4);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

template <bool AMSGRAD>
void step_int4(float* __restrict w, const float* __restrict g, const UpdateRange& r, int64_t at, int64_t n) {
  const Setup st(r, at);
  uint8_t* __restrict mc = static_cast<uint8_t*>(st.m) + at / 2;
  uint8_t* __restrict vc = static_cast<uint8_t*>(st.v) + at / 2;
  uint8_t* __restrict xc = AMSGRAD ? static_cast<uint8_t*>(st.vmax) + at / 2 : nullptr;
  float* __restrict m_scale = r.exp_avg_scales;
  float* __restrict v_scale = r.exp_avg_sq_scales;
  float* __restrict x_scale = AMSGRAD ? r.max_exp_avg_sq_scales : nullptr;
  float mb[compact::kBlock], vb[compact::kBlock], xb[compact::kBlock];
  const int64_t row = r.row_numel, per_row = (row + compact::kBlock - 1) / compact::kBlock;
  for (int64_t b = 0, len = 0; b < n; b += len) {
    const int64_t e = at + b, in_row = e % row;
    len = row - in_row < compact::kBlock ? row - in_row : compact::kBlock;
    len = n - b < len ? n - b : len;
    const int64_t blk = e / row * per_row + in_row / compact::kBlock;
    decode4_block<false>(mb, mc + b / 2, len, compact::kInt4SignedLevels, m_scale[blk]);
    decode4_block<true>(vb, vc + b / 2, len, compact::kInt4SqrtLevels, v_scale[blk]);
    if (AMSGRAD) decode4_block<true>(xb, xc + b / 2, len, compact::kInt4SqrtLevels, x_scale[blk]);
    uint32_t m_max = 0, v_max = 0, x_max = 0;
    for (int64_t j = 0; j < len; ++j) {
      float mi = mb[j], vi = vb[j], xi = AMSGRAD ? xb[j] : 0.f;
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
    encode4_block(mc + b / 2, mb, len, compact::kInt4SignedBounds, m_new);
    encode4_block(vc + b / 2, vb, len, compact::kInt4SqrtBounds, v_new);
    if (AMSGRAD) encode4_block(xc + b / 2, xb, len, compact::kInt4SqrtBounds, x_new);
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
  } else if (r.moment_kind == kMomentInt4) {  // [note: int4 by blocks]
    step = amsgrad ? &step_int4<true> : &step_int4<false>;
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
  const bool blockwise = r.moment_kind == kMomentInt8 || r.moment_kind == kMomentInt4;
  for (int64_t at = r.begin, n = 0; at < r.end; at += n) {
    n = blockwise ? whole_blocks(r, at, kConvert) : (r.end - at < kConvert ? r.end - at : kConvert);
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
