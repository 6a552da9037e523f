// CPU noise: batches of kLaneBlocks Philox blocks. Their words come word-major from
// cpu/noise_lanes, a loop that the compiler vectorises across blocks turns them into values
// (common/noise.h is branch-free for that; at the avx512 tier a build of that loop for AVX-512
// runs, 16 floats or 8 doubles a vector), and the values are interleaved back into element order
// and scaled into the output. Bits are those of apply_noise_block, element by element, on every
// path.
#include "cpu/noise.h"

#include <algorithm>
#include <stdexcept>

#include "cpu/noise_lanes.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

// The transform, block by block: the compiler vectorises it across blocks (each lane's arithmetic
// is that of one block, so every vector width gives the same bits).
template <Distribution kDist, class Gen>
__attribute__((always_inline)) inline void lane_values_loop(const uint32_t (&words)[4][kLaneBlocks],
                                                           Gen (&values)[kValuesPerBlock<Gen>][kLaneBlocks]) {
  constexpr int k = kValuesPerBlock<Gen>;
  for (int64_t j = 0; j < kLaneBlocks; ++j) {
    Gen z[k];
    values_of_words<kDist, Gen>(Words4{{words[0][j], words[1][j], words[2][j], words[3][j]}}, z);
    for (int lane = 0; lane < k; ++lane) values[lane][j] = z[lane];
  }
}

template <Distribution kDist, class Gen>
PRIVLEAK_SIMD_CLONES void lane_values(const uint32_t (&words)[4][kLaneBlocks],
                                      Gen (&values)[kValuesPerBlock<Gen>][kLaneBlocks]) {
  lane_values_loop<kDist, Gen>(words, values);
}

#if defined(PRIVLEAK_X86_AVX2)
// The avx512 tier's build of the same loop, 16 floats (8 doubles) per vector.
template <Distribution kDist, class Gen>
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl"))) void lane_values_avx512(
    const uint32_t (&words)[4][kLaneBlocks], Gen (&values)[kValuesPerBlock<Gen>][kLaneBlocks]) {
  lane_values_loop<kDist, Gen>(words, values);
}
#endif

template <Distribution kDist, class Gen>
void noise_batch(uint64_t key, uint32_t stream, uint64_t first_block, Gen* values) {
  alignas(64) uint32_t words[4][kLaneBlocks];
  alignas(64) Gen lanes[kValuesPerBlock<Gen>][kLaneBlocks];
  philox_lanes(key, stream, first_block, words);
#if defined(PRIVLEAK_X86_AVX2)
  if (avx512_enabled())
    lane_values_avx512<kDist, Gen>(words, lanes);
  else
#endif
    lane_values<kDist, Gen>(words, lanes);
  interleave_lanes(lanes, values);
}

// out[i] = scale * values[i] or out[i] += ..., i < count. `add` is a compile-time constant, so
// the loop has no branch and vectorises (a float addition under a condition would not).
template <class Out, bool kAdd>
PRIVLEAK_SIMD_CLONES void store_scaled(Out* __restrict out, const typename Element<Out>::Gen* __restrict values,
                                       int64_t count, typename Element<Out>::Gen scale) {
  for (int64_t i = 0; i < count; ++i) set_or_add(out[i], scale * values[i], kAdd);
}

// Batch `batch` (counted from the one holding element `offset`) of the draw [offset, offset + n).
template <Distribution kDist, class Out>
void apply_noise_batch(Out* out, int64_t n, uint64_t key, uint32_t stream, uint64_t offset,
                       typename Element<Out>::Gen scale, bool add, int64_t batch,
                       typename Element<Out>::Gen* values) {
  using Gen = typename Element<Out>::Gen;
  constexpr int k = kValuesPerBlock<Gen>;
  const uint64_t block = first_noise_block(offset, k) + static_cast<uint64_t>(batch) * kLaneBlocks;
  noise_batch<kDist, Gen>(key, stream, block, values);
  const uint64_t batch_begin = block * k;
  const uint64_t begin = std::max(batch_begin, offset);
  const uint64_t end = std::min(batch_begin + kLaneBlocks * k, offset + static_cast<uint64_t>(n));
  if (end <= begin) return;
  Out* first = out + (begin - offset);
  const Gen* first_value = values + (begin - batch_begin);
  const int64_t count = static_cast<int64_t>(end - begin);
  if (add)
    store_scaled<Out, true>(first, first_value, count, scale);
  else
    store_scaled<Out, false>(first, first_value, count, scale);
}

template <class Gen>
int64_t num_noise_batches(uint64_t offset, int64_t n) {
  constexpr int k = kValuesPerBlock<Gen>;
  return static_cast<int64_t>((end_noise_block(offset, n, k) - first_noise_block(offset, k) + kLaneBlocks - 1) /
                              kLaneBlocks);
}

template <Distribution kDist, class Out>
void apply_noise_typed(Out* out, int64_t n, uint64_t key, uint64_t offset, double scale, bool add) {
  using Gen = typename Element<Out>::Gen;
  const int64_t num_batches = num_noise_batches<Gen>(offset, n);
  const uint32_t stream = noise_stream<Gen>(kDist);
#pragma omp parallel if (n >= kMinParallelWork)
  {
    Gen values[kLaneBlocks * kValuesPerBlock<Gen>];
#pragma omp for schedule(static)
    for (int64_t batch = 0; batch < num_batches; ++batch)
      apply_noise_batch<kDist, Out>(out, n, key, stream, offset, static_cast<Gen>(scale), add, batch, values);
  }
}

}  // namespace

template <class T>
void fill_unit_gaussians(uint32_t stream, T* out, int64_t n, uint64_t key, uint64_t offset) {
  T values[kLaneBlocks * kValuesPerBlock<T>];
  for (int64_t batch = 0; batch < num_noise_batches<T>(offset, n); ++batch)
    apply_noise_batch<Distribution::gaussian, T>(out, n, key, stream, offset, T(1), false, batch, values);
}
template void fill_unit_gaussians<float>(uint32_t, float*, int64_t, uint64_t, uint64_t);
template void fill_unit_gaussians<double>(uint32_t, double*, int64_t, uint64_t, uint64_t);

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
