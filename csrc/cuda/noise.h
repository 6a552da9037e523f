#pragma once

#include <cstdint>
#include <vector>

#include "common/noise.h"

namespace privleak::cuda {

// privleak::cpu::apply_noise on each of the device arrays `outs` of `numels` elements, laid end to
// end in the stream from `offset`, on `stream` (a cudaStream_t) of `device`; the same bits.
void apply_noise(Distribution distribution, NoiseDType dtype, const std::vector<void*>& outs,
                 const std::vector<int64_t>& numels, uint64_t key, uint64_t offset, double scale, bool add, int device,
                 void* stream);

}  // namespace privleak::cuda
