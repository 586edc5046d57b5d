// Probe kernels for tests/contract/sm90_compile.py's contraction rule ([note: contraction probes]
// there): each compiles one scalar routine of the device code alone, from the checkout's headers,
// so that its SASS holds only that routine's arithmetic. The script builds this file twice, with
// nvcc's default contraction and with --fmad=false, and requires the same FFMA/DFMA count in each
// kernel: an fma that only the default build has is a product nvcc fused into a sum, which the host
// builds (-ffp-contract=off), torch and the reference round separately. Inputs and outputs go
// through global memory so that nothing folds to a constant.
#include <cuda_runtime.h>

#include "adamw_math.h"
#include "compact_math.h"
#include "dtypes.h"

using namespace ampfused;

namespace {
__device__ AdamWScalars scalars(const double* in, const float* t) {
  return adamw_scalars(in[0], in[1], in[2], in[3], in[4], *t);
}
}  // namespace

// one kernel per field of AdamWScalars: dead-code elimination leaves that field's computation alone
#define AMPFUSED_FIELD_PROBE(field)                                                            \
  extern "C" __global__ void probe_scalars_##field(const double* in, const float* t, float* out) { \
    out[0] = static_cast<float>(scalars(in, t).field);                                         \
  }
AMPFUSED_FIELD_PROBE(decay)
AMPFUSED_FIELD_PROBE(lerp_coeff)
AMPFUSED_FIELD_PROBE(beta2)
AMPFUSED_FIELD_PROBE(one_minus_beta2)
AMPFUSED_FIELD_PROBE(bc2_sqrt)
AMPFUSED_FIELD_PROBE(inv_bc2_sqrt)
AMPFUSED_FIELD_PROBE(eps)
AMPFUSED_FIELD_PROBE(neg_step_size)
AMPFUSED_FIELD_PROBE(lerp_from_m)

extern "C" __global__ void probe_pow_step(const double* in, const float* t, double* out) { out[0] = pow_step(in[0], *t); }

extern "C" __global__ void probe_adamw_element(const AdamWScalars* s, float* x) {
  adamw_element<false>(x[0], x[1], x[2], x[3], x[4], *s);
}

extern "C" __global__ void probe_adamw_element_amsgrad(const AdamWScalars* s, float* x) {
  adamw_element<true>(x[0], x[1], x[2], x[3], x[4], *s);
}

extern "C" __global__ void probe_finish_stats(const float* in, const float* found_inf, float* stats) {
  finish_stats(in[0], in[1] != 0.0f, found_inf, inv_scale_of(in + 2), in[3] != 0.0f, in[4], stats, true);
}

extern "C" __global__ void probe_scaler_update(const float* found_inf, float* scale, int32_t* growth, int32_t* hysteresis,
                                               int64_t* skipped, int64_t* consecutive, double* watch, ScalerRules r) {
  scaler_update(*found_inf, scale, growth, hysteresis, skipped, consecutive, watch, r);
}

// the compact encodings the CUDA update applies per element (compact_update.cuh)
extern "C" __global__ void probe_compact_codecs(const float* x, const uint32_t* bits, float* out, uint32_t* codes) {
  uint16_t p16 = 0, low = 0;
  int8_t q = 0;
  compact::split16(x[0], p16, low);
  codes[0] = p16 | (static_cast<uint32_t>(low) << 16);
  out[0] = compact::join16(static_cast<uint16_t>(bits[0]), static_cast<uint16_t>(bits[0] >> 16));
  compact::split8(x[1], bits[1] != 0, p16, q);
  codes[1] = p16 | (static_cast<uint32_t>(static_cast<uint8_t>(q)) << 16);
  out[1] = compact::join8(static_cast<uint16_t>(bits[2]), bits[1] != 0, static_cast<int8_t>(bits[2] >> 16));
  codes[2] = static_cast<uint8_t>(compact::encode_exp_avg(x[2], x[3]));
  codes[3] = compact::encode_exp_avg_sq(x[4], x[3]);
  out[2] = compact::decode_exp_avg(static_cast<int8_t>(bits[3]), x[3]);
  out[3] = compact::decode_exp_avg_sq(static_cast<uint8_t>(bits[3] >> 8), x[3]);
  codes[4] = compact::bf16_sr_bits(x[5], bits[4]) | (static_cast<uint32_t>(compact::bf16_rne_bits(x[5])) << 16);
  codes[5] = from_float<Half>(x[6]).x | (static_cast<uint32_t>(from_float<BFloat16>(x[6]).x) << 16);
  out[4] = to_float(Half{static_cast<uint16_t>(bits[5])});
  out[5] = to_float(BFloat16{static_cast<uint16_t>(bits[5] >> 16)});
}
