// Element types the kernels take, named as numpy and torch name them.
#pragma once

#include <stdexcept>
#include <string>

namespace privleak {

enum class DType { float32, float64 };

inline DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::float32;
  if (name == "float64") return DType::float64;
  throw std::invalid_argument("unsupported dtype '" + name + "' (expected float32 or float64)");
}

// Calls f(T{}) with T the C++ type of `dtype`.
template <class F>
decltype(auto) dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::float32: return f(float{});
    case DType::float64: return f(double{});
  }
  throw std::invalid_argument("unsupported dtype");
}

}  // namespace privleak
