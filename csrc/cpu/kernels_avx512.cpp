// AVX-512 (F, BW, VL, DQ) build of the CPU hot loops (kernels_isa.h is the template).
#include "isa_targets.h"
#define AMPFUSED_ISA isa_avx512
#define AMPFUSED_ISA_NAME "avx512"
#define AMPFUSED_ISA_GETTER kernels_avx512
#define AMPFUSED_GCC_TARGET AMPFUSED_AVX512_GCC_TARGET
#define AMPFUSED_CLANG_TARGET AMPFUSED_AVX512_CLANG_TARGET
#define AMPFUSED_VECTOR_BYTES 64  // kernels_impl.h keeps reduction lanes in vectors of this width
#include "kernels_isa.h"
