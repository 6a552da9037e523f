#pragma once

#include "common/conv_grads.h"
#include "common/noise.h"

namespace privleak::cuda {

// privleak::cpu::conv_weight_grads on device memory (out included), on `stream` of `device`; the
// same bits.
void conv_weight_grads(NoiseDType dtype, const void* x, const void* g, const ConvGeometry& geometry, void* out,
                       int device, void* stream);

}  // namespace privleak::cuda
