// Gaussian and Laplace noise as a pure function of (key, element index): element n of a draw is
// value n % k of Philox block n / k of its stream, k = 4 for float and 2 for double generation.
// Every CPU thread layout and every CUDA launch shape therefore gives the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/element.h"
#include "common/fp_math.h"
#include "common/hostdevice.h"
#include "common/philox.h"

namespace privleak {

enum class Distribution : uint32_t { gaussian = 1, laplace = 2 };

// Philox stream tags (counter word 2). Noise streams are (distribution << 1) | is_double; VMF's
// rejection step has its own tag, and its tangent coordinates use word 2 >= 2^31 (vmf.h).
constexpr uint32_t kVmfScalarStream = 18;  // Wood's rejection step, one sub-stream per sample

// The element types a noise kernel writes; half types are generated in float and rounded.
enum class NoiseDType { float32, float64, bfloat16, float16 };

template <class Gen>
constexpr int kValuesPerBlock = sizeof(Gen) == 4 ? 4 : 2;

// Float and double draws live in separate streams, as do the distributions.
template <class Gen>
PRIVLEAK_HOST_DEVICE uint32_t noise_stream(Distribution d) {
  return (static_cast<uint32_t>(d) << 1) | (sizeof(Gen) == 8 ? 1u : 0u);
}

// Uniform on (0, 1] from kBits random bits, the grid's midpoints (k + 1/2) 2^-kBits. Small values
// keep full relative precision, so the Gaussian tail reaches sqrt(2 ln 2^33) ~ 6.8 sigma rather
// than the 5.8 of a 24-bit uniform.
template <int kBits>
PRIVLEAK_HOST_DEVICE float uniform_open_zero(uint32_t bits) {
  constexpr float step = 1.0f / static_cast<float>(uint64_t(1) << kBits);  // a power of two: exact
  return static_cast<float>(bits) * step + step * 0.5f;
}

// Uniform on (0, 1) from 64 random bits (53 used): (k + 1/2) 2^-53 with k = (hi:lo) >> 11. k is
// assembled from two exact int32 -> double conversions (x86 before AVX-512 has no vector
// uint64 -> double), which gives the same double as converting k directly.
PRIVLEAK_HOST_DEVICE double exact_double(uint32_t v) {
  return static_cast<double>(static_cast<int32_t>(v ^ 0x80000000u)) + 2147483648.0;
}

PRIVLEAK_HOST_DEVICE double uniform_open_zero(uint32_t hi, uint32_t lo) {
  const double k = exact_double(hi) * 2097152.0 + exact_double(lo >> 11);  // hi * 2^21 + lo / 2^11
  return k * 1.1102230246251565e-16 + 5.551115123125783e-17;
}

// Box-Muller: r = sqrt(-2 log u1), (z0, z1) = r (cos 2 pi u2, sin 2 pi u2).
template <class T>
PRIVLEAK_HOST_DEVICE void box_muller(T u1, T u2, T& z0, T& z1) {
  const T r = std::sqrt(T(-2) * fp::log_positive(u1));
  T c, s;
  fp::cos_sin_two_pi(u2, c, s);
  z0 = r * c;
  z1 = r * s;
}

PRIVLEAK_HOST_DEVICE void gaussian_values(const Words4& r, float (&z)[4]) {
  box_muller(uniform_open_zero<32>(r.w[0]), uniform_open_zero<32>(r.w[1]), z[0], z[1]);
  box_muller(uniform_open_zero<32>(r.w[2]), uniform_open_zero<32>(r.w[3]), z[2], z[3]);
}

PRIVLEAK_HOST_DEVICE void gaussian_values(const Words4& r, double (&z)[2]) {
  box_muller(uniform_open_zero(r.w[0], r.w[1]), uniform_open_zero(r.w[2], r.w[3]), z[0], z[1]);
}

// Laplace(0, 1) as a random sign times an Exp(1) draw -log u; the sign takes one bit and is
// applied to the sign bit (a branch-free negation).
PRIVLEAK_HOST_DEVICE void laplace_values(const Words4& r, float (&z)[4]) {
  PRIVLEAK_UNROLL
  for (int i = 0; i < 4; ++i) {
    const float magnitude = -fp::log_positive(uniform_open_zero<31>(r.w[i] >> 1));
    z[i] = fp::bit_cast<float>(fp::bit_cast<uint32_t>(magnitude) ^ ((r.w[i] & 1u) << 31));
  }
}

PRIVLEAK_HOST_DEVICE void laplace_values(const Words4& r, double (&z)[2]) {
  PRIVLEAK_UNROLL
  for (int i = 0; i < 2; ++i) {
    const uint32_t hi = r.w[2 * i], lo = r.w[2 * i + 1];
    const double magnitude = -fp::log_positive(uniform_open_zero(hi, lo));
    // The sign is bit 0, one of the 11 the uniform drops; flipping the sign bit is exact negation.
    z[i] = fp::bit_cast<double>(fp::bit_cast<uint64_t>(magnitude) ^ (static_cast<uint64_t>(lo & 1u) << 63));
  }
}

// The k unit-scale values that one Philox block's words r give.
template <Distribution kDist, class Gen>
PRIVLEAK_HOST_DEVICE void values_of_words(const Words4& r, Gen (&z)[kValuesPerBlock<Gen>]) {
  if constexpr (kDist == Distribution::gaussian)
    gaussian_values(r, z);
  else
    laplace_values(r, z);
}

// The k unit-scale values of block `block` of `stream` (by default the distribution's own).
template <Distribution kDist, class Gen>
PRIVLEAK_HOST_DEVICE void noise_values(uint64_t key, uint64_t block, Gen (&z)[kValuesPerBlock<Gen>],
                                       uint32_t stream = noise_stream<Gen>(kDist)) {
  values_of_words<kDist, Gen>(philox_block(key, stream, block), z);
}

// out = noise, or out += noise in Gen arithmetic with one rounding to the output type.
template <class Out>
PRIVLEAK_HOST_DEVICE void set_or_add(Out& out, typename Element<Out>::Gen noise, bool add) {
  Element<Out>::store(out, add ? Element<Out>::load(out) + noise : noise);
}

// Fills elements [offset, offset + n) of block `block` that fall into the output `out` (whose
// element 0 is draw element `offset`).
template <Distribution kDist, class Out>
PRIVLEAK_HOST_DEVICE void apply_noise_block(uint64_t key, uint64_t offset, int64_t n,
                                            typename Element<Out>::Gen scale, bool add, uint64_t block,
                                            Out* out) {
  using Gen = typename Element<Out>::Gen;
  constexpr int k = kValuesPerBlock<Gen>;
  Gen z[k];
  noise_values<kDist, Gen>(key, block, z);
  for (int lane = 0; lane < k; ++lane) {
    const uint64_t element = block * k + lane;
    if (element < offset || element - offset >= static_cast<uint64_t>(n)) continue;
    set_or_add(out[element - offset], scale * z[lane], add);
  }
}

// Calls f(std::integral_constant<Distribution, d>{}).
template <class F>
decltype(auto) dispatch_distribution(Distribution d, F&& f) {
  if (d == Distribution::gaussian) return f(std::integral_constant<Distribution, Distribution::gaussian>{});
  return f(std::integral_constant<Distribution, Distribution::laplace>{});
}

PRIVLEAK_HOST_DEVICE uint64_t first_noise_block(uint64_t offset, int k) { return offset / k; }
PRIVLEAK_HOST_DEVICE uint64_t end_noise_block(uint64_t offset, int64_t n, int k) {
  return (offset + static_cast<uint64_t>(n) + k - 1) / k;
}

}  // namespace privleak
