// What the CPU kernels may assume about the machine. OpenMP is optional: without it the kernels
// run on one thread and give the same bits.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#if defined(_OPENMP)
#include <omp.h>
#endif

// Hand-written AVX2 (and F16C, which every AVX2 CPU has) and AVX-512 paths, taken when the CPU has
// them. Their functions carry target attributes: the rest of the build targets baseline x86-64.
#if defined(__x86_64__) && defined(__GNUC__)
#define PRIVLEAK_X86_AVX2 1
#include <cpuid.h>
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

// Which hand-written SIMD paths run. The tiers are ordered: a CPU that runs the AVX-512 paths
// runs the AVX2 paths of kernels that have no AVX-512 path. Every path gives the same bits.
//   default  portable loops (any CPU)
//   avx2     AVX2 with FMA and F16C (Haswell, Zen and later)
//   avx512   AVX-512 F, BW, DQ and VL (x86-64-v4: Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and later)
enum class CpuCapability : int { portable = 0, avx2 = 1, avx512 = 2 };

// The instruction-set extensions the tiers need, as the CPU (and the OS, which must save the
// wider registers) reports them.
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
};

// The best tier that `features` allow.
inline CpuCapability best_capability(const CpuFeatures& f) {
  if (!(f.avx2 && f.fma && f.f16c)) return CpuCapability::portable;
  if (!(f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl)) return CpuCapability::avx2;
  return CpuCapability::avx512;
}

inline const char* capability_name(CpuCapability c) {
  switch (c) {
    case CpuCapability::avx512:
      return "avx512";
    case CpuCapability::avx2:
      return "avx2";
    default:
      return "default";
  }
}

// "default", "avx2" or "avx512" into `out`; false for any other name.
inline bool parse_capability(const char* name, CpuCapability* out) {
  if (!name) return false;
  for (CpuCapability c : {CpuCapability::portable, CpuCapability::avx2, CpuCapability::avx512}) {
    if (std::strcmp(name, capability_name(c)) == 0) {
      *out = c;
      return true;
    }
  }
  return false;
}

// The tier that runs: the best the CPU has, lowered to `requested` (PRIVLEAK_CPU_CAPABILITY)
// when that names a lower one. A request above what the CPU has gets the best it has; null,
// "native" or an unrecognised name asks for nothing.
inline CpuCapability choose_capability(CpuCapability best, const char* requested) {
  CpuCapability asked;
  if (!parse_capability(requested, &asked)) return best;
  return static_cast<int>(asked) < static_cast<int>(best) ? asked : best;
}

// What this CPU reports (no request applied).
inline CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(PRIVLEAK_X86_AVX2)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  unsigned eax, ebx, ecx, edx;  // CPUID leaf 1: clang 14's __builtin_cpu_supports knows no "f16c"
  f.f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

// The best tier this CPU can run, whatever PRIVLEAK_CPU_CAPABILITY says.
inline CpuCapability cpu_best_capability() {
  static const CpuCapability best = best_capability(detect_cpu_features());
  return best;
}

// The tier the kernels run, fixed at the first use: cpu_best_capability() lowered by
// PRIVLEAK_CPU_CAPABILITY ("default", "avx2" or "avx512"). The compiler-made clones above are
// chosen by the CPU alone.
inline CpuCapability cpu_capability_level() {
  static const CpuCapability level =
      choose_capability(cpu_best_capability(), std::getenv("PRIVLEAK_CPU_CAPABILITY"));
  return level;
}

// Whether the hand-written AVX2 (and F16C) paths run: at the avx2 tier and above.
inline bool avx2_enabled() { return cpu_capability_level() != CpuCapability::portable; }

// Whether the hand-written AVX-512 paths run.
inline bool avx512_enabled() { return cpu_capability_level() == CpuCapability::avx512; }

// "avx512", "avx2" or "default": which paths run on this CPU.
inline const char* cpu_capability() { return capability_name(cpu_capability_level()); }

inline bool has_openmp() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

}  // namespace privleak::cpu
