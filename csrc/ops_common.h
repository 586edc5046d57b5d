// Argument checking shared by the CPU and CUDA op implementations: turns the op's tensor lists
// into plain pointer records, after checking every tensor, before anything is written.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace ampfused {

struct ScalerRules;  // adamw_math.h

// Flags of a param group in the op's `flags` list.
constexpr int64_t kFlagAmsgrad = 1;
constexpr int64_t kFlagMaximize = 2;

// dtype code of dtypes.h (kF32/kF16/kBF16); fails with a clear message otherwise.
int32_t dtype_code(const at::Tensor& t, const char* what);

struct UpdateTensor {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr without AMSGrad
  float* master;          // nullptr without a master copy
  float* step;
  int64_t numel;
  int32_t param_dtype;
  int32_t grad_dtype;
  int32_t group;
};

struct UpdateGroup {
  double lr;                           // used when lr_tensor is empty
  std::optional<at::Tensor> lr_tensor;  // a 0-d tensor lr (any device), read at kernel time
  double beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize;
};

struct UpdateArgs {
  std::vector<UpdateTensor> tensors;
  std::vector<UpdateGroup> groups;
};

// max_exp_avg_sqs / masters: an empty tensor where a param has none (see ops.cpp).
UpdateArgs collect_update(
    at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs, at::TensorList steps,
    at::TensorList masters, at::IntArrayRef groups, at::ArrayRef<double> lrs,
    const c10::List<std::optional<at::Tensor>>& lr_tensors, at::ArrayRef<double> beta1s, at::ArrayRef<double> beta2s,
    at::ArrayRef<double> epss, at::ArrayRef<double> weight_decays, at::IntArrayRef flags, const at::Tensor& stats);

// adamw_update's optional grad_scale (checked: one fp32 element on device), or nullptr.
const float* grad_scale_ptr(const std::optional<at::Tensor>& grad_scale, const at::Device& device);

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
