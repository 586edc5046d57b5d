// The random bits of stochastic rounding (DESIGN §9): a counter-based hash, no generator state.
//
// Element k of the tensor at index i of an update call, with the call's rounding seed, gets two
// 32-bit words: bits(k, keys[0], keys[1]) (low half: exp_avg, high half: exp_avg_sq) and
// bits(k, keys[2], keys[3]) (low half: max_exp_avg_sq, high half: the param), where the keys come
// from (seed, i, k >> 32) through splitmix64. [note: counter-based bits] Any thread can draw the
// bits of any element without a sequence to advance, so the result does not depend on the work
// split, and one seed per step (drawn on the host from torch's generator) reproduces a run. The
// bits are not torch.randint's (the reference backend draws its own): SR is unbiased either way.
// ATen-free and CUDA-compatible, so a device kernel can draw the same bits.
#pragma once

#include <cstdint>

#include "adamw_math.h"  // AMPFUSED_HD
#include "contract.h"    // the hash constants

namespace ampfused {
namespace compact {

AMPFUSED_HD uint64_t splitmix64(uint64_t z) {
  z += kGolden64;
  z = (z ^ (z >> 30)) * kSplitmixMul1;
  z = (z ^ (z >> 27)) * kSplitmixMul2;
  return z ^ (z >> 31);
}

// A 32-bit bijective mixer with full avalanche (two multiply-xorshift rounds).
AMPFUSED_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix32Mul1;
  x ^= x >> 15;
  x *= kMix32Mul2;
  x ^= x >> 16;
  return x;
}

struct RoundingKeys {
  uint32_t k[4];
};

// The keys of tensor `index` for the elements whose index has the high word `element_hi`.
AMPFUSED_HD RoundingKeys rounding_keys(uint64_t seed, int32_t index, uint32_t element_hi) {
  uint64_t z = splitmix64(seed ^ splitmix64((static_cast<uint64_t>(static_cast<uint32_t>(index)) << 32) | element_hi));
  RoundingKeys out;
  out.k[0] = static_cast<uint32_t>(z);
  out.k[1] = static_cast<uint32_t>(z >> 32);
  z = splitmix64(z);
  out.k[2] = static_cast<uint32_t>(z);
  out.k[3] = static_cast<uint32_t>(z >> 32);
  return out;
}

// 32 random bits of the element whose index has the low word `element_lo`.
AMPFUSED_HD uint32_t random_bits(uint32_t element_lo, uint32_t key0, uint32_t key1) {
  return mix32(mix32(element_lo ^ key0) ^ key1);
}

}  // namespace compact
}  // namespace ampfused
