// Micro-batches 2..N of an fp16/bf16 param on the CPU: our accumulate kernel instead of autograd's add.
//
// With p.grad = main_grad (fp32, ampfused/_main_grad.py), autograd's
// AccumulateGrad does `p.grad += g` with a bf16/fp16 g. On a GPU that add is one kernel at the
// 10 B/param floor; on a CPU, torch's mixed-dtype add is several times slower than ampfused's
// fused cast-and-add. This pre-hook on the param's AccumulateGrad node does that add with the `ampfused::accumulate` op and hands autograd
// an undefined gradient, which AccumulateGrad ignores (post-accumulate hooks still run). It is
// C++, so micro-batches run no Python per param; anything unusual -- p.grad is not our view,
// create_graph, a gradient a user hook changed into another shape, layout or device -- is left to
// AccumulateGrad unchanged.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>

namespace ampfused {
namespace {

using torch::autograd::AccumulateGrad;
using torch::autograd::variable_list;

struct AccumulateIntoMainGrad : torch::autograd::FunctionPreHook {
  AccumulateIntoMainGrad(AccumulateGrad* node, at::Tensor main_grad) : node(node), main_grad(std::move(main_grad)) {}

  variable_list operator()(const variable_list& grads) override {
    const at::Tensor& g = grads[0];
    // a pre-hook registered after ours (a user's) must still see the gradient: then autograd adds
    if (!g.defined() || at::GradMode::is_enabled() || node->pre_hooks().back().get() != this) return grads;
    static const auto accumulate = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("ampfused::accumulate", "")
                                       .typed<void(const at::Tensor&, const at::Tensor&)>();
    // pre-hooks run outside AccumulateGrad's lock; concurrent backwards on shared params must not race
    std::lock_guard<std::mutex> lock(mutex);
    if (!takes(g)) return grads;
    accumulate.call(main_grad, g);
    torch::autograd::impl::bump_version(main_grad);  // as the in-place add would
    return {at::Tensor()};
  }

  // Under compiled autograd this hook is not traced and AccumulateGrad's own add runs: same sum.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

  bool takes(const at::Tensor& g) const {
    const at::Tensor& grad = node->variable.grad();
    return node->variable.requires_grad() && grad.defined() && grad.is_same(main_grad) && g.device() == main_grad.device() &&
           g.layout() == at::kStrided && g.sizes() == main_grad.sizes() && g.is_contiguous() &&
           main_grad.is_contiguous() &&
           (g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kHalf || g.scalar_type() == at::kFloat);
  }

  AccumulateGrad* node;  // owns this hook, so it outlives it
  at::Tensor main_grad;
  std::mutex mutex;
};

AccumulateGrad* accumulator_of(const at::Tensor& param) {
  // the live node (the caller holds it), even while the param is frozen; else a new one
  auto node = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!node) {
    TORCH_CHECK(param.requires_grad() && param.is_leaf(), "ampfused: only a leaf that requires grad has an accumulator");
    node = torch::autograd::impl::grad_accumulator(param);
  }
  auto* acc = dynamic_cast<AccumulateGrad*>(node.get());
  TORCH_CHECK(acc != nullptr, "ampfused: the param has no AccumulateGrad node");
  return acc;
}

// The caller keeps the node alive (ampfused/_main_grad.py holds it), or the next forward would
// build a new AccumulateGrad without the hook.
void hook_accumulation(const at::Tensor& param, const at::Tensor& main_grad) {
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat && main_grad.sizes() == param.sizes(),
              "ampfused: main_grad must be a float32 tensor of the param's shape");
  AccumulateGrad* acc = accumulator_of(param);
  acc->add_pre_hook(std::make_unique<AccumulateIntoMainGrad>(acc, main_grad));
}

void unhook_accumulation(const at::Tensor& param, const at::Tensor& main_grad) {
  auto node = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!node) return;
  auto& hooks = node->pre_hooks();
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                             [&](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                               auto* ours = dynamic_cast<AccumulateIntoMainGrad*>(h.get());
                               return ours != nullptr && ours->main_grad.is_same(main_grad);
                             }),
              hooks.end());
}

}  // namespace
}  // namespace ampfused

// No tensor is written here, so the ops take their (catch-all) kernels with their definitions.
TORCH_LIBRARY_FRAGMENT(ampfused, m) {
  m.def("_hook_accumulation(Tensor param, Tensor main_grad) -> ()", &ampfused::hook_accumulation);
  m.def("_unhook_accumulation(Tensor param, Tensor main_grad) -> ()", &ampfused::unhook_accumulation);
}
