// Element types of the kernels' inputs and outputs, and how kernels read and write them.
#pragma once

#include <cstdint>

#include "common/fp_math.h"
#include "common/hostdevice.h"

namespace privleak {

struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };

// How kernels read and write an output element: in its generation type Gen (float for the half
// types, which are rounded to nearest even on the way out).
template <class Out> struct Element;
template <> struct Element<float> {
  using Gen = float;
  PRIVLEAK_HOST_DEVICE static float load(float v) { return v; }
  PRIVLEAK_HOST_DEVICE static void store(float& out, float v) { out = v; }
};
template <> struct Element<double> {
  using Gen = double;
  PRIVLEAK_HOST_DEVICE static double load(double v) { return v; }
  PRIVLEAK_HOST_DEVICE static void store(double& out, double v) { out = v; }
};
template <> struct Element<BFloat16> {
  using Gen = float;
  PRIVLEAK_HOST_DEVICE static float load(BFloat16 v) { return fp::bfloat16_bits_to_float(v.bits); }
  PRIVLEAK_HOST_DEVICE static void store(BFloat16& out, float v) { out.bits = fp::float_to_bfloat16_bits(v); }
};
template <> struct Element<Float16> {
  using Gen = float;
  PRIVLEAK_HOST_DEVICE static float load(Float16 v) { return fp::float16_bits_to_float(v.bits); }
  PRIVLEAK_HOST_DEVICE static void store(Float16& out, float v) { out.bits = fp::float_to_float16_bits(v); }
};

}  // namespace privleak
