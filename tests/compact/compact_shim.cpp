// A C ABI over csrc/compact_math.h for tests/compact/test_compact_native.py: each function applies one
// element-wise encoding to arrays (ctypes passes numpy buffers). No torch, no production code.
#include <cstdint>

#include "compact_math.h"

namespace c = ampfused::compact;

extern "C" {

void shim_rne16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::bf16_rne_bits(x[i]);
}

void shim_sr16(const float* x, const uint32_t* rand16, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::bf16_sr_bits(x[i], rand16[i]);
}

void shim_fp16_rne(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::fp16_rne_bits(x[i]);
}

void shim_fp16_to_float(const uint16_t* h, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::fp16_to_float(h[i]);
}

void shim_split16(const float* m, uint16_t* param, uint16_t* low, int64_t n) {
  for (int64_t i = 0; i < n; ++i) c::split16(m[i], param[i], low[i]);
}

void shim_join16(const uint16_t* param, const uint16_t* low, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::join16(param[i], low[i]);
}

void shim_split8(const float* m, int fp16, uint16_t* param, int8_t* residual, int64_t n) {
  for (int64_t i = 0; i < n; ++i) c::split8(m[i], fp16 != 0, param[i], residual[i]);
}

void shim_join8(const uint16_t* param, int fp16, const int8_t* residual, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::join8(param[i], fp16 != 0, residual[i]);
}

// Moments: element i uses scales[i / kBlock], the block scale the kernels compute.
void shim_encode_exp_avg(const float* m, const float* scales, int8_t* codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = c::encode_exp_avg(m[i], scales[i / c::kBlock]);
}

void shim_decode_exp_avg(const int8_t* codes, const float* scales, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::decode_exp_avg(codes[i], scales[i / c::kBlock]);
}

void shim_encode_exp_avg_sq(const float* v, const float* scales, uint8_t* codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = c::encode_exp_avg_sq(v[i], scales[i / c::kBlock]);
}

void shim_decode_exp_avg_sq(const uint8_t* codes, const float* scales, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c::decode_exp_avg_sq(codes[i], scales[i / c::kBlock]);
}

}  // extern "C"
