#include "cpu/noise_lanes.h"

#include "common/philox.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

void philox_lanes_portable(uint64_t key, uint32_t stream, uint64_t first_block, uint32_t (&words)[4][kLaneBlocks]) {
  for (int64_t j = 0; j < kLaneBlocks; ++j) {
    const Words4 r = philox_block(key, stream, first_block + static_cast<uint64_t>(j));
    for (int w = 0; w < 4; ++w) words[w][j] = r.w[w];
  }
}

template <class T, int k>
void interleave_portable(const T (&values)[k][kLaneBlocks], T* out) {
  for (int64_t j = 0; j < kLaneBlocks; ++j)
    for (int lane = 0; lane < k; ++lane) out[k * j + lane] = values[lane][j];
}

#if defined(PRIVLEAK_X86_AVX2)
// 8 blocks per vector, two vectors in flight: the multiplies of one hide the latency of the other.
constexpr int kVectors = 2;

// (hi, lo) of the 32 x 32 -> 64-bit products a_i * m, for 8 lanes.
__attribute__((target("avx2"))) inline void mul_hi_lo_avx2(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

__attribute__((target("avx2"))) void philox_lanes_avx2(uint64_t key, uint32_t stream, uint64_t first_block,
                                                       uint32_t (&words)[4][kLaneBlocks]) {
  static_assert(kLaneBlocks % (8 * kVectors) == 0, "whole vectors of blocks");
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(kPhiloxMul0));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(kPhiloxMul1));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t j = 0; j < kLaneBlocks; j += 8 * kVectors) {
    __m256i c[kVectors][4];
    for (int v = 0; v < kVectors; ++v) {
      const uint64_t block = first_block + static_cast<uint64_t>(j + 8 * v);
      const __m256i base = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block)));
      c[v][0] = _mm256_add_epi32(base, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      // A lane whose low word wrapped past 2^32 - 1 carries into the high word (an unsigned
      // compare, as a signed one on sign-flipped words; true is -1, so subtracting it adds 1).
      const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(base, sign), _mm256_xor_si256(c[v][0], sign));
      c[v][1] = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32))), wrapped);
      c[v][2] = _mm256_set1_epi32(static_cast<int>(stream));
      c[v][3] = _mm256_setzero_si256();
    }
    uint32_t key0 = static_cast<uint32_t>(key), key1 = static_cast<uint32_t>(key >> 32);
    for (int round = 0; round < kPhiloxRounds; ++round) {
      const __m256i k0 = _mm256_set1_epi32(static_cast<int>(key0)), k1 = _mm256_set1_epi32(static_cast<int>(key1));
      for (int v = 0; v < kVectors; ++v) {
        __m256i hi0, lo0, hi1, lo1;
        mul_hi_lo_avx2(c[v][0], mul0, hi0, lo0);
        mul_hi_lo_avx2(c[v][2], mul1, hi1, lo1);
        c[v][0] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[v][1]), k0);
        c[v][2] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[v][3]), k1);
        c[v][1] = lo1;
        c[v][3] = lo0;
      }
      key0 += kPhiloxWeyl0;
      key1 += kPhiloxWeyl1;
    }
    for (int v = 0; v < kVectors; ++v)
      for (int w = 0; w < 4; ++w)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[w] + j + 8 * v), c[v][w]);
  }
}

// A 4 x 8 transpose per 8 blocks: rows a, b, c, d become a0 b0 c0 d0 a1 b1 c1 d1 ...
__attribute__((target("avx2"))) void interleave_avx2(const float (&values)[4][kLaneBlocks], float* out) {
  static_assert(kLaneBlocks % 8 == 0, "whole vectors of blocks");
  for (int64_t j = 0; j < kLaneBlocks; j += 8) {
    const __m256 a = _mm256_loadu_ps(values[0] + j), b = _mm256_loadu_ps(values[1] + j);
    const __m256 c = _mm256_loadu_ps(values[2] + j), d = _mm256_loadu_ps(values[3] + j);
    // Per 128-bit half: ab_lo = a0 b0 a1 b1, ab_hi = a2 b2 a3 b3 (and blocks 4-7 in the upper half).
    const __m256d ab_lo = _mm256_castps_pd(_mm256_unpacklo_ps(a, b)), ab_hi = _mm256_castps_pd(_mm256_unpackhi_ps(a, b));
    const __m256d cd_lo = _mm256_castps_pd(_mm256_unpacklo_ps(c, d)), cd_hi = _mm256_castps_pd(_mm256_unpackhi_ps(c, d));
    // Blocks (0, 4), (1, 5), (2, 6), (3, 7), one 128-bit half each.
    const __m256 q0 = _mm256_castpd_ps(_mm256_unpacklo_pd(ab_lo, cd_lo));
    const __m256 q1 = _mm256_castpd_ps(_mm256_unpackhi_pd(ab_lo, cd_lo));
    const __m256 q2 = _mm256_castpd_ps(_mm256_unpacklo_pd(ab_hi, cd_hi));
    const __m256 q3 = _mm256_castpd_ps(_mm256_unpackhi_pd(ab_hi, cd_hi));
    float* o = out + 4 * j;
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(q0, q1, 0x20));
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(q2, q3, 0x20));
    _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(q0, q1, 0x31));
    _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(q2, q3, 0x31));
  }
}

__attribute__((target("avx2"))) void interleave_avx2(const double (&values)[2][kLaneBlocks], double* out) {
  static_assert(kLaneBlocks % 4 == 0, "whole vectors of blocks");
  for (int64_t j = 0; j < kLaneBlocks; j += 4) {
    const __m256d a = _mm256_loadu_pd(values[0] + j), b = _mm256_loadu_pd(values[1] + j);
    const __m256d lo = _mm256_unpacklo_pd(a, b), hi = _mm256_unpackhi_pd(a, b);  // blocks (0, 2) and (1, 3)
    _mm256_storeu_pd(out + 2 * j, _mm256_permute2f128_pd(lo, hi, 0x20));
    _mm256_storeu_pd(out + 2 * j + 4, _mm256_permute2f128_pd(lo, hi, 0x31));
  }
}

// The avx512 tier of cpu/platform.h (F, BW, DQ, VL); only these functions are built for it.
#define PRIVLEAK_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl")))
#define PRIVLEAK_AVX512_INLINE __attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl"), always_inline)) inline

// 16 blocks per vector, all kLaneBlocks in flight (measured on Zen 5: 4 vectors beat 2 by 10%).
constexpr int kVectors512 = 4;

// (hi, lo) of the 32 x 32 -> 64-bit products a_i * m, for 16 lanes: the high words from two
// even-lane products gathered back into lane order by one two-source permute, the low words from
// a 32-bit multiply (3% faster on Zen 5 than a second permute).
PRIVLEAK_AVX512_INLINE void mul_hi_lo_avx512(__m512i a, __m512i m, __m512i hi_index, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  hi = _mm512_permutex2var_epi32(even, hi_index, odd);
  lo = _mm512_mullo_epi32(a, m);
}

PRIVLEAK_AVX512 void philox_lanes_avx512(uint64_t key, uint32_t stream, uint64_t first_block,
                                         uint32_t (&words)[4][kLaneBlocks]) {
  static_assert(kLaneBlocks % (16 * kVectors512) == 0, "whole vectors of blocks");
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(kPhiloxMul0));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(kPhiloxMul1));
  // Word 2i + 1 of a product vector is the high word of lane 2i's product; index 16 + w picks
  // word w of the odd lanes' products.
  const __m512i hi_index = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t j = 0; j < kLaneBlocks; j += 16 * kVectors512) {
    __m512i c[kVectors512][4];
    for (int v = 0; v < kVectors512; ++v) {
      const uint64_t block = first_block + static_cast<uint64_t>(j + 16 * v);
      const __m512i base = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block)));
      c[v][0] = _mm512_add_epi32(base, iota);
      // A lane whose low word wrapped past 2^32 - 1 carries into the high word.
      const __mmask16 wrapped = _mm512_cmplt_epu32_mask(c[v][0], base);
      const __m512i high = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32)));
      c[v][1] = _mm512_mask_add_epi32(high, wrapped, high, _mm512_set1_epi32(1));
      c[v][2] = _mm512_set1_epi32(static_cast<int>(stream));
      c[v][3] = _mm512_setzero_si512();
    }
    uint32_t key0 = static_cast<uint32_t>(key), key1 = static_cast<uint32_t>(key >> 32);
    for (int round = 0; round < kPhiloxRounds; ++round) {
      const __m512i k0 = _mm512_set1_epi32(static_cast<int>(key0)), k1 = _mm512_set1_epi32(static_cast<int>(key1));
      for (int v = 0; v < kVectors512; ++v) {
        __m512i hi0, lo0, hi1, lo1;
        mul_hi_lo_avx512(c[v][0], mul0, hi_index, hi0, lo0);
        mul_hi_lo_avx512(c[v][2], mul1, hi_index, hi1, lo1);
        c[v][0] = _mm512_ternarylogic_epi32(hi1, c[v][1], k0, 0x96);  // three-way xor
        c[v][2] = _mm512_ternarylogic_epi32(hi0, c[v][3], k1, 0x96);
        c[v][1] = lo1;
        c[v][3] = lo0;
      }
      key0 += kPhiloxWeyl0;
      key1 += kPhiloxWeyl1;
    }
    for (int v = 0; v < kVectors512; ++v)
      for (int w = 0; w < 4; ++w) _mm512_storeu_si512(words[w] + j + 16 * v, c[v][w]);
  }
}

// 16 blocks at a time: pairs (a, b) and (c, d) interleave word by word, then the pairs interleave
// as 64-bit units, a0 b0 c0 d0 a1 b1 c1 d1 ...
PRIVLEAK_AVX512 void interleave_avx512(const float (&values)[4][kLaneBlocks], float* out) {
  static_assert(kLaneBlocks % 16 == 0, "whole vectors of blocks");
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i first64 = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  const __m512i second64 = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t j = 0; j < kLaneBlocks; j += 16) {
    const __m512 a = _mm512_loadu_ps(values[0] + j), b = _mm512_loadu_ps(values[1] + j);
    const __m512 c = _mm512_loadu_ps(values[2] + j), d = _mm512_loadu_ps(values[3] + j);
    const __m512d ab0 = _mm512_castps_pd(_mm512_permutex2var_ps(a, first, b));   // blocks 0-7
    const __m512d ab1 = _mm512_castps_pd(_mm512_permutex2var_ps(a, second, b));  // blocks 8-15
    const __m512d cd0 = _mm512_castps_pd(_mm512_permutex2var_ps(c, first, d));
    const __m512d cd1 = _mm512_castps_pd(_mm512_permutex2var_ps(c, second, d));
    double* o = reinterpret_cast<double*>(out + 4 * j);  // only moved, never computed on
    _mm512_storeu_pd(o, _mm512_permutex2var_pd(ab0, first64, cd0));
    _mm512_storeu_pd(o + 8, _mm512_permutex2var_pd(ab0, second64, cd0));
    _mm512_storeu_pd(o + 16, _mm512_permutex2var_pd(ab1, first64, cd1));
    _mm512_storeu_pd(o + 24, _mm512_permutex2var_pd(ab1, second64, cd1));
  }
}

PRIVLEAK_AVX512 void interleave_avx512(const double (&values)[2][kLaneBlocks], double* out) {
  static_assert(kLaneBlocks % 8 == 0, "whole vectors of blocks");
  const __m512i first = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  const __m512i second = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t j = 0; j < kLaneBlocks; j += 8) {
    const __m512d a = _mm512_loadu_pd(values[0] + j), b = _mm512_loadu_pd(values[1] + j);
    _mm512_storeu_pd(out + 2 * j, _mm512_permutex2var_pd(a, first, b));
    _mm512_storeu_pd(out + 2 * j + 8, _mm512_permutex2var_pd(a, second, b));
  }
}
#endif

}  // namespace

void philox_lanes(uint64_t key, uint32_t stream, uint64_t first_block, uint32_t (&words)[4][kLaneBlocks]) {
#if defined(PRIVLEAK_X86_AVX2)
  if (avx512_enabled()) {
    philox_lanes_avx512(key, stream, first_block, words);
    return;
  }
  if (avx2_enabled()) {
    philox_lanes_avx2(key, stream, first_block, words);
    return;
  }
#endif
  philox_lanes_portable(key, stream, first_block, words);
}

template <class T, int k>
void interleave_lanes(const T (&values)[k][kLaneBlocks], T* out) {
#if defined(PRIVLEAK_X86_AVX2)
  if (avx512_enabled()) {
    interleave_avx512(values, out);
    return;
  }
  if (avx2_enabled()) {
    interleave_avx2(values, out);
    return;
  }
#endif
  interleave_portable(values, out);
}
template void interleave_lanes<float, 4>(const float (&)[4][kLaneBlocks], float*);
template void interleave_lanes<double, 2>(const double (&)[2][kLaneBlocks], double*);

}  // namespace privleak::cpu
