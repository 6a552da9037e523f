#pragma once

#include <cstdint>

#include "common/noise.h"

namespace privleak::cuda {

// privleak::cpu::apply_noise on device memory, on `stream` (a cudaStream_t) of `device`; same bits.
void apply_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, uint64_t key,
                 uint64_t offset, double scale, bool add, int device, void* stream);

}  // namespace privleak::cuda
