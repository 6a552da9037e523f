// One thread per element (each has its own ChaCha20 stream), grid-stride; a list of arrays in one
// launch (cuda/array_list.cuh).
#include "cuda/secure_noise.h"

#include <cuda_runtime.h>

#include <stdexcept>

#include "cuda/array_list.cuh"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;

int64_t elements(int64_t n, uint64_t) { return n; }

template <bool kGaussian, class Out>
__global__ void secure_noise_kernel(const ArrayList list, ChaChaKey key, uint64_t scale, int grid_exponent,
                                    bool add) {
  using Gen = typename Element<Out>::Gen;
  for_each_item(list, [&](int i, int64_t j) {
    Out& out = static_cast<Out*>(list.data[i])[j];
    const double x = add ? static_cast<double>(Element<Out>::load(out)) : 0.0;
    Element<Out>::store(out, static_cast<Gen>(secure_noisy_value<kGaussian>(x, scale, grid_exponent, key,
                                                                           list.offset[i] + static_cast<uint64_t>(j))));
  });
}

template <bool kGaussian, class Out>
void launch(const std::vector<void*>& outs, const std::vector<int64_t>& numels, const ChaChaKey& key, uint64_t offset,
            uint64_t scale, int grid_exponent, bool add, cudaStream_t stream) {
  launch_lists(outs, numels, offset, elements, [&](const ArrayList& list, int64_t items) {
    const int64_t blocks = (items + kThreads - 1) / kThreads;
    const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
    secure_noise_kernel<kGaussian, Out><<<grid, kThreads, 0, stream>>>(list, key, scale, grid_exponent, add);
    check(cudaGetLastError(), "apply_secure_noise launch");
  });
}

template <bool kGaussian>
void launch_dtype(NoiseDType dtype, const std::vector<void*>& outs, const std::vector<int64_t>& numels,
                  const ChaChaKey& key, uint64_t offset, uint64_t scale, int grid_exponent, bool add, cudaStream_t s) {
  switch (dtype) {
    case NoiseDType::float32: return launch<kGaussian, float>(outs, numels, key, offset, scale, grid_exponent, add, s);
    case NoiseDType::float64: return launch<kGaussian, double>(outs, numels, key, offset, scale, grid_exponent, add, s);
    case NoiseDType::bfloat16:
      return launch<kGaussian, BFloat16>(outs, numels, key, offset, scale, grid_exponent, add, s);
    case NoiseDType::float16: return launch<kGaussian, Float16>(outs, numels, key, offset, scale, grid_exponent, add, s);
  }
  throw std::invalid_argument("apply_secure_noise: unknown dtype");
}

}  // namespace

void apply_secure_noise(Distribution distribution, NoiseDType dtype, const std::vector<void*>& outs,
                        const std::vector<int64_t>& numels, const ChaChaKey& key, uint64_t offset, uint64_t scale,
                        int grid_exponent, bool add, int device, void* stream) {
  check_array_list(outs, numels, "apply_secure_noise");
  if (scale < 1 || grid_exponent < -1000 || grid_exponent > 1000)
    throw std::invalid_argument("apply_secure_noise: needs scale >= 1 and |grid_exponent| <= 1000");
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  if (distribution == Distribution::gaussian)
    launch_dtype<true>(dtype, outs, numels, key, offset, scale, grid_exponent, add, s);
  else
    launch_dtype<false>(dtype, outs, numels, key, offset, scale, grid_exponent, add, s);
}

}  // namespace privleak::cuda
