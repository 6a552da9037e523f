// CUDA per-sample convolution weight gradients, the CPU's arithmetic (common/conv_grads.h): one
// thread per gradient element (sample, output, channel, kernel offset), its fma chain over the
// output positions in order, padding positions included as fma(+0, g, acc). Consecutive threads
// take consecutive kernel offsets and channels of one output, so a warp reads the same output
// gradient value at each step. A grid-stride loop covers any number of elements.
#include "cuda/conv_grads.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/element.h"
#include "common/ghost_norm.h"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;

template <class In, class Acc>
__global__ void __launch_bounds__(kThreads) conv_grads_kernel(const In* x, const In* g, ConvGeometry c, Acc* out) {
  const int64_t per_sample = c.grad_size(), total = c.batch * per_sample, positions = c.positions();
  const int64_t kernel = c.kernel_size();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = e / per_sample, rest = e % per_sample;
    const int64_t o = rest / (c.channels * kernel), ch = rest / kernel % c.channels, k = rest % kernel;
    const int64_t u = k / c.kernel_w, v = k % c.kernel_w;
    const In* xs = x + (n * c.channels + ch) * c.height * c.width;
    const In* gs = g + (n * c.outputs + o) * positions;
    Acc acc = Acc(0);
    for (int64_t h = 0; h < c.out_height; ++h) {
      const int64_t i = h * c.stride_h + u * c.dilation_h - c.pad_h;
      for (int64_t w = 0; w < c.out_width; ++w) {
        const int64_t j = w * c.stride_w + v * c.dilation_w - c.pad_w;
        const bool inside = i >= 0 && i < c.height && j >= 0 && j < c.width;
        const Acc xv = inside ? static_cast<Acc>(Element<In>::load(xs[i * c.width + j])) : Acc(0);
        acc = ghost_fma(xv, static_cast<Acc>(Element<In>::load(gs[h * c.out_width + w])), acc);
      }
    }
    out[e] = conv_result(acc);
  }
}

}  // namespace

void conv_weight_grads(NoiseDType dtype, const void* x, const void* g, const ConvGeometry& geometry, void* out,
                       int device, void* stream) {
  check_conv_geometry(geometry);
  const int64_t total = geometry.batch * geometry.grad_size();
  if (total == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65536));
  dispatch_ghost_dtype(dtype, [&](auto zero) {
    using In = decltype(zero);
    using Acc = typename GhostAcc<In>::type;
    conv_grads_kernel<In, Acc><<<blocks, kThreads, 0, s>>>(static_cast<const In*>(x), static_cast<const In*>(g),
                                                            geometry, static_cast<Acc*>(out));
  });
  check(cudaGetLastError(), "conv_weight_grads launch");
}

}  // namespace privleak::cuda
