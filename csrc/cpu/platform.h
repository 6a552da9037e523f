// What the CPU kernels may assume about the machine. OpenMP is optional: without it the kernels
// run on one thread and give the same bits.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

// Hand-written AVX2 (and F16C, which every AVX2 CPU has) paths, taken when the CPU has them.
#if defined(__x86_64__) && defined(__GNUC__)
#define PRIVLEAK_X86_AVX2 1
#include <immintrin.h>
#endif

// Wheels target baseline x86-64 (SSE2), where loops mixing 32- and 64-bit lanes do not
// vectorise. Hot loops are cloned for AVX2 and picked at load time by the CPU's features.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PRIVLEAK_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
// std::fma is one instruction on x86-64-v3 (Haswell, Zen and later) and a library call on the
// baseline; loops built on it get a v3 clone. The result is the same: fma rounds once either way.
#define PRIVLEAK_FMA_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PRIVLEAK_SIMD_CLONES
#define PRIVLEAK_FMA_CLONES
#endif

namespace privleak::cpu {

// Work (elements touched) below which a parallel region costs more than it saves, and on a busy
// machine a descheduled thread can stall its barrier for a whole scheduler tick. Splitting work
// never changes results, so this only decides speed.
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// The calling thread's number within the current parallel region (0 outside one).
inline int thread_index() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline void set_num_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

// Whether the hand-written AVX2 paths run: on x86-64 CPUs with AVX2 and F16C, unless
// PRIVLEAK_CPU_CAPABILITY=default (read at the first use) asks for the portable loops. Both give
// the same bits. The compiler-made clones above are chosen by the CPU alone.
inline bool avx2_enabled() {
#if defined(PRIVLEAK_X86_AVX2)
  static const bool enabled = [] {
    const char* requested = std::getenv("PRIVLEAK_CPU_CAPABILITY");
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
           !(requested && std::strcmp(requested, "default") == 0);
  }();
  return enabled;
#else
  return false;
#endif
}

// "avx2" or "default": which paths run on this CPU.
inline const char* cpu_capability() { return avx2_enabled() ? "avx2" : "default"; }

inline bool has_openmp() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

}  // namespace privleak::cpu
