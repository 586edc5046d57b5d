#include "ops_common.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <limits>

#include "adamw_math.h"
#include "compact_math.h"  // compact::kBlock
#include "contract_aten_generated.h"  // the contract's codes of ATen dtypes

namespace ampfused {

int32_t dtype_code(const at::Tensor& t, const char* what) {
  const int32_t code = dtype_code_of(t.scalar_type());
  TORCH_CHECK(code >= 0, "ampfused: ", what, " must be ", kKernelDtypeNames, ", got ", t.scalar_type());
  return code;
}

namespace {

// Dense of any memory format: the kernels walk param, grad and state as flat memory, so
// element k of one is element k of the others exactly when their strides agree (channels_last
// params with channels_last state and grads are fine).
bool same_flat_layout(const at::Tensor& t, const at::Tensor& param) {
  return (t.is_contiguous() && param.is_contiguous()) || (t.sizes() == param.sizes() && t.strides() == param.strides());
}

void check_like(const at::Tensor& t, const at::Tensor& param, const char* what, size_t i) {
  TORCH_CHECK(t.defined(), "ampfused: ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.device() == param.device(), "ampfused: ", what, "[", i, "] is on ", t.device(), " but params[", i, "] is on ", param.device());
  TORCH_CHECK(t.numel() == param.numel(), "ampfused: ", what, "[", i, "] has ", t.numel(), " elements but params[", i, "] has ", param.numel());
  TORCH_CHECK(same_flat_layout(t, param), "ampfused: ", what, "[", i, "] must be laid out in memory as params[", i,
              "] (both contiguous, or the same sizes and strides)");
}

// int4 codes of tensor i ([note: int4 packing] in _contract.py): the kernels find element k's code in
// byte k / 2, which holds for a contiguous param whose last dimension is even (every row starts on a
// byte) and contiguous codes of half its elements (packed_shape).
void check_int4_codes(const at::Tensor& t, const at::Tensor& param, const char* what, size_t i) {
  TORCH_CHECK(t.defined(), "ampfused: ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.device() == param.device(), "ampfused: ", what, "[", i, "] is on ", t.device(), " but params[", i, "] is on ", param.device());
  TORCH_CHECK(param.dim() > 0 && param.size(-1) % 2 == 0 && param.is_contiguous(), "ampfused: ", what, "[", i,
              "] holds int4 codes, two per byte, which need a contiguous params[", i, "] whose last dimension is even; ",
              "params[", i, "] has sizes ", param.sizes(), " and strides ", param.strides());
  TORCH_CHECK(t.numel() * 2 == param.numel() && t.is_contiguous(), "ampfused: ", what, "[", i, "] holds int4 codes ",
              "and must be a contiguous uint8 tensor of ", param.numel() / 2, " bytes (two codes per byte for the ",
              param.numel(), " elements of params[", i, "]: packed_shape), got ", t.numel(), " bytes",
              t.is_contiguous() ? "" : ", not contiguous");
}

// A moment buffer of tensor i laid out for its moment kind: as the param, or as its packed int4 codes.
void check_moment_layout(const at::Tensor& t, const at::Tensor& param, const char* what, size_t i, int32_t kind) {
  if (kind == kMomentInt4) {
    check_int4_codes(t, param, what, i);
  } else {
    check_like(t, param, what, i);
  }
}

const char* codes_name(int32_t kind) { return kind == kMomentInt4 ? "int4" : "int8"; }

// The moment kind of tensor i, told by its exp_avg buffer's dtype (which dtype means which encoding:
// docs/design.md §9, "told by dtypes"); int8 and int4 codes only where `int8_ok` / `int4_ok`, and its
// exp_avg_sq (and max_exp_avg_sq) must then be of that kind's dtype (exp_avg_sq_dtype_of).
int32_t moment_kind_of(const at::Tensor& exp_avg, const at::Tensor& param, size_t i, bool int8_ok, bool int4_ok) {
  TORCH_CHECK(exp_avg.defined(), "ampfused: exp_avgs[", i, "] is undefined");
  const int32_t kind = exp_avg_kind_of(exp_avg.scalar_type());
  TORCH_CHECK(kind != kMomentInt8 || int8_ok, "ampfused: exp_avgs[", i, "] holds int8 moment codes: int8 moments are not served by these kernels");
  TORCH_CHECK(kind != kMomentInt4 || int4_ok, "ampfused: exp_avgs[", i, "] holds int4 moment codes (uint8): int4 moments are not served by these kernels");
  TORCH_CHECK(kind >= 0, "ampfused: exp_avgs[", i, "] must be ", int8_ok || int4_ok ? kMomentDtypeNames : kFloatMomentDtypeNames,
              ", got ", exp_avg.scalar_type());
  check_moment_layout(exp_avg, param, "exp_avgs", i, kind);
  return kind;
}

// exp_avg_sq / max_exp_avg_sq of tensor i against its exp_avg's moment kind.
void check_square(const at::Tensor& t, const at::Tensor& param, const char* what, size_t i, int32_t kind) {
  TORCH_CHECK(t.defined(), "ampfused: ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.scalar_type() == exp_avg_sq_dtype_of(kind), "ampfused: ", what, "[", i, "] is ", t.scalar_type(),
              " but exp_avgs[", i, "] takes ", exp_avg_sq_dtype_of(kind), " squares: a tensor's moments share one dtype",
              " (int8 moments keep exp_avg as int8 codes and exp_avg_sq / max_exp_avg_sq as uint8 codes; int4 moments",
              " keep all three as uint8 bytes of two codes)");
  check_moment_layout(t, param, what, i, kind);
}

// The fp32 block scales of tensor i's int8 or int4 codes (entry `slot` of its three in moment_scales).
// Elements per row of a tensor's block grid (_contract.block_rows): a dim-0 slice, or the whole of a 0-d or 1-d tensor.
int64_t row_numel_of(const at::Tensor& param) {
  return param.dim() < 2 || param.size(0) == 0 ? param.numel() : param.numel() / param.size(0);
}

float* scales_of(const std::optional<at::TensorList>& moment_scales, size_t i, int slot, const at::Tensor& param,
                 const char* what, int32_t kind) {
  TORCH_CHECK(moment_scales.has_value(), "ampfused: ", what, "[", i, "] holds ", codes_name(kind),
              " codes but moment_scales is None");
  const at::Tensor& s = (*moment_scales)[3 * i + slot];
  const int64_t row = row_numel_of(param);
  const int64_t rows = param.dim() < 2 ? 1 : param.size(0);
  const int64_t blocks = rows * ((row + compact::kBlock - 1) / compact::kBlock);
  TORCH_CHECK(s.defined() && s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == blocks &&
                  s.device() == param.device(),
              "ampfused: moment_scales[", 3 * i + slot, "] (the scales of ", what, "[", i, "]) must be a contiguous float32 ",
              "tensor of ", blocks, " elements (one per ", compact::kBlock, " of each of ", rows, " rows of ", row,
              ") on ", param.device());
  return s.data_ptr<float>();
}

// A master buffer: a kind of _contract.MASTER_ENCODINGS, and one that completes its param (MASTER_PARAM_DTYPES).
int32_t master_kind_of(const at::Tensor& t, const at::Tensor& param, size_t i) {
  check_like(t, param, "masters", i);
  const int32_t kind = master_kind_of_storage(t.scalar_type());
  TORCH_CHECK(kind >= 0, "ampfused: masters[", i, "] must be ", kMasterDtypeNames, ", got ", t.scalar_type());
  TORCH_CHECK(master_completes(kind, param.scalar_type()), "ampfused: masters[", i, "] is ", master_description(kind),
              ", which needs a ", master_param_dtypes(kind), " param, but params[", i, "] is ", param.scalar_type());
  return kind;
}

int64_t element_bytes(const at::Tensor& t) { return static_cast<int64_t>(t.element_size()); }

void check_scalar(const at::Tensor& t, const at::Device& device, const char* what) {
  TORCH_CHECK(t.defined() && t.numel() == 1 && t.scalar_type() == at::kFloat, "ampfused: ", what, " must be a one-element float32 tensor");
  TORCH_CHECK(t.device() == device, "ampfused: ", what, " is on ", t.device(), " but the tensors are on ", device);
}

// adamw_update's optional grad_scale (checked: one fp32 element on device), or nullptr.
const float* grad_scale_ptr(const std::optional<at::Tensor>& grad_scale, const at::Device& device) {
  if (!grad_scale.has_value()) return nullptr;
  check_scalar(*grad_scale, device, "grad_scale");
  return grad_scale->data_ptr<float>();
}

void check_stats_vector(const at::Tensor& stats, const at::Device& device) {
  TORCH_CHECK(stats.defined() && stats.numel() == kStatsSize && stats.scalar_type() == at::kFloat && stats.is_contiguous(),
              "ampfused: stats must be a contiguous float32 tensor of ", kStatsSize, " elements");
  TORCH_CHECK(stats.device() == device, "ampfused: stats is on ", stats.device(), " but the tensors are on ", device);
}

void check_one(const at::Tensor& t, at::ScalarType dtype, const at::Device& device, const char* what) {
  TORCH_CHECK(t.defined() && t.numel() == 1 && t.scalar_type() == dtype, "ampfused: ", what, " must be a one-element ",
              dtype, " tensor");
  TORCH_CHECK(t.device() == device, "ampfused: ", what, " is on ", t.device(), " but the scale on ", device);
}

void check_dense(const at::Tensor& t, const char* what, size_t i) {
  TORCH_CHECK(t.is_non_overlapping_and_dense(), "ampfused: ", what, "[", i, "] must be dense (no gaps, no overlap)");
}

// An empty (or undefined) tensor stands for None in max_exp_avg_sqs / masters.
bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

}  // namespace

UpdateCall collect_update(
    at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList masters, at::IntArrayRef groups,
    at::ArrayRef<double> lrs, const c10::List<std::optional<at::Tensor>>& lr_tensors, at::ArrayRef<double> beta1s,
    at::ArrayRef<double> beta2s, at::ArrayRef<double> epss, at::ArrayRef<double> weight_decays, at::IntArrayRef flags,
    const at::Tensor& stats, const std::optional<at::Tensor>& scratch, const std::optional<at::Tensor>& grad_scale,
    std::optional<int64_t> rounding_seed, const std::optional<at::TensorList>& moment_scales,
    at::OptionalIntArrayRef rounding_index, at::OptionalIntArrayRef element_base, c10::DeviceType device_type,
    bool int8_moments, bool int4_moments) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && max_exp_avg_sqs.size() == n &&
                  steps.size() == n && masters.size() == n && groups.size() == n,
              "ampfused::adamw_update: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters and groups "
              "must have equal lengths");
  const size_t g = lrs.size();
  TORCH_CHECK(lr_tensors.size() == g && beta1s.size() == g && beta2s.size() == g && epss.size() == g &&
                  weight_decays.size() == g && flags.size() == g,
              "ampfused::adamw_update: the per-group lists (lrs, lr_tensors, beta1s, beta2s, epss, weight_decays, flags) "
              "must have equal lengths");
  UpdateCall out{{}, {}, {}, n > 0 ? params[0].device() : at::Device(device_type), stats, scratch, nullptr, rounding_seed};
  out.groups.reserve(g);
  out.lr_tensors.resize(g);
  for (size_t j = 0; j < g; ++j) {
    UpdateGroup group{};
    group.lr = lrs[j];
    group.beta1 = beta1s[j];
    group.beta2 = beta2s[j];
    group.eps = epss[j];
    group.weight_decay = weight_decays[j];
    group.lr_ptr = nullptr;
    group.lr_kind = kLrValue;
    group.flags = static_cast<int32_t>(flags[j] & (kFlagAmsgrad | kFlagMaximize));
    std::optional<at::Tensor> lr_t = lr_tensors.get(j);
    // The Python batch classified each lr once ([note: lr kinds] in ampfused/_batch.py) and sends the
    // floats as floats; the schema carries a tensor lr with no kind, so the op classifies it from the
    // tensor (its device here, its dtype by the generated lr_kind_of), the same rules for a direct caller.
    if (lr_t.has_value()) {
      TORCH_CHECK(lr_t->numel() == 1, "ampfused: a tensor lr must have one element");
      TORCH_CHECK(lr_t->is_floating_point(), "ampfused: a tensor lr must be floating point");
      if (lr_t->is_cpu()) {
        group.lr = lr_t->item<double>();  // no device sync
      } else {
        out.lr_tensors[j] = *lr_t;  // the backend reads it (on the device, or with a sync)
      }
    }
    out.groups.push_back(group);
  }
  TORCH_CHECK(!moment_scales.has_value() || moment_scales->size() == 3 * n, "ampfused::adamw_update: moment_scales "
              "must hold three entries per tensor (exp_avg, exp_avg_sq and max_exp_avg_sq scales), got ",
              moment_scales.has_value() ? moment_scales->size() : 0, " for ", n, " tensors");
  TORCH_CHECK(!element_base.has_value() || element_base->size() == n, "ampfused::adamw_update: element_base "
              "must hold one entry per tensor, got ", element_base.has_value() ? element_base->size() : 0, " for ", n);
  TORCH_CHECK(!rounding_index.has_value() || rounding_index->size() == n, "ampfused::adamw_update: rounding_index "
              "must hold one entry per tensor, got ", rounding_index.has_value() ? rounding_index->size() : 0, " for ", n,
              " tensors");
  if (n == 0) return out;
  const at::Device device = out.device;
  TORCH_CHECK(device.type() == device_type, "ampfused::adamw_update (", c10::DeviceTypeName(device_type),
              ") got tensors on ", device);
  check_stats_vector(stats, device);
  out.tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined() && p.device() == device, "ampfused: params[", i, "] is on ", p.device(), ", params[0] on ", device);
    check_dense(p, "params", i);
    TORCH_CHECK(groups[i] >= 0 && static_cast<size_t>(groups[i]) < g, "ampfused: groups[", i, "] = ", groups[i], " is not a group index");
    const bool amsgrad = (out.groups[groups[i]].flags & kFlagAmsgrad) != 0;
    check_like(grads[i], p, "grads", i);
    UpdateTensor t{};
    t.moment_kind = moment_kind_of(exp_avgs[i], p, i, int8_moments, int4_moments);
    check_square(exp_avg_sqs[i], p, "exp_avg_sqs", i, t.moment_kind);
    t.param = p.data_ptr();
    t.grad = grads[i].data_ptr();
    // a bf16 moment / split16 or split8 master travels in the record's float*
    // fields; the kind says what they point at (contract.h)
    t.exp_avg = static_cast<float*>(exp_avgs[i].data_ptr());
    t.exp_avg_sq = static_cast<float*>(exp_avg_sqs[i].data_ptr());
    if (amsgrad) {
      const at::Tensor& vmax = max_exp_avg_sqs[i];
      TORCH_CHECK(present(vmax) || p.numel() == 0, "ampfused: max_exp_avg_sqs[", i, "] is empty (None) but its group uses amsgrad");
      if (p.numel() > 0) {
        check_square(vmax, p, "max_exp_avg_sqs", i, t.moment_kind);
        t.max_exp_avg_sq = static_cast<float*>(vmax.data_ptr());
      }
    }
    if (t.moment_kind == kMomentInt8 || t.moment_kind == kMomentInt4) {
      t.exp_avg_scales = scales_of(moment_scales, i, 0, p, "exp_avgs", t.moment_kind);
      t.exp_avg_sq_scales = scales_of(moment_scales, i, 1, p, "exp_avg_sqs", t.moment_kind);
      if (t.max_exp_avg_sq != nullptr) {
        t.max_exp_avg_sq_scales = scales_of(moment_scales, i, 2, p, "max_exp_avg_sqs", t.moment_kind);
      }
    } else if (moment_scales.has_value()) {
      for (int slot = 0; slot < 3; ++slot) {
        TORCH_CHECK(!present((*moment_scales)[3 * i + slot]), "ampfused: moment_scales[", 3 * i + slot,
                    "] is given but exp_avgs[", i, "] is ", exp_avgs[i].scalar_type(), ", not int8 or int4 codes");
      }
    }
    const at::Tensor& master = masters[i];
    t.master_kind = kMasterF32;
    if (present(master) && p.numel() > 0) {
      t.master_kind = master_kind_of(master, p, i);
      t.master = static_cast<float*>(master.data_ptr());
    }
    t.stochastic = rounding_seed.has_value() ? 1 : 0;
    // the random bits' key: the tensor's position in the step's full lists ([note: rounding bits] in _contract.py)
    const int64_t index = rounding_index.has_value() ? (*rounding_index)[i] : static_cast<int64_t>(i);
    TORCH_CHECK(index >= 0 && index <= std::numeric_limits<int32_t>::max(), "ampfused: rounding_index[", i, "] = ", index, " is not a tensor index");
    t.index = static_cast<int32_t>(index);
    t.element_base = element_base.has_value() ? (*element_base)[i] : 0;
    TORCH_CHECK(t.element_base >= 0, "ampfused: element_base[", i, "] = ", t.element_base, " is not an element index");
    t.row_numel = row_numel_of(p);
    const at::Tensor& step = steps[i];
    TORCH_CHECK(step.defined() && step.numel() == 1 && step.scalar_type() == at::kFloat && step.device() == device,
                "ampfused: steps[", i, "] must be a one-element float32 tensor on ", device);
    t.step = step.data_ptr<float>();
    t.numel = p.numel();
    t.param_dtype = dtype_code(p, "params");
    t.grad_dtype = dtype_code(grads[i], "grads");
    t.group = static_cast<int32_t>(groups[i]);
    const int64_t moment_bytes = t.moment_kind == kMomentF32 ? 4 : t.moment_kind == kMomentBF16 ? 2 : 1;
    const int64_t master_bytes = present(master) ? element_bytes(master) : 4;
    t.aligned = aligned4(t.param, element_size(t.param_dtype)) && aligned4(t.grad, element_size(t.grad_dtype)) &&
                aligned4(t.exp_avg, moment_bytes) && aligned4(t.exp_avg_sq, moment_bytes) &&
                aligned4(t.max_exp_avg_sq, moment_bytes) && aligned4(t.master, master_bytes);
    out.tensors.push_back(t);
  }
  out.grad_scale = grad_scale_ptr(grad_scale, device);
  return out;
}

void check_stats(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf, const at::Tensor& stats) {
  const at::Device device = stats.device();
  check_stats_vector(stats, device);
  if (grad_scale.has_value()) check_scalar(*grad_scale, device, "grad_scale");
  if (found_inf.has_value()) check_scalar(*found_inf, device, "found_inf");
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(grads[i].device() == device, "ampfused: grads[", i, "] is on ", grads[i].device(), " but stats on ", device);
    check_dense(grads[i], "grads", i);
    dtype_code(grads[i], "grads");
  }
}

void check_scaler(const at::Tensor& found_inf, const at::Tensor& scale, const at::Tensor& growth_tracker,
                  const at::Tensor& hysteresis_tracker, const at::Tensor& skipped_steps,
                  const at::Tensor& consecutive_skips, const at::Tensor& watch) {
  const at::Device device = scale.device();
  check_one(scale, at::kFloat, device, "scale");
  check_one(found_inf, at::kFloat, device, "found_inf");
  check_one(growth_tracker, at::kInt, device, "growth_tracker");
  check_one(hysteresis_tracker, at::kInt, device, "hysteresis_tracker");
  check_one(skipped_steps, at::kLong, device, "skipped_steps");
  check_one(consecutive_skips, at::kLong, device, "consecutive_skips");
  TORCH_CHECK(watch.numel() == 2 && watch.scalar_type() == at::kDouble && watch.device() == device && watch.is_contiguous(),
              "ampfused: watch must be a contiguous float64 tensor of 2 elements on ", device);
}

ScalerRules scaler_rules(double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                         std::optional<double> min_scale) {
  return ScalerRules{growth_factor, backoff_factor,
                     static_cast<float>(min_scale.value_or(0.0)), growth_interval, static_cast<int32_t>(hysteresis),
                     min_scale.has_value()};
}

void check_accumulate(const at::Tensor& main_grad, const at::Tensor& grad) {
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat, "ampfused: main_grad must be float32, got ", main_grad.scalar_type());
  TORCH_CHECK(main_grad.is_contiguous() && grad.is_contiguous(), "ampfused: main_grad and grad must be contiguous");
  TORCH_CHECK(main_grad.numel() == grad.numel(), "ampfused: main_grad has ", main_grad.numel(), " elements, grad ", grad.numel());
  TORCH_CHECK(main_grad.device() == grad.device(), "ampfused: main_grad is on ", main_grad.device(), ", grad on ", grad.device());
  dtype_code(grad, "grad");
}

}  // namespace ampfused
