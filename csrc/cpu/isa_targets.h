// The x86 target attribute strings of each ISA variant: one spelling for the hot loops
// (kernels_avx2.cpp, kernels_avx512.cpp) and the test-only checks compiled for the same targets
// (csrc/testing/division_avx2.cpp, division_avx512.cpp).
#pragma once

#define AMPFUSED_AVX2_GCC_TARGET "avx2,fma,f16c"
#define AMPFUSED_AVX2_CLANG_TARGET "avx2,fma,f16c"
#define AMPFUSED_AVX512_GCC_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"
#define AMPFUSED_AVX512_CLANG_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
