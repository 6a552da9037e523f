#pragma once

#include <cstdint>
#include <vector>

#include "common/clip.h"
#include "common/noise.h"

namespace privleak::cpu {

// Fused DP-SGD clipping over per-sample gradients g_t[b] (dtype float32, bfloat16 or float16),
// T = tensors.size(), in the L2 or L1 norm, with C >= T columns of norm sums per sample:
//   sums[b * C + t] = |g_t[b]|_2^2 (L2) or |g_t[b]|_1 (L1) for t < T, in common/clip.h's order;
//                     columns T .. C - 1 are given (norm sums of tensors read elsewhere: book-
//                     keeping's ghost norms), and count in the clip factors like the others,
//   f[b * C + t]    = clip_factors(sums + b * C, clip_norms, C, per_layer, norm_type),
//   outs[t][j]      = scale * (sum_b f[b * C + t] g_t[b, j] + noise_std z_{offset + base_t + j}),
// with z the float Gaussian noise stream of `key` (privleak.mechanisms.gaussian_noise) over the
// concatenated tensors (base_t = elements of the tensors before t). Samples with factor 0 (a
// non-finite gradient) are skipped. clip_norms holds C values with per_layer, else 1. `factors`,
// if not null, receives f (B x C).
void clip_accumulate(NoiseDType dtype, const std::vector<PerSampleGrads>& tensors, const std::vector<float*>& outs,
                     int64_t batch, int64_t num_columns, const double* clip_norms, bool per_layer, ClipNorm norm_type,
                     double noise_std, uint64_t key, uint64_t offset, double scale, double* sums, float* factors);

// factors[b * T + t] = clip_factors(sums + b * T, clip_norms, T, per_layer, norm_type) for b <
// batch: the clip factors clip_accumulate forms, from norm sums computed elsewhere (book-keeping's
// ghost norms).
void clip_factors(const double* sums, const double* clip_norms, int64_t batch, int64_t num_tensors, bool per_layer,
                  ClipNorm norm_type, float* factors);

}  // namespace privleak::cpu
