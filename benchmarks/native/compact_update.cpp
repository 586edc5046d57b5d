// What the CPU update (csrc/cpu/compact_update.h, and the fp32-master path) costs one core: an
// AVX-512 build of the kernels on N elements (default 16384: L2, where memory is not the limit;
// 4194304 streams from memory), ns per element, minimum of many calls, for every compact mode.
// Also prints a hash of every output after a fixed number of steps, so a faster loop can be checked
// bit for bit against the old one.
//
//   g++ -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -I csrc benchmarks/native/compact_update.cpp \
//       csrc/cpu/kernels_avx2.cpp csrc/cpu/kernels_avx2_div.cpp csrc/cpu/kernels_avx512.cpp \
//       csrc/cpu/kernels_avx512_div.cpp -o /tmp/compact_update   (the extension's flags: csrc/build_extension.py)
//   taskset -c 0 /tmp/compact_update [calls [mode substring [N [avx512|avx512-div|avx2|avx2-div]]]]
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "adamw_math.h"
#include "cpu/cpu_kernels.h"

using namespace ampfused;

namespace {

int64_t kN = 16384;  // elements per call: argv[3] (default: 16384, in L2)

struct Mode {
  const char* name;
  int32_t master_kind;  // kMasterF32 with fp32 params means no master
  int32_t moment_kind;
  int32_t param_dtype;
  bool amsgrad;
};

struct Buffers {
  std::vector<float> p32, master, grad, scales[3];
  std::vector<uint16_t> p16, low16, m16[3];
  std::vector<int8_t> q;
  std::vector<float> m32[3];
  std::vector<uint8_t> codes[3];
};

uint64_t fnv(const void* data, size_t bytes, uint64_t h) {
  const unsigned char* c = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

cpu::UpdateRange make(const Mode& mode, Buffers& b, const AdamWScalars& s) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  b.grad.resize(kN);
  for (auto& x : b.grad) x = normal(rng) * 1e-2f;
  cpu::UpdateRange r{};
  const bool p16 = mode.param_dtype != kF32;
  if (p16) {
    b.p16.resize(kN);
    for (auto& x : b.p16) {  // bf16 or fp16 bits of a small normal weight
      const float w = normal(rng) * 0.05f;
      uint32_t u;
      std::memcpy(&u, &w, 4);
      x = mode.param_dtype == kBF16 ? static_cast<uint16_t>(u >> 16) : static_cast<uint16_t>(0x2000 + (rng() & 0x1FFF));
    }
    r.param = b.p16.data();
  } else {
    b.p32.resize(kN);
    for (auto& x : b.p32) x = normal(rng) * 0.05f;
    r.param = b.p32.data();
  }
  if (mode.master_kind == kMasterSplit8) {
    b.q.resize(kN);
    for (auto& x : b.q) x = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    r.master = reinterpret_cast<float*>(b.q.data());
  } else if (mode.master_kind == kMasterSplit16) {
    b.low16.resize(kN);
    for (auto& x : b.low16) x = static_cast<uint16_t>(rng());
    r.master = reinterpret_cast<float*>(b.low16.data());
  } else if (p16) {
    b.master.resize(kN);
    for (auto& x : b.master) x = normal(rng) * 0.05f;
    r.master = b.master.data();
  }
  float** moments[3] = {&r.exp_avg, &r.exp_avg_sq, &r.max_exp_avg_sq};
  float** scales[3] = {&r.exp_avg_scales, &r.exp_avg_sq_scales, &r.max_exp_avg_sq_scales};
  for (int k = 0; k < (mode.amsgrad ? 3 : 2); ++k) {
    if (mode.moment_kind == kMomentInt8) {
      b.codes[k].resize(kN);
      for (auto& x : b.codes[k]) x = static_cast<uint8_t>(k == 0 ? rng() % 241 - 120 : rng() % 241);
      b.scales[k].assign((kN + compact::kBlock - 1) / compact::kBlock, k == 0 ? 1e-3f : 1e-2f);  // one per started block
      *moments[k] = reinterpret_cast<float*>(b.codes[k].data());
      *scales[k] = b.scales[k].data();
    } else if (mode.moment_kind == kMomentBF16) {
      b.m16[k].resize(kN);
      for (auto& x : b.m16[k]) {
        const float f = k == 0 ? normal(rng) * 1e-3f : std::fabs(normal(rng)) * 1e-5f;
        uint32_t u;
        std::memcpy(&u, &f, 4);
        x = static_cast<uint16_t>(u >> 16);
      }
      *moments[k] = reinterpret_cast<float*>(b.m16[k].data());
    } else {
      b.m32[k].resize(kN);
      for (auto& x : b.m32[k]) x = k == 0 ? normal(rng) * 1e-3f : std::fabs(normal(rng)) * 1e-5f;
      *moments[k] = b.m32[k].data();
    }
  }
  r.grad = b.grad.data();
  r.numel = kN;
  r.param_dtype = mode.param_dtype;
  r.grad_dtype = kF32;
  r.master_kind = mode.master_kind;
  r.moment_kind = mode.moment_kind;
  r.scalars = &s;
  r.factor = 1.0f;
  r.begin = 0;
  r.end = kN;
  return r;
}

uint64_t hash(const Mode& mode, const Buffers& b) {
  uint64_t h = 1469598103934665603ull;
  h = fnv(b.p32.data(), b.p32.size() * 4, h);
  h = fnv(b.p16.data(), b.p16.size() * 2, h);
  h = fnv(b.master.data(), b.master.size() * 4, h);
  h = fnv(b.q.data(), b.q.size(), h);
  h = fnv(b.low16.data(), b.low16.size() * 2, h);
  for (int k = 0; k < 3; ++k) {
    h = fnv(b.m32[k].data(), b.m32[k].size() * 4, h);
    h = fnv(b.m16[k].data(), b.m16[k].size() * 2, h);
    h = fnv(b.codes[k].data(), b.codes[k].size(), h);
    h = fnv(b.scales[k].data(), b.scales[k].size() * 4, h);
  }
  (void)mode;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 2000;
  if (argc > 3) kN = std::atoll(argv[3]);
  if (kN <= 0) return 2;
  const char* want = argc > 4 ? argv[4] : "avx512";
  const cpu::IsaKernels* k = std::strcmp(want, "avx512-div") == 0 ? cpu::kernels_avx512_div()
                             : std::strcmp(want, "avx2") == 0  ? cpu::kernels_avx2()
                             : std::strcmp(want, "avx2-div") == 0  ? cpu::kernels_avx2_div()
                                                               : cpu::kernels_avx512();
  if (k == nullptr) return 1;
  std::printf("build %s, %lld elements\n", k->name, static_cast<long long>(kN));
  const AdamWScalars s = adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10.0f);
  const Mode modes[] = {
      {"fp32 master (bf16 param)", kMasterF32, kMomentF32, kBF16, false},
      {"split16", kMasterSplit16, kMomentF32, kBF16, false},
      {"bf16 moments (fp32 master)", kMasterF32, kMomentBF16, kBF16, false},
      {"split8 (bf16)", kMasterSplit8, kMomentF32, kBF16, false},
      {"split8 (fp16)", kMasterSplit8, kMomentF32, kF16, false},
      {"int8 moments (fp32 master)", kMasterF32, kMomentInt8, kBF16, false},
      {"int8 moments + amsgrad", kMasterF32, kMomentInt8, kBF16, true},
      {"split8 + int8 (bf16)", kMasterSplit8, kMomentInt8, kBF16, false},
  };
  for (const Mode& mode : modes) {
    if (argc > 2 && std::strstr(mode.name, argv[2]) == nullptr) continue;
    // the bitwise fingerprint: 50 steps from the fixed start
    Buffers b;
    cpu::UpdateRange r = make(mode, b, s);
    const bool fp32_path = mode.master_kind == kMasterF32 && mode.moment_kind == kMomentF32;
    for (int i = 0; i < 50; ++i) (fp32_path ? k->update : k->compact_update)(r);
    const uint64_t h = hash(mode, b);
    double best = 1e30;
    for (int i = 0; i < calls; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      (fp32_path ? k->update : k->compact_update)(r);
      const auto t1 = std::chrono::steady_clock::now();
      const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
      best = ns < best ? ns : best;
    }
    std::printf("%-28s %6.3f ns/element  hash %016llx\n", mode.name, best / kN, static_cast<unsigned long long>(h));
  }
  return 0;
}
