// The pass contract for C++ and CUDA: what the ops, the CPU hot loops and the CUDA kernels agree
// on with each other and with the Python side (ampfused/_contract.py spells the same numbers, the
// Triton kernels keep their own copies; a test holds them equal by reading the `constexpr ... kName
// = value;` lines below, so keep each constant on one such line).
//
// ATen-free and CUDA-free on purpose: included by the ops (ops_common.h), by adamw_math.h and
// dtypes.h, and by the nvcc-compiled passes.cu, which sees no torch header.
#pragma once

#include <cstdint>

// What both the host and the device call (nvcc reads __host__ __device__; host compilers see inline).
#if defined(__CUDACC__)
#define AMPFUSED_CONTRACT_HD __host__ __device__ inline
#else
#define AMPFUSED_CONTRACT_HD inline
#endif

namespace ampfused {

// ------------------------------------------------------------------ the stats vector
// One fp32 vector of kStatsSize slots: the stats pass writes it, the update pass reads it.
constexpr int kStatsNorm = 0;    // the gradient norm (inf on a skipped step whose norm was finite)
constexpr int kStatsSkip = 1;    // 1: skip the update, 0: step
constexpr int kStatsFactor = 2;  // what every gradient is multiplied by: 1/scale, times the clip coefficient
constexpr int kStatsSumsq = 3;   // the sum of squares of the unscaled gradients
constexpr int kStatsSize = 4;
constexpr float kClipEps = 1e-6f;  // torch.nn.utils.clip_grad_norm_'s epsilon

// ------------------------------------------------------------------ param group flags
// Bits of a group's `flags` in adamw_update.
constexpr int32_t kFlagAmsgrad = 1;
constexpr int32_t kFlagMaximize = 2;

// ------------------------------------------------------------------ dtype codes
// The element types the kernels read and write (per tensor, in the records below).
constexpr int32_t kF32 = 0;
constexpr int32_t kF16 = 1;
constexpr int32_t kBF16 = 2;

// Bytes per element of a dtype code.
inline constexpr int64_t element_size(int32_t dtype) { return dtype == kF32 ? 4 : 2; }

// Whether ptr allows 4-element vector access to elements of `bytes` bytes (nullptr: nothing to access).
inline bool aligned4(const void* ptr, int64_t bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % (4 * bytes) == 0;
}

// ------------------------------------------------------------------ the launch scratch
// [note: scratch] The caller's uint8 buffer of kScratchBytes, zero between launches (the last block
// of each launch resets its counter): the tickets and partials of the CUDA passes' last-block logic.
// One per optimizer, so two optimizers on two streams, or two replayed CUDA graphs, never share a
// counter. The CPU kernels need none.
constexpr int64_t kScratchStatsCounter = 0;   // byte offset of the stats pass's ticket counter
constexpr int64_t kScratchUpdateCounter = 8;  // byte offset of the update pass's ticket counter
constexpr int64_t kScratchPartials = 16;      // byte offset of the stats partials: two doubles per block
constexpr int kScratchBlocks = 4096;          // the most blocks a launch may have (partials for each)
constexpr int64_t kScratchBytes = 16 + 16 * 4096;
static_assert(kScratchBytes == kScratchPartials + 2 * static_cast<int64_t>(sizeof(double)) * kScratchBlocks,
              "the scratch holds both counters and two doubles for every block");

// ------------------------------------------------------------------ the update's records

// ------------------------------------------------------------------ compact state kinds
// How a tensor's master and moments are stored (DESIGN §9, ampfused/_compact.py), told by the
// dtypes of the op's lists. With a compact kind, the record's float* points at that encoding's
// elements: the kernels cast it by the kind.
constexpr int32_t kMasterF32 = 0;      // an fp32 master, or none (master == nullptr)
constexpr int32_t kMasterSplit16 = 1;  // int16 low halves of the fp32 master (bf16 params)
constexpr int32_t kMasterSplit8 = 2;   // int8 residuals in ulp(p)/256 (bf16 and fp16 params)
constexpr int32_t kMomentF32 = 0;      // fp32 exp_avg / exp_avg_sq / max_exp_avg_sq
constexpr int32_t kMomentBF16 = 1;     // bf16 moments (round to nearest even, or stochastic)
constexpr int32_t kMomentInt8 = 2;     // int8 exp_avg / uint8 exp_avg_sq codes, fp32 scales per 256 elements

// One tensor of the update pass, as the op checked it: the only per-tensor record. The CPU hot
// loops take element ranges of it (cpu/cpu_kernels.h), the CUDA update reads an array of it from
// device memory (cuda/multi_tensor.h), so it holds plain pointers and fixed-width integers only.
struct UpdateTensor {
  void* param;
  void* grad;             // written only with a grad_scale: the unscaled gradient
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr without AMSGrad
  float* master;          // nullptr without a master copy (the param is its own master)
  float* step;            // one fp32 element, advanced once the update has read it
  // kMomentInt8: the fp32 scale of each 256-element block of exp_avg / exp_avg_sq / max_exp_avg_sq
  // (read for the decode, rewritten with the new block maxima); nullptr otherwise
  float* exp_avg_scales;
  float* exp_avg_sq_scales;
  float* max_exp_avg_sq_scales;
  int64_t numel;
  int32_t param_dtype;    // dtype codes
  int32_t grad_dtype;
  int32_t group;          // index into the UpdateGroup list
  int32_t aligned;        // every pointer allows 4-element vector access (the CUDA update's fast path)
  int32_t master_kind;    // kMasterF32 / kMasterSplit16 / kMasterSplit8
  int32_t moment_kind;    // kMomentF32 / kMomentBF16 / kMomentInt8 (all of the tensor's moments alike)
  int32_t stochastic;     // 1: bf16 writes without an exact master round stochastically (the call has a seed)
  int32_t index;          // position in the op's lists: with the seed, it keys the random bits
};

// Whether the tensor takes the compact element loop rather than the fp32 one: a compact master or
// moment, or a stochastically rounded bf16 param without a master.
AMPFUSED_CONTRACT_HD bool is_compact(const UpdateTensor& t) {
  return t.master_kind != kMasterF32 || t.moment_kind != kMomentF32 ||
         (t.stochastic != 0 && t.param_dtype == kBF16 && t.master == nullptr);
}

// How a group's lr is read: kLrValue takes UpdateGroup::lr, the others read a one-element tensor
// of that dtype at lr_ptr when the kernel runs (the dtype codes above, and fp64).
constexpr int32_t kLrValue = -1;
constexpr int32_t kLrF64 = 3;

// One param group of the update pass: the only per-group record, by value in a CUDA launch's
// arguments (up to kInlineGroups of cuda/multi_tensor.h) or in device memory.
struct UpdateGroup {
  double lr;           // used when lr_dtype == kLrValue
  const void* lr_ptr;  // a tensor lr, read at kernel time (no host sync); nullptr with kLrValue
  int32_t lr_dtype;
  int32_t flags;       // kFlagAmsgrad | kFlagMaximize
  double beta1, beta2, eps, weight_decay;
};

}  // namespace ampfused
