// Per-sample gradient clipping for DP-SGD (Abadi et al., CCS 2016; Alg. 1 and 2 of Biswas et al.).
// Pass 1 computes every sample's norm sum per tensor (the sum of squares for the L2 norm, of
// absolute values for L1), clip_factors turns them into clip factors f = min(1, c / norm), pass 2
// forms (sum_b f_b g_b + std z) / L.
//
// Norm sums are summed in chunks of kClipChunk elements, each in kClipLanes interleaved float
// lanes combined in lane order in double, then the chunks in order in double: the result does not
// depend on SIMD width, thread count or backend.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/element.h"
#include "common/noise.h"
#include "common/hostdevice.h"

namespace privleak {

// One parameter's per-sample gradients: `batch` rows of `numel` contiguous elements.
struct PerSampleGrads {
  const void* grads;
  int64_t numel;
};

constexpr int64_t kClipChunk = 4096;
constexpr int kClipLanes = 16;

// The norm per-sample gradients are clipped in: L2 (DP-SGD with Gaussian noise) or L1 (Laplace
// noise). The value is the p of L_p, as Python passes it.
enum class ClipNorm : int { l1 = 1, l2 = 2 };

// sums[r] = norm sum of rows[r][0, n) (squares for L2, absolute values for L1), r < Rows. Rows
// read side by side keep more loads in flight than one row at a time; each row's sum is the same
// as on its own. The norm is a template parameter: each instantiation's inner loop is the plain
// one, without a branch.
template <ClipNorm Norm, int Rows, class In>
PRIVLEAK_HOST_DEVICE void chunk_norm_sums(const In* const* rows, int64_t n, double* sums) {
  float lanes[Rows][kClipLanes] = {};
  int64_t j = 0;
  for (; j + kClipLanes <= n; j += kClipLanes) {
    for (int lane = 0; lane < kClipLanes; ++lane) {  // rows inside lanes: the loop GCC vectorises
      PRIVLEAK_UNROLL
      for (int r = 0; r < Rows; ++r) {
        const float v = Element<In>::load(rows[r][j + lane]);
        if constexpr (Norm == ClipNorm::l2) lanes[r][lane] += v * v;
        else lanes[r][lane] += std::fabs(v);
      }
    }
  }
  for (int lane = 0; j < n; ++j, ++lane) {
    for (int r = 0; r < Rows; ++r) {
      const float v = Element<In>::load(rows[r][j]);
      if constexpr (Norm == ClipNorm::l2) lanes[r][lane] += v * v;
      else lanes[r][lane] += std::fabs(v);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    double sum = 0.0;
    for (int lane = 0; lane < kClipLanes; ++lane) sum += static_cast<double>(lanes[r][lane]);
    sums[r] = sum;
  }
}

// One sample's clip factors from its norm sums per tensor, s_0 .. s_{T-1} (squared norms for L2,
// L1 norms for L1): flat clipping scales every tensor by min(1, c_0 / |g|) with |g| =
// sqrt(sum_t s_t) (L2) or sum_t s_t (L1), per-layer clipping tensor t by min(1, c_t / |g_t|) with
// |g_t| = sqrt(s_t) or s_t. The sums add left to right in double. A sample with a non-finite sum
// gets 0 everywhere: it is dropped, so a NaN or inf gradient never reaches the sum.
PRIVLEAK_HOST_DEVICE void clip_factors(const double* sums, const double* clip_norms, int64_t num_tensors,
                                       bool per_layer, ClipNorm norm_type, float* factors) {
  bool finite = true;
  double total = 0.0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    finite = finite && std::isfinite(sums[t]);
    total += sums[t];
  }
  for (int64_t t = 0; t < num_tensors; ++t) {
    const double sum = per_layer ? sums[t] : total, c = clip_norms[per_layer ? t : 0];
    const double norm = norm_type == ClipNorm::l2 ? std::sqrt(sum) : sum;
    factors[t] = !finite ? 0.0f : norm > c ? static_cast<float>(c / norm) : 1.0f;
  }
}

PRIVLEAK_HOST_DEVICE int64_t clip_chunks(int64_t numel) { return (numel + kClipChunk - 1) / kClipChunk; }

// Calls f(In{}) with In the element type of the per-sample gradients.
template <class F>
void dispatch_grad_dtype(NoiseDType dtype, F&& f) {
  switch (dtype) {
    case NoiseDType::float32: return f(float{});
    case NoiseDType::bfloat16: return f(BFloat16{});
    case NoiseDType::float16: return f(Float16{});
    case NoiseDType::float64: break;
  }
  throw std::invalid_argument("per-sample gradients must be float32, bfloat16 or float16");
}

// clip_accumulate's shapes: at least one sample and one tensor, an output per tensor, and at least
// a column of norm sums per tensor.
inline void check_clip_accumulate(size_t tensors, size_t outs, int64_t batch, int64_t num_columns) {
  if (batch < 1 || tensors == 0 || outs != tensors || num_columns < static_cast<int64_t>(tensors))
    throw std::invalid_argument(
        "clip_accumulate: batch must be >= 1, with one output per tensor and at least one norm column per tensor");
}

// The ClipNorm of norm_type (1 or 2).
inline ClipNorm parse_clip_norm(int norm_type) {
  if (norm_type != 1 && norm_type != 2)
    throw std::invalid_argument("clip_accumulate: norm_type must be 1 or 2, got " + std::to_string(norm_type));
  return static_cast<ClipNorm>(norm_type);
}

// Calls f(std::integral_constant<ClipNorm, norm_type>{}).
template <class F>
void dispatch_clip_norm(ClipNorm norm_type, F&& f) {
  if (norm_type == ClipNorm::l1) return f(std::integral_constant<ClipNorm, ClipNorm::l1>{});
  return f(std::integral_constant<ClipNorm, ClipNorm::l2>{});
}

}  // namespace privleak
