// The AVX2 build of the CPU hot loops for AMD Zen 3 / Zen 4 (family 19h), whose divider is fast:
// the same loops, dividing by sqrt(1 - beta2^t) on the divider (kernels_avx512_div.cpp says why).
#include "isa_targets.h"
#define AMPFUSED_DIVIDER 1
#define AMPFUSED_ISA isa_avx2_div
#define AMPFUSED_ISA_NAME "avx2-div"
#define AMPFUSED_ISA_GETTER kernels_avx2_div
#define AMPFUSED_GCC_TARGET AMPFUSED_AVX2_GCC_TARGET
#define AMPFUSED_CLANG_TARGET AMPFUSED_AVX2_CLANG_TARGET
#define AMPFUSED_VECTOR_BYTES 32
#include "kernels_isa.h"
