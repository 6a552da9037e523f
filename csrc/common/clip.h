// Per-sample gradient clipping for DP-SGD (Abadi et al., CCS 2016; Alg. 1 and 2 of Biswas et al.).
// Pass 1 computes every sample's squared norm per tensor; the caller turns norms into clip
// factors f = min(1, c / norm); pass 2 forms (sum_b f_b g_b + std z) / L in one read.
//
// Squared norms are summed in chunks of kClipChunk elements, each in kClipLanes interleaved float
// lanes combined in lane order in double, then the chunks in order in double: the result does not
// depend on SIMD width, thread count or backend.
#pragma once

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

template <class In>
PRIVLEAK_HOST_DEVICE double chunk_sum_of_squares(const In* x, int64_t n) {
  float lanes[kClipLanes] = {};
  int64_t j = 0;
  for (; j + kClipLanes <= n; j += kClipLanes) {
    PRIVLEAK_UNROLL
    for (int lane = 0; lane < kClipLanes; ++lane) {
      const float v = Element<In>::load(x[j + lane]);
      lanes[lane] += v * v;
    }
  }
  for (int lane = 0; j < n; ++j, ++lane) {
    const float v = Element<In>::load(x[j]);
    lanes[lane] += v * v;
  }
  double sum = 0.0;
  for (int lane = 0; lane < kClipLanes; ++lane) sum += static_cast<double>(lanes[lane]);
  return sum;
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
