// AVX-512 (F, BW, VL, DQ) build of the CPU hot loops (kernels_isa.h is the template).
#define AMPFUSED_ISA isa_avx512
#define AMPFUSED_ISA_NAME "avx512"
#define AMPFUSED_ISA_GETTER kernels_avx512
#define AMPFUSED_GCC_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"
#define AMPFUSED_CLANG_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define AMPFUSED_VECTOR_BYTES 64  // kernels_impl.h keeps reduction lanes in vectors of this width
#include "kernels_isa.h"
