// CPU fused clipping. The samples go in groups small enough to stay in cache: pass 1 reads a
// group's rows from memory (four side by side), their factors follow, and pass 2 reads the same
// rows again from cache into running sums held in the outputs. Rows too large for that make one
// group of the whole batch. Pass 1 is parallel over (tensor, four rows, chunk) items, pass 2 over
// (tensor, column block) items. Every output element adds the samples in order, whatever the
// grouping and thread count, so the bits are those of the CUDA kernels.
#include "cpu/clip.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "common/clip.h"
#include "cpu/noise.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

constexpr int64_t kBlock = 8192;  // output elements a pass-2 item owns: 32 KiB runs of each sample row
constexpr int64_t kRowsTogether = 4;
// Gradients of one group: it and the running sums stay in L2 + L3 between the passes. Grouping
// pays for rows of up to a quarter of this (measured on a 32 MiB-L3 EPYC: B = 256, P = 1e5 went
// from 11 to 8 ms); for longer rows, reloading the running sums per group costs what the cache
// saves, so the batch is one group.
constexpr int64_t kGroupBytes = int64_t(4) << 20;
// fp16 rows are widened into a per-thread buffer, kRowsTogether rows of a pass-1 chunk or of a
// pass-2 block at a time.
constexpr int64_t kWidenBuffer = kRowsTogether * std::max(kClipChunk, kBlock);

int64_t samples_per_group(int64_t row_bytes, int64_t batch) {
  if (row_bytes == 0) return batch;
  const int64_t rows = kGroupBytes / row_bytes / kRowsTogether * kRowsTogether;
  return rows < kRowsTogether ? batch : std::min(rows, batch);
}

// Item i of a list of per-tensor counts: (tensor, index within it).
struct ItemIndex {
  std::vector<int64_t> starts{0};  // prefix sums, size T + 1
  ItemIndex() = default;
  explicit ItemIndex(const std::vector<int64_t>& counts) : starts(counts.size() + 1, 0) {
    for (size_t t = 0; t < counts.size(); ++t) starts[t + 1] = starts[t] + counts[t];
  }
  int64_t total() const { return starts.back(); }
  std::pair<size_t, int64_t> locate(int64_t item) const {
    const size_t t = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), item) - starts.begin()) - 1;
    return {t, item - starts[t]};
  }
};

// fp16 rows widened to float32 (exact): rows[r][0, n) -> dst + r * dst_stride, r < count. Where
// avx2_enabled(), F16C converts 8 per instruction. The portable conversion inside the kernels' own
// loops made fp16 clipping compute-bound at twice this time. F16C itself, one conversion per two
// cycles on Zen 2, keeps fp16 at about twice bf16's time there.
PRIVLEAK_SIMD_CLONES void widen_float16_run(const Float16* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = Element<Float16>::load(src[j]);
}

#if defined(PRIVLEAK_X86_AVX2)
__attribute__((target("avx2,f16c"))) void widen_float16_f16c(const Float16* const* rows, int64_t count, int64_t n,
                                                            float* dst, int64_t dst_stride) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int64_t r = 0; r < count; ++r)
      _mm256_storeu_ps(dst + r * dst_stride + j,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + j))));
  for (int64_t r = 0; r < count; ++r) widen_float16_run(rows[r] + j, n - j, dst + r * dst_stride + j);
}
#endif

void widen_float16(const Float16* const* rows, int64_t count, int64_t n, float* dst, int64_t dst_stride) {
#if defined(PRIVLEAK_X86_AVX2)
  if (avx2_enabled()) {
    widen_float16_f16c(rows, count, n, dst, dst_stride);
    return;
  }
#endif
  for (int64_t r = 0; r < count; ++r) widen_float16_run(rows[r], n, dst + r * dst_stride);
}

// The element type the kernels read: fp16 rows are first widened into a buffer, other types are
// read in place.
template <class In> struct Read { using type = In; };
template <> struct Read<Float16> { using type = float; };

// readable[r] = rows[r][0, n) as the kernels read it, r < count: for fp16 row r widened into
// buffer + r * buffer_stride.
template <class In>
void readable_rows(const In* const* rows, int64_t count, int64_t n, float* buffer, int64_t buffer_stride,
                   const typename Read<In>::type** readable) {
  if constexpr (std::is_same_v<In, Float16>) {
    widen_float16(rows, count, n, buffer, buffer_stride);
    for (int64_t r = 0; r < count; ++r) readable[r] = buffer + r * buffer_stride;
  } else {
    std::copy(rows, rows + count, readable);
  }
}

// Norm sums of `count` (1 .. kRowsTogether) rows' first n elements, into sums[r * sum_stride].
template <ClipNorm Norm, class In>
PRIVLEAK_SIMD_CLONES void chunk_sums(const In* const* rows, int64_t count, int64_t n, double* sums,
                                     int64_t sum_stride) {
  double row_sums[kRowsTogether];
  if (count == kRowsTogether) {
    chunk_norm_sums<Norm, kRowsTogether>(rows, n, row_sums);
  } else {
    for (int64_t r = 0; r < count; ++r) chunk_norm_sums<Norm, 1>(rows + r, n, row_sums + r);
  }
  for (int64_t r = 0; r < count; ++r) sums[r * sum_stride] = row_sums[r];
}

template <class In>
PRIVLEAK_SIMD_CLONES void accumulate_row(const In* __restrict row, float factor, int64_t width, float* __restrict acc) {
  for (int64_t j = 0; j < width; ++j) acc[j] += factor * Element<In>::load(row[j]);
}

// Four rows per sweep over the running sums, added in row order: the same sums as four calls of
// accumulate_row, with a quarter of the running-sum traffic.
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

template <ClipNorm Norm, class In>
class FusedClip {
  using Readable = typename Read<In>::type;

 public:
  FusedClip(const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs, int64_t batch,
            int64_t num_columns, const double* clip_norms, bool per_layer, double* sums)
      : tensors_(tensors), outs_(outs), num_tensors_(static_cast<int64_t>(tensors.size())), num_columns_(num_columns),
        clip_norms_(clip_norms), per_layer_(per_layer), sums_(sums),
        factors_(static_cast<size_t>(batch * num_columns)), noise_base_(tensors.size(), 0) {
    int64_t row_bytes = 0;
    std::vector<int64_t> blocks;
    for (size_t t = 0; t < tensors.size(); ++t) {
      row_bytes += tensors[t].numel * static_cast<int64_t>(sizeof(In));
      chunks_.push_back(clip_chunks(tensors[t].numel));
      blocks.push_back((tensors[t].numel + kBlock - 1) / kBlock);
      if (t + 1 < tensors.size()) noise_base_[t + 1] = noise_base_[t] + static_cast<uint64_t>(tensors[t].numel);
    }
    group_ = samples_per_group(row_bytes, batch);
    const int64_t row_sets = (group_ + kRowsTogether - 1) / kRowsTogether;
    std::vector<int64_t> chunk_items, partial_counts;
    for (int64_t c : chunks_) {
      chunk_items.push_back(row_sets * c);
      partial_counts.push_back(group_ * c);
    }
    chunk_items_ = ItemIndex(chunk_items);
    partial_starts_ = ItemIndex(partial_counts);
    partials_.resize(static_cast<size_t>(partial_starts_.total()));
    blocks_ = ItemIndex(blocks);
    kept_.resize(tensors.size());
  }

  int64_t group() const { return group_; }

  // Pass 1 over samples [first, first + count): partial norm sums per (tensor, row, chunk).
  void chunk_item(int64_t first, int64_t count, int64_t item, float* buffer) {
    const auto [t, local] = chunk_items_.locate(item);
    const int64_t chunks = chunks_[t], set = local / chunks, c = local % chunks, numel = tensors_[t].numel;
    const int64_t row = set * kRowsTogether, begin = c * kClipChunk;
    if (row >= count) return;
    const In* first_row = static_cast<const In*>(tensors_[t].grads) + (first + row) * numel + begin;
    const int64_t rows = std::min(kRowsTogether, count - row), n = std::min(kClipChunk, numel - begin);
    const In* row_starts[kRowsTogether];
    const Readable* readable[kRowsTogether];
    for (int64_t r = 0; r < rows; ++r) row_starts[r] = first_row + r * numel;
    readable_rows(row_starts, rows, n, buffer, kClipChunk, readable);
    chunk_sums<Norm>(readable, rows, n, partials_.data() + partial_starts_.starts[t] + row * chunks + c, chunks);
  }

  // Between the passes (one thread): the group's norm sums, factors and non-zero-factor rows.
  void finish_norms(int64_t first, int64_t count) {
    for (int64_t r = 0; r < count; ++r) {
      double* row_sums = sums_ + (first + r) * num_columns_;
      for (int64_t t = 0; t < num_tensors_; ++t) {
        const double* p = partials_.data() + partial_starts_.starts[t] + r * chunks_[t];
        double sum = 0.0;
        for (int64_t c = 0; c < chunks_[t]; ++c) sum += p[c];
        row_sums[t] = sum;
      }
      clip_factors(row_sums, clip_norms_, num_columns_, per_layer_, Norm, factors_.data() + (first + r) * num_columns_);
    }
    for (int64_t t = 0; t < num_tensors_; ++t) {
      kept_[t].clear();
      for (int64_t b = first; b < first + count; ++b)
        if (factor(b, t) != 0.0f) kept_[t].push_back(b);
    }
  }

  // Pass 2 over the group into the running sums; the last group adds the noise and scales.
  void block_item(int64_t first, int64_t item, bool last, float noise_std, uint64_t key, uint64_t offset,
                  float scale, float* acc, float* noise, float* buffer) {
    const auto [t, block] = blocks_.locate(item);
    const int64_t numel = tensors_[t].numel, begin = block * kBlock, width = std::min(kBlock, numel - begin);
    float* out = outs_[t] + begin;
    if (first == 0) std::fill(acc, acc + width, 0.0f);
    else std::copy(out, out + width, acc);
    const In* grads = static_cast<const In*>(tensors_[t].grads) + begin;
    add_rows(t, grads, width, acc, buffer);
    if (!last) {
      std::copy(acc, acc + width, out);
      return;
    }
    if (noise_std > 0.0f) {
      fill_unit_gaussians<float>(noise_stream<float>(Distribution::gaussian), noise, width, key,
                                 offset + noise_base_[t] + static_cast<uint64_t>(begin));
      for (int64_t j = 0; j < width; ++j) acc[j] += noise_std * noise[j];
    }
    for (int64_t j = 0; j < width; ++j) out[j] = acc[j] * scale;
  }

  // acc[0, width) += the group's kept rows of tensor t times their factors, in order; `grads`
  // points at sample 0's first element of the block.
  void add_rows(size_t t, const In* grads, int64_t width, float* acc, float* buffer) const {
    const int64_t numel = tensors_[t].numel;
    const std::vector<int64_t>& kept = kept_[t];
    const In* rows[kRowsTogether];
    const Readable* readable[kRowsTogether];
    size_t k = 0;
    for (; k + kRowsTogether <= kept.size(); k += kRowsTogether) {
      float f[kRowsTogether];
      for (int64_t r = 0; r < kRowsTogether; ++r) {
        rows[r] = grads + kept[k + r] * numel;
        f[r] = factor(kept[k + r], t);
      }
      readable_rows(rows, kRowsTogether, width, buffer, kBlock, readable);
      accumulate_four_rows(readable[0], readable[1], readable[2], readable[3], f, width, acc);
    }
    for (; k < kept.size(); ++k) {
      rows[0] = grads + kept[k] * numel;
      readable_rows(rows, 1, width, buffer, kBlock, readable);
      accumulate_row(readable[0], factor(kept[k], t), width, acc);
    }
  }

  int64_t chunk_items() const { return chunk_items_.total(); }
  int64_t block_items() const { return blocks_.total(); }
  const std::vector<float>& factors() const { return factors_; }

 private:
  float factor(int64_t b, int64_t t) const { return factors_[static_cast<size_t>(b * num_columns_ + t)]; }

  const std::vector<PerSampleGrads>& tensors_;
  const std::vector<float*>& outs_;
  int64_t num_tensors_;
  int64_t num_columns_;  // of the norm sums and factors: the tensors', then those of tensors read elsewhere
  const double* clip_norms_;
  bool per_layer_;
  double* sums_;
  std::vector<float> factors_;
  std::vector<uint64_t> noise_base_;  // noise index of each tensor's element 0
  std::vector<int64_t> chunks_;
  int64_t group_ = 0;
  ItemIndex chunk_items_, partial_starts_, blocks_;
  std::vector<double> partials_;
  std::vector<std::vector<int64_t>> kept_;  // per tensor, the group's samples with a non-zero factor, in order
};

template <ClipNorm Norm, class In>
void clip_accumulate_typed(const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                           int64_t batch, int64_t num_columns, const double* clip_norms, bool per_layer,
                           double noise_std, uint64_t key, uint64_t offset, double scale, double* sums,
                           float* factors) {
  FusedClip<Norm, In> clip(tensors, outs, batch, num_columns, clip_norms, per_layer, sums);
  const float std_f = static_cast<float>(noise_std), scale_f = static_cast<float>(scale);
  int64_t elements = 0;
  for (const auto& t : tensors) elements += batch * t.numel;
#pragma omp parallel if (elements >= kMinParallelWork)
  {
    float acc[kBlock], noise[kBlock];
    std::vector<float> widened(std::is_same_v<In, Float16> ? kWidenBuffer : 0);
    for (int64_t first = 0; first < batch; first += clip.group()) {
      const int64_t count = std::min(clip.group(), batch - first);
#pragma omp for schedule(static)
      for (int64_t item = 0; item < clip.chunk_items(); ++item) clip.chunk_item(first, count, item, widened.data());
#pragma omp single
      clip.finish_norms(first, count);
      const bool last = first + count == batch;
#pragma omp for schedule(static)
      for (int64_t item = 0; item < clip.block_items(); ++item)
        clip.block_item(first, item, last, std_f, key, offset, scale_f, acc, noise, widened.data());
    }
  }
  if (factors) std::copy(clip.factors().begin(), clip.factors().end(), factors);
}

}  // namespace

void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, int64_t num_columns, const double* clip_norms, bool per_layer, ClipNorm norm_type,
                     double noise_std, uint64_t key, uint64_t offset, double scale, double* sums, float* factors) {
  check_clip_accumulate(tensors.size(), outs.size(), batch, num_columns);
  dispatch_clip_norm(norm_type, [&](auto norm) {
    dispatch_grad_dtype(dtype, [&](auto zero) {
      clip_accumulate_typed<decltype(norm)::value, decltype(zero)>(tensors, outs, batch, num_columns, clip_norms,
                                                                   per_layer, noise_std, key, offset, scale, sums,
                                                                   factors);
    });
  });
}

void clip_factors(const double* sums, const double* clip_norms, int64_t batch, int64_t num_tensors, bool per_layer,
                  ClipNorm norm_type, float* factors) {
  for (int64_t b = 0; b < batch; ++b)
    privleak::clip_factors(sums + b * num_tensors, clip_norms, num_tensors, per_layer, norm_type,
                           factors + b * num_tensors);
}

}  // namespace privleak::cpu
