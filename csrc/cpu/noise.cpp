#include "cpu/noise.h"

#include <stdexcept>

#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

template <class Out>
void apply_noise_typed(Distribution d, Out* out, int64_t n, uint64_t key, uint64_t offset, double scale, bool add) {
  using Gen = typename NoiseStore<Out>::Gen;
  constexpr int k = kValuesPerBlock<Gen>;
  const int64_t first = static_cast<int64_t>(first_noise_block(offset, k));
  const int64_t end = static_cast<int64_t>(end_noise_block(offset, n, k));
  const Gen gen_scale = static_cast<Gen>(scale);
#pragma omp parallel for schedule(static)
  for (int64_t block = first; block < end; ++block)
    apply_noise_block<Out>(d, key, offset, n, gen_scale, add, static_cast<uint64_t>(block), out);
}

}  // namespace

void apply_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, uint64_t key,
                 uint64_t offset, double scale, bool add) {
  if (n < 0) throw std::invalid_argument("apply_noise: n must be >= 0");
  if (n == 0) return;
  switch (dtype) {
    case NoiseDType::float32: return apply_noise_typed(distribution, static_cast<float*>(out), n, key, offset, scale, add);
    case NoiseDType::float64: return apply_noise_typed(distribution, static_cast<double*>(out), n, key, offset, scale, add);
    case NoiseDType::bfloat16: return apply_noise_typed(distribution, static_cast<BFloat16*>(out), n, key, offset, scale, add);
    case NoiseDType::float16: return apply_noise_typed(distribution, static_cast<Float16*>(out), n, key, offset, scale, add);
  }
  throw std::invalid_argument("apply_noise: unknown dtype");
}

}  // namespace privleak::cpu
