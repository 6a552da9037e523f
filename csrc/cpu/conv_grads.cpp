// CPU per-sample convolution weight gradients as an implicit GEMM, one sample per work item.
//
// A sample's input goes into a padded channels-last copy xp (H_pad, W_pad, C), its output
// gradient into a transposed copy gt (T, O_pad) with O_pad a multiple of the vector width (zeros
// past O), both widened to the accumulation type. Row r = (u, v, c) of the sample's gradient, as
// a (K C) x O_pad matrix, is then sum_t xp[base(t) + offset(r)] gt[t, :], base(t) the top-left
// corner of position t's window: a GEMM whose rows of xp are gathered by offset, with no im2col
// buffer. The tile kernel keeps MR rows by NV vectors of outputs in registers for the whole chain
// over t, each row's x value broadcast and each vector of gt loaded once per t. The tile is then
// permuted into the weight's layout (O, C, k_h, k_w). Rows in (u, v, c) order put a tile's rows,
// consecutive channels, in one line of xp: (c, u, v) order made C = O = 128 twice as slow. Such a
// tile reads its rows' x values at constant offsets from one pointer, and the chain runs over the
// positions t in one loop, their windows' corners computed once a call (one pointer a row, and a
// loop over output rows then columns, spilled and reloaded registers: B = 64, one thread, the
// paper CNN's 12-channel layers 0.41 / 0.37 -> 0.36 / 0.33 ms, CIFAR's 32-64-channel ones 8-24%
// faster).
//
// The two copies in and the permutation out are transposes, done in 8 x 8 register blocks on the
// SIMD paths (float inputs): as scalar loops they took half of the 12-channel layers' time. The
// permutation is one transpose of the tile's rows gathered in the weight's order, each output
// row written whole: one transpose per channel wrote runs of k_h k_w elements to O rows C k_h k_w
// elements apart, which share a few cache sets, and took half of the time of a 128-channel layer
// at 8 x 8 pixels (B = 8, one thread, AVX-512: 0.32 -> 0.20 ms a sample).
//
// Paths: vectors of 16 floats (AVX-512, up to 6 rows by 4 vectors), 8 floats (AVX2, up to 6 by
// 2), and portable loops over 8 lanes (any CPU, and float64 inputs). Every path computes each
// element by the same fma chain over t, so all give the same bits.
#include "cpu/conv_grads.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/element.h"
#include "common/ghost_norm.h"

#if defined(PRIVLEAK_X86_AVX2)
#define PRIVLEAK_CONV_AVX2 __attribute__((target("avx2,fma")))
#define PRIVLEAK_CONV_AVX512 __attribute__((target("avx2,fma,avx512f")))
#endif

namespace privleak::cpu {
namespace {

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// A row stride for rows of n >= 16 floats: whole lines, an odd number of them. Rows a power of
// two of lines apart share a few cache sets, and a tile's walk down gt and xp thrashed them
// (C = O = 128 ran at half the speed of C = 112).
int64_t spread_stride(int64_t n) {
  if (n < 16) return n;
  const int64_t lines = (n + 15) / 16;
  return (lines % 2 ? lines : lines + 1) * 16;
}

constexpr int kMaxRows = 12;  // the tallest tile of any path

// The tile kernel's view of one sample: xp, gt, the row offsets into xp and the windows' corners.
template <class Acc>
struct Sample {
  const Acc* xp;
  const Acc* gt;
  const int64_t* offsets;  // per gradient row (u, v, c): its element's offset from a window's corner
  const int64_t* corners;  // per output position t = (h, w), in order: its window's corner in xp
  int64_t row;             // elements from one row of gt, and of the tile, to the next
  int64_t positions;
};

// Whether rows r0 .. r0 + rows - 1 read consecutive elements of a window (channels c .. c +
// rows - 1 of one kernel offset): then a tile addresses them from one pointer, by constants,
// which leaves the registers a tall tile needs (one pointer per row spilled them, and the paper
// CNN's 12-channel layers ran at a third of the fma rate).
inline bool consecutive_rows(const int64_t* offsets, int64_t r0, int rows) {
  for (int i = 1; i < rows; ++i)
    if (offsets[r0 + i] != offsets[r0] + i) return false;
  return true;
}

// The rows of a matrix to transpose: row i at base + i stride, or at base + gathered[i] (the
// gradient tile's rows in the weight's order, which a stride cannot step through).
template <class T>
struct SourceRows {
  const T* base;
  int64_t stride;
  const int64_t* gathered = nullptr;
  const T* operator()(int64_t i) const { return base + (gathered ? gathered[i] : i * stride); }
};

// ------------------------------------------------------------------------------------- portable

constexpr int kPortableLanes = 8;

// rows x (NV vectors of 8 lanes) of the gradient from row r0 and output o0 into tile[r][o].
template <class Acc, int MR, int NV>
PRIVLEAK_FMA_CLONES void tile_portable(const Sample<Acc>& s, int64_t r0, int64_t o0, Acc* tile) {
  constexpr int W = NV * kPortableLanes;
  Acc acc[MR][W] = {};
  const Acc* gt = s.gt + o0;
  for (int64_t t = 0; t < s.positions; ++t, gt += s.row) {
    const Acc* corner = s.xp + s.corners[t];
    PRIVLEAK_UNROLL
    for (int i = 0; i < MR; ++i) {
      const Acc xv = corner[s.offsets[r0 + i]];
      PRIVLEAK_UNROLL
      for (int j = 0; j < W; ++j) acc[i][j] = ghost_fma(xv, gt[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < W; ++j) tile[(r0 + i) * s.row + o0 + j] = acc[i][j];
}

// A path: the vector width, the widest tile, its height for a width, and the tile kernels. The
// short tile (kShortRows rows) ends a column of tiles whose rows are not a multiple of the tall
// one's: a 25-row gradient (5 x 5 kernel, one channel) in 12-row tiles computed 36 rows.
constexpr int kShortRows = 4;

template <class AccType>
struct Portable {
  using Acc = AccType;
  static constexpr int lanes = kPortableLanes, max_vectors = 1;
  static constexpr bool simd_transpose = false;
  static void tile(const Sample<Acc>& s, int64_t r0, int64_t o0, int vectors, Acc* out) {
    (void)vectors;
    tile_portable<Acc, kShortRows, 1>(s, r0, o0, out);
  }
  static void short_tile(const Sample<Acc>& s, int64_t r0, int64_t o0, int vectors, Acc* out) {
    tile(s, r0, o0, vectors, out);
  }
  static constexpr int rows(int vectors) { return (void)vectors, kShortRows; }
};

#if defined(PRIVLEAK_X86_AVX2)
// ------------------------------------------------------------------------------- AVX2, AVX-512

// The SIMD tile: tile_portable with MR x NV vectors of accumulators, each x value broadcast once
// per position. One body for both widths, defined with each one's target and intrinsics (a
// template cannot take a target attribute per instantiation).
#define PRIVLEAK_CONV_TILE(NAME, TARGET, VEC, LANES, ZERO, LOAD, SET1, FMADD, STORE)                      \
  template <int MR, int NV, bool Consecutive>                                                            \
  TARGET void NAME(const Sample<float>& s, int64_t r0, int64_t o0, float* tile) {                         \
    VEC acc[MR][NV];                                                                                     \
    PRIVLEAK_UNROLL                                                                                      \
    for (int i = 0; i < MR; ++i)                                                                         \
      PRIVLEAK_UNROLL                                                                                    \
      for (int j = 0; j < NV; ++j) acc[i][j] = ZERO();                                                   \
    int64_t offsets[MR];                                                                                 \
    for (int i = 0; i < MR; ++i) offsets[i] = Consecutive ? i : s.offsets[r0 + i];                       \
    const float* xp = Consecutive ? s.xp + s.offsets[r0] : s.xp;                                         \
    const float* gt = s.gt + o0;                                                                         \
    for (int64_t t = 0; t < s.positions; ++t, gt += s.row) {                                             \
      const float* corner = xp + s.corners[t];                                                           \
      VEC gv[NV];                                                                                        \
      PRIVLEAK_UNROLL                                                                                    \
      for (int j = 0; j < NV; ++j) gv[j] = LOAD(gt + LANES * j);                                         \
      PRIVLEAK_UNROLL                                                                                    \
      for (int i = 0; i < MR; ++i) {                                                                     \
        const VEC xv = SET1(corner[offsets[i]]);                                                         \
        PRIVLEAK_UNROLL                                                                                  \
        for (int j = 0; j < NV; ++j) acc[i][j] = FMADD(xv, gv[j], acc[i][j]);                            \
      }                                                                                                  \
    }                                                                                                    \
    PRIVLEAK_UNROLL                                                                                      \
    for (int i = 0; i < MR; ++i)                                                                         \
      PRIVLEAK_UNROLL                                                                                    \
      for (int j = 0; j < NV; ++j) STORE(tile + (r0 + i) * s.row + o0 + LANES * j, acc[i][j]);           \
  }

PRIVLEAK_CONV_TILE(tile_avx2, PRIVLEAK_CONV_AVX2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_set1_ps,
                   _mm256_fmadd_ps, _mm256_storeu_ps)
PRIVLEAK_CONV_TILE(tile_avx512, PRIVLEAK_CONV_AVX512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
                   _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps)
#undef PRIVLEAK_CONV_TILE

// Block (i0, j0) of transpose_avx2, inlined there (a call per block of 64 elements is overhead
// on small layers: the paper CNN's first one has 25 x 12 elements a sample).
template <bool Canonical>
PRIVLEAK_CONV_AVX2 __attribute__((always_inline)) inline void transpose_block_avx2(
    SourceRows<float> src, int64_t rows, int64_t cols, float* dst, int64_t dst_stride, int64_t i0, int64_t j0) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int n = static_cast<int>(std::min<int64_t>(8, rows - i0)), m = static_cast<int>(std::min<int64_t>(8, cols - j0));
  const __m256i load_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(m), lane);
  __m256 r[8];
  PRIVLEAK_UNROLL
  for (int i = 0; i < 8; ++i)
    r[i] = i >= n ? _mm256_setzero_ps()
           : m == 8 ? _mm256_loadu_ps(src(i0 + i) + j0)
                    : _mm256_maskload_ps(src(i0 + i) + j0, load_mask);
  __m256 t[8], u[8];
  PRIVLEAK_UNROLL
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  PRIVLEAK_UNROLL
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  const __m256i store_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  float* to = dst + j0 * dst_stride + i0;
  PRIVLEAK_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j >= m) break;
    // The immediates literal: a conditional one is constant only once the loop is unrolled, which
    // -O1 (the sanitizer build) and -O0 do not do, and the build failed there.
    __m256 v = j < 4 ? _mm256_permute2f128_ps(u[j % 4], u[j % 4 + 4], 0x20)
                     : _mm256_permute2f128_ps(u[j % 4], u[j % 4 + 4], 0x31);
    if (Canonical) v = _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (n == 8) _mm256_storeu_ps(to + j * dst_stride, v);
    else _mm256_maskstore_ps(to + j * dst_stride, store_mask, v);
  }
}

// dst[j dst_stride + i] = src(i)[j] for i < rows and j < cols, in 8 x 8 blocks transposed in
// registers (canonical: NaNs stored as conv_result stores them), in transpose_into's order of
// blocks. The scalar form, transpose_into below, moved one element per 3 cycles: the output
// permutation and the two input copies took half the paper CNN's 12-channel layers' time, as much
// as the fma chains (B = 64, one thread: 0.13 / 0.28 / 0.26 -> 0.10 / 0.19 / 0.18 ms; CIFAR's
// layers 12-17%).
template <bool Canonical, bool RowsWhole>
PRIVLEAK_CONV_AVX2 void transpose_avx2(SourceRows<float> src, int64_t rows, int64_t cols, float* dst,
                                       int64_t dst_stride) {
  if (RowsWhole) {
    for (int64_t j0 = 0; j0 < cols; j0 += 8)
      for (int64_t i0 = 0; i0 < rows; i0 += 8) transpose_block_avx2<Canonical>(src, rows, cols, dst, dst_stride, i0, j0);
  } else {
    for (int64_t i0 = 0; i0 < rows; i0 += 8)
      for (int64_t j0 = 0; j0 < cols; j0 += 8) transpose_block_avx2<Canonical>(src, rows, cols, dst, dst_stride, i0, j0);
  }
}

// The tile of rows r0 .. r0 + MR - 1, by constants from one pointer where they are consecutive.
template <int MR, int NV>
void tile_avx2_rows(const Sample<float>& s, int64_t r0, int64_t o0, float* tile) {
  if (consecutive_rows(s.offsets, r0, MR)) tile_avx2<MR, NV, true>(s, r0, o0, tile);
  else tile_avx2<MR, NV, false>(s, r0, o0, tile);
}

template <int MR, int NV>
void tile_avx512_rows(const Sample<float>& s, int64_t r0, int64_t o0, float* tile) {
  if (consecutive_rows(s.offsets, r0, MR)) tile_avx512<MR, NV, true>(s, r0, o0, tile);
  else tile_avx512<MR, NV, false>(s, r0, o0, tile);
}

struct Avx2 {
  using Acc = float;
  static constexpr int lanes = 8, max_vectors = 2;
  static constexpr bool simd_transpose = true;
  static constexpr int rows(int vectors) { return vectors == 1 ? 8 : 6; }
  static void tile(const Sample<float>& s, int64_t r0, int64_t o0, int vectors, float* out) {
    if (vectors == 1) tile_avx2_rows<8, 1>(s, r0, o0, out);
    else tile_avx2_rows<6, 2>(s, r0, o0, out);
  }
  static void short_tile(const Sample<float>& s, int64_t r0, int64_t o0, int vectors, float* out) {
    if (vectors == 1) tile_avx2_rows<kShortRows, 1>(s, r0, o0, out);
    else tile_avx2_rows<kShortRows, 2>(s, r0, o0, out);
  }
};

struct Avx512 {
  using Acc = float;
  static constexpr int lanes = 16, max_vectors = 4;
  static constexpr bool simd_transpose = true;
  static constexpr int rows(int vectors) { return vectors == 1 ? 12 : vectors == 2 ? 8 : 6; }
  static void tile(const Sample<float>& s, int64_t r0, int64_t o0, int vectors, float* out) {
    switch (vectors) {
      case 1: return tile_avx512_rows<12, 1>(s, r0, o0, out);
      case 2: return tile_avx512_rows<8, 2>(s, r0, o0, out);
      case 3: return tile_avx512_rows<6, 3>(s, r0, o0, out);
      default: return tile_avx512_rows<6, 4>(s, r0, o0, out);
    }
  }
  static void short_tile(const Sample<float>& s, int64_t r0, int64_t o0, int vectors, float* out) {
    switch (vectors) {
      case 1: return tile_avx512_rows<kShortRows, 1>(s, r0, o0, out);
      case 2: return tile_avx512_rows<kShortRows, 2>(s, r0, o0, out);
      case 3: return tile_avx512_rows<kShortRows, 3>(s, r0, o0, out);
      default: return tile_avx512_rows<kShortRows, 4>(s, r0, o0, out);
    }
  }
};
#endif

// ------------------------------------------------------------------------------------ one sample

// dst[j dst_stride + i] = src(i)[j], widened (canonical: NaNs as conv_result stores them), for
// i < rows and j < cols: in 16 x 16 blocks, so that the reads are runs and each line written is
// filled while in L1 (a plain loop wrote one element per line and took a sixth of the kernel's
// time at C = O = 32). A SIMD path transposes float blocks in registers instead. The blocks go
// along src's rows, or with ``RowsWhole`` down them, each of dst's rows written whole before
// the next: rows of dst a near power of two apart (the weight's C k of 128 x 9 floats) share a
// few cache sets, and a pass along src's rows wrote a block to each of them in turn.
template <class P, bool Canonical = false, bool RowsWhole = false, class In, class Acc>
void transpose_into(SourceRows<In> src, int64_t rows, int64_t cols, Acc* dst, int64_t dst_stride) {
#if defined(PRIVLEAK_X86_AVX2)
  if constexpr (P::simd_transpose && std::is_same_v<In, float> && std::is_same_v<Acc, float>)
    return transpose_avx2<Canonical, RowsWhole>(src, rows, cols, dst, dst_stride);
#endif
  const int64_t blocks_down = (rows + 15) / 16, blocks_along = (cols + 15) / 16;
  for (int64_t b = 0; b < blocks_down * blocks_along; ++b) {  // a division a block of 256 elements
    const int64_t i0 = 16 * (RowsWhole ? b % blocks_down : b / blocks_along);
    const int64_t j0 = 16 * (RowsWhole ? b / blocks_down : b % blocks_along);
    const int64_t i1 = std::min(rows, i0 + 16), j1 = std::min(cols, j0 + 16);
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t j = j0; j < j1; ++j) {
        const Acc v = static_cast<Acc>(Element<In>::load(src(i)[j]));
        dst[j * dst_stride + i] = Canonical ? conv_result(v) : v;
      }
  }
}

// What every sample of a call shares: the scratch sizes and each gradient row's offset into xp
// (computed once a call: per sample, the divisions took as long as the paper CNN's 12-channel
// layers' whole fma work).
template <class P>
struct Layout {
  int64_t hp, wp, positions, out_pad, rows, row, cs, rows_pad;
  std::vector<int64_t> offsets, corners, weight_rows;

  explicit Layout(const ConvGeometry& c)
      : hp(c.padded_height()),
        wp(c.padded_width()),
        positions(c.positions()),
        out_pad(round_up(c.outputs, P::lanes)),
        rows(c.kernel_size() * c.channels),
        row(spread_stride(out_pad)),  // gt's and the tile's row stride
        cs(spread_stride(c.channels)),  // xp's pixel stride
        rows_pad(rows + kMaxRows),  // tiles run up to kMaxRows past the last row: those repeat it, unread
        offsets(static_cast<size_t>(rows_pad)),
        corners(static_cast<size_t>(positions)),
        weight_rows(static_cast<size_t>(rows)) {
    for (int64_t r = 0; r < rows_pad; ++r) {
      const int64_t entry = std::min(r, rows - 1), ch = entry % c.channels, k = entry / c.channels;
      offsets[r] = ((k / c.kernel_w) * c.dilation_h * wp + (k % c.kernel_w) * c.dilation_w) * cs + ch;
    }
    // One loop over the positions, not over rows then columns: at 7 x 7 outputs (the paper CNN)
    // a tile's registers were reloaded every 7 positions.
    for (int64_t t = 0; t < positions; ++t)
      corners[t] = ((t / c.out_width) * c.stride_h * wp + (t % c.out_width) * c.stride_w) * cs;
    // Column (ch, k) of the weight's rows (o, ch, k) is row k C + ch of the tile.
    const int64_t kernel = c.kernel_size();
    for (int64_t e = 0; e < rows; ++e) weight_rows[e] = ((e % kernel) * c.channels + e / kernel) * row;
  }
};

// Scratch of one thread: the sample's padded input, transposed output gradient and gradient tile.
// Allocated zeroed, and the samples rewrite only what they fill: xp's borders, its channels past
// C and gt's outputs past O stay zero (the channels are never read, the outputs' lanes computed
// and not read).
template <class P>
struct Workspace {
  std::vector<typename P::Acc> xp, gt, tile;

  explicit Workspace(const Layout<P>& l)
      : xp(static_cast<size_t>(l.hp * l.wp * l.cs)),
        gt(static_cast<size_t>(l.positions * l.row)),
        tile(static_cast<size_t>(l.rows_pad * l.row)) {}
};

template <class P, class In, class Out>
void sample_grads(const In* x, const In* g, const ConvGeometry& c, const Layout<P>& l, Workspace<P>& ws, Out* out) {
  using Acc = typename P::Acc;
  for (int64_t i = 0; i < c.height; ++i)  // the image into xp's interior, transposed row by row
    transpose_into<P>(SourceRows<In>{x + i * c.width, c.height * c.width}, c.channels, c.width,
                      ws.xp.data() + ((i + c.pad_h) * l.wp + c.pad_w) * l.cs, l.cs);
  transpose_into<P>(SourceRows<In>{g, l.positions}, c.outputs, l.positions, ws.gt.data(), l.row);
  const Sample<Acc> s{ws.xp.data(), ws.gt.data(), l.offsets.data(), l.corners.data(), l.row, l.positions};
  for (int64_t o0 = 0; o0 < l.out_pad; o0 += int64_t(P::max_vectors) * P::lanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(P::max_vectors, (l.out_pad - o0) / P::lanes));
    const int64_t tall = P::rows(vectors);
    int64_t r0 = 0;
    for (; r0 + tall <= l.rows; r0 += tall) P::tile(s, r0, o0, vectors, ws.tile.data());
    if (l.rows - r0 > 2 * kShortRows) {  // one tall tile, partly past the end, beats three short ones
      P::tile(s, r0, o0, vectors, ws.tile.data());
      r0 += tall;
    }
    for (; r0 < l.rows; r0 += kShortRows) P::short_tile(s, r0, o0, vectors, ws.tile.data());
  }
  // tile[(k C + ch), o] -> out[o, ch, k]: one transpose of the tile's rows gathered in the
  // weight's order, each row of out written whole (a transpose per channel of its k x O matrix
  // wrote runs of k elements: at C = O = 128, 8 x 8 pixels, it took half of the kernel's time).
  transpose_into<P, true, true>(SourceRows<Acc>{ws.tile.data(), 0, l.weight_rows.data()}, l.rows, c.outputs, out,
                                l.rows);
}

template <class P, class In, class Out>
void conv_grads_path(const In* x, const In* g, const ConvGeometry& c, Out* out) {
  const int64_t work = c.batch * c.positions() * c.grad_size() / 16;  // vector FMAs, about
  const bool parallel = work >= kMinParallelWork;
  const Layout<P> layout(c);
  std::exception_ptr failure;  // an exception must not leave a parallel region (std::terminate)
#pragma omp parallel if (parallel)
  {
    std::optional<Workspace<P>> ws;  // allocated in the try: bad_alloc is caught there
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < c.batch; ++n) {
      try {
        if (!ws) ws.emplace(layout);
        sample_grads<P>(x + n * c.channels * c.height * c.width, g + n * c.outputs * c.positions(), c, layout, *ws,
                        out + n * c.grad_size());
      } catch (...) {
#pragma omp critical(privleak_conv_grads_failure)
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

void conv_weight_grads(NoiseDType dtype, const void* x, const void* g, const ConvGeometry& geometry, void* out,
                       CpuCapability path) {
  check_conv_geometry(geometry);
  if (static_cast<int>(path) > static_cast<int>(cpu_best_capability()))
    throw std::invalid_argument(std::string("conv_weight_grads: this CPU cannot run the ") + capability_name(path) +
                                " path (it has " + capability_name(cpu_best_capability()) + ")");
  dispatch_ghost_dtype(dtype, [&](auto tag) {
    using In = decltype(tag);
    const In* xs = static_cast<const In*>(x);
    const In* gs = static_cast<const In*>(g);
    if constexpr (std::is_same_v<In, double>) {
      conv_grads_path<Portable<double>>(xs, gs, geometry, static_cast<double*>(out));
    } else {
      float* o = static_cast<float*>(out);
#if defined(PRIVLEAK_X86_AVX2)
      if (path == CpuCapability::avx512) return conv_grads_path<Avx512>(xs, gs, geometry, o);
      if (path == CpuCapability::avx2) return conv_grads_path<Avx2>(xs, gs, geometry, o);
#endif
      conv_grads_path<Portable<float>>(xs, gs, geometry, o);
    }
  });
}

}  // namespace privleak::cpu
