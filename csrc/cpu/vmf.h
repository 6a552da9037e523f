#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace privleak::cpu {

// n samples of VMF(mu, kappa) on S^{p-1} into out (n x p, contiguous); mu (p,) is unit-norm. Sample
// s is a pure function of (key, offset + s) (common/vmf.h).
void vmf_sample(DType dtype, const void* mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset,
                void* out);

}  // namespace privleak::cpu
