// Host emulation of the CUDA compact update (csrc/cuda/compact_update.cuh) for
// the cuda-emulated kernel of tests/compact/conftest.py: the device code compiled by the host compiler, a block's
// threads run as std::threads, warp shuffles exchange through a barrier. It checks the code's
// walk (lanes, groups, tails, int8 / int4 blocks and their scales, the random bits) on a machine without
// a GPU; the device's own arithmetic (intrinsics, fma contraction) only a GPU run checks.
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_runtime.h"  // the stand-in (cuda_emulation/), first on the include path
#include "cuda/compact_update.cuh"

thread_local EmulatedDim threadIdx;
EmulatedDim blockDim{64};

namespace {

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const long generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  long generation_ = 0;
};

struct Warp {
  float value[32];
  Barrier barrier{32};
};
Warp* warps = nullptr;

}  // namespace

float __shfl_xor_sync(unsigned int, float x, int lane_mask) {
  Warp& w = warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  w.value[lane] = x;
  w.barrier.wait();
  const float y = w.value[lane ^ lane_mask];
  w.barrier.wait();
  return y;
}

extern "C" {

// One update of tensor *t as the compact variants step it (every chunk through compact_update.cuh's
// instance for its moments, as passes.cu picks it; a block of `threads` threads per chunk), then its
// step counter advanced.
void emulated_update(ampfused::UpdateTensor* t, double lr, double beta1, double beta2, double eps, double weight_decay,
                     float factor, int write_grad, float unscale, uint64_t seed, int threads) {
  using namespace ampfused;
  const AdamWScalars s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, *t->step + 1.0f);
  blockDim.x = static_cast<unsigned int>(threads);
  constexpr int64_t kChunk = 65536;  // multi_tensor.h's kChunkSize
  const int64_t work = work_numel(*t);  // contract.h: [note: blocks in rows]
  for (int64_t start = 0; start < work; start += kChunk) {
    const int64_t end = start + kChunk < work ? start + kChunk : work;
    std::vector<Warp> block_warps(threads / 32);
    warps = block_warps.data();
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) {
      pool.emplace_back([&, i] {
        threadIdx.x = static_cast<unsigned int>(i);
        if (t->moment_kind == kMomentInt8) {
          cuda::compact_pass::update_chunk<kMomentInt8>(*t, start, end, s, factor, write_grad != 0, unscale, seed);
        } else if (t->moment_kind == kMomentInt4) {
          cuda::compact_pass::update_chunk<kMomentInt4>(*t, start, end, s, factor, write_grad != 0, unscale, seed);
        } else {
          cuda::compact_pass::update_chunk<kMomentF32>(*t, start, end, s, factor, write_grad != 0, unscale, seed);
        }
      });
    }
    for (std::thread& th : pool) th.join();
  }
  *t->step = *t->step + 1.0f;
}

}  // extern "C"
