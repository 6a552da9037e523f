// CPU sup-over-inputs kernels, blocked like a GEMM (Goto and van de Geijn, "Anatomy of
// high-performance matrix multiplication", 2008) with the reduction fused into the last step, so
// the n_queries x n_inputs matrix of scores never exists.
//
// A tile is G::Q queries (two SIMD vectors, the queries in the lanes) by G::X inputs. With AVX2
// (and in the portable kernel) that is 2 x 8 float32 (2 x 4 float64) queries by 6 inputs: 12
// vector accumulators, the register budget of AVX2's 16. With AVX-512 it is 2 x 16 (2 x 8)
// queries by 12 inputs: 24 accumulators of the 32 zmm registers, twice the FMA width and twice
// the inputs per query load. Queries are packed into panels that hold, for each coordinate, the
// tile's queries side by side; inputs likewise, G::X side by side. One step of the tile kernel
// loads two query vectors and broadcasts G::X input values. With the queries in the lanes,
// keeping each query's best input is a lane-wise compare and blend, so the fused reduction costs
// a few instructions per tile.
//
// Blocking: a thread owns a block of up to kQueryBlock queries and a range of inputs; it walks the
// inputs in blocks of kInputBlock and the coordinates in blocks of G::D. The inputs are packed
// once for everyone when they fit (else by each thread, block by block), the queries by their
// thread (once for all coordinates when they fit). The packed query tile (G::Q x G::D) stays in
// L1 while the input block (kInputBlock x G::D) streams from L2. When p exceeds G::D, accumulators
// are parked in `partial` between coordinate blocks, which changes no bit: they are T in
// registers too.
//
// Determinism: every pair's score is computed by the operations of common/nearest.h in
// coordinate order, whatever the blocks, and each thread visits its inputs in increasing order
// keeping the first of equal scores; ranges of inputs are folded in order. So the winners depend
// on neither the thread count nor the blocking nor the tile shape, and the portable, AVX2 and
// AVX-512 kernels give the same bits (tests check all three). The path is chosen at load time
// (cpu/platform.h: cpu_capability_level()), or by the caller among those the CPU has.
#include "cpu/nearest.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/nearest.h"
#include "cpu/platform.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PRIVLEAK_HAS_AVX2_KERNEL 1
#define PRIVLEAK_AVX2 __attribute__((target("avx2,fma")))
#define PRIVLEAK_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
// The avx512 tier of cpu/platform.h (F, BW, DQ, VL); only these functions are built for it.
#define PRIVLEAK_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")))
#define PRIVLEAK_AVX512_INLINE \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl"), always_inline)) inline
#else
#define PRIVLEAK_HAS_AVX2_KERNEL 0
#endif

namespace privleak::cpu {
namespace {

// The shape of a tile kernel's work: Q queries by X inputs per tile, D coordinates per block.
template <class T, int kQueries, int kInputs, int64_t kDepth>
struct Geometry {
  using Type = T;
  static constexpr int Q = kQueries;
  static constexpr int X = kInputs;
  static constexpr int64_t D = kDepth;
};
// Portable and AVX2: two 256-bit vectors of queries by 6 inputs. The packed query tile
// (Q x D) takes 16 KiB, half of L1, and stays there while the block's inputs stream past.
template <class T>
using Geometry256 = Geometry<T, 64 / static_cast<int>(sizeof(T)), 6, 1024 / sizeof(T)>;
// AVX-512: two 512-bit vectors of queries by 12 inputs, the query tile again 16 KiB.
template <class T>
using Geometry512 = Geometry<T, 128 / static_cast<int>(sizeof(T)), 12, 128>;

// Inputs per block: the packed input block (kInputBlock x D) takes 120 KiB of L2 (60 KiB with
// AVX-512), so that two threads sharing a core's L2 (SMT) still fit. A multiple of every G::X:
// the packed inputs hold whole blocks of kInputBlock rows.
constexpr int64_t kInputBlock = 120;
static_assert(kInputBlock % Geometry256<float>::X == 0 && kInputBlock % Geometry512<float>::X == 0);
// Queries per block: each input block, read from memory (and packed, when the inputs are not
// packed once), serves this many queries from L2.
constexpr int64_t kQueryBlock = 512;
// The query block is packed once for all p coordinates when it takes at most this many elements
// (4 MiB of float32); beyond, it is packed again for each block of inputs and coordinates.
constexpr int64_t kPackedQueryBudget = int64_t(1) << 20;
// The inputs are packed once, for all threads and query blocks, when more than one query block
// reads them and they take at most this many bytes; otherwise each thread packs each input
// block as it goes, and each query block pays for a pass over the inputs.
constexpr int64_t kPackedInputBudgetBytes = int64_t(512) << 20;
// The tile kernels keep indices relative to the start of a range of inputs in lanes as wide as
// T: 32 bits for float32. Larger input sets are cut into ranges.
constexpr int64_t kMaxRange = int64_t(1) << 30;

template <class T>
using LaneIndex = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// What one call of a tile kernel works on; see the top of the file.
template <class T>
struct TileArgs {
  const T* queries;  // packed: depth x G::Q
  const T* inputs;   // packed: depth x G::X
  int64_t depth;
  T* partial;  // G::X x G::Q accumulators carried from one coordinate block to the next
  bool first_block, last_block;
  // Used by the last coordinate block only: fold the tile's scores into the queries' best.
  const T* input_norms;  // the tile's n_x (squared L2), else null
  int valid_inputs;      // inputs of the tile that exist (the rest is zero padding)
  T* best_score;         // G::Q
  LaneIndex<T>* best_index;
  LaneIndex<T> first_index;  // of the tile's first input, relative to the range
};

// The reference kernel: common/nearest.h written out. Also the kernel of machines without AVX2.
template <NearestMetric M, class G>
PRIVLEAK_FMA_CLONES void tile_portable(const TileArgs<typename G::Type>& a) {
  using T = typename G::Type;
  constexpr int Q = G::Q, kInputTile = G::X;
  T acc[kInputTile][Q];
  for (int j = 0; j < kInputTile; ++j)
    for (int i = 0; i < Q; ++i) acc[j][i] = a.first_block ? T(0) : a.partial[j * Q + i];
  for (int64_t k = 0; k < a.depth; ++k) {
    const T* q = a.queries + k * Q;
    const T* x = a.inputs + k * kInputTile;
    for (int j = 0; j < kInputTile; ++j)
      for (int i = 0; i < Q; ++i) acc[j][i] = nearest_accumulate<M>(acc[j][i], q[i], x[j]);
  }
  if (!a.last_block) {
    for (int j = 0; j < kInputTile; ++j)
      for (int i = 0; i < Q; ++i) a.partial[j * Q + i] = acc[j][i];
    return;
  }
  for (int j = 0; j < a.valid_inputs; ++j) {
    const T norm = a.input_norms ? a.input_norms[j] : T(0);
    for (int i = 0; i < Q; ++i) {
      const T score = nearest_score<M>(acc[j][i], norm);
      if (score < a.best_score[i]) {  // inputs come in increasing order: ties keep the first
        a.best_score[i] = score;
        a.best_index[i] = a.first_index + j;
      }
    }
  }
}

#if PRIVLEAK_HAS_AVX2_KERNEL
// The same operations on 256-bit vectors, lane i holding query i of the tile. Explicit FMA
// instructions round like std::fma, so this is the portable kernel's arithmetic exactly.
template <class T>
struct Avx2;

template <>
struct Avx2<float> {
  using Vec = __m256;
  using Index = __m256i;
  static PRIVLEAK_AVX2_INLINE Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static PRIVLEAK_AVX2_INLINE void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static PRIVLEAK_AVX2_INLINE Vec zero() { return _mm256_setzero_ps(); }
  static PRIVLEAK_AVX2_INLINE Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static PRIVLEAK_AVX2_INLINE Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static PRIVLEAK_AVX2_INLINE Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static PRIVLEAK_AVX2_INLINE Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static PRIVLEAK_AVX2_INLINE Vec abs(Vec a) {
    return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  }
  static PRIVLEAK_AVX2_INLINE Vec neg(Vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static PRIVLEAK_AVX2_INLINE Vec less(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static PRIVLEAK_AVX2_INLINE Vec select(Vec mask, Vec if_true, Vec if_false) {
    return _mm256_blendv_ps(if_false, if_true, mask);
  }
  static PRIVLEAK_AVX2_INLINE Index load_index(const int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static PRIVLEAK_AVX2_INLINE void store_index(int32_t* p, Index v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
  static PRIVLEAK_AVX2_INLINE Index select_index(Vec mask, int32_t if_true, Index if_false) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(if_true)), mask));
  }
};

template <>
struct Avx2<double> {
  using Vec = __m256d;
  using Index = __m256i;
  static PRIVLEAK_AVX2_INLINE Vec load(const double* p) { return _mm256_loadu_pd(p); }
  static PRIVLEAK_AVX2_INLINE void store(double* p, Vec v) { _mm256_storeu_pd(p, v); }
  static PRIVLEAK_AVX2_INLINE Vec zero() { return _mm256_setzero_pd(); }
  static PRIVLEAK_AVX2_INLINE Vec broadcast(const double* p) { return _mm256_broadcast_sd(p); }
  static PRIVLEAK_AVX2_INLINE Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_pd(a, b, c); }
  static PRIVLEAK_AVX2_INLINE Vec add(Vec a, Vec b) { return _mm256_add_pd(a, b); }
  static PRIVLEAK_AVX2_INLINE Vec sub(Vec a, Vec b) { return _mm256_sub_pd(a, b); }
  static PRIVLEAK_AVX2_INLINE Vec abs(Vec a) {
    return _mm256_and_pd(a, _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL)));
  }
  static PRIVLEAK_AVX2_INLINE Vec neg(Vec a) { return _mm256_xor_pd(a, _mm256_set1_pd(-0.0)); }
  static PRIVLEAK_AVX2_INLINE Vec less(Vec a, Vec b) { return _mm256_cmp_pd(a, b, _CMP_LT_OQ); }
  static PRIVLEAK_AVX2_INLINE Vec select(Vec mask, Vec if_true, Vec if_false) {
    return _mm256_blendv_pd(if_false, if_true, mask);
  }
  static PRIVLEAK_AVX2_INLINE Index load_index(const int64_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static PRIVLEAK_AVX2_INLINE void store_index(int64_t* p, Index v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
  static PRIVLEAK_AVX2_INLINE Index select_index(Vec mask, int64_t if_true, Index if_false) {
    return _mm256_castpd_si256(_mm256_blendv_pd(_mm256_castsi256_pd(if_false),
                                                _mm256_castsi256_pd(_mm256_set1_epi64x(if_true)), mask));
  }
};

#define PRIVLEAK_TILE_NAME tile_avx2
#define PRIVLEAK_TILE_TARGET PRIVLEAK_AVX2
#define PRIVLEAK_TILE_OPS Avx2
#define PRIVLEAK_TILE_GEOMETRY Geometry256
#include "cpu/nearest_tile.inc"
#undef PRIVLEAK_TILE_NAME
#undef PRIVLEAK_TILE_TARGET
#undef PRIVLEAK_TILE_OPS
#undef PRIVLEAK_TILE_GEOMETRY

// AVX-512: the same operations on 512-bit vectors, and masks in place of blends.
template <class T>
struct Avx512;

template <>
struct Avx512<float> {
  using Vec = __m512;
  using Index = __m512i;
  using Mask = __mmask16;
  static PRIVLEAK_AVX512_INLINE Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static PRIVLEAK_AVX512_INLINE void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static PRIVLEAK_AVX512_INLINE Vec zero() { return _mm512_setzero_ps(); }
  static PRIVLEAK_AVX512_INLINE Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static PRIVLEAK_AVX512_INLINE Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static PRIVLEAK_AVX512_INLINE Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static PRIVLEAK_AVX512_INLINE Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static PRIVLEAK_AVX512_INLINE Vec abs(Vec a) {
    return _mm512_and_ps(a, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)));
  }
  static PRIVLEAK_AVX512_INLINE Vec neg(Vec a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
  static PRIVLEAK_AVX512_INLINE Mask less(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static PRIVLEAK_AVX512_INLINE Vec select(Mask mask, Vec if_true, Vec if_false) {
    return _mm512_mask_blend_ps(mask, if_false, if_true);
  }
  static PRIVLEAK_AVX512_INLINE Index load_index(const int32_t* p) { return _mm512_loadu_si512(p); }
  static PRIVLEAK_AVX512_INLINE void store_index(int32_t* p, Index v) { _mm512_storeu_si512(p, v); }
  static PRIVLEAK_AVX512_INLINE Index select_index(Mask mask, int32_t if_true, Index if_false) {
    return _mm512_mask_blend_epi32(mask, if_false, _mm512_set1_epi32(if_true));
  }
};

template <>
struct Avx512<double> {
  using Vec = __m512d;
  using Index = __m512i;
  using Mask = __mmask8;
  static PRIVLEAK_AVX512_INLINE Vec load(const double* p) { return _mm512_loadu_pd(p); }
  static PRIVLEAK_AVX512_INLINE void store(double* p, Vec v) { _mm512_storeu_pd(p, v); }
  static PRIVLEAK_AVX512_INLINE Vec zero() { return _mm512_setzero_pd(); }
  static PRIVLEAK_AVX512_INLINE Vec broadcast(const double* p) { return _mm512_set1_pd(*p); }
  static PRIVLEAK_AVX512_INLINE Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_pd(a, b, c); }
  static PRIVLEAK_AVX512_INLINE Vec add(Vec a, Vec b) { return _mm512_add_pd(a, b); }
  static PRIVLEAK_AVX512_INLINE Vec sub(Vec a, Vec b) { return _mm512_sub_pd(a, b); }
  static PRIVLEAK_AVX512_INLINE Vec abs(Vec a) {
    return _mm512_and_pd(a, _mm512_castsi512_pd(_mm512_set1_epi64(0x7fffffffffffffffLL)));
  }
  static PRIVLEAK_AVX512_INLINE Vec neg(Vec a) { return _mm512_xor_pd(a, _mm512_set1_pd(-0.0)); }
  static PRIVLEAK_AVX512_INLINE Mask less(Vec a, Vec b) { return _mm512_cmp_pd_mask(a, b, _CMP_LT_OQ); }
  static PRIVLEAK_AVX512_INLINE Vec select(Mask mask, Vec if_true, Vec if_false) {
    return _mm512_mask_blend_pd(mask, if_false, if_true);
  }
  static PRIVLEAK_AVX512_INLINE Index load_index(const int64_t* p) { return _mm512_loadu_si512(p); }
  static PRIVLEAK_AVX512_INLINE void store_index(int64_t* p, Index v) { _mm512_storeu_si512(p, v); }
  static PRIVLEAK_AVX512_INLINE Index select_index(Mask mask, int64_t if_true, Index if_false) {
    return _mm512_mask_blend_epi64(mask, if_false, _mm512_set1_epi64(if_true));
  }
};

#define PRIVLEAK_TILE_NAME tile_avx512
#define PRIVLEAK_TILE_TARGET PRIVLEAK_AVX512
#define PRIVLEAK_TILE_OPS Avx512
#define PRIVLEAK_TILE_GEOMETRY Geometry512
#include "cpu/nearest_tile.inc"
#undef PRIVLEAK_TILE_NAME
#undef PRIVLEAK_TILE_TARGET
#undef PRIVLEAK_TILE_OPS
#undef PRIVLEAK_TILE_GEOMETRY
#endif

template <class T>
using TileKernel = void (*)(const TileArgs<T>&);

// Rows [0, count) of `rows`, coordinates [k0, k0 + depth), into panels of kTile rows: panel r
// holds, for each coordinate, its kTile rows side by side. Rows past `count` are zero; zeros
// leave every accumulator as it is (fma(0, 0, a) = a, a + |0 - 0| = a) and are never scored.
template <int kTile, class T>
void pack_panels(const T* rows, int64_t stride, int64_t count, int64_t k0, int64_t depth, const T* center, T* out) {
  const T* block_center = center ? center + k0 : nullptr;
  for (int64_t panel = 0; panel < ceil_div(count, kTile); ++panel) {
    T* dst = out + panel * kTile * depth;
    for (int r = 0; r < kTile; ++r) {
      const int64_t row = panel * kTile + r;
      if (row < count) {
        const T* src = rows + row * stride + k0;
        for (int64_t k = 0; k < depth; ++k) dst[k * kTile + r] = centred(src[k], block_center, k);
      } else {
        for (int64_t k = 0; k < depth; ++k) dst[k * kTile + r] = T(0);
      }
    }
  }
}

// n_x of inputs [begin, end). Cloned outside the parallel loop: OpenMP outlines a loop's body
// into a function of its own, which would not inherit the clone's target.
template <class T>
PRIVLEAK_FMA_CLONES void input_norms_range(const T* inputs, int64_t stride, int64_t p, const T* center,
                                           int64_t begin, int64_t end, T* norms) {
  for (int64_t j = begin; j < end; ++j) norms[j] = centred_squared_norm(inputs + j * stride, center, p);
}

template <class T>
void compute_input_norms(const T* inputs, int64_t n_inputs, int64_t stride, int64_t p, const T* center, T* norms) {
  constexpr int64_t kChunk = 64;
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < ceil_div(n_inputs, kChunk); ++chunk)
    input_norms_range(inputs, stride, p, center, chunk * kChunk, std::min(n_inputs, (chunk + 1) * kChunk), norms);
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

template <class T>
std::unique_ptr<T[], FreeDeleter> aligned_buffer(int64_t count) {
  constexpr size_t kAlign = 64;
  const size_t bytes = round_up(std::max<int64_t>(count, 1) * static_cast<int64_t>(sizeof(T)), kAlign);
  void* p = std::aligned_alloc(kAlign, bytes);
  if (!p) throw std::bad_alloc();
  return std::unique_ptr<T[], FreeDeleter>(static_cast<T*>(p));
}

bool packs_queries_once(int64_t query_block, int64_t p) { return query_block * p <= kPackedQueryBudget; }

// One thread's packing buffers and running best.
template <class G>
struct Workspace {
  using T = typename G::Type;
  bool queries_packed_once;
  std::unique_ptr<T[], FreeDeleter> queries, inputs, partial, best_score;
  std::unique_ptr<LaneIndex<T>[], FreeDeleter> best_index;

  Workspace(int64_t query_block, int64_t p, bool inputs_packed)
      : queries_packed_once(packs_queries_once(query_block, p)),
        queries(aligned_buffer<T>(query_block * (queries_packed_once ? p : G::D))),
        inputs(aligned_buffer<T>(inputs_packed ? 0 : kInputBlock * G::D)),
        partial(aligned_buffer<T>(p > G::D ? query_block * kInputBlock : 0)),
        best_score(aligned_buffer<T>(query_block)),
        best_index(aligned_buffer<LaneIndex<T>>(query_block)) {}
};

template <class T>
struct Problem {
  const T* queries;
  int64_t n_queries, query_stride;
  const T* inputs;
  int64_t n_inputs, input_stride, p;
  const T* center;        // squared L2, else null
  const T* input_norms;   // squared L2, else null
  const T* packed_inputs;  // all inputs packed (pack_all_inputs), or null
};

// Where input block b (inputs b * kInputBlock on), coordinates [k0, k0 + depth), starts in the
// packed inputs: whole blocks before it hold kInputBlock * p elements, and within the block each
// coordinate block holds its panels (the block's inputs rounded up to a tile) times its depth.
template <class G>
int64_t packed_input_offset(const Problem<typename G::Type>& pr, int64_t block, int64_t k0) {
  const int64_t block_inputs = std::min(kInputBlock, pr.n_inputs - block * kInputBlock);
  return block * kInputBlock * pr.p + round_up(block_inputs, G::X) * k0;
}

template <class G>
std::unique_ptr<typename G::Type[], FreeDeleter> pack_all_inputs(const Problem<typename G::Type>& pr) {
  const int64_t blocks = ceil_div(pr.n_inputs, kInputBlock);
  const int64_t depth_blocks = ceil_div(pr.p, G::D);
  auto packed = aligned_buffer<typename G::Type>(round_up(pr.n_inputs, G::X) * pr.p);
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < blocks * depth_blocks; ++item) {
    const int64_t block = item / depth_blocks, k0 = (item % depth_blocks) * G::D;
    pack_panels<G::X>(pr.inputs + block * kInputBlock * pr.input_stride, pr.input_stride,
                      std::min(kInputBlock, pr.n_inputs - block * kInputBlock), k0, std::min(G::D, pr.p - k0),
                      pr.center, packed.get() + packed_input_offset<G>(pr, block, k0));
  }
  return packed;
}

// The best input in [x_begin, x_begin + x_count) of each query in [q_begin, q_begin + q_count),
// into best_score / best_index (absolute).
template <class G, class T = typename G::Type>
void reduce_block(const Problem<T>& pr, TileKernel<T> tile, int64_t q_begin, int64_t q_count, int64_t x_begin,
                  int64_t x_count, Workspace<G>& ws, T* best_score, int64_t* best_index) {
  constexpr int Q = G::Q, kInputTile = G::X;
  const int64_t query_tiles = ceil_div(q_count, Q);
  std::fill_n(ws.best_score.get(), query_tiles * Q, std::numeric_limits<T>::infinity());
  std::fill_n(ws.best_index.get(), query_tiles * Q, LaneIndex<T>(0));
  const T* queries = pr.queries + q_begin * pr.query_stride;
  // Packed once, tile t holds all p coordinates from ws.queries + t * Q * p on; packed per
  // block, the block's depth coordinates from ws.queries + t * Q * depth on.
  const bool queries_packed_once = ws.queries_packed_once;
  if (queries_packed_once) pack_panels<Q>(queries, pr.query_stride, q_count, 0, pr.p, pr.center, ws.queries.get());

  for (int64_t xb = 0; xb < x_count; xb += kInputBlock) {
    const int64_t block_inputs = std::min(kInputBlock, x_count - xb);
    const int64_t input_tiles = ceil_div(block_inputs, kInputTile);
    for (int64_t k0 = 0; k0 < pr.p; k0 += G::D) {
      const int64_t depth = std::min(G::D, pr.p - k0);
      if (!queries_packed_once)
        pack_panels<Q>(queries, pr.query_stride, q_count, k0, depth, pr.center, ws.queries.get());
      const T* input_panels = ws.inputs.get();
      if (pr.packed_inputs)
        input_panels = pr.packed_inputs + packed_input_offset<G>(pr, (x_begin + xb) / kInputBlock, k0);
      else
        pack_panels<kInputTile>(pr.inputs + (x_begin + xb) * pr.input_stride, pr.input_stride, block_inputs, k0,
                                depth, pr.center, ws.inputs.get());
      for (int64_t t = 0; t < query_tiles; ++t) {
        for (int64_t u = 0; u < input_tiles; ++u) {
          const int64_t first = xb + u * kInputTile;  // relative to x_begin
          const T* query_panel = queries_packed_once ? ws.queries.get() + (t * pr.p + k0) * Q
                                                     : ws.queries.get() + t * Q * depth;
          tile({query_panel, input_panels + u * kInputTile * depth, depth,
                ws.partial.get() + (t * input_tiles + u) * Q * kInputTile, k0 == 0, k0 + depth == pr.p,
                pr.input_norms ? pr.input_norms + x_begin + first : nullptr,
                static_cast<int>(std::min<int64_t>(kInputTile, block_inputs - u * kInputTile)),
                ws.best_score.get() + t * Q, ws.best_index.get() + t * Q, static_cast<LaneIndex<T>>(first)});
        }
      }
    }
  }
  for (int64_t i = 0; i < q_count; ++i) {
    best_score[i] = ws.best_score[i];
    best_index[i] = x_begin + ws.best_index[i];
  }
}

// The blocked loop of G's tile kernel `tile`; input_norms already in `pr`.
template <class G, class T = typename G::Type>
void nearest_blocked(Problem<T> pr, TileKernel<T> tile, std::vector<T>& range_score, std::vector<int64_t>& range_index,
                     int64_t& ranges) {
  // Work items: (block of queries, range of inputs). Ranges split the inputs when there are too
  // few query blocks to keep every thread busy. Any split gives the same result.
  const int64_t query_block = std::min(kQueryBlock, round_up(pr.n_queries, int64_t(G::Q)));
  const int64_t query_blocks = ceil_div(pr.n_queries, query_block);
  const int64_t threads = max_threads();
  ranges = ceil_div(pr.n_inputs, kMaxRange);
  if (query_blocks < 2 * threads)
    ranges = std::max(ranges, std::min(ceil_div(2 * threads, query_blocks), ceil_div(pr.n_inputs, kInputBlock)));
  const int64_t range_length = round_up(ceil_div(pr.n_inputs, ranges), kInputBlock);
  ranges = ceil_div(pr.n_inputs, range_length);

  std::unique_ptr<T[], FreeDeleter> packed_inputs;
  if (query_blocks > 1 && round_up(pr.n_inputs, G::X) * pr.p * int64_t(sizeof(T)) <= kPackedInputBudgetBytes) {
    packed_inputs = pack_all_inputs<G>(pr);
    pr.packed_inputs = packed_inputs.get();
  }

  // Each range's winners, range-major; folded in range order by the caller.
  range_score.resize(static_cast<size_t>(ranges * pr.n_queries));
  range_index.resize(static_cast<size_t>(ranges * pr.n_queries));
  const int64_t items = query_blocks * ranges;
  // Allocated here: an exception (bad_alloc) must not leave an OpenMP region.
  std::vector<Workspace<G>> workspaces;
  for (int64_t t = 0; t < threads; ++t) workspaces.emplace_back(query_block, pr.p, pr.packed_inputs != nullptr);
#pragma omp parallel
  {
    Workspace<G>& ws = workspaces[thread_index()];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / ranges, r = item % ranges;
      const int64_t q_begin = b * query_block, x_begin = r * range_length;
      const int64_t offset = r * pr.n_queries + q_begin;
      reduce_block<G>(pr, tile, q_begin, std::min(query_block, pr.n_queries - q_begin), x_begin,
                      std::min(range_length, pr.n_inputs - x_begin), ws, range_score.data() + offset,
                      range_index.data() + offset);
    }
  }
}

template <NearestMetric M, class T>
void nearest_typed(Problem<T> pr, double* out_value, int64_t* out_index, CpuCapability path) {
  std::vector<T> norms;
  if constexpr (M == NearestMetric::squared_l2) {
    norms.resize(static_cast<size_t>(pr.n_inputs));
    compute_input_norms(pr.inputs, pr.n_inputs, pr.input_stride, pr.p, pr.center, norms.data());
    pr.input_norms = norms.data();
  }
  std::vector<T> range_score;
  std::vector<int64_t> range_index;
  int64_t ranges = 0;
#if PRIVLEAK_HAS_AVX2_KERNEL
  if (path == CpuCapability::avx512)
    nearest_blocked<Geometry512<T>>(pr, &tile_avx512<M, T>, range_score, range_index, ranges);
  else if (path == CpuCapability::avx2)
    nearest_blocked<Geometry256<T>>(pr, &tile_avx2<M, T>, range_score, range_index, ranges);
  else
#else
  (void)path;
#endif
    nearest_blocked<Geometry256<T>>(pr, &tile_portable<M, Geometry256<T>>, range_score, range_index, ranges);

#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pr.n_queries; ++i) {
    T score = range_score[i];
    int64_t index = range_index[i];
    for (int64_t r = 1; r < ranges; ++r) {
      if (nearest_better(range_score[r * pr.n_queries + i], range_index[r * pr.n_queries + i], score, index)) {
        score = range_score[r * pr.n_queries + i];
        index = range_index[r * pr.n_queries + i];
      }
    }
    out_index[i] = index;
    out_value[i] = nearest_exact_value<M>(pr.queries + i * pr.query_stride, pr.inputs + index * pr.input_stride, pr.p);
  }
}

}  // namespace

void nearest(DType dtype, NearestMetric metric, const void* queries, int64_t n_queries, int64_t query_stride,
             const void* inputs, int64_t n_inputs, int64_t input_stride, int64_t p, const void* center,
             double* out_value, int64_t* out_index, CpuCapability path) {
  if (n_queries < 0 || n_inputs < 1 || p < 1)
    throw std::invalid_argument("nearest needs n_queries >= 0, n_inputs >= 1 and p >= 1");
  if (static_cast<int>(path) > static_cast<int>(cpu_best_capability()))
    throw std::invalid_argument(std::string("nearest: this CPU cannot run the ") + capability_name(path) +
                                " path (it has " + capability_name(cpu_best_capability()) + ")");
  if (n_queries == 0) return;
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    const Problem<T> problem{static_cast<const T*>(queries), n_queries, query_stride, static_cast<const T*>(inputs),
                             n_inputs, input_stride, p,
                             metric == NearestMetric::squared_l2 ? static_cast<const T*>(center) : nullptr, nullptr,
                             nullptr};
    dispatch_metric(metric, [&](auto m) {
      nearest_typed<decltype(m)::value, T>(problem, out_value, out_index, path);
    });
  });
}

}  // namespace privleak::cpu
