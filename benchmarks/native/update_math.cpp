// What the AdamW element math costs one CPU core when memory is not the limit.
//
//   g++ -O3 -march=native -fno-math-errno -ffp-contract=off -I csrc \
//       benchmarks/native/update_math.cpp -o /tmp/update_math && taskset -c 0 /tmp/update_math
//
// Times the update loop over 16K elements (in L1/L2) and over 4M (the bench's size) with torch's
// math written out (sqrt and two divisions per element), ampfused's (csrc/adamw_math.h: the same
// results bitwise, the division by the constant sqrt(bc2) done with FMAs), the form DeepSpeed's
// CPUAdam uses (sqrt(v) * (1/sqrt(bc2)) + eps: one division; results move by up to an ulp), and
// with no division at all (not AdamW: the divider's share).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>
#define AMPFUSED_HAVE_FMA 1
#include "adamw_math.h"

using ampfused::AdamWScalars;

enum Math { kTwoDivisions, kAmpfused, kOneDivision, kNoDivision };

template <Math M>
__attribute__((noinline)) void update(float* __restrict p, const float* __restrict g, float* __restrict m,
                                      float* __restrict v, long n, const AdamWScalars& s0) {
  const AdamWScalars s = s0;
  const float inv_bc2_sqrt = 1.0f / s.bc2_sqrt;
  for (long i = 0; i < n; ++i) {
    float w = p[i], mi = m[i], vi = v[i], unused = 0.f;
    if (M == kAmpfused) {
      ampfused::adamw_element<false>(w, g[i], mi, vi, unused, s);
    } else if (M == kTwoDivisions) {
      w = w * s.decay;
      mi = __builtin_fmaf(s.lerp_coeff, g[i] - mi, mi);
      vi = __builtin_fmaf(s.one_minus_beta2 * g[i], g[i], vi * s.beta2);
      w = w + (mi * s.neg_step_size) / (std::sqrt(vi) / s.bc2_sqrt + s.eps);
    } else {
      w = w * s.decay;
      mi = __builtin_fmaf(s.lerp_coeff, g[i] - mi, mi);
      vi = __builtin_fmaf(s.one_minus_beta2 * g[i], g[i], vi * s.beta2);
      const float denom = std::sqrt(vi) * inv_bc2_sqrt + s.eps;
      w = M == kOneDivision ? w + (mi * s.neg_step_size) / denom : w + (mi * s.neg_step_size) * denom;
    }
    p[i] = w;
    m[i] = mi;
    v[i] = vi;
  }
}

int main() {
  for (long n : {16384L, 4000000L}) {
    std::vector<float> p(n, 0.5f), g(n, 1e-3f), m(n, 1e-4f), v(n, 1e-6f);
    const AdamWScalars s = ampfused::adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 5.f);
    const int reps = n < 100000 ? 2000 : 40;
    auto time = [&](const char* name, auto fn) {
      std::vector<double> ns;
      for (int r = 0; r < reps; ++r) {
        const auto start = std::chrono::steady_clock::now();
        fn();
        ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
      }
      std::nth_element(ns.begin(), ns.begin() + reps / 2, ns.end());
      std::printf("%8ld elements  %-34s %.3f ns/element\n", n, name, ns[reps / 2] / n);
    };
    time("torch's form (sqrt, 2 divisions)", [&] { update<kTwoDivisions>(p.data(), g.data(), m.data(), v.data(), n, s); });
    time("ampfused (same bits, 1 division)", [&] { update<kAmpfused>(p.data(), g.data(), m.data(), v.data(), n, s); });
    time("DeepSpeed form (sqrt, 1 division)", [&] { update<kOneDivision>(p.data(), g.data(), m.data(), v.data(), n, s); });
    time("no division (not AdamW)", [&] { update<kNoDivision>(p.data(), g.data(), m.data(), v.data(), n, s); });
  }
}
