#pragma once

#include <cstdint>

#include "common/ghost_norm.h"

namespace privleak::cuda {

// Scratch bytes ghost_norm needs: a double per (sample, position).
int64_t ghost_norm_workspace_bytes(int64_t batch, int64_t length);

// privleak::cpu::ghost_norm on device memory (out included), on `stream` of `device`; the same bits.
void ghost_norm(NoiseDType dtype, const void* activations, const void* output_grads, int64_t batch, int64_t length,
                int64_t d, int64_t p, double* out, void* workspace, int device, void* stream);

// Scratch bytes conv_ghost_norm needs: per sample its pixel Gram and a double per position.
int64_t conv_ghost_norm_workspace_bytes(int64_t batch, int64_t pixels, int64_t length);

// privleak::cpu::conv_ghost_norm on device memory; the same bits.
void conv_ghost_norm(NoiseDType dtype, const void* x, const void* output_grads, const ConvGeometry& geometry,
                     double* out, void* workspace, int device, void* stream);

// Scratch bytes embedding_ghost_norm needs: per (sample, position) a double, a link and a flag.
int64_t embedding_ghost_norm_workspace_bytes(int64_t batch, int64_t length);

// privleak::cpu::embedding_ghost_norm on device memory; the same bits.
void embedding_ghost_norm(NoiseDType dtype, const int64_t* ids, const void* output_grads, int64_t batch,
                          int64_t length, int64_t p, double* out, void* workspace, int device, void* stream);

}  // namespace privleak::cuda
