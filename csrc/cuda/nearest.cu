// CUDA sup-over-inputs kernels. A block owns a tile of queries and a range of inputs, walks the
// range in tiles staged through shared memory (SGEMM-style: each thread accumulates a TM x TN
// register tile), and after each input tile folds the scores into each query's running best;
// the scores of a tile never leave registers. At the end of the range the threads that share a
// query combine their bests with warp shuffles, and a second kernel folds the ranges and
// recomputes each winner's value in float64.
//
// The fp32/fp64 kernel runs the operations of common/nearest.h per pair in coordinate order
// (padding coordinates are zeros, which change no accumulator), and nearest_better is a total
// order, so the winners are those of the CPU for any split into ranges. The TF32 kernel is
// described in cuda/nearest.h.
#include "cuda/nearest.h"

#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "common/nearest.h"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;

// Register tiling of the fp32 / fp64 kernel: a block of 256 threads as 16 x 16, each thread
// owning queries ty + 16 i (i < TM) and inputs tx + 16 j (j < TN) of the block tile.
template <class T>
struct SimtShape;
template <>
struct SimtShape<float> {
  static constexpr int kTM = 8, kTN = 8, kDepth = 8;
};
template <>
struct SimtShape<double> {
  static constexpr int kTM = 4, kTN = 4, kDepth = 8;
};
constexpr int kThreadsPerSide = 16;

// The TF32 kernel: 64 x 64 block tiles, 4 warps each computing 32 x 32 with 16 x 16 x 8 MMAs.
constexpr int kTcTile = 64;
constexpr int kTcThreads = 128;
constexpr int kTcDepth = 32;
constexpr int kTcPad = 4;  // keeps rows 16-byte multiples (WMMA's ldm) and spreads banks

// How the inputs are split: ranges of whole input tiles, enough (query tiles x ranges) blocks to
// fill the device. The result does not depend on it.
struct Plan {
  int64_t query_tiles, ranges, range_length;
};

Plan make_plan(int64_t n_queries, int64_t n_inputs, int64_t tile_queries, int64_t tile_inputs, int multiprocessors) {
  const int64_t query_tiles = (n_queries + tile_queries - 1) / tile_queries;
  const int64_t input_tiles = (n_inputs + tile_inputs - 1) / tile_inputs;
  const int64_t wanted_blocks = 4 * static_cast<int64_t>(multiprocessors);
  int64_t ranges = (wanted_blocks + query_tiles - 1) / query_tiles;
  ranges = std::max<int64_t>(1, std::min<int64_t>({ranges, input_tiles, 65535}));
  const int64_t range_length = ((input_tiles + ranges - 1) / ranges) * tile_inputs;
  return {query_tiles, (n_inputs + range_length - 1) / range_length, range_length};
}

int64_t tile_side(DType dtype, bool tensor_cores) {
  if (tensor_cores) return kTcTile;
  return dispatch_float(dtype, [](auto zero) -> int64_t {
    using Shape = SimtShape<decltype(zero)>;
    return kThreadsPerSide * Shape::kTM;  // square tiles: kTM == kTN
  });
}

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Workspace: input norms (squared L2), then each range's best score and index per query.
template <class T>
struct Workspace {
  T* norms;
  T* range_score;
  int64_t* range_index;
};

template <class T>
int64_t workspace_bytes(NearestMetric metric, int64_t n_queries, int64_t n_inputs, const Plan& plan) {
  const int64_t norms = metric == NearestMetric::squared_l2 ? align256(n_inputs * sizeof(T)) : 0;
  const int64_t entries = plan.ranges * n_queries;
  return norms + align256(entries * sizeof(T)) + align256(entries * sizeof(int64_t));
}

template <class T>
Workspace<T> workspace_view(void* workspace, NearestMetric metric, int64_t n_queries, int64_t n_inputs,
                            const Plan& plan) {
  char* bytes = static_cast<char*>(workspace);
  T* norms = metric == NearestMetric::squared_l2 ? reinterpret_cast<T*>(bytes) : nullptr;
  if (norms) bytes += align256(n_inputs * sizeof(T));
  T* score = reinterpret_cast<T*>(bytes);
  bytes += align256(plan.ranges * n_queries * sizeof(T));
  return {norms, score, reinterpret_cast<int64_t*>(bytes)};
}

template <class T>
__global__ void input_norms_kernel(const T* __restrict__ inputs, int64_t n_inputs, int64_t stride, int64_t p,
                                   const T* __restrict__ center, T* __restrict__ norms) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < n_inputs) norms[j] = centred_squared_norm(inputs + j * stride, center, p);
}

// std::numeric_limits is host-only.
template <class T>
__device__ T positive_infinity();
template <>
__device__ float positive_infinity<float>() {
  return __int_as_float(0x7f800000);
}
template <>
__device__ double positive_infinity<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}

// Element (row, k) of a row-major matrix as the kernels read it: centred, and zero outside.
template <class T>
__device__ T load_coordinate(const T* rows, int64_t stride, int64_t row, int64_t row_end, int64_t k, int64_t p,
                             const T* center) {
  return row < row_end && k < p ? centred(rows[row * stride + k], center, k) : T(0);
}

// Combines the running bests of the `width` neighbouring lanes that share a query.
template <class T>
__device__ void combine_lanes(T& score, int64_t& index, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    const T other_score = __shfl_xor_sync(0xffffffffu, score, offset);
    const int64_t other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (nearest_better(other_score, other_index, score, index)) {
      score = other_score;
      index = other_index;
    }
  }
}

template <NearestMetric M, class T>
__global__ void __launch_bounds__(kThreads) nearest_simt_kernel(
    const T* __restrict__ queries, int64_t n_queries, int64_t query_stride, const T* __restrict__ inputs,
    int64_t n_inputs, int64_t input_stride, int64_t p, const T* __restrict__ center, const T* __restrict__ norms,
    int64_t range_length, T* __restrict__ range_score, int64_t* __restrict__ range_index) {
  using Shape = SimtShape<T>;
  constexpr int TM = Shape::kTM, TN = Shape::kTN, BK = Shape::kDepth;
  constexpr int BM = kThreadsPerSide * TM, BN = kThreadsPerSide * TN;
  // Coordinate-major, so that a thread's TM (TN) values for one coordinate are one row; the
  // padding staggers the columns that one load step writes across banks.
  __shared__ T query_tile[BK][BM + 4];
  __shared__ T input_tile[BK][BN + 4];

  const int tx = threadIdx.x % kThreadsPerSide, ty = threadIdx.x / kThreadsPerSide;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t range_begin = static_cast<int64_t>(blockIdx.y) * range_length;
  const int64_t range_end = min(n_inputs, range_begin + range_length);

  T best_score[TM];
  int64_t best_index[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    best_score[i] = positive_infinity<T>();
    best_index[i] = range_begin;
  }

  for (int64_t x0 = range_begin; x0 < range_end; x0 += BN) {
    T acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = T(0);
    for (int64_t k0 = 0; k0 < p; k0 += BK) {
      // Consecutive threads read consecutive coordinates of a row: coalesced.
      for (int e = threadIdx.x; e < BM * BK; e += kThreads)
        query_tile[e % BK][e / BK] =
            load_coordinate(queries, query_stride, q0 + e / BK, n_queries, k0 + e % BK, p, center);
      for (int e = threadIdx.x; e < BN * BK; e += kThreads)
        input_tile[e % BK][e / BK] =
            load_coordinate(inputs, input_stride, x0 + e / BK, range_end, k0 + e % BK, p, center);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        T a[TM], b[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = query_tile[kk][ty + kThreadsPerSide * i];
#pragma unroll
        for (int j = 0; j < TN; ++j) b[j] = input_tile[kk][tx + kThreadsPerSide * j];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = nearest_accumulate<M>(acc[i][j], a[i], b[j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int64_t input = x0 + tx + kThreadsPerSide * j;
      if (input >= range_end) continue;
      const T norm = norms ? norms[input] : T(0);
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const T score = nearest_score<M>(acc[i][j], norm);
        if (nearest_better(score, input, best_score[i], best_index[i])) {
          best_score[i] = score;
          best_index[i] = input;
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    combine_lanes(best_score[i], best_index[i], kThreadsPerSide);  // the 16 tx of one ty share a warp
    const int64_t q = q0 + ty + kThreadsPerSide * i;
    if (tx == 0 && q < n_queries) {
      range_score[blockIdx.y * n_queries + q] = best_score[i];
      range_index[blockIdx.y * n_queries + q] = best_index[i];
    }
  }
}

// TF32 tensor cores: coordinates are rounded to TF32 as they are staged, warps multiply 16 x 16
// fragments, and the 64 x 64 scores of a tile go through shared memory to the fold.
template <NearestMetric M>
__global__ void __launch_bounds__(kTcThreads) nearest_tf32_kernel(
    const float* __restrict__ queries, int64_t n_queries, int64_t query_stride, const float* __restrict__ inputs,
    int64_t n_inputs, int64_t input_stride, int64_t p, const float* __restrict__ center,
    const float* __restrict__ norms, int64_t range_length, float* __restrict__ range_score,
    int64_t* __restrict__ range_index) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  constexpr int kLd = kTcDepth + kTcPad, kScoreLd = kTcTile + kTcPad;
  __shared__ __align__(128) float query_tile[kTcTile][kLd];  // row-major queries x coordinates
  __shared__ __align__(128) float input_tile[kTcTile][kLd];  // inputs x coordinates: column-major B
  __shared__ __align__(128) float scores[kTcTile][kScoreLd];

  const int warp = threadIdx.x / 32, warp_row = warp / 2, warp_col = warp % 2;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTcTile;
  const int64_t range_begin = static_cast<int64_t>(blockIdx.y) * range_length;
  const int64_t range_end = min(n_inputs, range_begin + range_length);
  // The fold: two threads per query, each over half of the tile's inputs.
  const int fold_row = threadIdx.x / 2, fold_half = threadIdx.x % 2;
  float best_score = positive_infinity<float>();
  int64_t best_index = range_begin;

  for (int64_t x0 = range_begin; x0 < range_end; x0 += kTcTile) {
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[2][2];
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int64_t k0 = 0; k0 < p; k0 += kTcDepth) {
      for (int e = threadIdx.x; e < kTcTile * kTcDepth; e += kTcThreads) {
        const int row = e / kTcDepth, k = e % kTcDepth;
        query_tile[row][k] =
            wmma::__float_to_tf32(load_coordinate(queries, query_stride, q0 + row, n_queries, k0 + k, p, center));
        input_tile[row][k] =
            wmma::__float_to_tf32(load_coordinate(inputs, input_stride, x0 + row, range_end, k0 + k, p, center));
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTcDepth; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b[2];
        for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &query_tile[warp_row * 32 + 16 * i][kk], kLd);
        for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &input_tile[warp_col * 32 + 16 * j][kk], kLd);
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
      __syncthreads();
    }
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&scores[warp_row * 32 + 16 * i][warp_col * 32 + 16 * j], acc[i][j], kScoreLd,
                                wmma::mem_row_major);
    __syncthreads();
    for (int c = fold_half * (kTcTile / 2); c < (fold_half + 1) * (kTcTile / 2); ++c) {
      const int64_t input = x0 + c;
      if (input >= range_end) break;
      const float score = nearest_score<M>(scores[fold_row][c], norms ? norms[input] : 0.0f);
      if (nearest_better(score, input, best_score, best_index)) {
        best_score = score;
        best_index = input;
      }
    }
    __syncthreads();  // `scores` is written again by the next tile
  }
  combine_lanes(best_score, best_index, 2);
  const int64_t q = q0 + fold_row;
  if (fold_half == 0 && q < n_queries) {
    range_score[blockIdx.y * n_queries + q] = best_score;
    range_index[blockIdx.y * n_queries + q] = best_index;
  }
#else
  __trap();  // the host refuses devices below compute capability 8.0
#endif
}

// Folds each query's range winners in range order and recomputes the winner's value in float64.
template <NearestMetric M, class T>
__global__ void finish_kernel(const T* __restrict__ queries, int64_t n_queries, int64_t query_stride,
                              const T* __restrict__ inputs, int64_t input_stride, int64_t p, int64_t ranges,
                              const T* __restrict__ range_score, const int64_t* __restrict__ range_index,
                              double* __restrict__ out_value, int64_t* __restrict__ out_index) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= n_queries) return;
  T score = range_score[q];
  int64_t index = range_index[q];
  for (int64_t r = 1; r < ranges; ++r) {
    if (nearest_better(range_score[r * n_queries + q], range_index[r * n_queries + q], score, index)) {
      score = range_score[r * n_queries + q];
      index = range_index[r * n_queries + q];
    }
  }
  out_index[q] = index;
  out_value[q] = nearest_exact_value<M>(queries + q * query_stride, inputs + index * input_stride, p);
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

void check_tensor_cores(DType dtype, NearestMetric metric, int device) {
  if (dtype != DType::float32) throw std::invalid_argument("nearest: tensor cores need float32 data");
  if (metric == NearestMetric::l1)
    throw std::invalid_argument("nearest: tensor cores compute products; the l1 metric has none");
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  if (major < 8) throw std::invalid_argument("nearest: TF32 tensor cores need compute capability 8.0 or later");
}

}  // namespace

int64_t nearest_workspace_bytes(DType dtype, NearestMetric metric, int64_t n_queries, int64_t n_inputs,
                                bool tensor_cores, int device) {
  if (n_queries < 0 || n_inputs < 1) throw std::invalid_argument("nearest needs n_queries >= 0 and n_inputs >= 1");
  if (n_queries == 0) return 0;
  const int64_t side = tile_side(dtype, tensor_cores);
  const Plan plan = make_plan(n_queries, n_inputs, side, side, multiprocessor_count(device));
  return dispatch_float(dtype, [&](auto zero) { return workspace_bytes<decltype(zero)>(metric, n_queries, n_inputs, plan); });
}

void nearest(DType dtype, NearestMetric metric, const void* queries, int64_t n_queries, int64_t query_stride,
             const void* inputs, int64_t n_inputs, int64_t input_stride, int64_t p, const void* center,
             double* out_value, int64_t* out_index, bool tensor_cores, void* workspace, int device, void* stream) {
  if (n_queries < 0 || n_inputs < 1 || p < 1)
    throw std::invalid_argument("nearest needs n_queries >= 0, n_inputs >= 1 and p >= 1");
  if (tensor_cores) check_tensor_cores(dtype, metric, device);
  if (n_queries == 0) return;
  const DeviceGuard guard(device);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const int64_t side = tile_side(dtype, tensor_cores);
  const Plan plan = make_plan(n_queries, n_inputs, side, side, multiprocessor_count(device));
  if (plan.query_tiles > std::numeric_limits<int>::max()) throw std::invalid_argument("nearest: too many queries");

  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* q = static_cast<const T*>(queries);
    const T* x = static_cast<const T*>(inputs);
    const T* c = metric == NearestMetric::squared_l2 ? static_cast<const T*>(center) : nullptr;
    const Workspace<T> ws = workspace_view<T>(workspace, metric, n_queries, n_inputs, plan);
    if (ws.norms) {
      input_norms_kernel<T><<<blocks_for(n_inputs, kThreads), kThreads, 0, cuda_stream>>>(x, n_inputs, input_stride,
                                                                                          p, c, ws.norms);
      check(cudaGetLastError(), "nearest: input_norms_kernel launch");
    }
    const dim3 grid(static_cast<unsigned>(plan.query_tiles), static_cast<unsigned>(plan.ranges));
    dispatch_metric(metric, [&](auto m) {
      constexpr NearestMetric kMetric = decltype(m)::value;
      if constexpr (std::is_same_v<T, float> && kMetric != NearestMetric::l1) {
        if (tensor_cores) {
          nearest_tf32_kernel<kMetric><<<grid, kTcThreads, 0, cuda_stream>>>(
              q, n_queries, query_stride, x, n_inputs, input_stride, p, c, ws.norms, plan.range_length,
              ws.range_score, ws.range_index);
          check(cudaGetLastError(), "nearest: nearest_tf32_kernel launch");
        }
      }
      if (!tensor_cores) {
        nearest_simt_kernel<kMetric, T><<<grid, kThreads, 0, cuda_stream>>>(
            q, n_queries, query_stride, x, n_inputs, input_stride, p, c, ws.norms, plan.range_length, ws.range_score,
            ws.range_index);
        check(cudaGetLastError(), "nearest: nearest_simt_kernel launch");
      }
      finish_kernel<kMetric, T><<<blocks_for(n_queries, kThreads), kThreads, 0, cuda_stream>>>(
          q, n_queries, query_stride, x, input_stride, p, plan.ranges, ws.range_score, ws.range_index, out_value,
          out_index);
      check(cudaGetLastError(), "nearest: finish_kernel launch");
    });
  });
}

}  // namespace privleak::cuda
