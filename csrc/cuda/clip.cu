// CUDA fused clipping, the CPU's arithmetic in the CPU's order. Up to kGroup tensors travel in
// the kernel arguments, so one launch covers them (a model with more tensors takes one launch
// per kGroup). Pass 1: 16 threads per (tensor, sample, chunk), one per lane of
// chunk_norm_sums, then one thread per (tensor, sample) folds the chunks. Then one thread
// per sample computes its clip factors. Pass 2: one thread per output element, looping over the
// samples in order; neighbouring threads read neighbouring elements of a sample, so the loads
// coalesce. All launches queue on one stream: the host never waits between the passes.
#include "cuda/clip.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>

#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kGroup = 48;
constexpr int kThreads = 256;

struct Group {
  int count;
  int first;  // index of the group's first tensor among all tensors (the factors' column)
  int num_columns;  // of the norm sums and factors: every tensor's, then those of tensors read elsewhere
  const void* grads[kGroup];
  float* outs[kGroup];
  int64_t numel[kGroup];
  uint64_t noise_base[kGroup];  // noise index of the tensor's element 0
  int64_t starts[kGroup + 1];   // prefix sums of the tensors' work items
};

__device__ int locate(const Group& g, int64_t item) {
  int t = 0;
  while (t + 1 < g.count && g.starts[t + 1] <= item) ++t;
  return t;
}

template <ClipNorm Norm, class In>
__global__ void chunk_sums(Group g, int64_t batch, double* partials, int64_t partial_base) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t item = id / kClipLanes;
  const int lane = static_cast<int>(id % kClipLanes);
  const bool active = item < g.starts[g.count];  // every thread must reach the barrier below
  float sum = 0.0f;
  if (active) {
    const int t = locate(g, item);
    const int64_t chunks = clip_chunks(g.numel[t]), local = item - g.starts[t];
    const int64_t b = local / chunks, c = local % chunks;
    const In* x = static_cast<const In*>(g.grads[t]) + b * g.numel[t] + c * kClipChunk;
    const int64_t n = min(kClipChunk, g.numel[t] - c * kClipChunk);
    for (int64_t j = lane; j < n; j += kClipLanes) {
      const float v = Element<In>::load(x[j]);
      if constexpr (Norm == ClipNorm::l2) sum += v * v;
      else sum += fabsf(v);
    }
  }
  // Lanes combine in lane order in double, as in chunk_norm_sums; an item's 16 lanes are
  // neighbouring threads of one block (kThreads is a multiple of kClipLanes).
  __shared__ float lanes[kThreads];
  lanes[threadIdx.x] = sum;
  __syncthreads();
  if (active && lane == 0) {
    double total = 0.0;
    for (int l = 0; l < kClipLanes; ++l) total += static_cast<double>(lanes[threadIdx.x + l]);
    partials[partial_base + item] = total;
  }
}

__global__ void fold_chunks(Group g, int64_t batch, const double* partials, int64_t partial_base, double* out) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= g.count * batch) return;
  const int t = static_cast<int>(id / batch);
  const int64_t b = id % batch, chunks = clip_chunks(g.numel[t]);
  const double* p = partials + partial_base + g.starts[t] + b * chunks;
  double sum = 0.0;
  for (int64_t c = 0; c < chunks; ++c) sum += p[c];
  out[b * g.num_columns + g.first + t] = sum;
}

__global__ void sample_factors(const double* sums, const double* clip_norms, int64_t batch, int64_t num_tensors,
                               bool per_layer, ClipNorm norm_type, float* factors) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < batch)
    clip_factors(sums + b * num_tensors, clip_norms, num_tensors, per_layer, norm_type, factors + b * num_tensors);
}

template <class In>
__global__ void accumulate(Group g, int64_t batch, const float* factors, float noise_std, uint64_t key,
                           uint64_t offset, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < g.starts[g.count]; e += stride) {
    const int t = locate(g, e);
    const int64_t j = e - g.starts[t];
    const In* grads = static_cast<const In*>(g.grads[t]);
    float acc = 0.0f;
    for (int64_t b = 0; b < batch; ++b) {
      const float factor = factors[b * g.num_columns + g.first + t];
      if (factor != 0.0f) acc += factor * Element<In>::load(grads[b * g.numel[t] + j]);
    }
    if (noise_std > 0.0f) {
      const uint64_t element = offset + g.noise_base[t] + static_cast<uint64_t>(j);
      float z[kValuesPerBlock<float>];
      noise_values<Distribution::gaussian, float>(key, element / kValuesPerBlock<float>, z);
      acc += noise_std * z[element % kValuesPerBlock<float>];
    }
    g.outs[t][j] = acc * scale;
  }
}

// The tensors in groups of kGroup; `items(numel)` is a tensor's work-item count.
template <class Items>
std::vector<Group> make_groups(const std::vector<PerSampleGrads>& tensors, const std::vector<float*>* outs,
                               int64_t num_columns, Items items) {
  std::vector<Group> groups;
  uint64_t noise_base = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i % kGroup == 0) {
      groups.push_back(Group{});
      groups.back().first = static_cast<int>(i);
      groups.back().num_columns = static_cast<int>(num_columns);
    }
    Group& g = groups.back();
    const int t = g.count++;
    g.grads[t] = tensors[i].grads;
    g.outs[t] = outs ? (*outs)[i] : nullptr;
    g.numel[t] = tensors[i].numel;
    g.noise_base[t] = noise_base;
    g.starts[t + 1] = g.starts[t] + items(tensors[i].numel);
    noise_base += static_cast<uint64_t>(tensors[i].numel);
  }
  return groups;
}

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>(std::min<int64_t>((threads + kThreads - 1) / kThreads, 1 << 30));
}

}  // namespace

int64_t clip_workspace_bytes(const std::vector<int64_t>& numels, int64_t batch, int64_t num_columns) {
  int64_t chunks = 0;
  for (int64_t n : numels) chunks += batch * clip_chunks(n);
  const int64_t factors = batch * num_columns;
  return chunks * static_cast<int64_t>(sizeof(double)) + factors * static_cast<int64_t>(sizeof(float));
}

void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, int64_t num_columns, const double* clip_norms, bool per_layer, ClipNorm norm_type,
                     double noise_std, uint64_t key, uint64_t offset, double scale, double* sums, float* factors_out,
                     void* workspace, int device, void* stream) {
  check_clip_accumulate(tensors.size(), outs.size(), batch, num_columns);
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  int64_t partial_count = 0;
  for (const auto& t : tensors) partial_count += batch * clip_chunks(t.numel);
  auto* partials = static_cast<double*>(workspace);
  auto* factors = reinterpret_cast<float*>(partials + partial_count);
  dispatch_clip_norm(norm_type, [&](auto norm) {
    dispatch_grad_dtype(dtype, [&](auto zero) {
      using In = decltype(zero);
      constexpr ClipNorm Norm = decltype(norm)::value;
      int64_t partial_base = 0;
      for (const Group& g :
           make_groups(tensors, nullptr, num_columns, [&](int64_t n) { return batch * clip_chunks(n); })) {
        // A group whose tensors all have numel 0 has no chunks: a 0-block launch is an error
        // (cudaErrorInvalidConfiguration), so skip it; fold_chunks still writes their sums (0).
        if (g.starts[g.count] > 0) {
          chunk_sums<Norm, In><<<blocks_for(g.starts[g.count] * kClipLanes), kThreads, 0, s>>>(g, batch, partials,
                                                                                              partial_base);
          check(cudaGetLastError(), "clip_accumulate: chunk_sums launch");
        }
        fold_chunks<<<blocks_for(g.count * batch), kThreads, 0, s>>>(g, batch, partials, partial_base, sums);
        check(cudaGetLastError(), "clip_accumulate: fold_chunks launch");
        partial_base += g.starts[g.count];
      }
      sample_factors<<<blocks_for(batch), kThreads, 0, s>>>(sums, clip_norms, batch, num_columns, per_layer, norm_type,
                                                            factors);
      check(cudaGetLastError(), "clip_accumulate: sample_factors launch");
      for (const Group& g : make_groups(tensors, &outs, num_columns, [](int64_t n) { return n; })) {
        if (g.starts[g.count] == 0) continue;  // no output elements: nothing to launch (0 blocks is an error)
        accumulate<In><<<std::min(blocks_for(g.starts[g.count]), 65536u), kThreads, 0, s>>>(
            g, batch, factors, static_cast<float>(noise_std), key, offset, static_cast<float>(scale));
        check(cudaGetLastError(), "clip_accumulate: accumulate launch");
      }
    });
  });
  if (factors_out)
    check(cudaMemcpyAsync(factors_out, factors, static_cast<size_t>(batch * num_columns) * sizeof(float),
                          cudaMemcpyDeviceToDevice, s),
          "clip_accumulate: copying the factors");
}

void clip_factors(const double* sums, const double* clip_norms, int64_t batch, int64_t num_tensors, bool per_layer,
                  ClipNorm norm_type, float* factors, int device, void* stream) {
  if (batch < 1) return;  // 0 blocks is an error
  const DeviceGuard guard(device);
  sample_factors<<<blocks_for(batch), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      sums, clip_norms, batch, num_tensors, per_layer, norm_type, factors);
  check(cudaGetLastError(), "clip_factors: sample_factors launch");
}

}  // namespace privleak::cuda
