// One thread per element (each has its own ChaCha20 stream), grid-stride.
#include "cuda/secure_noise.h"

#include <cuda_runtime.h>

#include <stdexcept>

#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;

template <bool kGaussian, class Out>
__global__ void secure_noise_kernel(Out* out, int64_t n, ChaChaKey key, uint64_t offset, uint64_t scale,
                                    int grid_exponent, bool add) {
  using Gen = typename Element<Out>::Gen;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double x = add ? static_cast<double>(Element<Out>::load(out[i])) : 0.0;
    Element<Out>::store(out[i], static_cast<Gen>(secure_noisy_value<kGaussian>(x, scale, grid_exponent, key,
                                                                               offset + static_cast<uint64_t>(i))));
  }
}

template <bool kGaussian, class Out>
void launch(Out* out, int64_t n, const ChaChaKey& key, uint64_t offset, uint64_t scale, int grid_exponent, bool add,
            cudaStream_t stream) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  secure_noise_kernel<kGaussian, Out><<<grid, kThreads, 0, stream>>>(out, n, key, offset, scale, grid_exponent, add);
  check(cudaGetLastError(), "apply_secure_noise launch");
}

template <bool kGaussian>
void launch_dtype(NoiseDType dtype, void* out, int64_t n, const ChaChaKey& key, uint64_t offset, uint64_t scale,
                  int grid_exponent, bool add, cudaStream_t s) {
  switch (dtype) {
    case NoiseDType::float32: return launch<kGaussian>(static_cast<float*>(out), n, key, offset, scale, grid_exponent, add, s);
    case NoiseDType::float64: return launch<kGaussian>(static_cast<double*>(out), n, key, offset, scale, grid_exponent, add, s);
    case NoiseDType::bfloat16: return launch<kGaussian>(static_cast<BFloat16*>(out), n, key, offset, scale, grid_exponent, add, s);
    case NoiseDType::float16: return launch<kGaussian>(static_cast<Float16*>(out), n, key, offset, scale, grid_exponent, add, s);
  }
  throw std::invalid_argument("apply_secure_noise: unknown dtype");
}

}  // namespace

void apply_secure_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, const ChaChaKey& key,
                        uint64_t offset, uint64_t scale, int grid_exponent, bool add, int device, void* stream) {
  if (n < 0 || scale < 1 || grid_exponent < -1000 || grid_exponent > 1000)
    throw std::invalid_argument("apply_secure_noise: needs n >= 0, scale >= 1 and |grid_exponent| <= 1000");
  if (n == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  if (distribution == Distribution::gaussian)
    launch_dtype<true>(dtype, out, n, key, offset, scale, grid_exponent, add, s);
  else
    launch_dtype<false>(dtype, out, n, key, offset, scale, grid_exponent, add, s);
}

}  // namespace privleak::cuda
