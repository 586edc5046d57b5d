// AVX-512 (F, BW, VL, DQ) build of the CPU hot loops; chosen at run time only where the CPU has them.
// [note: system headers first] Everything included before the target pragma keeps the baseline
// target, so no inline function of the standard library is emitted with AVX-512 code here and then
// picked by the linker for a baseline caller.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#endif
#define AMPFUSED_ISA isa_avx512
#define AMPFUSED_HAVE_FMA 1
#include "kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace ampfused {
namespace cpu {
const IsaKernels* kernels_avx512() {
  static const IsaKernels k{"avx512", isa_avx512::accumulate, isa_avx512::sumsq, isa_avx512::update};
  return &k;
}
}  // namespace cpu
}  // namespace ampfused
#else
namespace ampfused {
namespace cpu {
const IsaKernels* kernels_avx512() { return nullptr; }
}  // namespace cpu
}  // namespace ampfused
#endif
