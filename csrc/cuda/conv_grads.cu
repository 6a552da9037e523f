// CUDA per-sample convolution weight gradients, the CPU's arithmetic (common/conv_grads.h): every
// element is its fma chain over the output positions in order, padding positions included as
// fma(+0, g, acc). Sample n's gradient is the product G_n = g_n X_n^T of its output gradient g_n
// (outputs x positions) and its patches X_n (channel-kernel columns x positions), so two kernels:
//
// - tiled: a block takes a 32-output x 64-column tile of one sample and walks the positions 16 at
//   a time through shared memory, each thread holding a 4 x 4 tile of chains in registers (a
//   matrix product that never splits the positions, so each chain keeps its order). On an H200
//   the element kernel below reached 1.0-1.4 TFLOP/s on the CIFAR CNN's layers, a few per cent
//   of the GPU: each fma there reads two values from memory.
// - element: one thread per element, for layers whose tiles would be mostly empty (few outputs or
//   columns: the paper CNN's 12 outputs, a depthwise convolution's one per group), and for grids
//   of fewer tiles than the GPU has multiprocessors (a small batch): each tile walks every
//   position, so there the element kernel spreads the same chains over more of the GPU.
#include "cuda/conv_grads.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/element.h"
#include "common/ghost_norm.h"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;  // element kernel

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

constexpr int kTileOutputs = 32, kTileColumns = 64, kTileSteps = 16, kMicro = 4;
constexpr int kTileThreads = (kTileOutputs / kMicro) * (kTileColumns / kMicro);  // 128
constexpr int kColumnThreads = kTileColumns / kMicro;                            // 16 threads across a tile's columns
constexpr int kGridCap = 65535;                                                  // gridDim.y and .z

// A tile column's place in a sample's input: its channel's offset, and its kernel offset's
// displacement (u d_h - p_h, v d_w - p_w) from the output position's stride multiple.
struct Column {
  int64_t channel_offset;
  int64_t di, dj;
  bool valid;
};

// Shared rows are padded by 2: a stage's stores (16 positions of two columns or outputs a warp)
// then fall in 32 different banks; its reads are by 16 consecutive addresses, or broadcast.
template <class In, class Acc>
__global__ void __launch_bounds__(kTileThreads) conv_grads_tiled_kernel(const In* x, const In* g, ConvGeometry c,
                                                                        Acc* out) {
  __shared__ Acc g_tile[kTileSteps][kTileOutputs + 2];
  __shared__ Acc x_tile[kTileSteps][kTileColumns + 2];
  __shared__ Column columns[kTileColumns];
  const int64_t kernel = c.kernel_size(), width = c.channels * kernel, positions = c.positions();
  const int64_t first_column = int64_t(blockIdx.x) * kTileColumns;
  for (int jj = threadIdx.x; jj < kTileColumns; jj += kTileThreads) {
    const int64_t column = first_column + jj, k = column % kernel;
    columns[jj] = Column{column / kernel * c.height * c.width, k / c.kernel_w * c.dilation_h - c.pad_h,
                         k % c.kernel_w * c.dilation_w - c.pad_w, column < width};
  }
  __syncthreads();
  // Loading, a thread keeps one position of the stage (t0 + step), which 16 consecutive threads
  // read at consecutive addresses of g and, stride apart, of x.
  const int step = threadIdx.x % kTileSteps, lane = threadIdx.x / kTileSteps;
  constexpr int kLanes = kTileThreads / kTileSteps;  // 8
  // Multiplying, thread (tx, ty) holds outputs ty + 8 i and columns tx + 16 j of the tile.
  const int tx = threadIdx.x % kColumnThreads, ty = threadIdx.x / kColumnThreads;
  constexpr int kRowThreads = kTileThreads / kColumnThreads;  // 8
  for (int64_t n = blockIdx.z; n < c.batch; n += gridDim.z) {
    const In* xs = x + n * c.channels * c.height * c.width;
    for (int64_t first_output = int64_t(blockIdx.y) * kTileOutputs; first_output < c.outputs;
         first_output += int64_t(gridDim.y) * kTileOutputs) {
      Acc acc[kMicro][kMicro];
#pragma unroll
      for (int i = 0; i < kMicro; ++i)
#pragma unroll
        for (int j = 0; j < kMicro; ++j) acc[i][j] = Acc(0);
      for (int64_t t0 = 0; t0 < positions; t0 += kTileSteps) {
        const int64_t t = t0 + step;
        const bool live = t < positions;
        const int64_t h = live ? t / c.out_width : 0, w = live ? t % c.out_width : 0;
        // Past the last position g is -0 (and x +0): fma(+0, -0, acc) is acc for every acc, -0
        // included (a chain's acc can be -0: a negative product that underflows), so the full
        // stage leaves the chains as the CPU's. With +0 there, a -0 would turn +0.
        for (int oo = lane; oo < kTileOutputs; oo += kLanes) {
          const int64_t o = first_output + oo;
          Acc value = live ? Acc(0) : -Acc(0);
          if (live && o < c.outputs) value = static_cast<Acc>(Element<In>::load(g[(n * c.outputs + o) * positions + t]));
          g_tile[step][oo] = value;
        }
        for (int jj = lane; jj < kTileColumns; jj += kLanes) {
          const Column col = columns[jj];
          const int64_t i = h * c.stride_h + col.di, j = w * c.stride_w + col.dj;
          const bool inside = live && col.valid && i >= 0 && i < c.height && j >= 0 && j < c.width;
          x_tile[step][jj] = inside ? static_cast<Acc>(Element<In>::load(xs[col.channel_offset + i * c.width + j]))
                                    : Acc(0);
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < kTileSteps; ++s) {
          Acc a[kMicro], b[kMicro];
#pragma unroll
          for (int i = 0; i < kMicro; ++i) a[i] = g_tile[s][ty + kRowThreads * i];
#pragma unroll
          for (int j = 0; j < kMicro; ++j) b[j] = x_tile[s][tx + kColumnThreads * j];
#pragma unroll
          for (int i = 0; i < kMicro; ++i)
#pragma unroll
            for (int j = 0; j < kMicro; ++j) acc[i][j] = ghost_fma(b[j], a[i], acc[i][j]);
        }
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < kMicro; ++i) {
        const int64_t o = first_output + ty + kRowThreads * i;
#pragma unroll
        for (int j = 0; j < kMicro; ++j) {
          const int64_t column = first_column + tx + kColumnThreads * j;
          if (o < c.outputs && column < width) out[(n * c.outputs + o) * width + column] = conv_result(acc[i][j]);
        }
      }
    }
  }
}

int64_t tiles_along(int64_t size, int tile) { return (size + tile - 1) / tile; }

// The tiled kernel where at least a quarter of its tiles' elements are the layer's and its tiles
// are at least as many as the multiprocessors.
bool tiled(const ConvGeometry& c, int multiprocessors) {
  const int64_t columns = c.channels * c.kernel_size();
  return c.outputs >= kTileOutputs / 2 && columns >= kTileColumns / 2 &&
         tiles_along(columns, kTileColumns) * tiles_along(c.outputs, kTileOutputs) * c.batch >= multiprocessors;
}

}  // namespace

void conv_weight_grads(NoiseDType dtype, const void* x, const void* g, const ConvGeometry& geometry, void* out,
                       int device, void* stream) {
  check_conv_geometry(geometry);
  const int64_t total = geometry.batch * geometry.grad_size();
  if (total == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_ghost_dtype(dtype, [&](auto zero) {
    using In = decltype(zero);
    using Acc = typename GhostAcc<In>::type;
    const auto xs = static_cast<const In*>(x);
    const auto gs = static_cast<const In*>(g);
    if (tiled(geometry, multiprocessor_count(device))) {
      const dim3 grid(static_cast<unsigned>(tiles_along(geometry.channels * geometry.kernel_size(), kTileColumns)),
                      static_cast<unsigned>(std::min<int64_t>(tiles_along(geometry.outputs, kTileOutputs), kGridCap)),
                      static_cast<unsigned>(std::min<int64_t>(geometry.batch, kGridCap)));
      conv_grads_tiled_kernel<In, Acc><<<grid, kTileThreads, 0, s>>>(xs, gs, geometry, static_cast<Acc*>(out));
    } else {
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65536));
      conv_grads_kernel<In, Acc><<<blocks, kThreads, 0, s>>>(xs, gs, geometry, static_cast<Acc*>(out));
    }
  });
  check(cudaGetLastError(), "conv_weight_grads launch");
}

}  // namespace privleak::cuda
