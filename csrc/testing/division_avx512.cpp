// AVX-512 variant of the division check (division_isa.h), the target of cpu/kernels_avx512.cpp.
#if defined(__x86_64__) && defined(__GNUC__)
#include "../cpu/isa_targets.h"
#define AMPFUSED_TESTING_FN division_mismatches_avx512
#define AMPFUSED_GCC_TARGET AMPFUSED_AVX512_GCC_TARGET
#define AMPFUSED_CLANG_TARGET AMPFUSED_AVX512_CLANG_TARGET
#include "division_isa.h"
#endif
