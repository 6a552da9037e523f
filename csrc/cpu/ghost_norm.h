#pragma once

#include <cstdint>

#include "common/ghost_norm.h"
#include "cpu/platform.h"

namespace privleak::cpu {

// out[b] = sum_{t,s} (a_t . a_s)(g_t . g_s) over sample b's positions t, s < length, for
// activations (batch, length, d) and output gradients (batch, length, p), both contiguous and of
// `dtype` (float32, float64, bfloat16 or float16), in common/ghost_norm.h's arithmetic. `path`
// picks the hand-written SIMD kernels (float64 always takes the portable one); every path gives
// the same bits.
void ghost_norm(NoiseDType dtype, const void* activations, const void* output_grads, int64_t batch, int64_t length,
                int64_t d, int64_t p, double* out, CpuCapability path);

// out[b] = sum_{t,s} (a_t . a_s)(g_t . g_s) for a convolution's input x (batch, channels, height,
// width) and output gradient (batch, outputs, out_height, out_width), contiguous, of `dtype`, a_t
// being output position t's patch of x (groups folded into the batch; a Conv1d has height 1), in
// common/ghost_norm.h's arithmetic for this form: from the pixel Gram, without forming patches.
// Same paths and bits rule as ghost_norm.
void conv_ghost_norm(NoiseDType dtype, const void* x, const void* output_grads, const ConvGeometry& geometry,
                     double* out, CpuCapability path);

// out[b] = sum_{t,s} [ids_t == ids_s] (g_t . g_s) for ids (batch, length) and output gradients
// (batch, length, p), contiguous, in common/ghost_norm.h's arithmetic.
void embedding_ghost_norm(NoiseDType dtype, const int64_t* ids, const void* output_grads, int64_t batch,
                          int64_t length, int64_t p, double* out);

}  // namespace privleak::cpu
