// The CUDA update of a chunk of a tensor with compact state (DESIGN §9): split16 / split8 masters,
// bf16, int8 and int4 moments, stochastic rounding. Device code only, included by passes.cu, whose
// compact update variant sends a chunk here when contract.h's is_compact says so: compact and fp32
// tensors share the one update launch.
//
// A warp takes 256 consecutive elements at a time, one scale block of
// int8 / int4 codes (chunks start on multiples of 256 within a tensor), and each lane 4 of them at
// 4*lane and 4 at 128 + 4*lane, so each load of the warp reads one contiguous run. The new scale of
// a block is the maximum of its new magnitudes, reduced over the warp with shuffles (NaN wins, as
// the specification's amax): no shared memory, no barrier, no second pass. A lane's 4 elements of
// int4 codes are 2 whole bytes (blocks and rows start on an even element, [note: int4 packing] in
// _contract.py), so no two lanes share a byte. Every other mode is walked
// the same way. Per element it is the CPU's compact update (cpu/compact_update.h) with the same
// functions: decode the master and moments (compact_math.h), adamw_element, encode; stochastic
// rounding takes the same counter-based bits (compact_random.h), so both devices give the same bits.
#pragma once

#include <cuda_runtime.h>

#include "../adamw_math.h"
#include "../compact_math.h"
#include "../compact_random.h"
#include "../contract.h"
#include "../dtypes.h"

namespace ampfused {
namespace cuda {

// [note: global accesses] Tensor pointers reach the kernels through a device table or a copy of a
// record, so the compiler cannot tell their space and emits generic LD/ST, which the SM must
// resolve against the shared and local windows first and which may alias shared memory as far as
// the compiler knows. Every tensor access goes through global(), which tells it (LDG/STG in the SASS;
// tests/contract/sm90_compile.py counts them). It is applied where the pointer is dereferenced, so
// a null pointer never meets the assumption. On the host (the emulation) it is the identity.
template <typename T>
__device__ __forceinline__ T* global(T* p) {
#if defined(__CUDA_ARCH__)
  __builtin_assume(__isGlobal(p));
#endif
  return p;
}

namespace compact_pass {

constexpr int kWarp = 32;
constexpr int kGroup = compact::kBlock;  // the elements a warp takes at a time: one scale block
constexpr int kHalfGroup = kGroup / 2;   // a lane's second part starts here
static_assert(kGroup == 8 * kWarp, "a lane holds two 4-element parts of a group");

// A lane's 8 elements of a group: part h is elements [at[h], at[h] + n[h]) of the tensor (n in 0..4).
struct Lane {
  int64_t at[2];
  int n[2];
};

template <typename T>
struct alignas(4 * sizeof(T)) Raw4 {
  T v[4];
};

struct alignas(2) Raw2Bytes {
  uint8_t v[2];
};

// Elements [0, n) of the 4 at p into out (the rest keep their values); one vector access when vec and n == 4.
template <typename T>
__device__ __forceinline__ void load_part(const T* p, int n, bool vec, T out[4]) {
  p = global(p);
  if (vec && n == 4) {
    const Raw4<T> r = *reinterpret_cast<const Raw4<T>*>(p);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = r.v[j];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < n) out[j] = p[j];
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_part(T* p, int n, bool vec, const T in[4]) {
  p = global(p);
  if (vec && n == 4) {
    Raw4<T> r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = in[j];
    *reinterpret_cast<Raw4<T>*>(p) = r;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < n) p[j] = in[j];
    }
  }
}

// The int4 codes of the 4 elements at `at` (n valid, even): bytes [at / 2, at / 2 + n / 2) of the
// packed moment; one 2-byte access when vec and n == 4 (at is then a multiple of 4).
__device__ __forceinline__ void load_codes4(const float* base, int64_t at, int n, bool vec, uint8_t out[2]) {
  const uint8_t* p = global(reinterpret_cast<const uint8_t*>(base) + (at >> 1));
  if (vec && n == 4) {
    const Raw2Bytes r = *reinterpret_cast<const Raw2Bytes*>(p);
    out[0] = r.v[0];
    out[1] = r.v[1];
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (2 * j < n) out[j] = p[j];
    }
  }
}

__device__ __forceinline__ void store_codes4(float* base, int64_t at, int n, bool vec, const uint8_t in[2]) {
  uint8_t* p = global(reinterpret_cast<uint8_t*>(base) + (at >> 1));
  if (vec && n == 4) {
    Raw2Bytes r;
    r.v[0] = in[0];
    r.v[1] = in[1];
    *reinterpret_cast<Raw2Bytes*>(p) = r;
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (2 * j < n) p[j] = in[j];
    }
  }
}

// A param or gradient of dtype code `dtype` as fp32 (exact), and back (RNE, as the fp32 path writes it).
__device__ __forceinline__ void load_floats(const void* base, int32_t dtype, int64_t at, int n, bool vec, float out[4]) {
  if (dtype == kF32) {
    load_part(static_cast<const float*>(base) + at, n, vec, out);
    return;
  }
  uint16_t bits[4] = {0, 0, 0, 0};
  load_part(static_cast<const uint16_t*>(base) + at, n, vec, bits);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = dtype == kF16 ? to_float(Half{bits[j]}) : to_float(BFloat16{bits[j]});
}

__device__ __forceinline__ void store_floats(void* base, int32_t dtype, int64_t at, int n, bool vec, const float in[4]) {
  if (dtype == kF32) {
    store_part(static_cast<float*>(base) + at, n, vec, in);
    return;
  }
  uint16_t bits[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bits[j] = dtype == kF16 ? from_float<Half>(in[j]).x : from_float<BFloat16>(in[j]).x;
  store_part(static_cast<uint16_t*>(base) + at, n, vec, bits);
}

// ------------------------------------------------------------------ decode

// The fp32 weights of 4 elements at `at` (n valid): the fp32 master, the param joined with its low
// half (split16) or residual (split8), or the param itself.
__device__ __forceinline__ void load_weights(const UpdateTensor& t, int64_t at, int n, bool vec, float out[4]) {
  if (t.master != nullptr && t.master_kind == kMasterF32) {
    load_part(t.master + at, n, vec, out);
  } else if (t.master == nullptr) {
    load_floats(t.param, t.param_dtype, at, n, vec, out);
  } else {  // split16 / split8: a 16-bit param (the op's checks)
    uint16_t bits[4] = {0, 0, 0, 0};
    load_part(static_cast<const uint16_t*>(t.param) + at, n, vec, bits);
    if (t.master_kind == kMasterSplit16) {
      uint16_t low[4] = {0, 0, 0, 0};
      load_part(reinterpret_cast<const uint16_t*>(t.master) + at, n, vec, low);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] = compact::join16(bits[j], low[j]);
    } else {
      int8_t q[4] = {0, 0, 0, 0};
      load_part(reinterpret_cast<const int8_t*>(t.master) + at, n, vec, q);
      const bool fp16 = t.param_dtype == kF16;
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] = compact::join8(bits[j], fp16, q[j]);
    }
  }
}

// One moment of 4 elements: fp32, bf16, or int8/uint8 or int4 codes decoded with their block's scale.
__device__ __forceinline__ void load_moment(const float* base, int32_t kind, bool signed_codes, float scale, int64_t at,
                                            int n, bool vec, float out[4]) {
  if (kind == kMomentF32) {
    load_part(base + at, n, vec, out);
  } else if (kind == kMomentBF16) {
    uint16_t bits[4] = {0, 0, 0, 0};
    load_part(reinterpret_cast<const uint16_t*>(base) + at, n, vec, bits);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = compact::bf16_to_float(bits[j]);
  } else if (kind == kMomentInt4) {
    uint8_t bytes[2] = {0, 0};
    load_codes4(base, at, n, vec, bytes);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int code = j % 2 == 0 ? compact::unpack4_even(bytes[j / 2]) : compact::unpack4_odd(bytes[j / 2]);
      out[j] = signed_codes ? compact::decode4_exp_avg(code, scale) : compact::decode4_exp_avg_sq(code, scale);
    }
  } else if (signed_codes) {
    int8_t code[4] = {0, 0, 0, 0};
    load_part(reinterpret_cast<const int8_t*>(base) + at, n, vec, code);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = compact::decode_exp_avg(code[j], scale);
  } else {
    uint8_t code[4] = {0, 0, 0, 0};
    load_part(reinterpret_cast<const uint8_t*>(base) + at, n, vec, code);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = compact::decode_exp_avg_sq(code[j], scale);
  }
}

// ------------------------------------------------------------------ encode

// Store 4 elements of an fp32 or bf16 moment; bf16 rounds to nearest even or, with sr, with the 16
// random bits (rand[j] >> shift).
__device__ __forceinline__ void store_moment(float* base, int32_t kind, int64_t at, int n, bool vec, const float x[4],
                                             bool sr, const uint32_t rand[4], int shift) {
  if (kind == kMomentF32) {
    store_part(base + at, n, vec, x);
    return;
  }
  uint16_t bits[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bits[j] = sr ? compact::bf16_sr_bits(x[j], (rand[j] >> shift) & 0xFFFFu) : compact::bf16_rne_bits(x[j]);
  store_part(reinterpret_cast<uint16_t*>(base) + at, n, vec, bits);
}

// max that returns NaN when either is NaN (torch.amax), whatever the order of the reduction.
__device__ __forceinline__ float max_nan(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

// The maximum over the warp (every lane gets it): a fixed butterfly, so every lane sees the same value.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Store a warp's group of int8 (CODES kMomentInt8) or int4 (kMomentInt4) moment codes: the new
// scale is the group's maximum of |x| (of sqrt(x) for exp_avg_sq's grids), written by lane 0, and
// every code is encoded with it. All lanes call this.
template <int32_t CODES>
__device__ __forceinline__ void store_codes_group(float* base, bool signed_codes, float* scales, int64_t group,
                                                  const Lane& l, bool vec, const float x[8]) {
  float magnitude = 0.0f;  // elements past the tensor's end count as 0, as the specification's padding
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float a = fabsf(signed_codes ? x[e] : __fsqrt_rn(x[e]));
    if (e % 4 < l.n[e / 4]) magnitude = max_nan(magnitude, a);
  }
  // every lane read the old scale (load_moment) before it gave its magnitude to the shuffles, which
  // all lanes reach before any goes on: lane 0's write cannot overtake another lane's read
  const float scale = warp_max(magnitude);
  if (threadIdx.x % kWarp == 0) global(scales)[group] = scale;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (CODES == kMomentInt4) {
      uint8_t bytes[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float even = x[4 * h + 2 * j], odd = x[4 * h + 2 * j + 1];
        bytes[j] = signed_codes ? compact::pack4(compact::encode4_exp_avg(even, scale), compact::encode4_exp_avg(odd, scale))
                                : compact::pack4(compact::encode4_exp_avg_sq(even, scale), compact::encode4_exp_avg_sq(odd, scale));
      }
      store_codes4(base, l.at[h], l.n[h], vec, bytes);
    } else if (signed_codes) {
      int8_t code[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) code[j] = compact::encode_exp_avg(x[4 * h + j], scale);
      store_part(reinterpret_cast<int8_t*>(base) + l.at[h], l.n[h], vec, code);
    } else {
      uint8_t code[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) code[j] = compact::encode_exp_avg_sq(x[4 * h + j], scale);
      store_part(reinterpret_cast<uint8_t*>(base) + l.at[h], l.n[h], vec, code);
    }
  }
}

// Store the new weights of 4 elements: the fp32 master and its param, the param split with its low
// half (split16) or residual (split8), or the param alone (a bf16 one to nearest even or, with sr,
// stochastically from the bits rand[j] >> 16), as the CPU's compact update writes them.
__device__ __forceinline__ void store_weights(const UpdateTensor& t, int64_t at, int n, bool vec, const float w[4], bool sr,
                                              const uint32_t rand[4]) {
  const bool fp32_master = t.master != nullptr && t.master_kind == kMasterF32;
  if (fp32_master) store_part(t.master + at, n, vec, w);
  if (t.param_dtype == kF32) {
    store_part(static_cast<float*>(t.param) + at, n, vec, w);
    return;
  }
  uint16_t bits[4];
  if (fp32_master) {
#pragma unroll
    for (int j = 0; j < 4; ++j) bits[j] = t.param_dtype == kF16 ? from_float<Half>(w[j]).x : from_float<BFloat16>(w[j]).x;
  } else if (t.master != nullptr && t.master_kind == kMasterSplit16) {
    uint16_t low[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) compact::split16(w[j], bits[j], low[j]);
    store_part(reinterpret_cast<uint16_t*>(t.master) + at, n, vec, low);
  } else if (t.master != nullptr) {  // split8
    int8_t q[4];
    const bool fp16 = t.param_dtype == kF16;
#pragma unroll
    for (int j = 0; j < 4; ++j) compact::split8(w[j], fp16, bits[j], q[j]);
    store_part(reinterpret_cast<int8_t*>(t.master) + at, n, vec, q);
  } else if (t.param_dtype == kBF16) {  // no master: as the specification's round_bf16 (NaN stays quiet)
#pragma unroll
    for (int j = 0; j < 4; ++j) bits[j] = sr ? compact::bf16_sr_bits(w[j], rand[j] >> 16) : compact::bf16_rne_bits(w[j]);
  } else {  // an fp16 param without a master
#pragma unroll
    for (int j = 0; j < 4; ++j) bits[j] = from_float<Half>(w[j]).x;
  }
  store_part(static_cast<uint16_t*>(t.param) + at, n, vec, bits);
}

// ------------------------------------------------------------------ the chunk

// One lane's 4 elements of a part: the decoded inputs, then the new values.
struct Part {
  float w[4], g[4], m[4], v[4], vmax[4];
};

// Work positions [begin, end) of compact tensor t (begin a multiple of kGroup; work_numel in
// contract.h: its elements, or for int8 / int4 moments in ragged rows those of rows padded to whole
// blocks, each group then one block at its row's elements, cut at the row's end), by every thread of the
// block; write_grad: the unscaled gradient g * unscale goes back into the grad (DESIGN §2.7).
// seed: the call's rounding seed, used when t.stochastic. CODES: the blockwise moments this instance
// serves, kMomentInt8 or kMomentInt4 (the blockwise variant of passes.cu, which ops_cuda.cpp launches
// for those tensors alone), or kMomentF32 for fp32 and bf16 moments (the compact variant).
//
// [note: compact registers] A lane issues both parts' loads (grad, weights, moments) before any
// store, so a warp has its whole group in flight at once; the pointers may alias as far as the
// compiler knows, so it keeps the source order, which is what puts the loads first
// (tests/contract/sm90_compile.py checks the SASS). That holds both parts' working sets, and for
// blockwise moments the group's new moments wait in registers for their scales: one block of 512 per
// SM, with more bytes in flight per SM than HBM needs by Little's law (docs/results/sm90-kernels.md).
// Stepping the parts one after the other halves the bytes in flight for no fewer registers, and a
// cap of two blocks per SM spills inside the loop (docs/results/cuda-compact-registers.md). The
// record and the scalars are the kernel's shared copies: the loop reads the few fields the
// compiler does not keep (LDS).
template <int32_t CODES>
__device__ __forceinline__ void update_chunk(const UpdateTensor& t, int64_t begin, int64_t end, const AdamWScalars& s,
                                             float factor, bool write_grad, float unscale, uint64_t seed) {
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const bool vec = t.aligned != 0 && !ragged_rows(t);  // a ragged row's blocks start anywhere
  const bool amsgrad = t.max_exp_avg_sq != nullptr;
  static_assert(CODES == kMomentF32 || CODES == kMomentInt8 || CODES == kMomentInt4, "CODES: kMomentF32, Int8 or Int4");
  constexpr bool kCodes = CODES != kMomentF32;
  // what the instance serves, so the other kinds' code folds away
  const int32_t moment_kind = kCodes ? CODES : (t.moment_kind == kMomentBF16 ? kMomentBF16 : kMomentF32);
  // SR applies to bf16 writes without an exact master: bf16 moments, and a bf16 param without one
  const bool sr_moments = t.stochastic != 0 && t.moment_kind == kMomentBF16;
  const bool sr_param = t.stochastic != 0 && t.master == nullptr && t.param_dtype == kBF16;
  // the random bits of element e are keyed by its index in the whole tensor, element_base + e
  // (compact_random.h), with one high word per chunk: unsharded chunks never cross a multiple of
  // 2^32, and a shard whose indices do is not sent here (_contract.crosses_high_word)
  const uint32_t key = t.stochastic != 0 ? compact::rounding_key(seed, t.index,
      static_cast<uint32_t>((t.element_base + element_at(t, begin)) >> 32)) : 0u;
  const bool ragged = ragged_rows(t);
  for (int64_t base = begin + static_cast<int64_t>(kGroup) * (threadIdx.x / kWarp); base < end;
       base += static_cast<int64_t>(kGroup) * warps) {  // uniform over the warp: whole warps take a group
    // the group's elements: [at, stop) of the tensor (the work position itself but in ragged rows)
    const int64_t at0 = element_at(t, base);
    const int64_t stop = ragged ? element_at(t, base + kGroup) : end;  // (the next block's first element)
    Lane l;
    l.at[0] = at0 + 4 * lane;
    l.at[1] = at0 + kHalfGroup + 4 * lane;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t left = stop - l.at[h];
      l.n[h] = left <= 0 ? 0 : (left >= 4 ? 4 : static_cast<int>(left));
    }
    const int64_t group = base / kGroup;
    float scale_m = 0.0f, scale_v = 0.0f, scale_vmax = 0.0f;
    if (kCodes) {
      scale_m = global(t.exp_avg_scales)[group];
      scale_v = global(t.exp_avg_sq_scales)[group];
      if (amsgrad) scale_vmax = global(t.max_exp_avg_sq_scales)[group];
    }
    Part part[2];
    auto load = [&](int h) {
      Part& q = part[h];
#pragma unroll
      for (int j = 0; j < 4; ++j) q.w[j] = q.g[j] = q.m[j] = q.v[j] = q.vmax[j] = 0.0f;
      const int64_t at = l.at[h];
      const int n = l.n[h];
      load_floats(t.grad, t.grad_dtype, at, n, vec, q.g);
      load_weights(t, at, n, vec, q.w);
      load_moment(t.exp_avg, moment_kind, true, scale_m, at, n, vec, q.m);
      load_moment(t.exp_avg_sq, moment_kind, false, scale_v, at, n, vec, q.v);
      if (amsgrad) load_moment(t.max_exp_avg_sq, moment_kind, false, scale_vmax, at, n, vec, q.vmax);
    };
    auto step_and_store = [&](int h) {
      Part& q = part[h];
      const int64_t at = l.at[h];
      const int n = l.n[h];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float gj = __fmul_rn(q.g[j], factor);
        if (amsgrad) {
          adamw_element<true>(q.w[j], gj, q.m[j], q.v[j], q.vmax[j], s);
        } else {
          adamw_element<false>(q.w[j], gj, q.m[j], q.v[j], q.vmax[j], s);
        }
      }
      if (write_grad) {
#pragma unroll
        for (int j = 0; j < 4; ++j) q.g[j] = __fmul_rn(q.g[j], unscale);
        store_floats(t.grad, t.grad_dtype, at, n, vec, q.g);
      }
      // the random words of the elements (compact_random.h): a = (exp_avg, exp_avg_sq), b = (max_exp_avg_sq, param)
      uint32_t rand_a[4] = {0u, 0u, 0u, 0u}, rand_b[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t hash = compact::element_hash(static_cast<uint32_t>(t.element_base + at + j), key);
        if (sr_moments) rand_a[j] = compact::random_word(hash, 0);
        if ((sr_moments && amsgrad) || sr_param) rand_b[j] = compact::random_word(hash, 1);
      }
      store_weights(t, at, n, vec, q.w, sr_param, rand_b);
      if (!kCodes) {  // blockwise moments wait for the group's scales (below)
        store_moment(t.exp_avg, moment_kind, at, n, vec, q.m, sr_moments, rand_a, 0);
        store_moment(t.exp_avg_sq, moment_kind, at, n, vec, q.v, sr_moments, rand_a, 16);
        if (amsgrad) store_moment(t.max_exp_avg_sq, moment_kind, at, n, vec, q.vmax, sr_moments, rand_b, 0);
      }
    };
    load(0);  // both parts' loads, then the stores ([note: compact registers])
    load(1);
    step_and_store(0);
    step_and_store(1);
    if (kCodes) {  // warp-uniform: every lane of the warp reaches the shuffles
      float m8[8], v8[8], vmax8[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        m8[e] = part[e / 4].m[e % 4];
        v8[e] = part[e / 4].v[e % 4];
        vmax8[e] = part[e / 4].vmax[e % 4];
      }
      store_codes_group<CODES>(t.exp_avg, true, t.exp_avg_scales, group, l, vec, m8);
      store_codes_group<CODES>(t.exp_avg_sq, false, t.exp_avg_sq_scales, group, l, vec, v8);
      if (amsgrad) store_codes_group<CODES>(t.max_exp_avg_sq, false, t.max_exp_avg_sq_scales, group, l, vec, vmax8);
    }
  }
}

}  // namespace compact_pass
}  // namespace cuda
}  // namespace ampfused
