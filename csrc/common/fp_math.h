// Elementary functions built from correctly rounded IEEE operations only (+, -, *, /, sqrt,
// exact scalings), evaluated in a fixed order. Compiled without FMA contraction (see
// CMakeLists.txt), they give the same bits on every CPU and GPU, which libm and CUDA's
// transcendentals do not. Accuracy: a few ulp, ample for noise.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/hostdevice.h"

namespace privleak::fp {

template <class To, class From>
PRIVLEAK_HOST_DEVICE To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

template <class T> struct Traits;
template <> struct Traits<float> {
  using Bits = uint32_t;
  static constexpr int kMantissaBits = 23;
  static constexpr int kExponentBias = 127;
  // Series lengths: the first omitted term is below half an ulp on the reduced ranges below.
  static constexpr int kLogTerms = 5;
  static constexpr int kSinTerms = 5;
  static constexpr Bits kSqrt2Mantissa = 0x3504F3u;  // mantissa field of float(sqrt 2)
};
template <> struct Traits<double> {
  using Bits = uint64_t;
  static constexpr int kMantissaBits = 52;
  static constexpr int kExponentBias = 1023;
  static constexpr int kLogTerms = 11;
  static constexpr int kSinTerms = 10;
  static constexpr Bits kSqrt2Mantissa = 0x6A09E667F3BCDull;  // mantissa field of double(sqrt 2)
};

// ln 2 split so that e * kLn2Hi is exact for |e| < 2^11: log's result keeps full precision.
constexpr double kLn2Hi = 6.93147180369123816490e-01;
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kHalfPi = 1.57079632679489661923;

// Natural log of a positive normal number: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), then
// log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716, by its Taylor series in s^2.
template <class T>
PRIVLEAK_HOST_DEVICE T log_positive(T x) {
  using Bits = typename Traits<T>::Bits;
  constexpr int kShift = Traits<T>::kMantissaBits;
  const Bits bits = bit_cast<Bits>(x);
  const Bits mantissa = bits & ((Bits(1) << kShift) - 1);
  // m > sqrt 2 is decided on the mantissa bits and m halved through its exponent field: integer
  // selects, where a conditional floating-point product would be a branch the compiler may not
  // speculate, and loops over this function would not vectorise.
  const bool above_sqrt2 = mantissa > Traits<T>::kSqrt2Mantissa;
  const int exponent = static_cast<int>(bits >> kShift) - Traits<T>::kExponentBias + (above_sqrt2 ? 1 : 0);
  const Bits m_exponent = static_cast<Bits>(Traits<T>::kExponentBias - (above_sqrt2 ? 1 : 0));
  const T m = bit_cast<T>(static_cast<Bits>(mantissa | (m_exponent << kShift)));
  const T s = (m - T(1)) / (m + T(1));
  const T s2 = s * s;
  T series = T(1) / T(2 * Traits<T>::kLogTerms - 1);
  PRIVLEAK_UNROLL
  for (int k = Traits<T>::kLogTerms - 2; k >= 0; --k) series = T(1) / T(2 * k + 1) + s2 * series;
  const T e = static_cast<T>(exponent);
  return e * T(kLn2Hi) + (T(2) * s * series + e * T(kLn2Lo));
}

// log(1 + x) for x > -1, accurate for small x: with u = 1 + x rounded, log(u) * x / (u - 1)
// cancels the rounding of u (Goldberg, "What every computer scientist should know about
// floating-point arithmetic", 1991, Thm. 4).
template <class T>
PRIVLEAK_HOST_DEVICE T log1p_accurate(T x) {
  const T u = T(1) + x;
  const T du = u - T(1);
  return du == T(0) ? x : log_positive(u) * (x / du);
}

// Taylor coefficients (-1)^k / (2k+1)! and (-1)^k / (2k)!, as double literals; float rounds them
// once. privleak/reference.py holds the same literals. (Functions, not arrays: CUDA device code
// cannot read namespace-scope arrays; unrolled loops fold these calls into constants.)
PRIVLEAK_HOST_DEVICE constexpr double sin_coefficient(int k) {
  constexpr double c[10] = {1.0, -0.16666666666666666, 0.008333333333333333, -0.0001984126984126984,
                            2.7557319223985893e-06, -2.505210838544172e-08, 1.6059043836821613e-10,
                            -7.647163731819816e-13, 2.8114572543455206e-15, -8.22063524662433e-18};
  return c[k];
}
PRIVLEAK_HOST_DEVICE constexpr double cos_coefficient(int k) {
  constexpr double c[10] = {1.0, -0.5, 0.041666666666666664, -0.001388888888888889,
                            2.48015873015873e-05, -2.755731922398589e-07, 2.08767569878681e-09,
                            -1.1470745597729725e-11, 4.779477332387385e-14, -1.5619206968586225e-16};
  return c[k];
}

// cos(2 pi u) and sin(2 pi u) for u in [0, 1]. The reduction u*4 = q + r, |r| <= 1/2, is exact,
// so the series only ever sees |angle| <= pi/4.
template <class T>
PRIVLEAK_HOST_DEVICE void cos_sin_two_pi(T u, T& cos_out, T& sin_out) {
  const T quarter_turns = u * T(4);
  const T q = static_cast<T>(static_cast<int>(quarter_turns + T(0.5)));
  const T a = (quarter_turns - q) * T(kHalfPi);
  const T a2 = a * a;
  constexpr int n = Traits<T>::kSinTerms;
  // sin a = a sum_k s_k a^2k and cos a = sum_k c_k a^2k, by Horner from the last term.
  T sin_series = static_cast<T>(sin_coefficient(n - 1)), cos_series = static_cast<T>(cos_coefficient(n - 1));
  PRIVLEAK_UNROLL
  for (int k = n - 2; k >= 0; --k) {
    sin_series = static_cast<T>(sin_coefficient(k)) + a2 * sin_series;
    cos_series = static_cast<T>(cos_coefficient(k)) + a2 * cos_series;
  }
  const T s = a * sin_series, c = cos_series;
  // Quadrant k rotates (c, s) by k quarter turns: (c, s), (-s, c), (-c, -s), (s, -c).
  const int k = static_cast<int>(q) & 3;
  const T x = (k & 1) ? s : c, y = (k & 1) ? c : s;
  cos_out = x * (((k == 1) | (k == 2)) ? T(-1) : T(1));
  sin_out = y * ((k >= 2) ? T(-1) : T(1));
}

// Round-to-nearest-even float -> bfloat16 / float16 bit patterns, as a hardware conversion gives
// them: overflow gives inf, and NaN a quiet NaN (rounding its bits could carry into inf).
PRIVLEAK_HOST_DEVICE uint16_t float_to_bfloat16_bits(float x) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? (bits >> 16) | 0x40u : rounded);
}

PRIVLEAK_HOST_DEVICE float bfloat16_bits_to_float(uint16_t h) {
  return bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// c ? a : b as bit masks. The float16 conversions compute every case and pick one with this: with
// a ternary GCC moves the float arithmetic of one case under a branch (it may trap, in GCC's default
// model) and then cannot vectorise the loops that convert whole gradients or noise buffers. That
// made fp16 clipping 11x slower than bf16.
PRIVLEAK_HOST_DEVICE uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

PRIVLEAK_HOST_DEVICE uint16_t float_to_float16_bits(float x) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  // Below 2^-14 the result is subnormal, in units of 2^-24: adding 0.5 makes the float addition
  // round to them (RNE), and the units land in the low mantissa bits of 0.5 + k 2^-24.
  const uint32_t subnormal = bit_cast<uint32_t>(bit_cast<float>(magnitude) + 0.5f) - 0x3F000000u;
  const uint32_t normal = (magnitude - 0x38000000u + 0xFFFu + ((magnitude >> 13) & 1u)) >> 13;
  // From 65520 up, RNE gives inf; NaN stays a (quiet) NaN.
  const uint32_t beyond = magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u;
  const uint32_t large = magnitude >= 0x477FF000u ? beyond : normal;
  return static_cast<uint16_t>(sign | select_bits(magnitude < 0x38800000u, subnormal, large));
}

PRIVLEAK_HOST_DEVICE float float16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  const float subnormal = static_cast<float>(static_cast<int32_t>(mantissa)) * 5.9604644775390625e-8f;  // m 2^-24
  const uint32_t special = 0x7F800000u | (mantissa << 13);  // inf and NaN
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  return bit_cast<float>(sign | select_bits(exponent == 0, bit_cast<uint32_t>(subnormal), exponent == 31 ? special : normal));
}

}  // namespace privleak::fp
