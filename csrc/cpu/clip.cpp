// CPU fused clipping. Pass 1 is parallel over (tensor, sample, chunk) items; pass 2 over
// (tensor, column block) items, each reading its block of every sample once and writing it once.
#include "cpu/clip.h"

#include <algorithm>
#include <stdexcept>

#include "common/clip.h"
#include "cpu/noise.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

constexpr int64_t kBlock = 8192;  // output elements a pass-2 item owns: 32 KiB runs of each sample row

// Item i of a list of per-tensor counts: (tensor, index within it).
struct ItemIndex {
  std::vector<int64_t> starts;  // prefix sums, size T + 1
  explicit ItemIndex(const std::vector<int64_t>& counts) : starts(counts.size() + 1, 0) {
    for (size_t t = 0; t < counts.size(); ++t) starts[t + 1] = starts[t] + counts[t];
  }
  int64_t total() const { return starts.back(); }
  std::pair<size_t, int64_t> locate(int64_t item) const {
    const size_t t = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), item) - starts.begin()) - 1;
    return {t, item - starts[t]};
  }
};

template <class In>
void sum_of_squares_typed(const std::vector<PerSampleGrads>& tensors, int64_t batch, double* out) {
  std::vector<int64_t> counts;
  for (const auto& t : tensors) counts.push_back(batch * clip_chunks(t.numel));
  const ItemIndex items(counts);
  std::vector<double> partials(static_cast<size_t>(items.total()));
  int64_t elements = 0;
  for (const auto& t : tensors) elements += batch * t.numel;
#pragma omp parallel for schedule(static) if (elements >= kMinParallelWork)
  for (int64_t item = 0; item < items.total(); ++item) {
    const auto [t, local] = items.locate(item);
    const int64_t chunks = clip_chunks(tensors[t].numel), b = local / chunks, c = local % chunks;
    const In* row = static_cast<const In*>(tensors[t].grads) + b * tensors[t].numel;
    const int64_t begin = c * kClipChunk;
    partials[item] = chunk_sum_of_squares(row + begin, std::min(kClipChunk, tensors[t].numel - begin));
  }
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  for (int64_t t = 0; t < num_tensors; ++t) {
    const int64_t chunks = clip_chunks(tensors[t].numel);
    for (int64_t b = 0; b < batch; ++b) {
      const double* p = partials.data() + items.starts[t] + b * chunks;
      double sum = 0.0;
      for (int64_t c = 0; c < chunks; ++c) sum += p[c];
      out[b * num_tensors + t] = sum;
    }
  }
}

template <class In>
PRIVLEAK_SIMD_CLONES void accumulate_row(const In* __restrict row, float factor, int64_t width, float* __restrict acc) {
  for (int64_t j = 0; j < width; ++j) acc[j] += factor * Element<In>::load(row[j]);
}

// Four rows per sweep over the accumulators, added in row order: the same sums as four calls of
// accumulate_row, with a quarter of the accumulator traffic.
template <class In>
PRIVLEAK_SIMD_CLONES void accumulate_four_rows(const In* __restrict r0, const In* __restrict r1,
                                               const In* __restrict r2, const In* __restrict r3, const float* f,
                                               int64_t width, float* __restrict acc) {
  for (int64_t j = 0; j < width; ++j) {
    float a = acc[j];
    a += f[0] * Element<In>::load(r0[j]);
    a += f[1] * Element<In>::load(r1[j]);
    a += f[2] * Element<In>::load(r2[j]);
    a += f[3] * Element<In>::load(r3[j]);
    acc[j] = a;
  }
}

template <class In>
void clip_accumulate_typed(const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                           int64_t batch, const float* factors, double noise_std, uint64_t key, uint64_t offset,
                           double scale) {
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> blocks;
  std::vector<uint64_t> base(tensors.size(), 0);  // noise index of each tensor's element 0
  for (size_t t = 0; t < tensors.size(); ++t) {
    blocks.push_back((tensors[t].numel + kBlock - 1) / kBlock);
    if (t + 1 < tensors.size()) base[t + 1] = base[t] + static_cast<uint64_t>(tensors[t].numel);
  }
  const ItemIndex items(blocks);
  auto factor = [&](int64_t b, size_t t) { return factors[b * num_tensors + static_cast<int64_t>(t)]; };
  std::vector<std::vector<int64_t>> active(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t)
    for (int64_t b = 0; b < batch; ++b)
      if (factor(b, t) != 0.0f) active[t].push_back(b);
  const float std_f = static_cast<float>(noise_std), scale_f = static_cast<float>(scale);
  int64_t elements = 0;
  for (const auto& t : tensors) elements += batch * t.numel;
#pragma omp parallel if (elements >= kMinParallelWork)
  {
    float acc[kBlock], noise[kBlock];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items.total(); ++item) {
      const auto [t, block] = items.locate(item);
      const int64_t begin = block * kBlock, width = std::min(kBlock, tensors[t].numel - begin);
      std::fill(acc, acc + width, 0.0f);
      const In* grads = static_cast<const In*>(tensors[t].grads);
      auto row = [&](int64_t b) { return grads + b * tensors[t].numel + begin; };
      const std::vector<int64_t>& kept = active[t];  // samples with a non-zero factor, in order
      size_t k = 0;
      for (; k + 4 <= kept.size(); k += 4) {
        const float f[4] = {factor(kept[k], t), factor(kept[k + 1], t), factor(kept[k + 2], t), factor(kept[k + 3], t)};
        accumulate_four_rows(row(kept[k]), row(kept[k + 1]), row(kept[k + 2]), row(kept[k + 3]), f, width, acc);
      }
      for (; k < kept.size(); ++k) accumulate_row(row(kept[k]), factor(kept[k], t), width, acc);
      if (noise_std > 0.0) {
        fill_unit_gaussians<float>(noise_stream<float>(Distribution::gaussian), noise, width, key,
                                   offset + base[t] + static_cast<uint64_t>(begin));
        for (int64_t j = 0; j < width; ++j) acc[j] += std_f * noise[j];
      }
      float* out = outs[t] + begin;
      for (int64_t j = 0; j < width; ++j) out[j] = acc[j] * scale_f;
    }
  }
}

}  // namespace

void per_sample_sum_of_squares(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, int64_t batch,
                               double* out) {
  if (batch < 1) throw std::invalid_argument("per_sample_sum_of_squares: batch must be >= 1");
  dispatch_grad_dtype(dtype, [&](auto zero) { sum_of_squares_typed<decltype(zero)>(tensors, batch, out); });
}

void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, const float* factors, double noise_std, uint64_t key, uint64_t offset,
                     double scale) {
  if (batch < 1 || outs.size() != tensors.size())
    throw std::invalid_argument("clip_accumulate: batch must be >= 1 and there must be one output per tensor");
  dispatch_grad_dtype(dtype, [&](auto zero) {
    clip_accumulate_typed<decltype(zero)>(tensors, outs, batch, factors, noise_std, key, offset, scale);
  });
}

}  // namespace privleak::cpu
