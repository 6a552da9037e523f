// Per-sample gradient clipping for DP-SGD (Abadi et al., CCS 2016; Alg. 1 and 2 of Biswas et al.).
// Pass 1 computes every sample's squared norm per tensor, clip_factors turns them into clip
// factors f = min(1, c / norm), pass 2 forms (sum_b f_b g_b + std z) / L.
//
// Squared norms are summed in chunks of kClipChunk elements, each in kClipLanes interleaved float
// lanes combined in lane order in double, then the chunks in order in double: the result does not
// depend on SIMD width, thread count or backend.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>

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

// sums[r] = squared norm of rows[r][0, n), r < Rows. Rows read side by side keep more loads in
// flight than one row at a time; each row's sum is the same as on its own.
template <int Rows, class In>
PRIVLEAK_HOST_DEVICE void chunk_sums_of_squares(const In* const* rows, int64_t n, double* sums) {
  float lanes[Rows][kClipLanes] = {};
  int64_t j = 0;
  for (; j + kClipLanes <= n; j += kClipLanes) {
    for (int lane = 0; lane < kClipLanes; ++lane) {  // rows inside lanes: the loop GCC vectorises
      PRIVLEAK_UNROLL
      for (int r = 0; r < Rows; ++r) {
        const float v = Element<In>::load(rows[r][j + lane]);
        lanes[r][lane] += v * v;
      }
    }
  }
  for (int lane = 0; j < n; ++j, ++lane) {
    for (int r = 0; r < Rows; ++r) {
      const float v = Element<In>::load(rows[r][j]);
      lanes[r][lane] += v * v;
    }
  }
  for (int r = 0; r < Rows; ++r) {
    double sum = 0.0;
    for (int lane = 0; lane < kClipLanes; ++lane) sum += static_cast<double>(lanes[r][lane]);
    sums[r] = sum;
  }
}

// One sample's clip factors from its squared norms per tensor, s_0 .. s_{T-1}: flat clipping
// scales every tensor by min(1, c_0 / sqrt(sum_t s_t)), per-layer clipping tensor t by
// min(1, c_t / sqrt(s_t)). A sample with a non-finite squared norm gets 0 everywhere: it is
// dropped, so a NaN or inf gradient never reaches the sum.
PRIVLEAK_HOST_DEVICE void clip_factors(const double* squares, const double* clip_norms, int64_t num_tensors,
                                       bool per_layer, float* factors) {
  bool finite = true;
  double total = 0.0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    finite = finite && std::isfinite(squares[t]);
    total += squares[t];
  }
  for (int64_t t = 0; t < num_tensors; ++t) {
    const double norm = std::sqrt(per_layer ? squares[t] : total), c = clip_norms[per_layer ? t : 0];
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

}  // namespace privleak
