// The random bits of stochastic rounding (DESIGN §9): the one counter-based hash of every backend,
// [note: rounding bits] in ampfused/_contract.py (ampfused/_compact.py random_words is its
// specification, kernels/_compact_state.py the Triton spelling). No generator state: any thread
// can draw the bits of any element without a sequence to advance, so the result does not depend
// on the work split, and one seed per step (drawn on the host from torch's generator) reproduces a
// run, with the same bits on every backend. ATen-free and CUDA-compatible.
#pragma once

#include <cstdint>

#include "adamw_math.h"  // AMPFUSED_HD
#include "contract.h"    // the hash constants

namespace ampfused {
namespace compact {

// "lowbias32" (C. Wellons' hash-prospector): a bijective 32-bit avalanche.
AMPFUSED_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixMul1;
  x ^= x >> 15;
  x *= kMixMul2;
  x ^= x >> 15;
  return x;
}

// The key of tensor `index` (its position in the step's full lists) for the elements whose index
// has the high word `element_hi`; the seed enters as two kRoundingSeedBits-bit words.
AMPFUSED_HD uint32_t rounding_key(uint64_t seed, int32_t index, uint32_t element_hi) {
  constexpr uint64_t kWord = (uint64_t{1} << kRoundingSeedBits) - 1;
  uint32_t key = mix32(static_cast<uint32_t>(index) + kKeySalt);
  key = mix32(key ^ static_cast<uint32_t>(seed & kWord));
  key = mix32(key ^ static_cast<uint32_t>((seed >> kRoundingSeedBits) & kWord));
  return mix32(key ^ element_hi);
}

// The element's hash: the input of both of its random words.
AMPFUSED_HD uint32_t element_hash(uint32_t element_lo, uint32_t key) { return mix32(element_lo ^ key); }

// Random word 0 (low half: exp_avg, high half: exp_avg_sq) or 1 (low half: max_exp_avg_sq, high
// half: the param) of an element's hash.
AMPFUSED_HD uint32_t random_word(uint32_t hash, int word) { return mix32(hash ^ (word == 0 ? kWord0Salt : kWord1Salt)); }

}  // namespace compact
}  // namespace ampfused
