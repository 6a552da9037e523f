// CPU noise: batches of Philox blocks are generated into a small buffer by a loop that the
// compiler vectorises across blocks (common/noise.h is branch-free for that), then scaled into
// the output. Bits are those of apply_noise_block, element by element.
#include "cpu/noise.h"

#include <algorithm>
#include <stdexcept>

#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

constexpr int64_t kBatchBlocks = 64;

template <Distribution kDist, class Gen>
PRIVLEAK_SIMD_CLONES void noise_batch(uint64_t key, uint64_t first_block, Gen* __restrict values) {
  constexpr int k = kValuesPerBlock<Gen>;
  for (int64_t j = 0; j < kBatchBlocks; ++j) {
    Gen z[k];
    noise_values<kDist, Gen>(key, first_block + j, z);
    for (int lane = 0; lane < k; ++lane) values[j * k + lane] = z[lane];
  }
}

template <Distribution kDist, class Out>
void apply_noise_typed(Out* out, int64_t n, uint64_t key, uint64_t offset, double scale, bool add) {
  using Gen = typename NoiseStore<Out>::Gen;
  constexpr int k = kValuesPerBlock<Gen>;
  const uint64_t first = first_noise_block(offset, k);
  const int64_t num_batches =
      static_cast<int64_t>((end_noise_block(offset, n, k) - first + kBatchBlocks - 1) / kBatchBlocks);
  const Gen gen_scale = static_cast<Gen>(scale);
#pragma omp parallel
  {
    Gen values[kBatchBlocks * k];
#pragma omp for schedule(static)
    for (int64_t batch = 0; batch < num_batches; ++batch) {
      const uint64_t block = first + static_cast<uint64_t>(batch) * kBatchBlocks;
      noise_batch<kDist, Gen>(key, block, values);
      // Elements of this batch that belong to the draw [offset, offset + n).
      const uint64_t batch_begin = block * k;
      const uint64_t begin = std::max(batch_begin, offset);
      const uint64_t end = std::min(batch_begin + kBatchBlocks * k, offset + static_cast<uint64_t>(n));
      for (uint64_t e = begin; e < end; ++e) NoiseStore<Out>::apply(out[e - offset], gen_scale * values[e - batch_begin], add);
    }
  }
}

}  // namespace

void apply_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, uint64_t key,
                 uint64_t offset, double scale, bool add) {
  if (n < 0) throw std::invalid_argument("apply_noise: n must be >= 0");
  if (n == 0) return;
  dispatch_distribution(distribution, [&](auto dist) {
    constexpr Distribution kDist = decltype(dist)::value;
    switch (dtype) {
      case NoiseDType::float32: return apply_noise_typed<kDist>(static_cast<float*>(out), n, key, offset, scale, add);
      case NoiseDType::float64: return apply_noise_typed<kDist>(static_cast<double*>(out), n, key, offset, scale, add);
      case NoiseDType::bfloat16: return apply_noise_typed<kDist>(static_cast<BFloat16*>(out), n, key, offset, scale, add);
      case NoiseDType::float16: return apply_noise_typed<kDist>(static_cast<Float16*>(out), n, key, offset, scale, add);
    }
    throw std::invalid_argument("apply_noise: unknown dtype");
  });
}

}  // namespace privleak::cpu
