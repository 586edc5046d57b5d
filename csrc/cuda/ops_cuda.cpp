// CUDA implementations of the ampfused ops: argument checks, the cached device tables of
// multi_tensor.h, and the launches (passes.cu). Host code only; compiled by the host compiler.
//
// Each pass has two cached tables: the chunk layout (and its grid),
// keyed by the element counts only, and the tensor entries, keyed by every pointer, size, dtype
// and group index they encode. A new address (autograd allocating p.grad elsewhere) therefore
// uploads O(tensors) bytes of entries and never rebuilds the layout (~820k chunks at 7B). A few
// tables are kept per process (several optimizers, or the stats and update passes of a GAN, each
// find theirs). Building one copies from pinned host memory with a non-blocking copy on the current
// stream: nothing synchronizes, and the copy can be captured in a CUDA graph (the pinned buffer
// lives as long as the table).
//
// Tables and CUDA graphs: a captured graph bakes a table's device addresses into its
// launches, so a table used during capture moves out of the small LRU into a list that is never
// freed. A table *built* during capture holds nothing until the graph first replays (its upload
// and counter reset are only recorded), so eager calls never get it: they build their own.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "../contract_aten_generated.h"  // lr_kind_of
#include "../ops_common.h"
#include "multi_tensor.h"

namespace ampfused {
namespace cuda {
namespace {

constexpr size_t kCachedTables = 16;

int sm_count(int device) {
  static std::mutex mu;
  static std::vector<int> counts;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(counts.size()) <= device) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

int grid_for(int64_t work_items, int device, int blocks_per_sm) {
  const int64_t most = std::min<int64_t>(kMaxGrid, static_cast<int64_t>(sm_count(device)) * blocks_per_sm);
  return static_cast<int>(std::max<int64_t>(1, std::min(work_items, most)));
}

// One uploaded buffer: `host` (pinned) is kept alive for the async copy and graph replays. Tables
// are read-only on the device: what a launch writes lives in the caller's scratch (below).
struct Table {
  std::vector<int64_t> key;
  at::Tensor host;
  at::Tensor device;
  int64_t n_chunks = 0;
  int grid = 1;
  bool built_in_capture = false;  // empty until the capturing graph first replays

  const void* data() const { return device.data_ptr(); }
};

// The caller's scratch ([note: scratch] in contract.h), or, without one, a fresh zeroed buffer (a
// memset on the stream; inside a capture it lives in the graph's pool).
at::Tensor scratch_or_fresh(const std::optional<at::Tensor>& scratch, const at::Device& device, const char* op) {
  if (!scratch.has_value()) return at::zeros({kScratchBytes}, at::TensorOptions().dtype(at::kByte).device(device));
  const at::Tensor& s = *scratch;
  TORCH_CHECK(s.device() == device && s.scalar_type() == at::kByte && s.is_contiguous() && s.numel() >= kScratchBytes,
              op, ": scratch must be a contiguous uint8 tensor of at least ", kScratchBytes, " bytes on ", device,
              ", got ", s.scalar_type(), " of ", s.numel(), " on ", s.device());
  return s;
}
unsigned int* stats_counter(const at::Tensor& scratch) {
  return reinterpret_cast<unsigned int*>(static_cast<char*>(scratch.data_ptr()) + kScratchStatsCounter);
}
unsigned int* update_counter(const at::Tensor& scratch) {
  return reinterpret_cast<unsigned int*>(static_cast<char*>(scratch.data_ptr()) + kScratchUpdateCounter);
}
double* stats_partials(const at::Tensor& scratch) {
  return reinterpret_cast<double*>(static_cast<char*>(scratch.data_ptr()) + kScratchPartials);
}

std::shared_ptr<Table> upload(std::vector<int64_t> key, const void* bytes, int64_t n_bytes, const at::Device& device) {
  auto table = std::make_shared<Table>();
  table->key = std::move(key);
  const int64_t size = std::max<int64_t>(16, n_bytes);
  table->host = at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  if (n_bytes > 0) std::memcpy(table->host.data_ptr(), bytes, n_bytes);
  table->device = at::empty({size}, at::TensorOptions().dtype(at::kByte).device(device));
  table->device.copy_(table->host, /*non_blocking=*/true);
  return table;
}

// The chunk layout of tensors of `numels` elements, and the grid of a launch of `blocks_per_sm`.
std::shared_ptr<Table> build_layout(std::vector<int64_t> key, const std::vector<int64_t>& numels, const at::Device& device,
                                    int blocks_per_sm) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < numels.size(); ++i) {
    for (int64_t start = 0; start < numels[i]; start += kChunkSize) chunks.push_back(Chunk{static_cast<int32_t>(i), 0, start});
  }
  auto table = upload(std::move(key), chunks.data(), static_cast<int64_t>(chunks.size() * sizeof(Chunk)), device);
  table->n_chunks = static_cast<int64_t>(chunks.size());
  table->grid = grid_for(table->n_chunks, device.index(), blocks_per_sm);
  return table;
}

// The cached table for `key`, built by `build` on a miss (most recently used first).
// Capture pins a table: see "Tables and CUDA graphs" at the top of this file.
template <typename Build>
std::shared_ptr<Table> cached_table(const std::vector<int64_t>& key, Build build) {
  static std::mutex mu;
  static std::deque<std::shared_ptr<Table>> tables;  // eager tables, LRU
  static std::vector<std::shared_ptr<Table>> kept;   // used by a captured graph: never freed
  std::lock_guard<std::mutex> lock(mu);
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  for (const std::shared_ptr<Table>& t : kept) {
    if (t->key == key && (capturing || !t->built_in_capture)) return t;
  }
  for (auto it = tables.begin(); it != tables.end(); ++it) {
    if ((*it)->key == key) {
      std::shared_ptr<Table> hit = *it;
      tables.erase(it);
      if (capturing) {
        kept.push_back(hit);
      } else {
        tables.push_front(hit);
      }
      return hit;
    }
  }
  std::shared_ptr<Table> fresh = build();
  if (capturing) {
    fresh->built_in_capture = true;
    kept.push_back(fresh);
    return fresh;
  }
  tables.push_front(fresh);
  if (tables.size() > kCachedTables) tables.pop_back();
  return fresh;
}

// A step allocates temporaries only in rare cases (more
// than kInlineGroups groups: a pinned buffer and its device copy; an lr tensor on another GPU or of
// an integer dtype: its fp32 copy). Eagerly, the caching allocators keep them until the stream is
// done with them. A captured graph replays the copy and the kernel reading them later, so
// temporaries made during capture are kept for the life of the process (a few bytes per capture).
void keep_for_graphs(std::vector<at::Tensor> temporaries) {
  if (temporaries.empty() || c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) return;
  static std::mutex mu;
  static std::vector<at::Tensor> kept;
  std::lock_guard<std::mutex> lock(mu);
  for (at::Tensor& t : temporaries) kept.push_back(std::move(t));
}

// Layout key: kind, device, then every element count.
std::shared_ptr<Table> layout_for(int64_t kind, const at::Device& device, const std::vector<int64_t>& numels, int blocks_per_sm) {
  std::vector<int64_t> key{kind, device.index()};
  key.insert(key.end(), numels.begin(), numels.end());
  return cached_table(key, [&] { return build_layout(key, numels, device, blocks_per_sm); });
}

void accumulate_cuda(const at::Tensor& main_grad, const at::Tensor& grad) {
  check_accumulate(main_grad, grad);
  TORCH_CHECK(main_grad.is_cuda(), "ampfused::accumulate (CUDA) got tensors on ", main_grad.device());
  const int64_t n = main_grad.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(main_grad.device());
  const int32_t dtype = dtype_code(grad, "grad");
  float* dst = main_grad.data_ptr<float>();
  const void* src = grad.data_ptr();
  const bool aligned = aligned4(dst, 4) && aligned4(src, element_size(dtype));
  const int grid = grid_for((n + 4 * kBlockSize - 1) / (4 * kBlockSize), main_grad.device().index(), 4);
  C10_CUDA_CHECK(launch_accumulate(dst, src, dtype, n, aligned, grid, c10::cuda::getCurrentCUDAStream()));
}

void grad_stats_cuda(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf, std::optional<double> max_grad_norm,
                     const at::Tensor& stats, const std::optional<at::Tensor>& scratch, bool check_nonfinite) {
  check_stats(grads, grad_scale, found_inf, stats);
  TORCH_CHECK(stats.is_cuda(), "ampfused::grad_stats (CUDA) got stats on ", stats.device());
  const at::Device device = stats.device();
  const c10::cuda::CUDAGuard guard(device);
  std::vector<StatsEntry> entries;
  std::vector<int64_t> numels;
  std::vector<int64_t> key{1, device.index()};  // 1: stats entries
  entries.reserve(grads.size());
  numels.reserve(grads.size());
  key.reserve(2 + 3 * grads.size());
  for (const at::Tensor& g : grads) {
    const int32_t dtype = dtype_code(g, "grads");
    const void* ptr = g.data_ptr();
    entries.push_back(StatsEntry{ptr, g.numel(), dtype, aligned4(ptr, element_size(dtype))});
    numels.push_back(g.numel());
    key.push_back(reinterpret_cast<int64_t>(ptr));
    key.push_back(g.numel());
    key.push_back(dtype);
  }
  std::shared_ptr<Table> layout = layout_for(11, device, numels, stats_blocks_per_sm());
  std::shared_ptr<Table> table = cached_table(key, [&] {
    return upload(key, entries.data(), static_cast<int64_t>(entries.size() * sizeof(StatsEntry)), device);
  });
  StatsParams p{};
  p.tensors = static_cast<const StatsEntry*>(table->data());
  p.chunks = static_cast<const Chunk*>(layout->data());
  p.n_chunks = layout->n_chunks;
  p.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  p.found_inf = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  p.clip = max_grad_norm.has_value() ? 1 : 0;
  p.max_grad_norm = static_cast<float>(max_grad_norm.value_or(0.0));
  p.check_nonfinite = check_nonfinite ? 1 : 0;
  p.stats = stats.data_ptr<float>();
  const at::Tensor launch_scratch = scratch_or_fresh(scratch, device, "ampfused::grad_stats");
  p.partials = stats_partials(launch_scratch);
  p.counter = stats_counter(launch_scratch);
  C10_CUDA_CHECK(launch_stats(p, layout->grid, c10::cuda::getCurrentCUDAStream()));
}

// The lr of a group given as a tensor on a GPU: read on the device at kernel time, in its own float
// dtype: no sync, no temporary, and graph replays see scheduler updates. Only an lr on another GPU
// or of a non-float dtype is copied over on the stream (reading it on the host would synchronize);
// the copy goes to `temporaries` (see keep_for_graphs).
void point_at_lr(UpdateGroup& group, const at::Tensor& lr, const at::Device& device, std::vector<at::Tensor>& temporaries) {
  if (!lr.is_cuda()) {
    group.lr = lr.item<double>();  // not a CPU tensor (collect_update read those) nor a GPU one
    return;
  }
  const bool direct = lr.device() == device && lr_kind_of(lr.scalar_type()) >= 0;
  at::Tensor lr_t = direct ? lr : lr.to(device, at::kFloat);
  group.lr_ptr = lr_t.data_ptr();
  group.lr_kind = lr_kind_of(lr_t.scalar_type());
  if (!direct) temporaries.push_back(lr_t);
}

void adamw_update_cuda(const UpdateCall& call) {
  const at::Device device = call.device;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // a captured graph would replay this step's seed: the same random bits every step (functional.rounding_seed
  // refuses it first; this keeps the op itself honest)
  TORCH_CHECK(!call.rounding_seed.has_value() ||
                  c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
              "ampfused::adamw_update (CUDA): stochastic rounding (a rounding_seed) cannot be captured in a CUDA graph: "
              "every replay would reuse the captured seed; capture with stochastic_rounding=False");

  // [note: a launch per variant] Each variant of the update kernel (multi_tensor.h) runs over the
  // tensors it serves alone, one launch each on the stream, plain first: registers are a kernel's,
  // so a single launch of the blockwise variant (one block of 512 per SM) would hold every fp32 and bf16
  // tensor of the step to its occupancy too. The table lists the tensors grouped by variant, and
  // each launch gets its slice (records, chunk layout, step counters to advance); a tensor's random
  // bits are keyed by its record's index, not its place in the table, so the order changes nothing
  // (docs/results/sm90-kernels.md: registers, blocks and bytes in flight per SM of each variant).
  constexpr int kVariants = 3;
  auto variant_of = [](const UpdateTensor& t) {
    const bool blockwise = t.moment_kind == kMomentInt8 || t.moment_kind == kMomentInt4;
    return blockwise ? kUpdateCompactBlockwise : is_compact(t) ? kUpdateCompact : kUpdatePlain;
  };
  std::vector<UpdateTensor> ordered;
  ordered.reserve(call.tensors.size());
  std::vector<int64_t> numels[kVariants];
  int32_t counts[kVariants] = {0, 0, 0};
  for (int v = 0; v < kVariants; ++v) {
    for (const UpdateTensor& t : call.tensors) {
      if (variant_of(t) != v) continue;
      ordered.push_back(t);
      numels[v].push_back(work_numel(t));  // [note: blocks in rows]
      ++counts[v];
    }
  }
  std::vector<int64_t> key{2, device.index()};  // 2: update entries (in the order of `ordered`)
  key.reserve(2 + 13 * ordered.size());
  for (const UpdateTensor& t : ordered) {
    for (const void* ptr : {static_cast<const void*>(t.param), static_cast<const void*>(t.grad),
                            static_cast<const void*>(t.exp_avg), static_cast<const void*>(t.exp_avg_sq),
                            static_cast<const void*>(t.max_exp_avg_sq), static_cast<const void*>(t.master),
                            static_cast<const void*>(t.step), static_cast<const void*>(t.exp_avg_scales),
                            static_cast<const void*>(t.exp_avg_sq_scales),
                            static_cast<const void*>(t.max_exp_avg_sq_scales)}) {
      key.push_back(reinterpret_cast<int64_t>(ptr));
    }
    key.push_back(t.numel);
    key.push_back((static_cast<int64_t>(t.group) << 8) | (t.param_dtype << 4) | t.grad_dtype);
    // the encodings: the same pointers may hold another kind after a state change
    key.push_back((t.master_kind << 8) | (t.moment_kind << 4) | t.stochastic);
    key.push_back(t.index);  // the random bits' key: the same pointers may come in another order
    key.push_back(t.element_base);
    key.push_back(t.row_numel);
  }
  std::shared_ptr<Table> table = cached_table(key, [&] {
    return upload(key, ordered.data(), static_cast<int64_t>(ordered.size() * sizeof(UpdateTensor)), device);
  });

  // Group hyperparameters: by value in the launch (they change every step under a scheduler).
  std::vector<UpdateGroup> groups = call.groups;
  std::vector<at::Tensor> keep_alive;
  for (size_t j = 0; j < groups.size(); ++j) {
    if (call.lr_tensors[j].defined()) point_at_lr(groups[j], call.lr_tensors[j], device, keep_alive);
  }
  UpdateParams p{};
  p.n_groups = static_cast<int32_t>(groups.size());
  p.stats = call.stats.data_ptr<float>();
  const at::Tensor launch_scratch = scratch_or_fresh(call.scratch, device, "ampfused::adamw_update");
  p.grad_scale = call.grad_scale;
  p.counter = update_counter(launch_scratch);
  p.rounding_seed = static_cast<uint64_t>(call.rounding_seed.value_or(0));
  at::Tensor group_table;
  if (groups.size() <= static_cast<size_t>(kInlineGroups)) {
    std::copy(groups.begin(), groups.end(), p.inline_groups);
    p.groups = nullptr;
  } else {
    const int64_t bytes = static_cast<int64_t>(groups.size() * sizeof(UpdateGroup));
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), groups.data(), bytes);
    group_table = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    group_table.copy_(host, /*non_blocking=*/true);
    keep_alive.push_back(host);
    p.groups = static_cast<const UpdateGroup*>(group_table.data_ptr());
  }
  const UpdateTensor* records = static_cast<const UpdateTensor*>(table->data());
  for (int v = 0; v < kVariants; ++v) {
    if (counts[v] == 0) continue;
    const UpdateVariant variant = static_cast<UpdateVariant>(v);
    // the grid depends on the variant's occupancy: a layout per variant (12, 13, 14)
    std::shared_ptr<Table> layout = layout_for(12 + v, device, numels[v], update_blocks_per_sm(variant));
    p.tensors = records;
    p.n_tensors = counts[v];
    p.chunks = static_cast<const Chunk*>(layout->data());
    p.n_chunks = layout->n_chunks;
    // launches of one stream run one after the other: each finds the counter reset by the last
    C10_CUDA_CHECK(launch_update(p, variant, layout->grid, stream));
    records += counts[v];
  }
  if (group_table.defined()) keep_alive.push_back(group_table);
  keep_for_graphs(std::move(keep_alive));
}

void scaler_update_cuda(const at::Tensor& found_inf, const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& hysteresis_tracker, const at::Tensor& skipped_steps,
                        const at::Tensor& consecutive_skips, const at::Tensor& watch, double growth_factor,
                        double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                        std::optional<double> min_scale) {
  check_scaler(found_inf, scale, growth_tracker, hysteresis_tracker, skipped_steps, consecutive_skips, watch);
  TORCH_CHECK(scale.is_cuda(), "ampfused::scaler_update (CUDA) got tensors on ", scale.device());
  const c10::cuda::CUDAGuard guard(scale.device());
  const ScalerRules rules = scaler_rules(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale);
  C10_CUDA_CHECK(launch_scaler_update(found_inf.data_ptr<float>(), scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                                      hysteresis_tracker.data_ptr<int32_t>(), skipped_steps.data_ptr<int64_t>(),
                                      consecutive_skips.data_ptr<int64_t>(), watch.data_ptr<double>(), rules,
                                      c10::cuda::getCurrentCUDAStream()));
}

}  // namespace
}  // namespace cuda
}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, CUDA, m) {
  m.impl("accumulate", &ampfused::cuda::accumulate_cuda);
  m.impl("grad_stats", &ampfused::cuda::grad_stats_cuda);
  m.impl("adamw_update", &ampfused::adamw_update_op<c10::DeviceType::CUDA, ampfused::cuda::adamw_update_cuda, true, true>);
  m.impl("scaler_update", &ampfused::cuda::scaler_update_cuda);
}
