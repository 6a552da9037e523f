// Argument marshalling shared by the modules. Arrays cross from Python as integer addresses; the
// Python layer (privleak/_arrays.py) has already checked dtype, shape, strides and device, and
// keeps the arrays alive during the call.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <array>
#include <vector>

#include "common/clip.h"
#include "common/conv_grads.h"
#include "common/nearest.h"
#include "common/noise.h"
#include "common/secure_noise.h"

namespace privleak::bindings {

template <class T = void>
T* as_pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

inline Distribution parse_distribution(const std::string& name) {
  if (name == "gaussian") return Distribution::gaussian;
  if (name == "laplace") return Distribution::laplace;
  throw std::invalid_argument("unknown noise distribution '" + name + "' (expected gaussian or laplace)");
}

// A ConvGeometry from its fields in declaration order, as the Python layer lists them.
inline ConvGeometry conv_geometry(const std::array<int64_t, 15>& f) {
  return ConvGeometry{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], f[13], f[14]};
}

inline NoiseDType parse_noise_dtype(const std::string& name) {
  if (name == "float32") return NoiseDType::float32;
  if (name == "float64") return NoiseDType::float64;
  if (name == "bfloat16") return NoiseDType::bfloat16;
  if (name == "float16") return NoiseDType::float16;
  throw std::invalid_argument("unsupported noise dtype '" + name + "' (expected float32, float64, bfloat16 or float16)");
}

// The dtypes of a ghost-norm call's layers, once its per-layer lists are checked to be one length.
inline std::vector<NoiseDType> ghost_norm_layers(const std::vector<std::string>& dtypes,
                                                 const std::vector<std::uintptr_t>& activations,
                                                 const std::vector<std::uintptr_t>& output_grads,
                                                 const std::vector<int64_t>& lengths, const std::vector<int64_t>& ds,
                                                 const std::vector<int64_t>& ps) {
  const size_t layers = dtypes.size();
  if (activations.size() != layers || output_grads.size() != layers || lengths.size() != layers ||
      ds.size() != layers || ps.size() != layers)
    throw std::invalid_argument("ghost_norm: one dtype, activations, output_grads, length, d and p per layer");
  std::vector<NoiseDType> types;
  for (const std::string& name : dtypes) types.push_back(parse_noise_dtype(name));
  return types;
}

inline std::vector<PerSampleGrads> per_sample_grads(const std::vector<std::uintptr_t>& grads,
                                             const std::vector<int64_t>& numels) {
  if (grads.size() != numels.size()) throw std::invalid_argument("one numel per gradient tensor is needed");
  std::vector<PerSampleGrads> tensors;
  for (size_t i = 0; i < grads.size(); ++i) tensors.push_back({as_pointer<const void>(grads[i]), numels[i]});
  return tensors;
}

inline std::vector<void*> void_pointers(const std::vector<std::uintptr_t>& addresses) {
  std::vector<void*> pointers;
  for (std::uintptr_t a : addresses) pointers.push_back(as_pointer(a));
  return pointers;
}

inline std::vector<float*> float_pointers(const std::vector<std::uintptr_t>& addresses) {
  std::vector<float*> pointers;
  for (std::uintptr_t a : addresses) pointers.push_back(as_pointer<float>(a));
  return pointers;
}

// Calls fill(address, n, offset) for each of the arrays at `addresses` of `numels` elements, laid
// end to end in one noise stream from `offset`: a model's tensors take their noise in one call.
template <class Fill>
void each_in_stream(const std::vector<std::uintptr_t>& addresses, const std::vector<int64_t>& numels, uint64_t offset,
                    Fill fill) {
  if (addresses.size() != numels.size()) throw std::invalid_argument("one numel per output array is needed");
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (numels[i] < 0) throw std::invalid_argument("numels must be >= 0");
    fill(as_pointer(addresses[i]), numels[i], offset);
    offset += static_cast<uint64_t>(numels[i]);
  }
}

inline ChaChaKey to_chacha_key(const std::array<uint32_t, 8>& words) {
  ChaChaKey key;
  for (int i = 0; i < 8; ++i) key.w[i] = words[i];
  return key;
}

inline NearestMetric parse_metric(const std::string& name) {
  if (name == "inner_product") return NearestMetric::inner_product;
  if (name == "squared_l2") return NearestMetric::squared_l2;
  if (name == "l1") return NearestMetric::l1;
  throw std::invalid_argument("unknown metric '" + name + "' (expected inner_product, squared_l2 or l1)");
}

}  // namespace privleak::bindings
