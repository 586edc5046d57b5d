// Op schemas of ampfused._C and the Python module that loads them.
//
// The kernels are reached through torch.ops.ampfused.* (the dispatcher), so
// they work under torch.compile and with torch.library.opcheck; the Python module itself is empty
// and exists only so that `import ampfused._C` loads this library and runs its registrations. It
// uses no pybind11 and no torch/extension.h.
#include <Python.h>
#include <torch/library.h>
#include <torch/version.h>

#include <exception>

#include "cpu/cpu_kernels.h"

// [note: no optional mutable lists] max_exp_avg_sqs and masters use an empty tensor where a param
// has no AMSGrad buffer / no master copy: torch's auto-functionalization (torch.compile) fails on
// `Tensor(a!)?[]` lists holding None (torch 2.13).
//
// `scratch` is the caller's launch scratch ([note: scratch] in contract.h): FusedAmpAdamW passes one
// per optimizer; without it each CUDA launch gets a fresh zeroed one. The CPU kernels ignore it.
// `flags` are contract.h's group flags; the stats vector has its slots.
//
// adamw_update writes grads only when grad_scale is given (the unscaled gradient, DESIGN §2.7).
// Compact state is told by the dtypes of masters and moments (docs/design.md §9, "told by dtypes");
// rounding_seed (None: round to nearest even) makes the bf16 writes without an exact master
// stochastic, from a counter-based hash of (seed, list index, element index). moment_scales (None
// when no tensor has int8 or int4 moments) holds three entries per tensor, the fp32 block scales of
// its exp_avg, exp_avg_sq and max_exp_avg_sq codes, an empty tensor where it has none; a kernel that
// does not serve int8 (int4) moments refuses them.
//
// grad_stats with check_nonfinite=false lets only found_inf skip (skip_nonfinite=False).
TORCH_LIBRARY(ampfused, m) {
  m.def("accumulate(Tensor(a!) main_grad, Tensor grad) -> ()");
  m.def("grad_stats(Tensor[] grads, Tensor? grad_scale, Tensor? found_inf, float? max_grad_norm, Tensor(a!) stats, "
        "Tensor(b!)? scratch=None, bool check_nonfinite=True) -> ()");
  m.def(
      "adamw_update(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, Tensor(f!)[] masters, int[] groups, float[] lrs, "
      "Tensor?[] lr_tensors, float[] beta1s, float[] beta2s, float[] epss, float[] weight_decays, int[] flags, "
      "Tensor stats, Tensor(h!)? scratch=None, Tensor? grad_scale=None, int? rounding_seed=None, "
      "Tensor(i!)[]? moment_scales=None, int[]? rounding_index=None, int[]? element_base=None) -> ()");
  m.def(
      "scaler_update(Tensor found_inf, Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor(d!) skipped_steps, Tensor(e!) consecutive_skips, Tensor(f!) watch, float growth_factor, "
      "float backoff_factor, int growth_interval, int hysteresis, float? min_scale) -> ()");
}

static struct PyModuleDef ampfused_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                               "ampfused compiled kernels (ops in torch.ops.ampfused)", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&ampfused_c_module);
  if (module == nullptr) return nullptr;
#ifdef AMPFUSED_WITH_CUDA
  PyModule_AddIntConstant(module, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(module, "WITH_CUDA", 0);
#endif
  PyModule_AddStringConstant(module, "TORCH_VERSION", TORCH_VERSION);  // the torch this was built against
  try {
    PyModule_AddStringConstant(module, "CPU_ISA", ampfused::cpu::kernels().name);
  } catch (const std::exception& e) {  // a bad AMPFUSED_CPU_ISA: the import fails and says why
    Py_DECREF(module);
    PyErr_SetString(PyExc_ImportError, e.what());
    return nullptr;
  }
  return module;
}
