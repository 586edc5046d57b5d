// AVX2 + FMA + F16C build of the CPU hot loops; chosen at run time only where the CPU has them.
// [note: system headers first] Everything included before the target pragma keeps the baseline
// target, so no inline function of the standard library is emitted with AVX2 code here and then
// picked by the linker for a baseline caller.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define AMPFUSED_ISA isa_avx2
#define AMPFUSED_HAVE_FMA 1
#include "kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace ampfused {
namespace cpu {
const IsaKernels* kernels_avx2() {
  static const IsaKernels k{"avx2", isa_avx2::accumulate, isa_avx2::sumsq, isa_avx2::update};
  return &k;
}
}  // namespace cpu
}  // namespace ampfused
#else
namespace ampfused {
namespace cpu {
const IsaKernels* kernels_avx2() { return nullptr; }
}  // namespace cpu
}  // namespace ampfused
#endif
