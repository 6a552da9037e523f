// Von Mises-Fisher sampling on S^{p-1} (Wood, "Simulation of the von Mises Fisher distribution",
// Commun. Statist. Simul. 1994), written so that it stays exact for p up to 10^7 and kappa from
// 1e-6 to 1e9, returns for every finite kappa > 0 (the sample tends to mu), and is deterministic:
// only IEEE operations and privleak's own log (fp_math.h), so CPU and CUDA give the same bits.
//
// A sample is y = w mu + sqrt(1 - w^2) v, with w = mu.y from Wood's rejection step and v uniform
// on the unit sphere orthogonal to mu. v comes from p - 1 Gaussians mapped by the Householder
// reflection H = I - 2 u u^T / u^T u, u = e1 - s mu, which sends e1 to s mu; s = +1 if mu_0 <= 0
// and -1 otherwise, so that u^T u = 2 (1 - s mu_0) >= 2 never cancels. H applied to
// y' = (s w, t z), z the Gaussians, t = sqrt(1 - w^2) / |z|, gives coordinate by coordinate
//   y_0 = w mu_0 + s t D,   y_i = t z_i + beta s mu_i (i >= 1),
//   D = sum_{i>=1} mu_i z_i,   beta = s w - s t D / (1 - s mu_0).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/fp_math.h"
#include "common/hostdevice.h"
#include "common/noise.h"
#include "common/philox.h"

namespace privleak {

// Tangent coordinates are reduced in chunks of this many, in order, then the chunks in order.
constexpr int64_t kVmfChunk = 256;

PRIVLEAK_HOST_DEVICE int64_t vmf_num_chunks(int64_t p) { return (p - 1 + kVmfChunk - 1) / kVmfChunk; }

// VMF's counter space. Sample s of a draw at offset o is global sample S = o + s; a draw needs
// o + n <= 2^63 (so S < 2^63) and p - 1 <= 2^31 tangent coordinates. Sample S reads exactly
//   - tangent: Philox counters (block lo, block hi, 2^31 | floor(S / 2^32), 0) with
//     block = (S mod 2^32) 2^30 + j, j < ceil((p - 1) / k) <= 2^30; coordinate i is value i % k
//     of block j = i / k (k = 4 for float, 2 for double generation; float32 and float64 samples of
//     one S read the same counters: they are one draw at two precisions, not two draws);
//   - Wood's rejection step: counters (r, S mod 2^32, kVmfScalarStream, floor(S / 2^32)) for
//     r = 0, 1, ..., 2^32 - 1 in order (2^34 words; one round of the loop takes about 16).
// Every other privleak Philox stream has word 2 < 32 and word 3 = 0, so no two (key, S) share a
// counter with each other or with any other draw. Should a rejection loop use up its 2^32
// blocks (with an acceptance rate above 1/2 per round that has probability below 2^-(2^29)),
// the sample comes out NaN and the CPU raises instead of reusing counters.
constexpr uint64_t kVmfSampleLimit = uint64_t(1) << 63;  // S < 2^63
constexpr int64_t kVmfMaxTangent = int64_t(1) << 31;     // p - 1 <= 2^31
constexpr uint32_t kVmfTangentMark = 0x80000000u;
constexpr int kVmfTangentBlockBits = 30;
constexpr uint64_t kVmfScalarBlocks = uint64_t(1) << 32;

PRIVLEAK_HOST_DEVICE uint32_t vmf_tangent_stream(uint64_t sample) {
  return kVmfTangentMark | static_cast<uint32_t>(sample >> 32);
}
// The element index (block k + lane) of tangent coordinate 0 of `sample`, k values per block.
PRIVLEAK_HOST_DEVICE uint64_t vmf_tangent_first_element(uint64_t sample, int k) {
  return ((sample & 0xFFFFFFFFull) << kVmfTangentBlockBits) * static_cast<uint64_t>(k);
}

PRIVLEAK_HOST_DEVICE double vmf_nan() { return fp::bit_cast<double>(uint64_t(0x7FF8000000000000ull)); }

// Fresh random words for one sample's rejection loops (the scalar counters above).
struct SampleWords {
  uint64_t key;
  uint64_t sample;
  uint64_t next_block = 0;
  int used = 4;
  bool exhausted = false;
  Words4 words{};

  PRIVLEAK_HOST_DEVICE uint32_t next() {
    if (used == 4) {
      if (next_block == kVmfScalarBlocks) {  // out of counters: the caller returns NaN
        exhausted = true;
        next_block = 0;
      }
      const Words4 counter{{static_cast<uint32_t>(next_block), static_cast<uint32_t>(sample), kVmfScalarStream,
                            static_cast<uint32_t>(sample >> 32)}};
      words = philox4x32_10(counter, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
      ++next_block;
      used = 0;
    }
    return words.w[used++];
  }
  PRIVLEAK_HOST_DEVICE double uniform() {
    const uint32_t hi = next();
    return uniform_open_zero(hi, next());
  }
  PRIVLEAK_HOST_DEVICE double normal() {
    double z0, z1;
    const double u1 = uniform();
    box_muller(u1, uniform(), z0, z1);
    return z0;
  }
};

// Marsaglia and Tsang's Gamma(a) sampler, a >= 1 (ACM TOMS 2000), returning the draw as
// d (1 + t)^3 with d = a - 1/3: the caller gets t, whose differences stay exact when a is huge.
// The acceptance test log u < x^2/2 + d (1 - v + log v), v = (1 + t)^3, t = c x, is evaluated as
// d (3 log1p(t) - t (3 + 3t + t^2)), free of the cancellation of 1 - v + log v.
PRIVLEAK_HOST_DEVICE double gamma_t(double d, SampleWords& words) {
  const double c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    if (words.exhausted) return vmf_nan();
    const double x = words.normal();
    const double t = c * x;
    if (t <= -1.0) continue;
    const double log_u = fp::log_positive(words.uniform());
    if (log_u < 0.5 * x * x + d * (3.0 * fp::log1p_accurate(t) - t * (3.0 + 3.0 * t + t * t))) return t;
  }
}

struct VmfW {
  double w;            // mu . y
  double one_minus_w;  // 1 - w, exact where w is close to 1
};

// Z ~ Beta(a, a) as (z, 1 - 2z). For a >= 1 from two Gamma(a) draws d (1 + t)^3, with the
// difference of the draws expanded so that 1 - 2z stays exact when a is huge. a = 1/2 (p = 2) is
// the arcsine law: z = sin^2(pi U / 2), 1 - 2z = cos(pi U).
PRIVLEAK_HOST_DEVICE void symmetric_beta(double a, SampleWords& words, double& z, double& one_minus_2z) {
  if (a < 1.0) {
    double cos_pi_u, sin_pi_u;
    fp::cos_sin_two_pi(0.5 * words.uniform(), cos_pi_u, sin_pi_u);
    z = 0.5 * (1.0 - cos_pi_u);
    one_minus_2z = cos_pi_u;
    return;
  }
  const double d = a - 1.0 / 3.0;
  const double t1 = gamma_t(d, words), t2 = gamma_t(d, words);
  const double g1 = (1.0 + t1) * (1.0 + t1) * (1.0 + t1), g2 = (1.0 + t2) * (1.0 + t2) * (1.0 + t2);
  const double sum = g1 + g2;
  z = g1 / sum;
  one_minus_2z = (t2 - t1) * (3.0 + 3.0 * (t1 + t2) + t1 * t1 + t1 * t2 + t2 * t2) / sum;  // (g2 - g1) / sum
}

// Wood's rejection step for w with m1 = p - 1 and concentration kappa, in forms that never
// subtract nearly equal numbers and never overflow (kappa up to the largest double):
//   b = m1 / (2 kappa + sqrt(4 kappa^2 + m1^2)),  x0 = (1 - b) / (1 + b),  Z ~ Beta(m1/2, m1/2),
//   w = (1 - (1 + b) Z) / den, den = 1 - (1 - b) Z,  1 - w = 2 b Z / den,
//   w - x0 = 2 b (1 - 2Z) / ((1 + b) den),  1 - x0^2 = 4b / (1 + b)^2,
//   accept when log U <= kappa (w - x0) + m1 log1p(-x0 (w - x0) / (1 - x0^2))
//                      = 2 kappa b (1 - 2Z) / ((1 + b) den) + m1 log1p(-(1 - b) (1 - 2Z) / (2 den)),
// which is Wood's test kappa w + m1 log(1 - x0 w) - c >= log U with c = kappa x0 + m1 log(1 - x0^2).
// b, 1 - b and 2 kappa b come from r = m1 / (2 kappa) when 2 kappa >= m1 (b = r / (1 + sqrt(1 + r^2)),
// 2 kappa b = m1 / (1 + sqrt(1 + r^2))) and from q = 2 kappa / m1 otherwise (b = 1 / (q + sqrt(1 + q^2)),
// 1 - b = (q + q^2 / (1 + sqrt(1 + q^2))) b, 2 kappa b = 2 kappa b): no square overflows, and the
// test's two terms stay O(m1) however large kappa is. (Forming 4 kappa^2 overflowed above
// kappa ~ 1.3e154, made the test NaN and the loop endless.) As kappa -> inf, b ~ m1 / (4 kappa) -> 0
// and w -> 1: the sample tends to mu, and is mu to working precision long before b underflows.
struct WoodConstants {
  double b, one_minus_b, two_kappa_b;

  PRIVLEAK_HOST_DEVICE static WoodConstants make(double m1, double kappa) {
    if (kappa >= 0.5 * m1) {
      const double r = (0.5 * m1) / kappa;
      const double root = 1.0 + std::sqrt(1.0 + r * r);
      return {r / root, (root - r) / root, m1 / root};
    }
    const double q = (2.0 * kappa) / m1;
    const double s = std::sqrt(1.0 + q * q);
    const double b = 1.0 / (q + s);
    return {b, (q + q * q / (1.0 + s)) * b, 2.0 * kappa * b};
  }
};

PRIVLEAK_HOST_DEVICE VmfW vmf_w(int64_t p, double kappa, uint64_t key, uint64_t sample) {
  SampleWords words{key, sample};
  const double m1 = static_cast<double>(p - 1);
  const WoodConstants c = WoodConstants::make(m1, kappa);
  for (;;) {
    double z, one_minus_2z;
    symmetric_beta(0.5 * m1, words, z, one_minus_2z);
    const double den = 1.0 - c.one_minus_b * z;
    const double w = (1.0 - (1.0 + c.b) * z) / den;
    const double one_minus_w = 2.0 * c.b * z / den;
    const double log_ratio = c.two_kappa_b * one_minus_2z / ((1.0 + c.b) * den) +
                             m1 * fp::log1p_accurate(-c.one_minus_b * one_minus_2z / (2.0 * den));
    const double u = words.uniform();
    if (words.exhausted) return {vmf_nan(), vmf_nan()};
    if (fp::log_positive(u) <= log_ratio) return {w, one_minus_w};
  }
}

// The per-sample constants of the Householder map (see the top of this file).
struct VmfFrame {
  double w, s, t, beta;

  PRIVLEAK_HOST_DEVICE static VmfFrame make(VmfW w, double mu0, double norm_sq, double dot) {
    const double s = mu0 <= 0.0 ? 1.0 : -1.0;
    const double t = std::sqrt(w.one_minus_w * (2.0 - w.one_minus_w)) / std::sqrt(norm_sq);  // sqrt(1 - w^2) / |z|
    return {w.w, s, t, s * w.w - s * t * dot / (1.0 - s * mu0)};
  }
  PRIVLEAK_HOST_DEVICE double first(double mu0, double dot) const { return w * mu0 + s * t * dot; }
  PRIVLEAK_HOST_DEVICE double other(double z, double mu) const { return t * z + beta * s * mu; }
};

}  // namespace privleak
