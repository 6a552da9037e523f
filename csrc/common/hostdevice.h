// Marks scalar code that CPU and CUDA kernels share, so the math is written once.
#pragma once

#if defined(__CUDACC__)
#define PRIVLEAK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PRIVLEAK_HOST_DEVICE inline
#endif

// Fully unrolls a loop with a compile-time trip count, so that loops around it stay free of
// control flow and vectorise across their iterations (CPU) or keep values in registers (CUDA).
#if defined(__CUDACC__)
#define PRIVLEAK_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__)
#define PRIVLEAK_UNROLL _Pragma("GCC unroll 32")
#elif defined(__clang__)
#define PRIVLEAK_UNROLL _Pragma("clang loop unroll(full)")
#else
#define PRIVLEAK_UNROLL
#endif
