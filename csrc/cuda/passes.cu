// CUDA kernels of the four passes (stats, update, scaler update, accumulate). Light on purpose:
// only the CUDA runtime and ampfused's own headers, no ATen, so this file compiles in seconds per
// architecture.
//
// The stats and update kernels each run once over the
// whole table. Whatever must happen after every block is done (adding the per-block partial sums
// in a fixed order; advancing the step counters after every block has read them) is done by the
// last block to finish, found with a device counter (threadfence + atomicAdd), so nothing returns
// to the host and the result does not depend on block scheduling.
#include <cuda_runtime.h>

#include "../adamw_math.h"
#include "../contract.h"
#include "../dtypes.h"
#include "compact_update.cuh"
#include "multi_tensor.h"

namespace ampfused {
namespace cuda {
namespace {

constexpr int kStatsUnroll = 4;  // 16-byte loads in flight per thread in the stats loop

template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

template <typename T>
__device__ __forceinline__ void load4(const T* p, float out[4]) {
  const Pack4<T> pack = *global(reinterpret_cast<const Pack4<T>*>(p));  // [note: global accesses]
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = to_float(pack.v[j]);
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float in[4]) {
  Pack4<T> pack;
#pragma unroll
  for (int j = 0; j < 4; ++j) pack.v[j] = from_float<T>(in[j]);
  *global(reinterpret_cast<Pack4<T>*>(p)) = pack;
}

// Deterministic block-wide sum (fixed shuffle tree, then warp sums in order). All threads call it.
__device__ double block_sum(double x, double* shared /* kBlockSize / 32 slots */) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.0;
  if (warp == 0) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;  // valid in thread 0
}

// True in every thread of the block that finished last (after its own work and a threadfence).
__device__ bool last_block_done(unsigned int* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release: this block's partials and step reads happen before its ticket
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) __threadfence();  // acquire: the other blocks' writes are visible to what follows
  }
  __syncthreads();
  return last;
}

// ------------------------------------------------------------------------------------ update

// write_grad: the unscaled gradient g * unscale is written back into the grad (DESIGN §2.7).
template <typename P, typename G>
__device__ void update_chunk(const UpdateTensor& t, int64_t begin, int64_t end, const AdamWScalars& s, float factor,
                             bool write_grad, float unscale) {
  P* param = static_cast<P*>(t.param);
  G* grad = static_cast<G*>(t.grad);
  float* m = t.exp_avg;
  float* v = t.exp_avg_sq;
  float* vmax = t.max_exp_avg_sq;
  float* master = t.master;
  const bool amsgrad = vmax != nullptr, has_master = master != nullptr;
  int64_t scalar_begin = begin;
  if (t.aligned) {
    const int64_t n4 = (end - begin) / 4;
    for (int64_t k = threadIdx.x; k < n4; k += blockDim.x) {
      const int64_t i = begin + 4 * k;
      float w[4], g[4], mi[4], vi[4], vmaxi[4];
      if (has_master) {
        load4(master + i, w);
      } else {
        load4(param + i, w);
      }
      load4(grad + i, g);
      load4(m + i, mi);
      load4(v + i, vi);
      if (amsgrad) load4(vmax + i, vmaxi);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float gj = __fmul_rn(g[j], factor);
        if (amsgrad) {
          adamw_element<true>(w[j], gj, mi[j], vi[j], vmaxi[j], s);
        } else {
          adamw_element<false>(w[j], gj, mi[j], vi[j], vmaxi[j], s);
        }
      }
      if (write_grad) {
#pragma unroll
        for (int j = 0; j < 4; ++j) g[j] = __fmul_rn(g[j], unscale);
        store4(grad + i, g);
      }
      store4(m + i, mi);
      store4(v + i, vi);
      if (amsgrad) store4(vmax + i, vmaxi);
      if (has_master) store4(master + i, w);
      store4(param + i, w);
    }
    scalar_begin = begin + 4 * n4;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += blockDim.x) {
    float w = has_master ? global(master)[i] : to_float(global(param)[i]);
    float mi = global(m)[i], vi = global(v)[i], vmaxi = amsgrad ? global(vmax)[i] : 0.0f;
    const float graw = to_float(global(grad)[i]);
    const float gi = __fmul_rn(graw, factor);
    if (write_grad) global(grad)[i] = from_float<G>(__fmul_rn(graw, unscale));
    if (amsgrad) {
      adamw_element<true>(w, gi, mi, vi, vmaxi, s);
      global(vmax)[i] = vmaxi;
    } else {
      adamw_element<false>(w, gi, mi, vi, vmaxi, s);
    }
    global(m)[i] = mi;
    global(v)[i] = vi;
    if (has_master) global(master)[i] = w;
    global(param)[i] = from_float<P>(w);
  }
}

template <typename P>
__device__ void update_chunk_p(const UpdateTensor& t, int64_t begin, int64_t end, const AdamWScalars& s, float f,
                               bool write_grad, float unscale) {
  switch (t.grad_dtype) {
    case kF32: return update_chunk<P, float>(t, begin, end, s, f, write_grad, unscale);
    case kF16: return update_chunk<P, Half>(t, begin, end, s, f, write_grad, unscale);
    default: return update_chunk<P, BFloat16>(t, begin, end, s, f, write_grad, unscale);
  }
}

// A group's lr: by value, or read from a device tensor of any float dtype (no cast temporary).
__device__ double lr_of(const UpdateGroup& h) {
  if (h.lr_ptr == nullptr) return h.lr;
  switch (h.lr_kind) {
    case kLrF64: return *global(static_cast<const double*>(h.lr_ptr));
    case kLrF16: return static_cast<double>(to_float(*global(static_cast<const Half*>(h.lr_ptr))));
    case kLrBF16: return static_cast<double>(to_float(*global(static_cast<const BFloat16*>(h.lr_ptr))));
    default: return static_cast<double>(*global(static_cast<const float*>(h.lr_ptr)));
  }
}

// VARIANT (multi_tensor.h's UpdateVariant): ops_cuda.cpp launches each variant over the tensors it
// serves alone ([note: a launch per variant] there): the plain one over fp32-state tensors, the
// compact ones (compact_update.cuh) over the compact tensors (contract.h's is_compact), the
// blockwise one over those with int8 or int4 moments (an instance of the chunk loop for each,
// picked per chunk: a tensor's moments are of one kind). Registers are a kernel's, so each variant's tensors run at the
// occupancy of its own code (docs/results/sm90-kernels.md).
// [note: update occupancy] The plain variant is held to two blocks of 512 per SM (64 registers),
// which its loops fit without a spill; the compact ones hold a whole group a lane and take one
// ([note: compact registers] in compact_update.cuh).
template <int VARIANT>
__global__ void __launch_bounds__(kBlockSize, VARIANT == kUpdatePlain ? 2 : 1)
    update_kernel(const __grid_constant__ UpdateParams p) {
  constexpr bool COMPACT = VARIANT != kUpdatePlain;
  if (p.stats[kStatsSkip] != 0.0f) return;  // skipped step: every block leaves at once, nothing is written
  const float factor = p.stats[kStatsFactor];
  const bool write_grad = p.grad_scale != nullptr;  // else the grads stay as they are
  const float unscale = write_grad ? inv_scale_of(global(p.grad_scale)) : 1.0f;
  __shared__ AdamWScalars chunk_scalars;
  __shared__ UpdateTensor chunk_tensor;  // the compact variants' record: [note: compact registers]
  for (int64_t c = blockIdx.x; c < p.n_chunks; c += gridDim.x) {
    const Chunk chunk = p.chunks[c];
    const UpdateTensor t = p.tensors[chunk.tensor];  // the plain loops keep it in registers
    // by value, from the device table or the kernel's parameters (a generic pointer could be either)
    const UpdateGroup h = p.groups != nullptr ? global(p.groups)[t.group] : p.inline_groups[t.group];
    // the per-tensor scalars (two fp64 powers) once per block and chunk, not in every thread
    __syncthreads();  // every thread has copied the previous chunk's scalars
    if (threadIdx.x == 0) {
      chunk_scalars = adamw_scalars(lr_of(h), h.beta1, h.beta2, h.eps, h.weight_decay, __fadd_rn(*global(t.step), 1.0f));
      if (COMPACT) chunk_tensor = t;
    }
    __syncthreads();
    const AdamWScalars s = chunk_scalars;
    const float f = (h.flags & kFlagMaximize) ? -factor : factor;  // -(g*f) == g*(-f) exactly
    const int64_t end = min(chunk.start + kChunkSize, COMPACT ? work_numel(t) : t.numel);
    if (COMPACT && is_compact(t)) {  // (every tensor of a compact launch is)
      if (VARIANT != kUpdateCompactBlockwise) {
        compact_pass::update_chunk<kMomentF32>(chunk_tensor, chunk.start, end, chunk_scalars, f, write_grad, unscale,
                                               p.rounding_seed);
      } else if (t.moment_kind == kMomentInt4) {
        compact_pass::update_chunk<kMomentInt4>(chunk_tensor, chunk.start, end, chunk_scalars, f, write_grad, unscale,
                                                p.rounding_seed);
      } else {
        compact_pass::update_chunk<kMomentInt8>(chunk_tensor, chunk.start, end, chunk_scalars, f, write_grad, unscale,
                                                p.rounding_seed);
      }
      continue;
    }
    switch (t.param_dtype) {
      case kF32: update_chunk_p<float>(t, chunk.start, end, s, f, write_grad, unscale); break;
      case kF16: update_chunk_p<Half>(t, chunk.start, end, s, f, write_grad, unscale); break;
      default: update_chunk_p<BFloat16>(t, chunk.start, end, s, f, write_grad, unscale); break;
    }
  }
  // Every block has read the step counters it needed: the last one advances them all.
  if (last_block_done(p.counter)) {
    for (int i = threadIdx.x; i < p.n_tensors; i += blockDim.x) {
      float* step = global(p.tensors[i].step);
      *step = __fadd_rn(*step, 1.0f);
    }
    if (threadIdx.x == 0) *p.counter = 0;
  }
}

// ------------------------------------------------------------------------------------- stats

// `bad` counts the inf/NaN u by their exponent bits (is_finite_f32), an
// integer test: nothing a compiler contracts. u itself is __fmul_rn (never fused), as torch's.
template <typename G>
__device__ void chunk_sumsq(const StatsEntry& t, int64_t begin, int64_t end, float inv, float& acc, float& bad) {
  const G* g = static_cast<const G*>(t.grad);
  int64_t scalar_begin = begin;
  if (t.aligned) {
    const int64_t n4 = (end - begin) / 4;
    int64_t k = threadIdx.x;
    // kStatsUnroll 16-byte loads in flight a thread, issued before any math; the
    // sums take the elements in the order of the plain loop below, so the result is the same.
    for (; k + (kStatsUnroll - 1) * blockDim.x < n4; k += kStatsUnroll * blockDim.x) {
      float x[kStatsUnroll][4];
#pragma unroll
      for (int r = 0; r < kStatsUnroll; ++r) load4(g + begin + 4 * (k + r * blockDim.x), x[r]);
#pragma unroll
      for (int r = 0; r < kStatsUnroll; ++r) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float u = __fmul_rn(x[r][j], inv);
          acc = __fmaf_rn(u, u, acc);
          bad += is_finite_f32(u) ? 0.0f : 1.0f;
        }
      }
    }
    for (; k < n4; k += blockDim.x) {
      float x[4];
      load4(g + begin + 4 * k, x);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float u = __fmul_rn(x[j], inv);
        acc = __fmaf_rn(u, u, acc);
        bad += is_finite_f32(u) ? 0.0f : 1.0f;
      }
    }
    scalar_begin = begin + 4 * n4;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += blockDim.x) {
    const float u = __fmul_rn(to_float(global(g)[i]), inv);
    acc = __fmaf_rn(u, u, acc);
    bad += is_finite_f32(u) ? 0.0f : 1.0f;
  }
}

__global__ void __launch_bounds__(kBlockSize) stats_kernel(const __grid_constant__ StatsParams p) {
  __shared__ double shared[kBlockSize / 32];
  const float inv = p.grad_scale != nullptr ? inv_scale_of(global(p.grad_scale)) : 1.0f;
  double acc = 0.0, bad = 0.0;
  for (int64_t c = blockIdx.x; c < p.n_chunks; c += gridDim.x) {
    const Chunk chunk = p.chunks[c];
    const StatsEntry t = p.tensors[chunk.tensor];
    const int64_t end = min(chunk.start + kChunkSize, t.numel);
    float a = 0.0f, b = 0.0f;
    switch (t.dtype) {
      case kF32: chunk_sumsq<float>(t, chunk.start, end, inv, a, b); break;
      case kF16: chunk_sumsq<Half>(t, chunk.start, end, inv, a, b); break;
      default: chunk_sumsq<BFloat16>(t, chunk.start, end, inv, a, b); break;
    }
    acc += a;
    bad += b;
  }
  const double block = block_sum(acc, shared);
  const double block_bad = block_sum(bad, shared);
  if (threadIdx.x == 0) {
    global(p.partials)[2 * blockIdx.x] = block;
    global(p.partials)[2 * blockIdx.x + 1] = block_bad;
  }
  if (last_block_done(p.counter)) {
    // the final reduction is block-wide: each thread adds a strided share of the partials
    double x = 0.0, y = 0.0;
    for (int i = threadIdx.x; i < static_cast<int>(gridDim.x); i += blockDim.x) {
      x += static_cast<volatile double*>(global(p.partials))[2 * i];
      y += static_cast<volatile double*>(global(p.partials))[2 * i + 1];
    }
    const double total = block_sum(x, shared);
    const double total_bad = block_sum(y, shared);
    if (threadIdx.x == 0) {
      finish_stats(static_cast<float>(total), !(total_bad == 0.0), p.found_inf != nullptr ? global(p.found_inf) : nullptr, inv,
                   p.clip != 0, p.max_grad_norm, global(p.stats), p.check_nonfinite != 0);
      *p.counter = 0;
    }
  }
}

// ---------------------------------------------------------------------------- scaler update

__global__ void scaler_update_kernel(const float* found_inf, float* scale, int32_t* growth_tracker,
                                     int32_t* hysteresis_tracker, int64_t* skipped_steps, int64_t* consecutive_skips,
                                     double* watch, const ScalerRules rules) {
  scaler_update(*found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps, consecutive_skips, watch, rules);
}

// -------------------------------------------------------------------------------- accumulate

template <typename G>
__global__ void __launch_bounds__(kBlockSize) accumulate_kernel(float* dst, const G* src, int64_t n, bool aligned) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (aligned) {
    const int64_t n4 = n / 4;
    for (int64_t k = tid; k < n4; k += stride) {
      float a[4], b[4];
      load4(dst + 4 * k, a);
      load4(src + 4 * k, b);
#pragma unroll
      for (int j = 0; j < 4; ++j) a[j] = __fadd_rn(a[j], b[j]);
      store4(dst + 4 * k, a);
    }
    scalar_begin = 4 * n4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) dst[i] = __fadd_rn(dst[i], to_float(src[i]));
}

}  // namespace

cudaError_t launch_update(const UpdateParams& params, UpdateVariant variant, int grid, cudaStream_t stream) {
  switch (variant) {
    case kUpdateCompactBlockwise: update_kernel<kUpdateCompactBlockwise><<<grid, kBlockSize, 0, stream>>>(params); break;
    case kUpdateCompact: update_kernel<kUpdateCompact><<<grid, kBlockSize, 0, stream>>>(params); break;
    default: update_kernel<kUpdatePlain><<<grid, kBlockSize, 0, stream>>>(params); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_stats(const StatsParams& params, int grid, cudaStream_t stream) {
  stats_kernel<<<grid, kBlockSize, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t launch_scaler_update(const float* found_inf, float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                 int64_t* skipped_steps, int64_t* consecutive_skips, double* watch,
                                 const ScalerRules& rules, cudaStream_t stream) {
  scaler_update_kernel<<<1, 1, 0, stream>>>(found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps,
                                            consecutive_skips, watch, rules);
  return cudaGetLastError();
}

namespace {
template <typename Kernel>
int blocks_per_sm(Kernel kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kBlockSize, 0) != cudaSuccess || blocks < 1) {
    (void)cudaGetLastError();  // clear it: the caller falls back to one block per SM
    blocks = 1;
  }
  return blocks;
}
}  // namespace

int update_blocks_per_sm(UpdateVariant variant) {
  static const int plain = blocks_per_sm(update_kernel<kUpdatePlain>);
  static const int compact = blocks_per_sm(update_kernel<kUpdateCompact>);
  static const int blockwise = blocks_per_sm(update_kernel<kUpdateCompactBlockwise>);
  return variant == kUpdateCompactBlockwise ? blockwise : variant == kUpdateCompact ? compact : plain;
}

int stats_blocks_per_sm() {
  static const int blocks = blocks_per_sm(stats_kernel);
  return blocks;
}

cudaError_t launch_accumulate(float* dst, const void* src, int32_t src_dtype, int64_t n, bool aligned, int grid,
                              cudaStream_t stream) {
  switch (src_dtype) {
    case kF32:
      accumulate_kernel<<<grid, kBlockSize, 0, stream>>>(dst, static_cast<const float*>(src), n, aligned);
      break;
    case kF16:
      accumulate_kernel<<<grid, kBlockSize, 0, stream>>>(dst, static_cast<const Half*>(src), n, aligned);
      break;
    default:
      accumulate_kernel<<<grid, kBlockSize, 0, stream>>>(dst, static_cast<const BFloat16*>(src), n, aligned);
      break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ampfused
