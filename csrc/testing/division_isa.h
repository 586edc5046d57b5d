// One ISA variant of the test-only division check, templated on macros as cpu/kernels_isa.h is
// (division_base.cpp, division_avx2.cpp, division_avx512.cpp only name their variant):
//   AMPFUSED_TESTING_FN   the function's name (division_mismatches_avx2, ...)
//   AMPFUSED_GCC_TARGET / AMPFUSED_CLANG_TARGET   the target attribute strings (none: baseline)
// The same target and the same AMPFUSED_HAVE_FMA as the hot loops of that ISA, so adamw_math.h
// takes the same division path as the update compiled for it.
#include <cmath>
#include <cstdint>
#include <cstring>

#define AMPFUSED_PRAGMA_(x) _Pragma(#x)
#define AMPFUSED_PRAGMA(x) AMPFUSED_PRAGMA_(x)

#if defined(AMPFUSED_GCC_TARGET)
#if defined(__clang__)
AMPFUSED_PRAGMA(clang attribute push(__attribute__((target(AMPFUSED_CLANG_TARGET))), apply_to = function))
#else
#pragma GCC push_options
AMPFUSED_PRAGMA(GCC target(AMPFUSED_GCC_TARGET))
#endif
#define AMPFUSED_HAVE_FMA 1
#endif

#include "../adamw_math.h"

namespace ampfused {
namespace testing {

// Of every fp32 a = 2^exponent * (1 + m/2^23), how many a / c the update's division by its
// per-tensor constant gets wrong (adamw_math.h, [note: division by a constant]; 0 with a plain division).
int64_t AMPFUSED_TESTING_FN(float c, int32_t exponent) {
  const float y = 1.0f / c;
  int64_t bad = 0;
  for (uint32_t m = 0; m < (1u << 23); ++m) {
    const uint32_t bits = (static_cast<uint32_t>(exponent + 127) << 23) | m;
    float a;
    std::memcpy(&a, &bits, sizeof a);
#if defined(AMPFUSED_EXACT_DIV_BY_CONSTANT)
    const float q = div_by_constant(a, c, y);
#else
    const float q = a / c;
    (void)y;
#endif
    bad += q != a / c;
  }
  return bad;
}

}  // namespace testing
}  // namespace ampfused

#if defined(AMPFUSED_GCC_TARGET)
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
