// CPU implementations of the ampfused ops: argument checks, work split, at::parallel_for, and
// the choice of the ISA variant of the hot loops (cpu_kernels.h).
//
// The stats pass cuts the gradients into fixed ranges, sums each
// range into its own double slot and adds the slots in order, so the result does not depend on the
// number of threads.
//
// [note: grain] A pass opens at most one parallel region, and none where its work is small: below
// kGrain elements in all it runs on the calling thread, above it on min(threads, ceil(elements /
// kGrain)) tasks, each a run of whole ranges of about equal element count (run_ranges). A region is
// not free: on an idle machine waking torch's OpenMP team and meeting at its barrier costs
// microseconds, but where other processes keep the cores busy a thread of the team that is not
// running holds the barrier until the scheduler runs it again, a tick of milliseconds, whatever the
// work. kGrain is ATen's own internal GRAIN_SIZE (32768 elements, below which its elementwise
// kernels run inline): below it a second thread saved nothing measurable (docs/results/cpu-busy.md,
// which also shows what a region costs above it).
// ATen's region always takes its whole team (ParallelOpenMP.h: no num_threads clause), so tasks
// beyond the work only bound how many threads do any of it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "../adamw_math.h"
#include "../compact_random.h"
#include "../ops_common.h"
#include "cpu_kernels.h"

namespace ampfused {
namespace cpu {

namespace {

constexpr int64_t kRange = 1 << 16;  // elements per work item: big enough to amortize, small enough to balance
constexpr int64_t kGrain = 1 << 15;  // [note: grain]

// body(first, last) for runs of the items [0, count) (elements(i) elements each, total in all)
// that together cover every item once, in one parallel region or inline ([note: grain]). What
// an item computes does not depend on the run it falls in.
template <class Elements, class Body>
void run_ranges(int64_t count, int64_t total, const Elements& elements, const Body& body) {
  if (count == 0) return;
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (total + kGrain - 1) / kGrain);
  if (tasks <= 1 || at::in_parallel_region()) {
    body(int64_t{0}, count);
    return;
  }
  // cut[t] is the first item of task t: the first item that starts at or past t/tasks of the work
  std::vector<int64_t> cut(tasks + 1, count);
  cut[0] = 0;
  int64_t t = 1;
  int64_t before = 0;  // elements of the items before item i
  for (int64_t i = 0; i < count && t < tasks; ++i) {
    while (t < tasks && before * tasks >= total * t) cut[t++] = i;
    before += elements(i);
  }
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      if (cut[task] < cut[task + 1]) body(cut[task], cut[task + 1]);
    }
  });
}

// The widest variant the CPU supports, capped by ATEN_CPU_CAPABILITY
// (default|avx2|avx512) as ATen's own kernels are; on AMD family 19h (Zen 3, Zen 4), whose divider
// is fast, it is the variant's -div twin ([note: division by a constant]). AMPFUSED_CPU_ISA=base|
// avx2|avx2-div|avx512|avx512-div overrides the choice, for tests and the bench (an AVX-512 machine
// can run the AVX2 or baseline loops); a variant the CPU lacks is not taken (CPU_ISA says which
// one runs). Read once, at the first use. Tests that compare with torch bitwise force both
// (ATEN_CPU_CAPABILITY=default with base): the baseline loops round a*b + c twice, as ATen's
// default build does, where ATen's AVX2/AVX-512 kernels fuse it.
int isa_rank(const std::string& name) {
  if (name == "avx512" || name == "avx512-div") return 2;
  if (name == "avx2" || name == "avx2-div") return 1;
  if (name == "base" || name == "default") return 0;
  return -1;
}

struct IsaRequest {
  int cap;             // the widest rank allowed
  std::string forced;  // AMPFUSED_CPU_ISA, "" where unset
};

IsaRequest isa_request() {
  const char* ours = std::getenv("AMPFUSED_CPU_ISA");
  if (ours != nullptr && *ours != '\0') {
    const int rank = isa_rank(ours);
    if (rank < 0) {
      throw std::invalid_argument(std::string("AMPFUSED_CPU_ISA=") + ours + ": use base, avx2, avx2-div, avx512 or avx512-div");
    }
    return {rank, ours};
  }
  const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
  if (aten == nullptr || *aten == '\0') return {2, ""};
  const int rank = isa_rank(aten);
  return {rank < 0 ? 0 : rank, ""};
}

const IsaKernels* choose() {
  const IsaRequest req = isa_request();
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  // the divider on AMD family 19h, where it is faster (docs/results/cpu-loops.md)
  const std::string& forced = req.forced;
  const bool divide = forced.empty() ? __builtin_cpu_is("amdfam19h") > 0
                                     : forced.size() > 4 && forced.compare(forced.size() - 4, 4, "-div") == 0;
  if (avx512 && kernels_avx512() != nullptr && req.cap >= 2) return divide ? kernels_avx512_div() : kernels_avx512();
  if (avx2 && kernels_avx2() != nullptr && req.cap >= 1) return divide ? kernels_avx2_div() : kernels_avx2();
#endif
  return kernels_base();
}

void accumulate_cpu(const at::Tensor& main_grad, const at::Tensor& grad) {
  check_accumulate(main_grad, grad);
  TORCH_CHECK(main_grad.device().is_cpu(), "ampfused::accumulate (CPU) got tensors on ", main_grad.device());
  const int32_t dtype = dtype_code(grad, "grad");
  float* dst = main_grad.data_ptr<float>();
  const char* src = static_cast<const char*>(grad.data_ptr());
  const IsaKernels& k = kernels();
  // one tensor per call (the backward hook's micro-batches): ATen's own split is [note: grain]'s
  at::parallel_for(0, main_grad.numel(), kGrain, [&](int64_t begin, int64_t end) {
    k.accumulate(dst + begin, src + begin * element_size(dtype), dtype, end - begin);
  });
}

void grad_stats_cpu(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf, std::optional<double> max_grad_norm,
                    const at::Tensor& stats, const std::optional<at::Tensor>& /*scratch: unused on CPU*/,
                    bool check_nonfinite) {
  check_stats(grads, grad_scale, found_inf, stats);
  TORCH_CHECK(stats.device().is_cpu(), "ampfused::grad_stats (CPU) got stats on ", stats.device());
  const float inv = inv_scale_of(grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr);
  struct Range {
    const char* data;
    int32_t dtype;
    int64_t n;
  };
  std::vector<Range> ranges;
  int64_t elements = 0;
  for (const at::Tensor& g : grads) {
    elements += g.numel();
    const int32_t dtype = dtype_code(g, "grads");
    const char* base = static_cast<const char*>(g.data_ptr());
    for (int64_t b = 0; b < g.numel(); b += kRange) {
      ranges.push_back(Range{base + b * element_size(dtype), dtype, std::min(kRange, g.numel() - b)});
    }
  }
  std::vector<SumSq> partial(ranges.size(), SumSq{0.0, false});
  const IsaKernels& k = kernels();
  run_ranges(
      static_cast<int64_t>(ranges.size()), elements, [&](int64_t r) { return ranges[r].n; },
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) partial[r] = k.sumsq(ranges[r].data, ranges[r].dtype, ranges[r].n, inv);
      });
  double total = 0.0;
  bool bad = false;
  for (const SumSq& x : partial) {
    total += x.sumsq;
    bad = bad || x.bad;
  }
  finish_stats(static_cast<float>(total), bad, found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr, inv,
               max_grad_norm.has_value(), static_cast<float>(max_grad_norm.value_or(0.0)), stats.data_ptr<float>(),
               check_nonfinite);
}

// The end of the update range that starts at element `b` of `t` (a block boundary): kRange elements
// on, and for int8 / int4 moments on a block boundary too ([note: blocks in rows] in _contract.py: a row's
// last block may be short, so a row that is no whole number of blocks counts kRange in its padded length).
int64_t range_end(const UpdateTensor& t, int64_t b) {
  if (ragged_rows(t)) {
    const int64_t v = b / t.row_numel * padded_row(t) + b % t.row_numel + kRange;  // b's work position, kRange on
    return std::min(t.numel, element_at(t, v));
  }
  const int64_t e = std::min(t.numel, b + kRange);
  if ((t.moment_kind != kMomentInt8 && t.moment_kind != kMomentInt4) || e == t.numel) return e;
  // the last block start at or before e (past b: a block is shorter than kRange), blocks starting at every row
  const int64_t row_start = e / t.row_numel * t.row_numel;
  return row_start + (e - row_start) / compact::kBlock * compact::kBlock;
}

void adamw_update_cpu(const UpdateCall& call) {
  const float unscale = inv_scale_of(call.grad_scale);
  const float* step_stats = call.stats.data_ptr<float>();
  if (step_stats[kStatsSkip] != 0.0f) return;  // a skipped step writes nothing at all
  const float base_factor = step_stats[kStatsFactor];
  std::vector<double> lr(call.groups.size());
  for (size_t j = 0; j < call.groups.size(); ++j) {
    // a tensor lr on another device is read here (it syncs with that device)
    lr[j] = call.lr_tensors[j].defined() ? call.lr_tensors[j].item<double>() : call.groups[j].lr;
  }
  std::vector<AdamWScalars> scalars(call.tensors.size());
  std::vector<UpdateRange> ranges;
  int64_t elements = 0;
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const UpdateTensor& t = call.tensors[i];
    elements += t.numel;
    const UpdateGroup& g = call.groups[t.group];
    scalars[i] = adamw_scalars(lr[t.group], g.beta1, g.beta2, g.eps, g.weight_decay, *t.step + 1.0f);
    // -(g * f) == g * (-f) exactly: maximize folds into the factor
    const float f = (g.flags & kFlagMaximize) != 0 ? -base_factor : base_factor;
    for (int64_t b = 0; b < t.numel;) {
      const int64_t e = range_end(t, b);
      ranges.push_back(UpdateRange{t, &scalars[i], f, call.grad_scale != nullptr ? t.grad : nullptr, unscale, b, e});
      if (t.stochastic != 0) {  // one high word per range: unsharded ranges never cross a multiple of 2^32,
        // a shard whose global indices do is not sent here (_contract.crosses_high_word)
        ranges.back().rounding_key = compact::rounding_key(static_cast<uint64_t>(*call.rounding_seed), t.index,
                                                           static_cast<uint32_t>((t.element_base + b) >> 32));
      }
      b = e;
    }
  }
  const IsaKernels& k = kernels();
  run_ranges(
      static_cast<int64_t>(ranges.size()), elements, [&](int64_t r) { return ranges[r].end - ranges[r].begin; },
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) is_compact(ranges[r]) ? k.compact_update(ranges[r]) : k.update(ranges[r]);
      });
  for (const UpdateTensor& t : call.tensors) *t.step = *t.step + 1.0f;
}

void scaler_update_cpu(const at::Tensor& found_inf, const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& skipped_steps,
                       const at::Tensor& consecutive_skips, const at::Tensor& watch, double growth_factor,
                       double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                       std::optional<double> min_scale) {
  check_scaler(found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps, consecutive_skips, watch);
  TORCH_CHECK(scale.device().is_cpu(), "ampfused::scaler_update (CPU) got tensors on ", scale.device());
  const ScalerRules rules = scaler_rules(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale);
  scaler_update(*found_inf.data_ptr<float>(), scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                hysteresis_tracker.data_ptr<int32_t>(), skipped_steps.data_ptr<int64_t>(),
                consecutive_skips.data_ptr<int64_t>(), watch.data_ptr<double>(), rules);
}

}  // namespace

const IsaKernels& kernels() {
  static const IsaKernels* chosen = choose();
  return *chosen;
}

}  // namespace cpu
}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, CPU, m) {
  m.impl("accumulate", &ampfused::cpu::accumulate_cpu);
  m.impl("grad_stats", &ampfused::cpu::grad_stats_cpu);
  m.impl("adamw_update", &ampfused::adamw_update_op<c10::DeviceType::CPU, ampfused::cpu::adamw_update_cpu, /*int8 moments*/ true, /*int4 moments*/ true>);
  m.impl("scaler_update", &ampfused::cpu::scaler_update_cpu);
}

