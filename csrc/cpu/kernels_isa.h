// One x86 ISA variant of the CPU hot loops, templated on macros (the one source of the AVX2 and
// AVX-512 builds; kernels_avx2.cpp / kernels_avx512.cpp only name their ISA):
//   AMPFUSED_ISA          namespace of the variant (isa_avx2, ...)
//   AMPFUSED_ISA_NAME     its name as CPU_ISA reports it ("avx2", ...)
//   AMPFUSED_ISA_GETTER   the cpu_kernels.h function returning it (kernels_avx2, ...)
//   AMPFUSED_GCC_TARGET / AMPFUSED_CLANG_TARGET   the target attribute strings
// The variant is chosen at run time only where the CPU has the ISA (ops_cpu.cpp).
//
// Everything included before the target pragma keeps the baseline
// target, so no inline function of the standard library is emitted with AVX code here and then
// picked by the linker for a baseline caller.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>  // its intrinsics carry their own target attributes
#endif

#include "cpu_kernels.h"

#define AMPFUSED_PRAGMA_(x) _Pragma(#x)
#define AMPFUSED_PRAGMA(x) AMPFUSED_PRAGMA_(x)

#if defined(__x86_64__) && defined(__GNUC__)
#if defined(__clang__)
AMPFUSED_PRAGMA(clang attribute push(__attribute__((target(AMPFUSED_CLANG_TARGET))), apply_to = function))
#else
#pragma GCC push_options
AMPFUSED_PRAGMA(GCC target(AMPFUSED_GCC_TARGET))
#endif
#define AMPFUSED_HAVE_FMA 1  // every x86 variant built here has FMA (see adamw_math.h)
#define AMPFUSED_F16C 1       // ... and F16C (kernels_impl.h: [note: fp16 by blocks])
#include "kernels_impl.h"
#include "compact_update.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace ampfused {
namespace cpu {
const IsaKernels* AMPFUSED_ISA_GETTER() {
  static const IsaKernels k{AMPFUSED_ISA_NAME, AMPFUSED_ISA::accumulate, AMPFUSED_ISA::sumsq, AMPFUSED_ISA::update,
                                AMPFUSED_ISA::compact_update};
  return &k;
}
}  // namespace cpu
}  // namespace ampfused
#else
namespace ampfused {
namespace cpu {
const IsaKernels* AMPFUSED_ISA_GETTER() { return nullptr; }
}  // namespace cpu
}  // namespace ampfused
#endif
