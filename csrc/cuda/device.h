#pragma once

#include <string>

namespace privleak::cuda {

// Number of usable CUDA devices; 0 with `error` set when the driver or a GPU is missing.
int device_count(std::string& error);
std::string device_name(int device);
// The device's streaming multiprocessors (a launch plan's measure of how many blocks fill it).
int multiprocessor_count(int device);

// Throws std::runtime_error naming `what` when a CUDA call failed.
void check(int status, const char* what);

// Makes `device` current for the lifetime of the guard (restoring the previous one if it changed).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
  bool changed_;
};

}  // namespace privleak::cuda
