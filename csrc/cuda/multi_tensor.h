// The device-side tables of the multi-tensor CUDA passes and the launch shape: the one place that
// knows chunk sizes and launch limits. Plain C++ (no torch headers): included by passes.cu and by
// ops_cuda.cpp, which builds the tables.
//
// Unlike torch's MultiTensorApply, which packs at most ~110 pointers
// into each launch's kernel arguments and launches again for the rest, every pass here reads one
// device table (tensor entries, then chunk entries) and launches once whatever the number of
// tensors. ops_cuda.cpp builds a table once per distinct set of pointers and reuses it while the
// pointers stay the same (they do: params and optimizer state are not re-allocated between steps).
// Per-group hyperparameters (lr changes every step under a scheduler) travel by value in the
// kernel arguments instead, up to kInlineGroups groups.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../adamw_math.h"
#include "../contract.h"

namespace ampfused {
namespace cuda {

constexpr int kBlockSize = 512;
constexpr int64_t kChunkSize = 65536;  // elements per chunk; a multiple of 4 * kBlockSize
// The grid is SMs x the blocks per SM that cudaOccupancyMaxActiveBlocksPerMultiprocessor
// reports for each kernel (registers decide it), at most kMaxGrid blocks: one wave, all resident.
constexpr int kMaxGrid = kScratchBlocks;  // contract.h: the scratch has partials for this many blocks
constexpr int kInlineGroups = 24;  // param groups passed by value; more go through a device table

static_assert(kChunkSize % (4 * kBlockSize) == 0, "chunks must hold whole 4-wide vectors for every thread");

struct Chunk {
  int32_t tensor;
  int32_t unused;
  int64_t start;
};

// The tables hold contract.h's records: StatsEntry, UpdateTensor, UpdateGroup.
struct UpdateParams {
  const UpdateTensor* tensors;
  const Chunk* chunks;
  int64_t n_chunks;
  int32_t n_tensors;
  int32_t n_groups;
  const float* stats;         // stats[kStatsSkip], stats[kStatsFactor] from the stats pass
  const float* grad_scale;    // nullptr, or the loss scale: the unscaled gradient is written into the grads
  unsigned int* counter;      // zero between launches; the last block resets it
  const UpdateGroup* groups;  // nullptr: inline_groups
  uint64_t rounding_seed;     // stochastic rounding of the tensors whose record says so (compact_random.h)
  UpdateGroup inline_groups[kInlineGroups];
};

struct StatsParams {
  const StatsEntry* tensors;
  const Chunk* chunks;
  int64_t n_chunks;
  const float* grad_scale;  // nullptr: 1
  const float* found_inf;   // nullptr: none
  float max_grad_norm;
  int32_t clip;
  int32_t check_nonfinite;  // 0: only found_inf skips (skip_nonfinite=False without a scaler)
  float* stats;             // the stats vector (contract.h slots)
  double* partials;         // two slots per block: sum of squares, non-finite sum (in the scratch)
  unsigned int* counter;    // zero between launches; the last block resets it
};

// Defined in passes.cu; they return the launch's error (cudaSuccess when it was queued).
// The update kernel's variants: each serves the tensors its comment names, in a launch of its own
// ([note: a launch per variant] in ops_cuda.cpp).
enum UpdateVariant : int {
  kUpdatePlain = 0,        // no compact state (contract.h's is_compact)
  kUpdateCompact = 1,           // compact masters, bf16 moments, stochastic rounding, no blockwise moments
  kUpdateCompactBlockwise = 2,  // int8 or int4 moments (with any master)
};

cudaError_t launch_update(const UpdateParams& params, UpdateVariant variant, int grid, cudaStream_t stream);
cudaError_t launch_stats(const StatsParams& params, int grid, cudaStream_t stream);
cudaError_t launch_scaler_update(const float* found_inf, float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                 int64_t* skipped_steps, int64_t* consecutive_skips, double* watch,
                                 const ScalerRules& rules, cudaStream_t stream);
// Blocks per SM the occupancy API allows for the update (plain or compact variant) / stats kernel
// at kBlockSize threads.
int update_blocks_per_sm(UpdateVariant variant);
int stats_blocks_per_sm();
cudaError_t launch_accumulate(float* dst, const void* src, int32_t src_dtype, int64_t n, bool aligned, int grid,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace ampfused
