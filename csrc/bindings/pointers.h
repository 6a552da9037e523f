// Arrays cross from Python as integer addresses; the Python layer (privleak/_arrays.py) has
// already checked dtype, shape, strides and device, and keeps the arrays alive during the call.
#pragma once

#include <cstdint>

namespace privleak::bindings {

template <class T = void>
T* as_pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace privleak::bindings
