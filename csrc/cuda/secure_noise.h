#pragma once

#include <cstdint>

#include "common/noise.h"
#include "common/secure_noise.h"

namespace privleak::cuda {

// privleak::cpu::apply_secure_noise on device memory, on `stream` of `device`; the same bits.
void apply_secure_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, const ChaChaKey& key,
                        uint64_t offset, uint64_t scale, int grid_exponent, bool add, int device, void* stream);

}  // namespace privleak::cuda
