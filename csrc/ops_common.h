// Argument checking shared by the CPU and CUDA op implementations: turns the op's tensor lists
// into the plain records of contract.h, after checking every tensor, before anything is written.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <optional>
#include <vector>

#include "contract.h"

namespace ampfused {

struct ScalerRules;  // adamw_math.h

// dtype code of contract.h (kF32/kF16/kBF16); fails with a clear message otherwise.
int32_t dtype_code(const at::Tensor& t, const char* what);

// One adamw_update call, checked (every tensor, before anything is written) and turned into the
// records of contract.h. The group records are built here, once for every backend; a backend only
// resolves the lrs given as tensors off the CPU (lr_tensors).
struct UpdateCall {
  std::vector<UpdateTensor> tensors;
  std::vector<UpdateGroup> groups;     // lr: the float, or the value of a CPU tensor lr
  std::vector<at::Tensor> lr_tensors;  // per group: a tensor lr not on the CPU, else undefined
  at::Device device;                   // of every tensor
  at::Tensor stats;
  std::optional<at::Tensor> scratch;
  const float* grad_scale;             // nullptr, or the checked one-element loss scale
  std::optional<int64_t> rounding_seed;  // stochastic rounding of bf16 writes (with each record's index)
};

// The checks and records of an adamw_update call whose tensors must be on `device_type`.
// max_exp_avg_sqs / masters: an empty tensor where a param has none ([note: no optional mutable
// lists] in ops.cpp). The dtypes of masters and moments give each record its compact kinds
// (contract.h): float32 / bf16 bits (split16, bf16 params) / int8 (split8) masters; float32 or
// bfloat16 moments, the same for all of a tensor's moments, or with `int8_moments` int8/uint8
// codes, with `int4_moments` uint8 bytes of two 4-bit codes ([note: int4 packing] in _contract.py),
// whose block scales come in moment_scales (three entries per tensor, see ops.cpp).
UpdateCall collect_update(
    at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList masters, at::IntArrayRef groups,
    at::ArrayRef<double> lrs, const c10::List<std::optional<at::Tensor>>& lr_tensors, at::ArrayRef<double> beta1s,
    at::ArrayRef<double> beta2s, at::ArrayRef<double> epss, at::ArrayRef<double> weight_decays, at::IntArrayRef flags,
    const at::Tensor& stats, const std::optional<at::Tensor>& scratch, const std::optional<at::Tensor>& grad_scale,
    std::optional<int64_t> rounding_seed, const std::optional<at::TensorList>& moment_scales,
    at::OptionalIntArrayRef rounding_index, at::OptionalIntArrayRef element_base, c10::DeviceType device_type,
    bool int8_moments, bool int4_moments);

// adamw_update as registered for one device type (the schema is in ops.cpp): the arguments are
// collected by the one path above, and `Run` gets the call when it has a tensor. kInt8Moments /
// kInt4Moments: `Run` serves int8 / int4 moments (others refuse them in the checks, before anything
// is written).
template <c10::DeviceType kDevice, void (*Run)(const UpdateCall&), bool kInt8Moments = false,
          bool kInt4Moments = false>
void adamw_update_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList masters,
                     at::IntArrayRef groups, at::ArrayRef<double> lrs,
                     const c10::List<std::optional<at::Tensor>>& lr_tensors, at::ArrayRef<double> beta1s,
                     at::ArrayRef<double> beta2s, at::ArrayRef<double> epss, at::ArrayRef<double> weight_decays,
                     at::IntArrayRef flags, const at::Tensor& stats, const std::optional<at::Tensor>& scratch,
                     const std::optional<at::Tensor>& grad_scale, std::optional<int64_t> rounding_seed,
                     std::optional<at::TensorList> moment_scales, at::OptionalIntArrayRef rounding_index,
                     at::OptionalIntArrayRef element_base) {
  const UpdateCall call = collect_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, groups,
                                         lrs, lr_tensors, beta1s, beta2s, epss, weight_decays, flags, stats, scratch,
                                         grad_scale, rounding_seed, moment_scales, rounding_index, element_base, kDevice,
                                         kInt8Moments, kInt4Moments);
  if (!call.tensors.empty()) Run(call);
}

// Checks for grad_stats; returns nothing, throws on bad input.
void check_stats(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf, const at::Tensor& stats);
// Checks for scaler_update.
void check_scaler(const at::Tensor& found_inf, const at::Tensor& scale, const at::Tensor& growth_tracker,
                  const at::Tensor& hysteresis_tracker, const at::Tensor& skipped_steps,
                  const at::Tensor& consecutive_skips, const at::Tensor& watch);
void check_accumulate(const at::Tensor& main_grad, const at::Tensor& grad);

// scaler_update's float arguments as the kernels' ScalerRules (adamw_math.h), the same on every device.
ScalerRules scaler_rules(double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                         std::optional<double> min_scale);

}  // namespace ampfused
