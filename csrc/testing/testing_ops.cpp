// Test-only ops, in their own library `ampfused_testing` so the production extension ampfused._C
// carries none of them. tests/testing_extension.py builds this folder on demand with the flags
// csrc/build_extension.py gives _C (the same optimization, fp-contract and OpenMP flags).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace ampfused {
namespace testing {

// division_isa.h, one per ISA variant (the x86 ones only where they are compiled)
int64_t division_mismatches_base(float c, int32_t exponent);
#if defined(__x86_64__) && defined(__GNUC__)
int64_t division_mismatches_avx2(float c, int32_t exponent);
int64_t division_mismatches_avx512(float c, int32_t exponent);
#endif

// How many distinct threads run the work items of one at::parallel_for called from an extension
// built with build_extension.py's flags (without torch's OpenMP runtime it is 1).
int64_t parallel_threads(int64_t work_items) {
  std::mutex mu;
  std::set<std::thread::id> seen;
  at::parallel_for(0, work_items, 1, [&](int64_t begin, int64_t end) {
    volatile double sink = 0.0;
    for (int64_t r = begin; r < end; ++r) {
      for (int j = 0; j < 200000; ++j) sink = sink + 1.0;  // long enough that every thread gets an item
    }
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

// The division check in the variant named as ampfused._C.CPU_ISA names it. The caller passes
// only a variant this CPU runs (the one _C chose).
int64_t division_mismatches(double c, int64_t exponent, std::string isa) {
  const float cf = static_cast<float>(c);
  const int32_t e = static_cast<int32_t>(exponent);
  if (isa == "default") return division_mismatches_base(cf, e);
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == "avx2") return division_mismatches_avx2(cf, e);
  if (isa == "avx512") return division_mismatches_avx512(cf, e);
#endif
  TORCH_CHECK(false, "ampfused_testing: no division check compiled for ISA ", isa);
}

}  // namespace testing
}  // namespace ampfused

// No tensor arguments: the ops take their (catch-all) kernels with their definitions.
TORCH_LIBRARY(ampfused_testing, m) {
  m.def("parallel_threads(int work_items) -> int", &ampfused::testing::parallel_threads);
  m.def("division_mismatches(float c, int exponent, str isa) -> int", &ampfused::testing::division_mismatches);
}
