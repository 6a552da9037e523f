#pragma once

#include <cstdint>
#include <vector>

#include "common/clip.h"
#include "common/noise.h"

namespace privleak::cpu {

// out[b * T + t] = |g_t[b]|^2 for T = tensors.size() (common/clip.h). dtype: float32, bfloat16, float16.
void per_sample_sum_of_squares(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, int64_t batch,
                               double* out);

// outs[t][j] = scale * (sum_b factors[b * T + t] g_t[b, j] + noise_std z_{offset + base_t + j}), with z the
// float Gaussian noise stream of `key` (privleak.mechanisms.gaussian_noise) over the concatenated
// tensors (base_t = elements of the tensors before t), and samples with factor 0 skipped (dropped).
void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, const float* factors, double noise_std, uint64_t key, uint64_t offset,
                     double scale);

}  // namespace privleak::cpu
