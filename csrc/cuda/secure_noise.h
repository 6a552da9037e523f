#pragma once

#include <cstdint>
#include <vector>

#include "common/noise.h"
#include "common/secure_noise.h"

namespace privleak::cuda {

// privleak::cpu::apply_secure_noise on each of the device arrays `outs` of `numels` elements, laid
// end to end in the stream from `offset`, on `stream` of `device`; the same bits.
void apply_secure_noise(Distribution distribution, NoiseDType dtype, const std::vector<void*>& outs,
                        const std::vector<int64_t>& numels, const ChaChaKey& key, uint64_t offset, uint64_t scale,
                        int grid_exponent, bool add, int device, void* stream);

}  // namespace privleak::cuda
