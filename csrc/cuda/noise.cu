// One thread per Philox block, grid-stride, so the launch shape never changes the bits; a list of
// arrays in one launch (cuda/array_list.cuh).
#include "cuda/noise.h"

#include <cuda_runtime.h>

#include <stdexcept>

#include "cuda/array_list.cuh"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridBlocks = 65536;

// An array's work items: the Philox blocks its elements fall in (a block that straddles two arrays
// is drawn by both, each storing its own elements).
template <class Out>
int64_t noise_blocks(int64_t n, uint64_t offset) {
  constexpr int k = kValuesPerBlock<typename Element<Out>::Gen>;
  return n == 0 ? 0 : static_cast<int64_t>(end_noise_block(offset, n, k) - first_noise_block(offset, k));
}

template <Distribution kDist, class Out>
__global__ void apply_noise_kernel(const ArrayList list, uint64_t key, typename Element<Out>::Gen scale, bool add) {
  constexpr int k = kValuesPerBlock<typename Element<Out>::Gen>;
  for_each_item(list, [&](int i, int64_t j) {
    apply_noise_block<kDist, Out>(key, list.offset[i], list.n[i], scale, add,
                                  first_noise_block(list.offset[i], k) + static_cast<uint64_t>(j),
                                  static_cast<Out*>(list.data[i]));
  });
}

template <Distribution kDist, class Out>
void launch(const std::vector<void*>& outs, const std::vector<int64_t>& numels, uint64_t key, uint64_t offset,
            double scale, bool add, cudaStream_t stream) {
  using Gen = typename Element<Out>::Gen;
  launch_lists(outs, numels, offset, noise_blocks<Out>, [&](const ArrayList& list, int64_t items) {
    const int64_t needed = (items + kThreads - 1) / kThreads;
    const unsigned grid = static_cast<unsigned>(needed < kMaxGridBlocks ? needed : kMaxGridBlocks);
    apply_noise_kernel<kDist, Out><<<grid, kThreads, 0, stream>>>(list, key, static_cast<Gen>(scale), add);
    check(cudaGetLastError(), "apply_noise launch");
  });
}

}  // namespace

void apply_noise(Distribution distribution, NoiseDType dtype, const std::vector<void*>& outs,
                 const std::vector<int64_t>& numels, uint64_t key, uint64_t offset, double scale, bool add, int device,
                 void* stream) {
  check_array_list(outs, numels, "apply_noise");
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_distribution(distribution, [&](auto dist) {
    constexpr Distribution kDist = decltype(dist)::value;
    switch (dtype) {
      case NoiseDType::float32: return launch<kDist, float>(outs, numels, key, offset, scale, add, s);
      case NoiseDType::float64: return launch<kDist, double>(outs, numels, key, offset, scale, add, s);
      case NoiseDType::bfloat16: return launch<kDist, BFloat16>(outs, numels, key, offset, scale, add, s);
      case NoiseDType::float16: return launch<kDist, Float16>(outs, numels, key, offset, scale, add, s);
    }
    throw std::invalid_argument("apply_noise: unknown dtype");
  });
}

}  // namespace privleak::cuda
