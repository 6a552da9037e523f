#pragma once

#include <cstdint>
#include <vector>

#include "common/clip.h"
#include "common/noise.h"

namespace privleak::cuda {

// Scratch bytes per_sample_sum_of_squares needs (one double per chunk of every sample).
int64_t sum_of_squares_workspace_bytes(const std::vector<int64_t>& numels, int64_t batch);

// privleak::cpu::per_sample_sum_of_squares and clip_accumulate on device memory, on `stream` of
// `device`; the same bits.
void per_sample_sum_of_squares(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, int64_t batch,
                               double* out, void* workspace, int device, void* stream);
void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, const float* factors, double noise_std, uint64_t key, uint64_t offset,
                     double scale, int device, void* stream);

}  // namespace privleak::cuda
