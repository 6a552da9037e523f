// CUDA VMF sampling: the CPU's three passes as three kernels. Pass 1 gives one thread a chunk of
// tangent coordinates (its Gaussians and their sums, in the chunk order of common/vmf.h), pass 2
// one thread a sample (fold, Wood's step, frame), pass 3 one thread a coordinate. A sample whose
// rejection loop ran out of counters (common/vmf.h; never in practice) comes out NaN.
#include "cuda/vmf.h"

#include <cuda_runtime.h>

#include <stdexcept>

#include "common/vmf.h"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;

struct Workspace {
  double* norm_sq;  // n x chunks
  double* dot;      // n x chunks
  VmfFrame* frames;  // n
};

Workspace workspace_view(void* workspace, int64_t n, int64_t chunks) {
  auto* norm_sq = static_cast<double*>(workspace);
  auto* dot = norm_sq + n * chunks;
  return {norm_sq, dot, reinterpret_cast<VmfFrame*>(dot + n * chunks)};
}

template <class T>
__global__ void gaussians_and_sums(const T* mu, int64_t p, int64_t n, uint64_t key, uint64_t offset, T* out,
                                   Workspace ws) {
  const int64_t m = p - 1, chunks = vmf_num_chunks(p);
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= n * chunks) return;
  const int64_t sample = id / chunks, chunk = id % chunks;
  const int64_t begin = chunk * kVmfChunk, end = min(m, begin + kVmfChunk);
  constexpr int k = kValuesPerBlock<T>;
  const uint64_t global = offset + static_cast<uint64_t>(sample);  // S in common/vmf.h's counter space
  const uint32_t stream = vmf_tangent_stream(global);
  const uint64_t first_element = vmf_tangent_first_element(global, k);
  T* z = out + sample * p + 1;
  double norm_sq = 0.0, dot = 0.0;
  int64_t i = begin;
  while (i < end) {
    const uint64_t element = first_element + i;
    T values[k];
    noise_values<Distribution::gaussian, T>(key, element / k, values, stream);
    for (int lane = static_cast<int>(element % k); lane < k && i < end; ++lane, ++i) {
      z[i] = values[lane];
      const double zi = static_cast<double>(values[lane]);
      norm_sq += zi * zi;
      dot += zi * static_cast<double>(mu[i + 1]);
    }
  }
  ws.norm_sq[id] = norm_sq;
  ws.dot[id] = dot;
}

template <class T>
__global__ void frames_kernel(const T* mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset, T* out,
                              Workspace ws) {
  const int64_t sample = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (sample >= n) return;
  const int64_t chunks = vmf_num_chunks(p);
  double norm_sq = ws.norm_sq[sample * chunks], dot = ws.dot[sample * chunks];
  for (int64_t chunk = 1; chunk < chunks; ++chunk) {
    norm_sq += ws.norm_sq[sample * chunks + chunk];
    dot += ws.dot[sample * chunks + chunk];
  }
  if (norm_sq == 0.0) {  // every Gaussian was 0: take e_1 as the tangent direction
    out[sample * p + 1] = T(1);
    norm_sq = 1.0;
    dot = static_cast<double>(mu[1]);
  }
  const double mu0 = static_cast<double>(mu[0]);
  const VmfFrame frame = VmfFrame::make(vmf_w(p, kappa, key, offset + static_cast<uint64_t>(sample)), mu0, norm_sq, dot);
  ws.frames[sample] = frame;
  out[sample * p] = static_cast<T>(frame.first(mu0, dot));
}

template <class T>
__global__ void map_tangent(const T* mu, int64_t p, int64_t n, T* out, Workspace ws) {
  const int64_t m = p - 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; id < n * m; id += stride) {
    const int64_t sample = id / m, i = id % m;
    T& z = out[sample * p + 1 + i];
    z = static_cast<T>(ws.frames[sample].other(static_cast<double>(z), static_cast<double>(mu[i + 1])));
  }
}

unsigned grid_for(int64_t threads) {
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

}  // namespace

int64_t vmf_workspace_bytes(int64_t p, int64_t n) {
  return static_cast<int64_t>(2 * n * vmf_num_chunks(p) * sizeof(double) + n * sizeof(VmfFrame));
}

void vmf_sample(DType dtype, const void* mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset,
                void* out, void* workspace, int device, void* stream) {
  if (p < 2 || n < 0 || !(kappa > 0.0) || !(kappa <= 1.7976931348623157e308))
    throw std::invalid_argument("vmf_sample needs p >= 2, n >= 0, finite kappa > 0");
  if (p - 1 > kVmfMaxTangent) throw std::invalid_argument("vmf_sample: mu must have p - 1 <= 2^31 coordinates");
  if (offset > kVmfSampleLimit || static_cast<uint64_t>(n) > kVmfSampleLimit - offset)
    throw std::invalid_argument("vmf_sample: offset + n must be <= 2^63 (VMF's counter space)");
  if (n == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  const Workspace ws = workspace_view(workspace, n, vmf_num_chunks(p));
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* m = static_cast<const T*>(mu);
    T* o = static_cast<T*>(out);
    const int64_t pass1_threads = n * vmf_num_chunks(p);
    gaussians_and_sums<T><<<static_cast<unsigned>((pass1_threads + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        m, p, n, key, offset, o, ws);
    check(cudaGetLastError(), "vmf_sample: gaussians_and_sums launch");
    frames_kernel<T><<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(m, p, kappa, n, key,
                                                                                               offset, o, ws);
    check(cudaGetLastError(), "vmf_sample: frames launch");
    map_tangent<T><<<grid_for(n * (p - 1)), kThreads, 0, s>>>(m, p, n, o, ws);
    check(cudaGetLastError(), "vmf_sample: map_tangent launch");
  });
}

}  // namespace privleak::cuda
