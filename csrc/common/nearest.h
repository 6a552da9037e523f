// Sup-over-inputs reductions ("nearest input"): for each query y, the input x that maximises
// <x, y> (VMF), or minimises ||x - y||^2 (Gaussian) or ||x - y||_1 (Laplace). Shared by the CPU
// and CUDA kernels: this header is the scalar definition of what every kernel computes.
//
// What a kernel computes for the pair (query y, input x), p coordinates, in the input dtype T:
//
//   acc = 0;  for k = 0 .. p-1 in order:  acc = fma(y_k, x_k, acc)        inner product, squared L2
//                                         acc = acc + |y_k - x_k|        L1
//   score = -acc (inner product) | n_x - (acc + acc) (squared L2) | acc (L1)
//
// and the winner is the input of least score, the lowest index among equal scores. For squared
// L2 both points are first translated by the same centre c (x_k - c_k and y_k - c_k, rounded to
// T), and n_x = ||x - c||^2 is accumulated the same way; ||y - c||^2 is the same for every input
// and is left out. Every kernel (blocked CPU, SIMD CPU, tiled CUDA) performs exactly these
// operations for every pair, in this order, whatever its blocking, thread count or launch shape,
// so they all return the same winners. (The CUDA tensor-core path is the exception: it rounds
// to TF32 and may pick another input among near-ties; see cuda/nearest.h.)
//
// Cancellation. ||x - y||^2 = n_x + ||y - c||^2 - 2 <x - c, y - c> subtracts numbers of size
// ||x - c||^2 + ||y - c||^2, so the score carries an absolute error of about
// p eps (||x - c||^2 + ||y - c||^2) (eps = 2^-24 for float32): two inputs whose distances to y
// differ by less than that may come out in either order. Centring at the inputs' mean keeps the
// norms as small as the data allow (translating both points changes no distance). The value a
// kernel returns is not this score: it is the winner's <x, y>, ||x - y||^2 or ||x - y||_1
// recomputed directly from the data in float64 (nearest_exact_value), so it is accurate to
// float64 rounding, and at most the score's error above the true optimum.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "common/hostdevice.h"

namespace privleak {

enum class NearestMetric { inner_product, squared_l2, l1 };

// fma with one rounding on host and device. Host code calls the C library (or the FMA
// instruction, where the compiler targets it); the result is the same.
template <class T>
PRIVLEAK_HOST_DEVICE T fused_multiply_add(T a, T b, T c) {
#if defined(__CUDA_ARCH__)
  return ::fma(a, b, c);  // CUDA overloads fma for float and double
#else
  return std::fma(a, b, c);
#endif
}

template <class T>
PRIVLEAK_HOST_DEVICE T absolute(T v) {
#if defined(__CUDA_ARCH__)
  return ::fabs(v);
#else
  return std::abs(v);
#endif
}

// One step of the accumulation over coordinates (see the top of this file).
template <NearestMetric M, class T>
PRIVLEAK_HOST_DEVICE T nearest_accumulate(T acc, T query, T input) {
  if constexpr (M == NearestMetric::l1) {
    return acc + absolute(query - input);
  } else {
    return fused_multiply_add(query, input, acc);
  }
}

// The score the kernels minimise. `input_norm` is n_x = ||x - c||^2 (squared L2 only).
template <NearestMetric M, class T>
PRIVLEAK_HOST_DEVICE T nearest_score(T acc, T input_norm) {
  if constexpr (M == NearestMetric::inner_product) {
    return -acc;
  } else if constexpr (M == NearestMetric::squared_l2) {
    return input_norm - (acc + acc);
  } else {
    return acc;
  }
}

// Coordinate k as the kernels read it: minus the centre for squared L2 (`center` non-null).
template <class T>
PRIVLEAK_HOST_DEVICE T centred(T value, const T* center, int64_t k) {
  return center ? value - center[k] : value;
}

// n_x = ||x - c||^2, accumulated like the scores.
template <class T>
PRIVLEAK_HOST_DEVICE T centred_squared_norm(const T* x, const T* center, int64_t p) {
  T norm = T(0);
  for (int64_t k = 0; k < p; ++k) {
    const T t = centred(x[k], center, k);
    norm = fused_multiply_add(t, t, norm);
  }
  return norm;
}

// A candidate (score, index) beats the current best when its score is smaller, or equal with a
// smaller index: a total order, so any order of comparisons (CPU blocks in index order, CUDA
// warp shuffles) finds the same winner, the lowest index of least score. A NaN score never wins.
template <class T>
PRIVLEAK_HOST_DEVICE bool nearest_better(T score, int64_t index, T best_score, int64_t best_index) {
  return score < best_score || (score == best_score && index < best_index);
}

// The winner's value, recomputed from the data in float64 in coordinate order: <x, y>,
// ||x - y||^2 or ||x - y||_1. Products of float32 coordinates are exact in float64.
template <NearestMetric M, class T>
PRIVLEAK_HOST_DEVICE double nearest_exact_value(const T* query, const T* input, int64_t p) {
  double value = 0.0;
  for (int64_t k = 0; k < p; ++k) {
    const double y = static_cast<double>(query[k]), x = static_cast<double>(input[k]);
    if constexpr (M == NearestMetric::inner_product) {
      value += y * x;
    } else if constexpr (M == NearestMetric::squared_l2) {
      const double d = y - x;
      value += d * d;
    } else {
      value += absolute(y - x);
    }
  }
  return value;
}

// Calls f(std::integral_constant<NearestMetric, metric>{}).
template <class F>
decltype(auto) dispatch_metric(NearestMetric metric, F&& f) {
  switch (metric) {
    case NearestMetric::inner_product:
      return f(std::integral_constant<NearestMetric, NearestMetric::inner_product>{});
    case NearestMetric::squared_l2:
      return f(std::integral_constant<NearestMetric, NearestMetric::squared_l2>{});
    case NearestMetric::l1:
      return f(std::integral_constant<NearestMetric, NearestMetric::l1>{});
  }
  throw std::invalid_argument("unknown nearest metric");
}

}  // namespace privleak
