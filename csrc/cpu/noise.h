#pragma once

#include <cstdint>

#include "common/noise.h"

namespace privleak::cpu {

// out[i] = scale * z_{offset + i} (or out[i] += ... when `add`), i < n, where z is the unit
// noise of `distribution` under `key` (common/noise.h). `out` is contiguous.
void apply_noise(Distribution distribution, NoiseDType dtype, void* out, int64_t n, uint64_t key,
                 uint64_t offset, double scale, bool add);

// Serial: out[i] = N(0, 1) element offset + i of Philox stream `stream` (float or double).
template <class T>
void fill_unit_gaussians(uint32_t stream, T* out, int64_t n, uint64_t key, uint64_t offset);

}  // namespace privleak::cpu
