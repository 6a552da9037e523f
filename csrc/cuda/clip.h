#pragma once

#include <cstdint>
#include <vector>

#include "common/clip.h"
#include "common/noise.h"

namespace privleak::cuda {

// Scratch bytes clip_accumulate needs: a double per chunk of every sample, a float per factor.
int64_t clip_workspace_bytes(const std::vector<int64_t>& numels, int64_t batch, int64_t num_columns);

// privleak::cpu::clip_accumulate on device memory (clip_norms and sums included), on `stream`
// of `device`; the same bits.
void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, int64_t num_columns, const double* clip_norms, bool per_layer, ClipNorm norm_type,
                     double noise_std, uint64_t key, uint64_t offset, double scale, double* sums, float* factors,
                     void* workspace, int device, void* stream);

// privleak::cpu::clip_factors on device memory, on `stream` of `device`; the same bits.
void clip_factors(const double* sums, const double* clip_norms, int64_t batch, int64_t num_tensors, bool per_layer,
                  ClipNorm norm_type, float* factors, int device, void* stream);

}  // namespace privleak::cuda
