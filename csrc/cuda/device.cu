#include "cuda/device.h"

#include <cuda_runtime.h>

#include <stdexcept>

namespace privleak::cuda {

void check(int status, const char* what) {
  if (status != cudaSuccess) {
    const auto error = static_cast<cudaError_t>(status);
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(error) + ": " +
                             cudaGetErrorString(error));
  }
}

int device_count(std::string& error) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    error = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  error.clear();
  return count;
}

int multiprocessor_count(int device) {
  int count = 0;
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return count;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return prop.name;
}

DeviceGuard::DeviceGuard(int device) : previous_(0), changed_(false) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = true;
  }
}

// Restores only a device it changed: cudaSetDevice makes the device's primary context, so a
// restore to device 0 (cudaGetDevice's answer in a thread that has none) would cost a context on
// GPU 0 to a call on another GPU. A destructor cannot throw: a failed restore is cleared, so that
// the next launch's check does not report it as its own.
DeviceGuard::~DeviceGuard() {
  if (changed_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

}  // namespace privleak::cuda
