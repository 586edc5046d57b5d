// Interface between the CPU op implementations (ops_cpu.cpp, baseline ISA, ATen threading) and
// the hot loops (kernels_impl.h, compiled once per ISA: kernels_base.cpp, and kernels_isa.h through
// kernels_avx2.cpp / kernels_avx512.cpp, and their *_div twins that divide on the divider).
//
// The hot loops are plain C++ loops that the compiler auto-vectorizes
// (-O3 -fno-math-errno, `#pragma GCC target` per file). The library itself is built for baseline
// x86-64 and picks the widest variant the CPU supports at run time, so it never dies with an
// illegal instruction on an older machine. ATEN_CPU_CAPABILITY (default|avx2|avx512) caps the
// choice, as it caps ATen's own kernels.
#pragma once

#include <cstdint>

#include "../contract.h"

namespace ampfused {
struct AdamWScalars;
namespace cpu {

// One contiguous element range [begin, end) of one tensor (contract.h's record) for the update pass.
struct UpdateRange : UpdateTensor {
  const AdamWScalars* scalars;
  float factor;           // clip coefficient / loss scale, negated for maximize
  void* grad_out;         // nullptr, or grad: the unscaled gradient g * unscale is written back (DESIGN §2.7)
  float unscale;          // 1 / loss scale, as torch's unscale_ rounds it
  int64_t begin;
  int64_t end;
  uint32_t rounding_key;  // stochastic rounding (compact_random.h): the key of this range's elements
};

struct SumSq {
  double sumsq;  // in double: a range's float blocks summed
  bool bad;      // an element was inf/NaN
};

struct IsaKernels {
  const char* name;
  // dst[i] += float(src[i]) for i < n
  void (*accumulate)(float* dst, const void* src, int32_t src_dtype, int64_t n);
  // sum over i < n of (float(g[i]) * inv_scale)^2, accumulated in float blocks, returned as double,
  // and whether any float(g[i]) * inv_scale was inf/NaN
  SumSq (*sumsq)(const void* grad, int32_t dtype, int64_t n, float inv_scale);
  void (*update)(const UpdateRange& range);
  // the update of a range of a tensor with compact state (contract.h's is_compact; compact_update.h)
  void (*compact_update)(const UpdateRange& range);
};

// nullptr where the variant was not compiled in (non-x86 or non-GCC-compatible compiler)
const IsaKernels* kernels_base();
const IsaKernels* kernels_avx2();
const IsaKernels* kernels_avx512();
const IsaKernels* kernels_avx512_div();  // the same, dividing on the divider (adamw_math.h)
const IsaKernels* kernels_avx2_div();

// The variant used in this process (chosen once).
const IsaKernels& kernels();

}  // namespace cpu
}  // namespace ampfused
