// CPU ghost norms, blocked like a GEMM (Goto and van de Geijn 2008) with the T x T reduction fused
// in, so neither Gram matrix is ever stored: a work item holds its rows' stripe of each (2L x T
// doubles), never the whole.
//
// A sample's rows are packed, for a and g alike, into panels of L rows: for each coordinate, the
// panel's L rows side by side (a transposition, with half types widened to float32). A work item
// is a block of two panels, 2L rows t, against the panels of rows s up to its own. Chunk by chunk
// (kGhostChunk coordinates, outermost, so the block's slice stays in L1), one call of the tile
// kernel per panel and NR columns keeps 2 x NR vectors of float32 fma chains in registers, the
// block's rows in the lanes and each column's value broadcast, and adds them to the stripe's
// doubles when the chunk ends. The products w_ts then go into each row's `below` in order of s, by
// tiles of kGhostRowTile columns (common/ghost_norm.h).
// The lower triangle is all that is computed, bar the upper half of each block's diagonal panel:
// about half of what the two batched GEMMs compute (and none of their T x T memory traffic).
//
// Paths: L = 8 rows and NR = 4 columns for the portable loops and AVX2 (two 8-float vectors by 4:
// 8 chains, an FMA's latency times its two ports), L = 16 and NR = 8 for AVX-512 (two 16-float
// vectors by 8). Every path computes each Gram entry by the same fma chain and each row's sum in
// the same order, so all give the same bits; float64 inputs take the portable path.
//
// Convolution form: the input's pixels are the rows (channels-first, so packing is a copy), the
// pixel Gram's lower triangle is kept whole per sample (N^2 doubles, the thread's own), the
// output gradients' Gram comes in stripes as above, and each row's patch Gram entries a_t . a_s
// are sums over the kernel offsets of pixel Gram entries, read as runs of a Gram row. Threads
// take whole samples.
//
// Samples of at most L / 2 rows share a panel, as one pack of their rows end to end: the Gram
// entries between two of them are computed too, and left out of the rows' sums, so each sample's
// norm has the bits it has alone (a sample of 2 rows alone would fill 2 of a panel's 16 lanes).
//
// The dense form's threads take whole samples when there are enough of them to share evenly;
// otherwise work items (sample, block) are spread over threads (heaviest first) within groups of
// samples whose packed panels fit kPackBudget, packed in parallel over (sample, matrix, panel)
// first. (Samples here are packs where short samples share panels.)
#include "cpu/ghost_norm.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/ghost_norm.h"
#include "cpu/platform.h"

#if defined(PRIVLEAK_X86_AVX2)
#define PRIVLEAK_GHOST_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PRIVLEAK_GHOST_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))
#endif

namespace privleak::cpu {
namespace {

// Packed panels of a group of samples: up to this many bytes (the last-level cache of a
// mid-size CPU), or one sample when a sample alone is larger.
constexpr int64_t kPackBudget = int64_t(32) << 20;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Elements from one packed panel to the next: n L and a cache line more. With n L a multiple of
// 4 KiB (n = 1024: 64 KiB panels) the panels a block reads would share the same L2 sets and evict
// one another; that took a third off T = 256, d = p = 1024.
int64_t panel_stride(int64_t n, int L) { return n * L + 64 / 4; }

// ------------------------------------------------------------------------------------- portable

// Rows [panel L, panel L + L) of x (rows of n coordinates, `length` of them) into out[k L + r];
// rows past the end are zero: their entries are computed and never read.
template <int L, class In, class Acc>
void pack_portable(const In* x, int64_t length, int64_t n, int64_t panel, Acc* out) {
  for (int r = 0; r < L; ++r) {
    const int64_t row = panel * L + r;
    if (row < length) {
      const In* src = x + row * n;
      for (int64_t k = 0; k < n; ++k) out[k * L + r] = static_cast<Acc>(Element<In>::load(src[k]));
    } else {
      for (int64_t k = 0; k < n; ++k) out[k * L + r] = Acc(0);
    }
  }
}

// One chunk of a tile: out[j 2L + i] += the fma chain over k < kc of t_i[k] s_j[k], for the NP L
// rows i of panels t0 (and t1) and the NR columns j of s; panels are k-major, L wide.
template <class Acc, int L, int NR, int NP>
PRIVLEAK_FMA_CLONES void tile_portable(const Acc* t0, const Acc* t1, const Acc* s, int64_t kc, double* out) {
  Acc acc[NR][NP * L] = {};
  for (int64_t k = 0; k < kc; ++k) {
    PRIVLEAK_UNROLL
    for (int j = 0; j < NR; ++j) {
      const Acc b = s[k * L + j];
      PRIVLEAK_UNROLL
      for (int i = 0; i < L; ++i) acc[j][i] = ghost_fma(t0[k * L + i], b, acc[j][i]);
      if constexpr (NP == 2) {
        PRIVLEAK_UNROLL
        for (int i = 0; i < L; ++i) acc[j][L + i] = ghost_fma(t1[k * L + i], b, acc[j][L + i]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < NP * L; ++i) out[j * 2 * L + i] += static_cast<double>(acc[j][i]);
}

template <class AccType>
struct Portable {
  using Acc = AccType;
  static constexpr int L = 8, NR = 4;
  template <class In>
  static void pack(const In* x, int64_t length, int64_t n, int64_t panel, Acc* out) {
    pack_portable<L>(x, length, n, panel, out);
  }
  template <int NP>
  static void tile(const Acc* t0, const Acc* t1, const Acc* s, int64_t kc, double* out) {
    tile_portable<Acc, L, NR, NP>(t0, t1, s, kc, out);
  }
};

#if defined(PRIVLEAK_X86_AVX2)
// ----------------------------------------------------------------------------------------- AVX2

PRIVLEAK_GHOST_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PRIVLEAK_GHOST_AVX2 inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PRIVLEAK_GHOST_AVX2 inline __m256 load8(const Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// r[i][k] -> r[k][i] for an 8 x 8 block.
PRIVLEAK_GHOST_AVX2 inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// pack_portable<8> by 8 x 8 transposes (the last n mod 8 coordinates one by one).
template <class In>
PRIVLEAK_GHOST_AVX2 void pack_avx2(const In* x, int64_t length, int64_t n, int64_t panel, float* out) {
  const int64_t row0 = panel * 8;
  const int rows = static_cast<int>(std::min<int64_t>(8, length - row0));
  int64_t k0 = 0;
  for (; k0 + 8 <= n; k0 += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = i < rows ? load8(x + (row0 + i) * n + k0) : _mm256_setzero_ps();
    transpose8(r);
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + (k0 + k) * 8, r[k]);
  }
  for (; k0 < n; ++k0)
    for (int i = 0; i < 8; ++i) out[k0 * 8 + i] = i < rows ? Element<In>::load(x[(row0 + i) * n + k0]) : 0.0f;
}

template <int NP>
PRIVLEAK_GHOST_AVX2 void tile_avx2(const float* t0, const float* t1, const float* s, int64_t kc, double* out) {
  __m256 acc[4][NP];
  PRIVLEAK_UNROLL
  for (int j = 0; j < 4; ++j)
    PRIVLEAK_UNROLL
    for (int h = 0; h < NP; ++h) acc[j][h] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 a[NP];
    a[0] = _mm256_loadu_ps(t0 + k * 8);
    if constexpr (NP == 2) a[1] = _mm256_loadu_ps(t1 + k * 8);
    PRIVLEAK_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256 b = _mm256_broadcast_ss(s + k * 8 + j);
      PRIVLEAK_UNROLL
      for (int h = 0; h < NP; ++h) acc[j][h] = _mm256_fmadd_ps(a[h], b, acc[j][h]);
    }
  }
  PRIVLEAK_UNROLL
  for (int j = 0; j < 4; ++j) {
    PRIVLEAK_UNROLL
    for (int h = 0; h < NP; ++h) {
      double* o = out + j * 16 + h * 8;
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(acc[j][h]));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(acc[j][h], 1));
      _mm256_storeu_pd(o, _mm256_add_pd(_mm256_loadu_pd(o), lo));
      _mm256_storeu_pd(o + 4, _mm256_add_pd(_mm256_loadu_pd(o + 4), hi));
    }
  }
}

struct Avx2 {
  using Acc = float;
  static constexpr int L = 8, NR = 4;
  template <class In>
  static void pack(const In* x, int64_t length, int64_t n, int64_t panel, float* out) {
    pack_avx2(x, length, n, panel, out);
  }
  template <int NP>
  static void tile(const float* t0, const float* t1, const float* s, int64_t kc, double* out) {
    tile_avx2<NP>(t0, t1, s, kc, out);
  }
};

// -------------------------------------------------------------------------------------- AVX-512

PRIVLEAK_GHOST_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PRIVLEAK_GHOST_AVX512 inline __m512 load16(const BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PRIVLEAK_GHOST_AVX512 inline __m512 load16(const Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[i][k] -> r[k][i] for a 16 x 16 block: pairs of rows interleaved, then pairs of pairs, then
// the 128-bit quarters in two rounds.
PRIVLEAK_GHOST_AVX512 inline void transpose16(__m512* r) {
  __m512 t[16];
  PRIVLEAK_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + c], quarter q: rows 4i .. 4i + 3 at coordinate 4q + c.
  PRIVLEAK_UNROLL
  for (int i = 0; i < 4; ++i) {
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  PRIVLEAK_UNROLL
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
  }
  PRIVLEAK_UNROLL
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd);
  }
}

template <class In>
PRIVLEAK_GHOST_AVX512 void pack_avx512(const In* x, int64_t length, int64_t n, int64_t panel, float* out) {
  const int64_t row0 = panel * 16;
  const int rows = static_cast<int>(std::min<int64_t>(16, length - row0));
  int64_t k0 = 0;
  for (; k0 + 16 <= n; k0 += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? load16(x + (row0 + i) * n + k0) : _mm512_setzero_ps();
    transpose16(r);
    for (int k = 0; k < 16; ++k) _mm512_storeu_ps(out + (k0 + k) * 16, r[k]);
  }
  for (; k0 < n; ++k0)
    for (int i = 0; i < 16; ++i) out[k0 * 16 + i] = i < rows ? Element<In>::load(x[(row0 + i) * n + k0]) : 0.0f;
}

template <int NP>
PRIVLEAK_GHOST_AVX512 void tile_avx512(const float* t0, const float* t1, const float* s, int64_t kc, double* out) {
  __m512 acc[8][NP];
  PRIVLEAK_UNROLL
  for (int j = 0; j < 8; ++j)
    PRIVLEAK_UNROLL
    for (int h = 0; h < NP; ++h) acc[j][h] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 a[NP];
    a[0] = _mm512_loadu_ps(t0 + k * 16);
    if constexpr (NP == 2) a[1] = _mm512_loadu_ps(t1 + k * 16);
    PRIVLEAK_UNROLL
    for (int j = 0; j < 8; ++j) {
      const __m512 b = _mm512_set1_ps(s[k * 16 + j]);
      PRIVLEAK_UNROLL
      for (int h = 0; h < NP; ++h) acc[j][h] = _mm512_fmadd_ps(a[h], b, acc[j][h]);
    }
  }
  PRIVLEAK_UNROLL
  for (int j = 0; j < 8; ++j) {
    PRIVLEAK_UNROLL
    for (int h = 0; h < NP; ++h) {
      double* o = out + j * 32 + h * 16;
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(acc[j][h]));
      const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(acc[j][h], 1));
      _mm512_storeu_pd(o, _mm512_add_pd(_mm512_loadu_pd(o), lo));
      _mm512_storeu_pd(o + 8, _mm512_add_pd(_mm512_loadu_pd(o + 8), hi));
    }
  }
}

struct Avx512 {
  using Acc = float;
  static constexpr int L = 16, NR = 8;
  template <class In>
  static void pack(const In* x, int64_t length, int64_t n, int64_t panel, float* out) {
    pack_avx512(x, length, n, panel, out);
  }
  template <int NP>
  static void tile(const float* t0, const float* t1, const float* s, int64_t kc, double* out) {
    tile_avx512<NP>(t0, t1, s, kc, out);
  }
};
#endif

// ------------------------------------------------------------------------------------ the blocks

// The Gram tiles of block q (rows 2qL + i) with panels col < cols: out[(col L + j) 2L + i] =
// entry (row i, row j of panel col). Chunks go outermost, so that the block's slice of a chunk
// stays in L1 while every panel's slice streams past; the block's second panel is left out of the
// tile with itself (its lanes stay 0 there), whose entries all lie above the diagonal.
template <class P>
void gram_stripe(const typename P::Acc* x, int64_t n, int64_t q, int64_t cols, int np, double* out) {
  constexpr int L = P::L;
  std::fill(out, out + cols * L * 2 * L, 0.0);
  const int64_t panel_size = panel_stride(n, L);
  const auto* t0 = x + 2 * q * panel_size;
  for (int64_t c0 = 0; c0 < n; c0 += kGhostChunk) {
    const int64_t kc = std::min(kGhostChunk, n - c0);
    for (int64_t col = 0; col < cols; ++col) {
      const int first = col == 2 * q + 1 ? 1 : 0;
      const auto* s = x + col * panel_size + c0 * L;
      const auto* t = t0 + first * panel_size + c0 * L;
      for (int j0 = 0; j0 < L; j0 += P::NR) {
        double* o = out + (col * L + j0) * 2 * L + first * L;
        if (np - first == 2) P::template tile<2>(t, t + panel_size, s + j0, kc, o);
        else P::template tile<1>(t, nullptr, s + j0, kc, o);
      }
    }
  }
}

// partial[i] += w_ts for rows t = row0 + i < row0 + rows and columns s = col0 + j, j < cols, s < t,
// in order of s. Adding +0 where s >= t, or where s is another sample's row (s < first[i]: several
// short samples share a panel), changes nothing: `partial` starts at +0 and is never -0.
template <int L>
PRIVLEAK_SIMD_CLONES void add_below(const double* aa, const double* gg, int64_t row0, int rows, int64_t col0,
                                    int cols, const int64_t* first, double* partial) {
  for (int j = 0; j < cols; ++j) {
    const int64_t s = col0 + j;
    for (int i = 0; i < rows; ++i) {
      const double w = aa[j * 2 * L + i] * gg[j * 2 * L + i];
      partial[i] += s >= first[i] && s < row0 + i ? w : 0.0;
    }
  }
}

// Rows t = row0 + i of block q (rows of two panels from row0 = 2 q L) into rows_out[t], from the
// block's Gram stripes of a and g (entry (t, s) at [s 2L + i], s < (2q + np) L; common/ghost_norm.h).
// The rows are those of samples of `sample_length` rows laid end to end (one sample, or several
// short ones packed into a panel): row t's sum runs over the columns of its own sample only.
template <int L>
void block_rows(const double* aa, const double* gg, int64_t length, int64_t sample_length, int64_t q, int np,
                double* rows_out) {
  const int64_t row0 = 2 * q * L, cols = 2 * q + np, tile = L * 2 * L;
  const int rows = static_cast<int>(std::min<int64_t>(np * L, length - row0));
  // Packed samples (one panel) lie within one row tile, as each would alone.
  static_assert(kGhostRowTile % L == 0, "a row tile is whole panels");
  int64_t first[2 * L];  // the first row of each row's sample
  for (int i = 0; i < rows; ++i) first[i] = (row0 + i) - (row0 + i) % sample_length;
  double below[2 * L] = {}, partial[2 * L] = {};
  for (int64_t col = 0; col < cols; ++col) {
    const int64_t col0 = col * L;
    const int width = static_cast<int>(std::min<int64_t>(L, length - col0));
    add_below<L>(aa + col * tile, gg + col * tile, row0, rows, col0, width, first, partial);
    if ((col0 + L) % kGhostRowTile == 0 || col == cols - 1) {
      for (int i = 0; i < rows; ++i) below[i] += partial[i];
      std::fill(partial, partial + 2 * L, 0.0);
    }
  }
  for (int i = 0; i < rows; ++i) {
    const int64_t diagonal = (row0 + i) * 2 * L + i;  // row t = row0 + i against column t of the stripe
    rows_out[row0 + i] = ghost_row_total(below[i], aa[diagonal], gg[diagonal]);
  }
}

// Panels in block q of a sample of `length` rows: two, or one at the end.
template <int L>
int block_panels(int64_t length, int64_t q) {
  return static_cast<int>(std::min<int64_t>(2, ceil_div(length, L) - 2 * q));
}

// Rows of block q of one sample, or of a pack of short samples of `sample_length` rows (packed a
// and g panels), into rows_out[t]; `scratch` holds its Gram tiles (2L x T doubles of each).
template <class P>
void ghost_block(const typename P::Acc* pa, const typename P::Acc* pg, int64_t length, int64_t sample_length,
                 int64_t d, int64_t p, int64_t q, std::vector<double>& scratch, double* rows_out) {
  constexpr int L = P::L;
  const int np = block_panels<L>(length, q);
  const int64_t cols = 2 * q + np, tile = L * 2 * L;
  scratch.resize(static_cast<size_t>(2 * cols * tile));
  double* aa = scratch.data();
  double* gg = aa + cols * tile;
  gram_stripe<P>(pa, d, q, cols, np, aa);
  gram_stripe<P>(pg, p, q, cols, np, gg);
  block_rows<L>(aa, gg, length, sample_length, q, np, rows_out);
}

// Where each sample's packed panels go: a's panels, then g's, panel_stride apart.
struct PackedLayout {
  int64_t a_stride, g_stride, a_size, sample_size;
  PackedLayout(int64_t panels, int64_t d, int64_t p, int L)
      : a_stride(panel_stride(d, L)), g_stride(panel_stride(p, L)), a_size(panels * a_stride),
        sample_size(a_size + panels * g_stride) {}
};

// Panel `panel` of matrix `matrix` (0: a, 1: g) of one sample into its place in `packed`.
template <class P, class In>
void pack_panel(const In* a, const In* g, int64_t length, int64_t d, int64_t p, const PackedLayout& layout,
                int matrix, int64_t panel, typename P::Acc* packed) {
  if (matrix) P::pack(g, length, p, panel, packed + layout.a_size + panel * layout.g_stride);
  else P::pack(a, length, d, panel, packed + panel * layout.a_stride);
}

template <class P, class In>
void ghost_norm_path(const In* a, const In* g, int64_t batch, int64_t length, int64_t d, int64_t p, double* out) {
  using Acc = typename P::Acc;
  constexpr int L = P::L;
  // Samples of at most L / 2 positions go `per_panel` to a panel, as one pack whose rows are
  // theirs end to end: alone, each would pad a panel of L rows (B 64, T 2, d = p = 512: 3.6x the
  // time). The Gram entries between two of them are computed and left out of the rows
  // (block_rows); each entry and each row sum is computed as for the sample alone, so the bits
  // are the same.
  const int64_t per_panel = length > 0 ? std::max<int64_t>(1, L / length) : 1;
  const int64_t packed_length = per_panel * length, packs = ceil_div(batch, per_panel);
  const int64_t panels = ceil_div(packed_length, L), blocks = ceil_div(panels, 2);
  const PackedLayout layout(panels, d, p, L);
  // Pack k: the samples from k per_panel on, its rows from row k packed_length of a, g and rows.
  const auto pack_length = [&](int64_t k) { return std::min(per_panel, batch - k * per_panel) * length; };
  std::vector<double> rows(static_cast<size_t>(batch * length));
  // Vector FMAs, about: a parallel region pays from a few hundred thousand on.
  const int64_t work = batch * length * std::min<int64_t>(packed_length, 2 * L) * (d + p) / 16;
  const bool parallel = work >= kMinParallelWork;
  const int64_t threads = parallel ? max_threads() : 1;
  if (packs % threads == 0 || packs >= 4 * threads) {
    // Whole packs per thread, balanced enough: one loop and no barrier between packing and the
    // blocks (on a busy machine a descheduled thread stalls a barrier), each pack's panels in
    // its thread's cache.
#pragma omp parallel if (parallel)
    {
      std::vector<Acc> packed(static_cast<size_t>(layout.sample_size));
      std::vector<double> scratch;
#pragma omp for schedule(dynamic, 1)
      for (int64_t k = 0; k < packs; ++k) {
        const int64_t rows_k = pack_length(k);
        const In* pack_a = a + k * packed_length * d;
        const In* pack_g = g + k * packed_length * p;
        for (int matrix = 0; matrix < 2; ++matrix)
          for (int64_t panel = 0; panel < panels; ++panel)
            pack_panel<P>(pack_a, pack_g, rows_k, d, p, layout, matrix, panel, packed.data());
        for (int64_t q = 0; 2 * q * L < rows_k; ++q)
          ghost_block<P>(packed.data(), packed.data() + layout.a_size, rows_k, length, d, p, q, scratch,
                         rows.data() + k * packed_length);
      }
    }
  } else {
    // Few packs: (pack, block) items over all threads, in groups of packs packed together.
    const int64_t pack_bytes = std::max<int64_t>(1, layout.sample_size * static_cast<int64_t>(sizeof(Acc)));
    const int64_t group = std::clamp<int64_t>(kPackBudget / pack_bytes, 1, packs);
    std::vector<Acc> packed(static_cast<size_t>(group * layout.sample_size));
#pragma omp parallel if (parallel)
    {
      std::vector<double> scratch;
      for (int64_t first = 0; first < packs; first += group) {
        const int64_t count = std::min(group, packs - first);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < count * 2 * panels; ++item) {
          const int64_t k = first + item / (2 * panels);
          pack_panel<P>(a + k * packed_length * d, g + k * packed_length * p, pack_length(k), d, p, layout,
                        static_cast<int>(item / panels % 2), item % panels,
                        packed.data() + (k - first) * layout.sample_size);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < count * blocks; ++item) {
          const int64_t q = blocks - 1 - item / count, k = first + item % count;  // the longest blocks first
          if (2 * q * L >= pack_length(k)) continue;  // past the end of a last, shorter pack
          const Acc* pa = packed.data() + (k - first) * layout.sample_size;
          ghost_block<P>(pa, pa + layout.a_size, pack_length(k), length, d, p, q, scratch,
                         rows.data() + k * packed_length);
        }
      }
    }
  }
  for (int64_t b = 0; b < batch; ++b) out[b] = ghost_sample_total(rows.data() + b * length, length);
}

// ---------------------------------------------------------------------------------- Convolution

// Rows [panel L, panel L + L) of a channels-first sample (coordinate k of row r at x[k rows + r])
// into out[k L + r], rows past the end zero: the panels pack_portable makes, without transposing.
template <int L, class In, class Acc>
void pack_channels_first(const In* x, int64_t rows, int64_t n, int64_t panel, Acc* out) {
  const int64_t row0 = panel * L;
  const int count = static_cast<int>(std::min<int64_t>(L, rows - row0));
  for (int64_t k = 0; k < n; ++k) {
    const In* src = x + k * rows + row0;
    Acc* dst = out + k * L;
    for (int r = 0; r < count; ++r) dst[r] = static_cast<Acc>(Element<In>::load(src[r]));
    for (int r = count; r < L; ++r) dst[r] = Acc(0);
  }
}

// The lower triangle of a sample's pixel Gram, gram[u N + v] for v <= u < N, from its packed
// pixel panels (n channels each).
template <class P>
void pixel_gram(const typename P::Acc* packed, int64_t pixels, int64_t n, std::vector<double>& scratch,
                double* gram) {
  constexpr int L = P::L;
  for (int64_t q = 0; 2 * q * L < pixels; ++q) {
    const int np = block_panels<L>(pixels, q);
    const int64_t cols = 2 * q + np, row0 = 2 * q * L;
    scratch.resize(static_cast<size_t>(cols * L * 2 * L));
    gram_stripe<P>(packed, n, q, cols, np, scratch.data());
    for (int64_t u = row0; u < std::min(pixels, row0 + np * L); ++u)
      for (int64_t v = 0; v <= u; ++v) gram[u * pixels + v] = scratch[v * 2 * L + u - row0];
  }
}

// The output columns [first, last) whose pixels under a kernel column lie in the input's width.
struct ColumnRun {
  int64_t first, last, offset;  // offset: the pixel column of output column 0 (+ stride per column)
};

ColumnRun column_run(const ConvGeometry& c, int64_t kernel_column) {
  const int64_t offset = kernel_column * c.dilation_w - c.pad_w;
  // x = sx s + offset in [0, W): sx >= ceil(-offset / s), sx <= floor((W - 1 - offset) / s).
  const int64_t first = offset >= 0 ? 0 : (-offset + c.stride_w - 1) / c.stride_w;
  const int64_t last = c.width - 1 - offset < 0 ? 0 : std::min(c.out_width, (c.width - 1 - offset) / c.stride_w + 1);
  return {first, std::max(first, last), offset};
}

// patch[s] = a_t . a_s for s <= t: conv_patch_gram's sums for a whole row, k outermost (so each
// entry's terms still come in order of k), the pixels of each output row's run of valid columns
// read as one strided run of the Gram row (contiguous at stride 1).
PRIVLEAK_SIMD_CLONES void patch_gram_row(const double* gram, const ConvGeometry& c, const ColumnRun* runs, int64_t t,
                                         double* patch) {
  const int64_t pixels = c.height * c.width, ty = t / c.out_width, tx = t % c.out_width;
  std::fill(patch, patch + t + 1, 0.0);
  for (int64_t k = 0; k < c.kernel_size(); ++k) {
    const int64_t u = conv_pixel(c, t, k);
    if (u < 0) continue;
    const ColumnRun run = runs[k % c.kernel_w];
    const double* row = gram + u * pixels;
    for (int64_t sy = 0; sy <= ty; ++sy) {
      const int64_t y = sy * c.stride_h - c.pad_h + k / c.kernel_w * c.dilation_h;
      if (y < 0 || y >= c.height) continue;
      const int64_t last = sy == ty ? std::min(run.last, tx + 1) : run.last, start = y * c.width + run.offset;
      double* out = patch + sy * c.out_width;
      for (int64_t sx = run.first; sx < last; ++sx) out[sx] += row[start + sx * c.stride_w];
    }
  }
}

// Rows of block q of one sample: the g side from its packed panels (n coordinates), the a side
// from its pixel Gram.
template <class P>
void conv_block(const typename P::Acc* pg, const double* gram, const ConvGeometry& c, const ColumnRun* runs, int64_t q,
                std::vector<double>& scratch, std::vector<double>& patch, double* rows_out) {
  constexpr int L = P::L;
  const int64_t length = c.positions();
  const int np = block_panels<L>(length, q);
  const int64_t cols = 2 * q + np, tile = L * 2 * L, row0 = 2 * q * L;
  scratch.resize(static_cast<size_t>(2 * cols * tile));
  double* aa = scratch.data();
  double* gg = aa + cols * tile;
  std::fill(aa, gg, 0.0);  // entries above the diagonal stay 0 (gram_stripe fills gg itself)
  gram_stripe<P>(pg, c.outputs, q, cols, np, gg);
  for (int64_t t = row0; t < std::min(length, row0 + np * L); ++t) {
    patch_gram_row(gram, c, runs, t, patch.data());
    for (int64_t s = 0; s <= t; ++s) aa[s * 2 * L + t - row0] = patch[s];
  }
  block_rows<L>(aa, gg, length, length, q, np, rows_out);
}

// Samples (groups folded in) go whole to threads: their pixel Grams are the threads' own.
template <class P, class In>
void conv_ghost_norm_path(const In* x, const In* g, const ConvGeometry& c, double* out) {
  using Acc = typename P::Acc;
  constexpr int L = P::L;
  const int64_t pixels = c.height * c.width, length = c.positions(), kernel = c.kernel_size();
  const int64_t x_stride = panel_stride(c.channels, L), g_stride = panel_stride(c.outputs, L);
  std::vector<ColumnRun> runs;
  for (int64_t j = 0; j < c.kernel_w; ++j) runs.push_back(column_run(c, j));
  std::vector<double> rows(static_cast<size_t>(c.batch * length));
  // Vector FMAs of the two Grams, about, and the patch Gram's sums.
  const int64_t work = c.batch * (pixels * pixels * c.channels / 32 + length * length * (c.outputs / 32 + kernel));
#pragma omp parallel if (work >= kMinParallelWork)
  {
    std::vector<Acc> px(static_cast<size_t>(ceil_div(pixels, L) * x_stride));
    std::vector<Acc> pg(static_cast<size_t>(ceil_div(length, L) * g_stride));
    std::vector<double> gram(static_cast<size_t>(pixels * pixels)), scratch, patch(static_cast<size_t>(length));
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < c.batch; ++b) {
      const In* sample_x = x + b * c.channels * pixels;
      const In* sample_g = g + b * c.outputs * length;
      for (int64_t panel = 0; panel * L < pixels; ++panel)
        pack_channels_first<L>(sample_x, pixels, c.channels, panel, px.data() + panel * x_stride);
      for (int64_t panel = 0; panel * L < length; ++panel)
        pack_channels_first<L>(sample_g, length, c.outputs, panel, pg.data() + panel * g_stride);
      pixel_gram<P>(px.data(), pixels, c.channels, scratch, gram.data());
      for (int64_t q = 0; 2 * q * L < length; ++q)
        conv_block<P>(pg.data(), gram.data(), c, runs.data(), q, scratch, patch, rows.data() + b * length);
    }
  }
  for (int64_t b = 0; b < c.batch; ++b) out[b] = ghost_sample_total(rows.data() + b * length, length);
}

// ------------------------------------------------------------------------------------ Embedding

// An Embedding group's row: members[0 .. count) are its positions, in order; v holds p doubles.
template <class In>
PRIVLEAK_FMA_CLONES double embedding_group(const In* g, int64_t p, const int64_t* members, int64_t count,
                                           double* v) {
  const In* first = g + members[0] * p;
  for (int64_t j = 0; j < p; ++j) v[j] = static_cast<double>(Element<In>::load(first[j]));
  for (int64_t m = 1; m < count; ++m) {
    const In* row = g + members[m] * p;
    for (int64_t j = 0; j < p; ++j) v[j] += static_cast<double>(Element<In>::load(row[j]));
  }
  constexpr int kLanes = kEmbeddingLanes;
  double lanes[kLanes] = {};
  int64_t j0 = 0;
  for (; j0 + kLanes <= p; j0 += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = ghost_fma(v[j0 + l], v[j0 + l], lanes[l]);
  for (int l = 0; j0 + l < p; ++l) lanes[l] = ghost_fma(v[j0 + l], v[j0 + l], lanes[l]);
  return embedding_lanes_total(lanes);
}

template <class In>
void embedding_typed(const int64_t* ids, const In* g, int64_t batch, int64_t length, int64_t p, double* out) {
#pragma omp parallel if (batch * length * p >= kMinParallelWork)
  {
    std::vector<std::pair<int64_t, int64_t>> order(static_cast<size_t>(length));  // (id, position)
    std::vector<int64_t> members(static_cast<size_t>(length));
    std::vector<double> rows(static_cast<size_t>(length)), v(static_cast<size_t>(p));
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t* sample_ids = ids + b * length;
      const In* sample_g = g + b * length * p;
      for (int64_t t = 0; t < length; ++t) order[t] = {sample_ids[t], t};
      std::sort(order.begin(), order.end());  // groups together, each in order of position
      std::fill(rows.begin(), rows.end(), 0.0);
      for (int64_t begin = 0; begin < length;) {
        int64_t end = begin;
        for (; end < length && order[end].first == order[begin].first; ++end) members[end - begin] = order[end].second;
        rows[order[begin].second] = embedding_group(sample_g, p, members.data(), end - begin, v.data());
        begin = end;
      }
      out[b] = ghost_sample_total(rows.data(), length);
    }
  }
}

void check_path(CpuCapability path, const char* op) {
  if (static_cast<int>(path) > static_cast<int>(cpu_best_capability()))
    throw std::invalid_argument(std::string(op) + ": this CPU cannot run the " + capability_name(path) +
                                " path (it has " + capability_name(cpu_best_capability()) + ")");
}

}  // namespace

void ghost_norm(NoiseDType dtype, const void* activations, const void* output_grads, int64_t batch, int64_t length,
                int64_t d, int64_t p, double* out, CpuCapability path) {
  check_ghost_sizes(batch, length, d, p);
  check_path(path, "ghost_norm");
  if (batch == 0) return;
  dispatch_ghost_dtype(dtype, [&](auto zero) {
    using In = decltype(zero);
    const auto* a = static_cast<const In*>(activations);
    const auto* g = static_cast<const In*>(output_grads);
    if constexpr (std::is_same_v<In, double>) {
      ghost_norm_path<Portable<double>>(a, g, batch, length, d, p, out);
    } else {
#if defined(PRIVLEAK_X86_AVX2)
      if (path == CpuCapability::avx512) return ghost_norm_path<Avx512>(a, g, batch, length, d, p, out);
      if (path == CpuCapability::avx2) return ghost_norm_path<Avx2>(a, g, batch, length, d, p, out);
#endif
      ghost_norm_path<Portable<float>>(a, g, batch, length, d, p, out);
    }
  });
}

void conv_ghost_norm(NoiseDType dtype, const void* x, const void* output_grads, const ConvGeometry& geometry,
                     double* out, CpuCapability path) {
  check_conv_ghost_geometry(geometry);
  check_path(path, "conv_ghost_norm");
  if (geometry.batch == 0) return;
  dispatch_ghost_dtype(dtype, [&](auto zero) {
    using In = decltype(zero);
    const auto* xs = static_cast<const In*>(x);
    const auto* g = static_cast<const In*>(output_grads);
    if constexpr (std::is_same_v<In, double>) {
      conv_ghost_norm_path<Portable<double>>(xs, g, geometry, out);
    } else {
#if defined(PRIVLEAK_X86_AVX2)
      if (path == CpuCapability::avx512) return conv_ghost_norm_path<Avx512>(xs, g, geometry, out);
      if (path == CpuCapability::avx2) return conv_ghost_norm_path<Avx2>(xs, g, geometry, out);
#endif
      conv_ghost_norm_path<Portable<float>>(xs, g, geometry, out);
    }
  });
}

void embedding_ghost_norm(NoiseDType dtype, const int64_t* ids, const void* output_grads, int64_t batch,
                          int64_t length, int64_t p, double* out) {
  check_ghost_sizes(batch, length, 0, p);
  if (batch == 0) return;
  dispatch_ghost_dtype(dtype, [&](auto zero) {
    using In = decltype(zero);
    embedding_typed(ids, static_cast<const In*>(output_grads), batch, length, p, out);
  });
}

}  // namespace privleak::cpu
