// The AVX-512 build of the CPU hot loops for CPUs whose divider is fast (AMD family 19h: Zen 4;
// ops_cpu.cpp chooses it): the same loops, dividing by sqrt(1 - beta2^t) on the divider instead of by
// adamw_math.h's FMA sequence ([note: division by a constant]). Bitwise the same results.
#include "isa_targets.h"
#define AMPFUSED_DIVIDER 1
#define AMPFUSED_ISA isa_avx512_div
#define AMPFUSED_ISA_NAME "avx512-div"
#define AMPFUSED_ISA_GETTER kernels_avx512_div
#define AMPFUSED_GCC_TARGET AMPFUSED_AVX512_GCC_TARGET
#define AMPFUSED_CLANG_TARGET AMPFUSED_AVX512_CLANG_TARGET
#define AMPFUSED_VECTOR_BYTES 64
#include "kernels_isa.h"
