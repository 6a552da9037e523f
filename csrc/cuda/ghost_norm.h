#pragma once

#include <cstdint>
#include <vector>

#include "common/ghost_norm.h"

namespace privleak::cuda {

// A dense layer's activations (B, length, d) and output gradients (B, length, p), on the device.
struct GhostLayer {
  NoiseDType dtype;
  const void* activations;
  const void* output_grads;
  int64_t length, d, p;
};

// Scratch bytes ghost_norm needs for layers of these lengths.
int64_t ghost_norm_workspace_bytes(int64_t batch, const std::vector<int64_t>& lengths);

// privleak::cpu::ghost_norm of each layer k into out[k batch ...] (device memory), on `stream` of
// `device`; the same bits. The layers share launches (cuda/ghost_norm.cu says how).
void ghost_norm(const std::vector<GhostLayer>& layers, int64_t batch, double* out, void* workspace, int device,
                void* stream);

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
