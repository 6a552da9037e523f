// Secure-mode noise: exact discrete Laplace and discrete Gaussian samples on a power-of-two grid,
// from ChaCha20 keyed with operating-system entropy.
//
// Why: floating-point samplers (Box-Muller, -log u) produce a "porous" set of outputs whose low
// bits reveal the input (Mironov, "On significance of the least significant bits for
// differential privacy", CCS 2012; Jin et al., "Are we there yet? Timing and floating-point
// attacks on differential privacy systems", S&P 2022). The defence here is the discretisation
// of Canonne, Kamath and Steinke ("The discrete Gaussian for differential privacy", NeurIPS
// 2020): the input is rounded to the grid g Z (g = 2^k), integer noise Y is drawn exactly from
// the discrete Laplace / discrete Gaussian (their Algorithms 1-3, with exact rational
// arithmetic), and x' + Y is formed exactly in integers. Converting that integer to floating
// point is post-processing, so the guarantees of the discrete mechanisms hold for what is
// released: eps = Delta / (g t)-DP for the discrete Laplace with scale t (Ghosh et al. 2009), and
// rho = Delta^2 / (2 g^2 sigma^2)-zCDP for the discrete Gaussian (CKS20, Thm. 4), with Delta the
// sensitivity on the grid: rounding moves each of n values by less than g / 2, so it is at most the
// true L2 sensitivity plus g sqrt(n) (L1: plus g n); mechanisms.secure_scale raises the scale to
// cover that.
//
// Each element has its own ChaCha20 stream (nonce = element index and distribution), so
// rejection loops of any length keep elements independent and CPU and CUDA equal, bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/chacha20.h"
#include "common/hostdevice.h"

namespace privleak {

using uint128 = unsigned __int128;

struct ChaChaKey {
  uint32_t w[8];
};

PRIVLEAK_HOST_DEVICE int leading_zeros(uint64_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return __builtin_clzll(v);
#endif
}

PRIVLEAK_HOST_DEVICE int bit_length(uint128 v) {
  const uint64_t hi = static_cast<uint64_t>(v >> 64), lo = static_cast<uint64_t>(v);
  if (hi != 0) return 128 - leading_zeros(hi);
  return lo != 0 ? 64 - leading_zeros(lo) : 0;
}

// The random words of one element.
class SecureWords {
 public:
  PRIVLEAK_HOST_DEVICE SecureWords(const ChaChaKey& key, uint64_t element, uint32_t stream)
      : key_(key), nonce_{static_cast<uint32_t>(element), static_cast<uint32_t>(element >> 32), stream} {}

  PRIVLEAK_HOST_DEVICE uint32_t next() {
    if (used_ == 16) {
      words_ = chacha20_block(key_.w, block_++, nonce_);
      used_ = 0;
    }
    return words_.w[used_++];
  }

  // Uniform on {0, ..., m - 1}, m >= 1: draw as many bits as m - 1 has, reject values >= m.
  PRIVLEAK_HOST_DEVICE uint128 below(uint128 m) {
    const int bits = bit_length(m - 1);
    for (;;) {
      uint128 v = 0;
      for (int have = 0; have < bits; have += 32) v = (v << 32) | next();
      if (bits < 128) v &= (uint128(1) << bits) - 1;
      if (v < m) return v;
    }
  }

  PRIVLEAK_HOST_DEVICE bool bernoulli(uint128 num, uint128 den) { return below(den) < num; }

  // Bernoulli(exp(-num/den)) exactly (CKS20 Algorithm 1): exp(-1) floor(gamma) times, then the
  // gamma in [0, 1] case by counting successive Bernoulli(gamma / K) successes.
  PRIVLEAK_HOST_DEVICE bool bernoulli_exp_minus(uint128 num, uint128 den) {
    while (num > den) {
      if (!bernoulli_exp_minus_at_most_one(1, 1)) return false;
      num -= den;
    }
    return bernoulli_exp_minus_at_most_one(num, den);
  }

 private:
  PRIVLEAK_HOST_DEVICE bool bernoulli_exp_minus_at_most_one(uint128 num, uint128 den) {
    uint64_t k = 1;
    while (bernoulli(num, den * k)) ++k;
    return (k & 1) != 0;
  }

  ChaChaKey key_;
  uint32_t nonce_[3];
  uint32_t block_ = 0;
  int used_ = 16;
  Words16 words_{};
};

// |Y| beyond this is rejected so that the integer arithmetic below cannot overflow; the
// probability of reaching it is below exp(-2^19) for the scales privleak uses (t <= 2^22).
constexpr int64_t kMaxDiscreteMagnitude = int64_t(1) << 40;

// Discrete Laplace: P(Y = y) proportional to exp(-|y| / t), t >= 1 (CKS20 Algorithm 2).
PRIVLEAK_HOST_DEVICE int64_t discrete_laplace(uint64_t t, SecureWords& words) {
  for (;;) {
    const uint64_t u = static_cast<uint64_t>(words.below(t));
    if (!words.bernoulli_exp_minus(u, t)) continue;
    uint64_t v = 0;
    while (words.bernoulli_exp_minus(1, 1)) ++v;
    const uint64_t magnitude = u + t * v;
    const bool negative = (words.next() & 1u) != 0;
    if (negative && magnitude == 0) continue;
    if (magnitude >= static_cast<uint64_t>(kMaxDiscreteMagnitude)) continue;
    return negative ? -static_cast<int64_t>(magnitude) : static_cast<int64_t>(magnitude);
  }
}

PRIVLEAK_HOST_DEVICE uint64_t isqrt(uint64_t n) {
  uint64_t r = 0;
  for (uint64_t bit = uint64_t(1) << 62; bit != 0; bit >>= 2) {
    if (n >= r + bit) {
      n -= r + bit;
      r = (r >> 1) + bit;
    } else {
      r >>= 1;
    }
  }
  return r;
}

// Discrete Gaussian: P(Y = y) proportional to exp(-y^2 / (2 sigma2)), sigma2 an integer >= 1
// (CKS20 Algorithm 3): discrete Laplace proposals with t = floor(sigma) + 1, accepted with
// probability exp(-(|Y| - sigma2/t)^2 / (2 sigma2)) = exp(-(|Y| t - sigma2)^2 / (2 sigma2 t^2)).
PRIVLEAK_HOST_DEVICE int64_t discrete_gaussian(uint64_t sigma2, SecureWords& words) {
  const uint64_t t = isqrt(sigma2) + 1;
  for (;;) {
    const int64_t y = discrete_laplace(t, words);
    const uint64_t magnitude = static_cast<uint64_t>(y < 0 ? -y : y);
    const uint128 scaled = uint128(magnitude) * t;
    const uint128 diff = scaled > sigma2 ? scaled - sigma2 : sigma2 - scaled;
    if (words.bernoulli_exp_minus(diff * diff, uint128(2) * sigma2 * t * t)) return y;
  }
}

// 2^k as a double, exactly (|k| < 1000).
PRIVLEAK_HOST_DEVICE double power_of_two(int k) {
  uint64_t bits = static_cast<uint64_t>(1023 + k) << 52;
  double v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

// One released element, in grid units g = 2^grid_exponent: round(x / g) (ties up; 0 for a fresh
// draw) plus Y, where Y is discrete Gaussian with variance parameter `scale` = sigma^2 / g^2 or
// discrete Laplace with scale `scale` = b / g. The caller has checked |x| / g < 2^61.
template <bool kGaussian>
PRIVLEAK_HOST_DEVICE double secure_noisy_value(double x, uint64_t scale, int grid_exponent, const ChaChaKey& key,
                                               uint64_t element) {
  SecureWords words(key, element, kGaussian ? 1u : 2u);
  const int64_t base = static_cast<int64_t>(floor(x * power_of_two(-grid_exponent) + 0.5));
  const int64_t y = kGaussian ? discrete_gaussian(scale, words) : discrete_laplace(scale, words);
  return static_cast<double>(base + y) * power_of_two(grid_exponent);  // the one rounding: post-processing
}

}  // namespace privleak
