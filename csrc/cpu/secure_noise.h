#pragma once

#include <cstdint>

#include "common/noise.h"
#include "common/secure_noise.h"

namespace privleak::cpu {

// out[i] = g (round(out[i] / g) + Y_{offset+i}) when `add`, else g Y_{offset+i}; Y discrete
// Gaussian (scale = sigma^2 / g^2) or discrete Laplace (scale = b / g), g = 2^grid_exponent
// (common/secure_noise.h). The caller checks that |out| / g < 2^61 and is finite.
void apply_secure_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, const ChaChaKey& key,
                        uint64_t offset, uint64_t scale, int grid_exponent, bool add);

}  // namespace privleak::cpu
