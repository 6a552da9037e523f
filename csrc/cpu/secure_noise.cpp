#include "cpu/secure_noise.h"

#include <stdexcept>

#include "common/noise.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

template <bool kGaussian, class Out>
void apply_typed(Out* out, int64_t n, const ChaChaKey& key, uint64_t offset, uint64_t scale, int grid_exponent,
                 bool add) {
#pragma omp parallel for schedule(static, 1024) if (n >= 1024)  // several ChaCha20 blocks an element
  for (int64_t i = 0; i < n; ++i) {
    using Gen = typename Element<Out>::Gen;
    const double x = add ? static_cast<double>(Element<Out>::load(out[i])) : 0.0;
    Element<Out>::store(out[i], static_cast<Gen>(secure_noisy_value<kGaussian>(x, scale, grid_exponent, key,
                                                                               offset + static_cast<uint64_t>(i))));
  }
}

template <bool kGaussian>
void apply_dtype(NoiseDType dtype, void* out, int64_t n, const ChaChaKey& key, uint64_t offset, uint64_t scale,
                 int grid_exponent, bool add) {
  switch (dtype) {
    case NoiseDType::float32: return apply_typed<kGaussian>(static_cast<float*>(out), n, key, offset, scale, grid_exponent, add);
    case NoiseDType::float64: return apply_typed<kGaussian>(static_cast<double*>(out), n, key, offset, scale, grid_exponent, add);
    case NoiseDType::bfloat16: return apply_typed<kGaussian>(static_cast<BFloat16*>(out), n, key, offset, scale, grid_exponent, add);
    case NoiseDType::float16: return apply_typed<kGaussian>(static_cast<Float16*>(out), n, key, offset, scale, grid_exponent, add);
  }
  throw std::invalid_argument("apply_secure_noise: unknown dtype");
}

}  // namespace

void apply_secure_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, const ChaChaKey& key,
                        uint64_t offset, uint64_t scale, int grid_exponent, bool add) {
  if (n < 0 || scale < 1 || grid_exponent < -1000 || grid_exponent > 1000)
    throw std::invalid_argument("apply_secure_noise: needs n >= 0, scale >= 1 and |grid_exponent| <= 1000");
  if (distribution == Distribution::gaussian)
    apply_dtype<true>(dtype, out, n, key, offset, scale, grid_exponent, add);
  else
    apply_dtype<false>(dtype, out, n, key, offset, scale, grid_exponent, add);
}

}  // namespace privleak::cpu
