// The pass contract for C++ and CUDA: what the ops, the CPU hot loops and the CUDA kernels agree
// on with each other and with the Python side. Every shared number and record (stats slots, flags,
// dtype codes, lr kinds, compact kinds, the scratch, UpdateTensor, UpdateGroup, StatsEntry) is
// defined in ampfused/_contract.py and generated into contract_generated.h; this header adds the
// helpers over them.
//
// ATen-free and CUDA-free on purpose: included by the ops (ops_common.h), by adamw_math.h and
// dtypes.h, and by the nvcc-compiled passes.cu, which sees no torch header.
#pragma once

#include <cstdint>

#include "contract_generated.h"

// What both the host and the device call (nvcc reads __host__ __device__; host compilers see inline).
#if defined(__CUDACC__)
#define AMPFUSED_CONTRACT_HD __host__ __device__ inline
#else
#define AMPFUSED_CONTRACT_HD inline
#endif

namespace ampfused {

// Bytes per element of a dtype code.
inline constexpr int64_t element_size(int32_t dtype) { return dtype == kF32 ? 4 : 2; }

// Whether ptr allows 4-element vector access to elements of `bytes` bytes (nullptr: nothing to access).
inline bool aligned4(const void* ptr, int64_t bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % (4 * bytes) == 0;
}

// The launch scratch ([note: scratch] in ampfused/_contract.py): the CUDA passes' tickets and
// partials. The CPU kernels need none.
static_assert(kScratchBytes == kScratchPartials + 2 * static_cast<int64_t>(sizeof(double)) * kScratchBlocks,
              "the scratch holds both counters and two doubles for every block");

// Whether the tensor takes the compact element loop rather than the fp32 one: a compact master or
// moment, or a stochastically rounded bf16 param without a master.
AMPFUSED_CONTRACT_HD bool is_compact(const UpdateTensor& t) {
  return t.master_kind != kMasterF32 || t.moment_kind != kMomentF32 ||
         (t.stochastic != 0 && t.param_dtype == kBF16 && t.master == nullptr);
}

// [note: blocks in rows] (_contract.py) int8 and int4 blocks start at every row: a tensor whose rows are no
// whole number of blocks (and that has more than one row) is chunked in rows padded to whole
// blocks, its work elements, and its chunks step whole blocks one at a time (row_block_start).
AMPFUSED_CONTRACT_HD bool ragged_rows(const UpdateTensor& t) {
  const bool blockwise = t.moment_kind == kMomentInt8 || t.moment_kind == kMomentInt4;
  return blockwise && t.row_numel % compact::kBlock != 0 && t.row_numel != t.numel;
}

AMPFUSED_CONTRACT_HD int64_t padded_row(const UpdateTensor& t) {
  return (t.row_numel + compact::kBlock - 1) / compact::kBlock * compact::kBlock;
}

// The elements the chunk layout counts for t: its own, or those of its padded rows.
AMPFUSED_CONTRACT_HD int64_t work_numel(const UpdateTensor& t) {
  return ragged_rows(t) ? t.numel / t.row_numel * padded_row(t) : t.numel;
}

// The tensor's element at work position v (a block's first, or a chunk's end): itself, or past the padding.
AMPFUSED_CONTRACT_HD int64_t element_at(const UpdateTensor& t, int64_t v) {
  if (!ragged_rows(t)) return v;
  const int64_t padded = padded_row(t), in_row = v % padded;
  return v / padded * t.row_numel + (in_row < t.row_numel ? in_row : t.row_numel);
}

}  // namespace ampfused
