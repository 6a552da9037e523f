// One thread per Philox block, grid-stride, so the launch shape never changes the bits.
#include "cuda/noise.h"

#include <cuda_runtime.h>

#include <stdexcept>

#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridBlocks = 65536;

template <Distribution kDist, class Out>
__global__ void apply_noise_kernel(Out* out, int64_t n, uint64_t key, uint64_t offset,
                                   typename Element<Out>::Gen scale, bool add, uint64_t first, uint64_t end) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t block = first + static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; block < end;
       block += stride)
    apply_noise_block<kDist, Out>(key, offset, n, scale, add, block, out);
}

template <Distribution kDist, class Out>
void launch(Out* out, int64_t n, uint64_t key, uint64_t offset, double scale, bool add,
            cudaStream_t stream) {
  using Gen = typename Element<Out>::Gen;
  constexpr int k = kValuesPerBlock<Gen>;
  const uint64_t first = first_noise_block(offset, k), end = end_noise_block(offset, n, k);
  const int64_t needed = static_cast<int64_t>((end - first + kThreads - 1) / kThreads);
  const unsigned grid = static_cast<unsigned>(needed < kMaxGridBlocks ? needed : kMaxGridBlocks);
  apply_noise_kernel<kDist, Out><<<grid, kThreads, 0, stream>>>(out, n, key, offset, static_cast<Gen>(scale), add, first, end);
  check(cudaGetLastError(), "apply_noise launch");
}

}  // namespace

void apply_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, uint64_t key,
                 uint64_t offset, double scale, bool add, int device, void* stream) {
  if (n < 0) throw std::invalid_argument("apply_noise: n must be >= 0");
  if (n == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_distribution(distribution, [&](auto dist) {
    constexpr Distribution kDist = decltype(dist)::value;
    switch (dtype) {
      case NoiseDType::float32: return launch<kDist>(static_cast<float*>(out), n, key, offset, scale, add, s);
      case NoiseDType::float64: return launch<kDist>(static_cast<double*>(out), n, key, offset, scale, add, s);
      case NoiseDType::bfloat16: return launch<kDist>(static_cast<BFloat16*>(out), n, key, offset, scale, add, s);
      case NoiseDType::float16: return launch<kDist>(static_cast<Float16*>(out), n, key, offset, scale, add, s);
    }
    throw std::invalid_argument("apply_noise: unknown dtype");
  });
}

}  // namespace privleak::cuda
