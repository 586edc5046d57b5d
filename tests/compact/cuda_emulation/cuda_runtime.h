// A stand-in for the CUDA runtime header, for tests/compact/cuda_emulation.cpp only: it lets the
// host compiler build csrc/cuda/compact_update.cuh, with the block's threads as std::threads and
// warp shuffles through a barrier. Device intrinsics become their IEEE host equivalents.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#define __device__
#define __host__
#define __forceinline__ inline

struct EmulatedDim {
  unsigned int x;
};
extern thread_local EmulatedDim threadIdx;
extern EmulatedDim blockDim;

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
float __shfl_xor_sync(unsigned int mask, float x, int lane_mask);
