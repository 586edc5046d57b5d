// Baseline-ISA build of the CPU hot loops (SSE2 on x86-64; whatever the target has elsewhere).
#include <cmath>
#include <cstdint>
#include <cstring>

#define AMPFUSED_ISA isa_base
#include "kernels_impl.h"
#include "compact_update.h"

namespace ampfused {
namespace cpu {
const IsaKernels* kernels_base() {
  static const IsaKernels k{"default", isa_base::accumulate, isa_base::sumsq, isa_base::update, isa_base::compact_update};
  return &k;
}
}  // namespace cpu
}  // namespace ampfused
