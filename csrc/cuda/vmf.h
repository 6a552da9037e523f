#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace privleak::cuda {

// Scratch bytes vmf_sample needs for n samples in p dimensions.
int64_t vmf_workspace_bytes(int64_t p, int64_t n);

// privleak::cpu::vmf_sample on device memory, on `stream` of `device`; the same bits.
void vmf_sample(DType dtype, const void* mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset,
                void* out, void* workspace, int device, void* stream);

}  // namespace privleak::cuda
