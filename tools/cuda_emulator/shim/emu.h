// CUDA execution-model emulator: compiles .cu sources (after prep.py) as plain host C++.
// Force-included (-include emu.h). __CUDA_ARCH__ and __CUDACC__ are NOT defined, so shared
// headers take their host branches (std::fma, ...), exactly as the CPU build does.
#pragma once
#if defined(__CUDA_ARCH__) || defined(__CUDACC__)
#error "emu.h must be compiled as host C++"
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n) alignas(n)
// prep.py rewrites every __shared__ declaration; one left over is an error.
#define __shared__ __shared__not_rewritten_by_prep_py__

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

// threadIdx / blockIdx: per emulated thread (an OS thread, or a fiber whose values the scheduler
// swaps in). blockDim / gridDim: per launch.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

namespace emu {
// Runs body() once per thread of every block; blocks one after another (or a few groups of
// blocks at a time), the threads of one block concurrently. Records launch errors (0 blocks,
// too many threads, ...) for cudaGetLastError.
void launch(dim3 grid, dim3 block, size_t dynamic_shared, const char* kernel, const std::function<void()>& body);
void* shared_alloc(size_t bytes, size_t align, const char* name);
void syncthreads();
void warp_exchange(const void* in, void* out, size_t bytes, int src_lane, unsigned mask);
unsigned lane_id();
[[noreturn]] void trap(const char* what);
template <class T>
T* shared(const char* name) {
  return static_cast<T*>(shared_alloc(sizeof(T), alignof(T), name));
}
}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  static_assert(std::is_trivially_copyable<T>::value, "__shfl_sync of a trivially copyable value");
  if (width != 32) __builtin_trap();
  T out;
  emu::warp_exchange(&var, &out, sizeof(T), src_lane & 31, mask);
  return out;
}

template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable<T>::value, "__shfl_xor_sync of a trivially copyable value");
  if (width != 32) __builtin_trap();
  T out;
  emu::warp_exchange(&var, &out, sizeof(T), static_cast<int>((emu::lane_id() ^ lane_mask) & 31), mask);
  return out;
}

[[noreturn]] inline void __trap() { emu::trap("__trap()"); }
inline float __int_as_float(int bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline double __longlong_as_double(long long bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// Device min/max: CUDA's integer overloads convert mixed operands to their common type; float
// ones are fminf/fmaxf (NaN-ignoring).
template <class A, class B,
          std::enable_if_t<std::is_integral<A>::value && std::is_integral<B>::value, int> = 0>
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B,
          std::enable_if_t<std::is_integral<A>::value && std::is_integral<B>::value, int> = 0>
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
using std::sqrt;

// ---------------------------------------------------------------- CUDA runtime, host stand-ins
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoDevice = 100,
  cudaErrorLaunchOutOfResources = 701,
};
typedef struct CUstream_st* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrComputeCapabilityMajor = 75 };
struct cudaDeviceProp {
  char name[256];
  int major, minor, multiProcessorCount;
  size_t totalGlobalMem, sharedMemPerBlock;
};
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
// Copies at once (the emulator has one stream, and kernels finish before their launch returns).
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
// cudaDevAttrMultiProcessorCount: EMU_SMS (default 132, an H100's), so tests can vary launch plans
// that depend on it; cudaDevAttrComputeCapabilityMajor: 9.
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
