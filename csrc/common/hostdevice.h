// Marks scalar code that CPU and CUDA kernels share, so the math is written once.
#pragma once

#if defined(__CUDACC__)
#define PRIVLEAK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PRIVLEAK_HOST_DEVICE inline
#endif
