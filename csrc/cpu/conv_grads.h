#pragma once

#include "common/conv_grads.h"
#include "common/noise.h"
#include "cpu/platform.h"

namespace privleak::cpu {

// out (batch, outputs, channels, kernel_h, kernel_w), float32 (float64 for float64 inputs): each
// sample's convolution weight gradient for x and output gradients g (common/conv_grads.h), both
// contiguous and of `dtype`. `path` picks the hand-written SIMD kernel; every path gives the same
// bits.
void conv_weight_grads(NoiseDType dtype, const void* x, const void* g, const ConvGeometry& geometry, void* out,
                       CpuCapability path);

}  // namespace privleak::cpu
