// CPU column statistics. A thread reduces a tile (a chunk of rows x a block of columns) row by
// row, so every read is a contiguous run of a row and the column loop vectorises. For each column
// the operations are those of common/column_stats.h in the same order, hence the same bits as the
// CUDA kernel, for any thread count.
#include "cpu/column_stats.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <vector>

#include "common/column_stats.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

// A tile reads 16 KiB (float32) of each row: long enough runs for the hardware prefetcher, which
// 2 KiB runs at a 16 KiB stride defeat (a 4000 x 4000 max took 2.4x numpy's time with 512 columns,
// 1.2x with 4096). The accumulators (up to 128 KiB) stay in L2.
constexpr int64_t kBlockCols = 4096;

// Structure of arrays, so that the update below is a branch-free, vectorisable loop.
template <class T>
struct Tile {
  T max[kBlockCols];
  int64_t argmax[kBlockCols];
  T min[kBlockCols];
  double sum[kBlockCols];

  ColumnPartial<T> partial(int64_t j) const { return {max[j], argmax[j], min[j], sum[j]}; }
};

// The hot loop: folds row `r` into the accumulators of `width` columns (column_partial_add, vectorised).
template <unsigned kStats, class T, bool kWeighted>
PRIVLEAK_SIMD_CLONES void add_row(const T* __restrict row, T weight, int64_t width, int64_t r,
                                  T* __restrict max, int64_t* __restrict argmax, T* __restrict min,
                                  double* __restrict sum) {
  for (int64_t j = 0; j < width; ++j) {
    const T v = kWeighted ? weight * row[j] : row[j];
    if constexpr (wants(kStats, kStatMax)) {
      const bool new_max = replaces_max(v, max[j]);
      max[j] = new_max ? v : max[j];
      if constexpr (wants(kStats, kStatArgmax)) argmax[j] = new_max ? r : argmax[j];
    }
    if constexpr (wants(kStats, kStatMin)) min[j] = replaces_min(v, min[j]) ? v : min[j];
    if constexpr (wants(kStats, kStatSum)) sum[j] += static_cast<double>(v);
  }
}

template <unsigned kStats, class T, bool kWeighted>
void reduce_tile(const T* matrix, int64_t row_stride, const T* row_weights, int64_t row_begin,
                 int64_t row_end, int64_t col_begin, int64_t width, Tile<T>& tile) {
  auto row = [&](int64_t r) { return matrix + r * row_stride + col_begin; };
  auto weight = [&](int64_t r) { return kWeighted ? row_weights[r] : T(1); };
  for (int64_t j = 0; j < width; ++j) {
    const ColumnPartial<T> p = column_partial_start(kWeighted ? weight(row_begin) * row(row_begin)[j] : row(row_begin)[j], row_begin);
    tile.max[j] = p.max;
    tile.argmax[j] = p.argmax;
    tile.min[j] = p.min;
    tile.sum[j] = p.sum;
  }
  for (int64_t r = row_begin + 1; r < row_end; ++r)
    add_row<kStats, T, kWeighted>(row(r), weight(r), width, r, tile.max, tile.argmax, tile.min, tile.sum);
}

template <unsigned kStats, class T, bool kWeighted>
void column_stats_typed(const T* matrix, int64_t rows, int64_t cols, int64_t row_stride,
                        const T* row_weights, ColumnStatsOutput<T> out) {
  const ColumnStatsPlan plan = plan_column_stats(rows);
  const bool parallel = rows * cols >= kMinParallelWork;
  const int64_t num_blocks = (cols + kBlockCols - 1) / kBlockCols;
  auto width = [&](int64_t block) { return std::min(kBlockCols, cols - block * kBlockCols); };
  auto reduce = [&](int64_t chunk, int64_t block, Tile<T>& tile) {
    const int64_t row_begin = chunk * plan.rows_per_chunk;
    reduce_tile<kStats, T, kWeighted>(matrix, row_stride, row_weights, row_begin,
                                      std::min(rows, row_begin + plan.rows_per_chunk),
                                      block * kBlockCols, width(block), tile);
  };

  if (num_blocks >= max_threads() || plan.num_chunks == 1 || !parallel) {
    // Enough column blocks to keep every thread busy (or a small matrix): each block folds its
    // chunks as it goes.
#pragma omp parallel if (parallel)
    {
      auto tile = std::make_unique<Tile<T>>();
      std::vector<ColumnPartial<T>> acc(kBlockCols);
#pragma omp for schedule(dynamic, 1)
      for (int64_t block = 0; block < num_blocks; ++block) {
        for (int64_t chunk = 0; chunk < plan.num_chunks; ++chunk) {
          reduce(chunk, block, *tile);
          for (int64_t j = 0; j < width(block); ++j) {
            if (chunk == 0)
              acc[j] = tile->partial(j);
            else
              column_partial_fold<kStats>(acc[j], tile->partial(j));
          }
        }
        for (int64_t j = 0; j < width(block); ++j) out.template store<kStats>(block * kBlockCols + j, acc[j]);
      }
    }
    return;
  }

  // Fewer column blocks than threads: reduce (chunk, block) tiles in parallel, then fold each
  // column's chunk partials in chunk order. Partials take at most 1024 x cols entries, and here
  // cols < 4096 x threads.
  std::vector<ColumnPartial<T>> partials(static_cast<size_t>(plan.num_chunks * cols));
  const int64_t num_tiles = plan.num_chunks * num_blocks;
#pragma omp parallel
  {
    auto tile = std::make_unique<Tile<T>>();
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t chunk = t / num_blocks, block = t % num_blocks;
      reduce(chunk, block, *tile);
      for (int64_t j = 0; j < width(block); ++j) partials[chunk * cols + block * kBlockCols + j] = tile->partial(j);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t col = 0; col < cols; ++col) {
    ColumnPartial<T> acc = partials[col];
    for (int64_t chunk = 1; chunk < plan.num_chunks; ++chunk)
      column_partial_fold<kStats>(acc, partials[chunk * cols + col]);
    out.template store<kStats>(col, acc);
  }
}

}  // namespace

void column_stats(DType dtype, unsigned stats, const void* matrix, int64_t rows, int64_t cols,
                  int64_t row_stride, const void* row_weights, void* out_max, int64_t* out_argmax,
                  void* out_min, double* out_sum) {
  if (rows < 1 || cols < 0) throw std::invalid_argument("column_stats needs rows >= 1 and cols >= 0");
  if (cols == 0) return;
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    const ColumnStatsOutput<T> out{static_cast<T*>(out_max), out_argmax, static_cast<T*>(out_min), out_sum};
    const T* m = static_cast<const T*>(matrix);
    const T* w = static_cast<const T*>(row_weights);
    dispatch_stats(stats, [&](auto mask) {
      constexpr unsigned kStats = decltype(mask)::value;
      if (w)
        column_stats_typed<kStats, T, true>(m, rows, cols, row_stride, w, out);
      else
        column_stats_typed<kStats, T, false>(m, rows, cols, row_stride, nullptr, out);
    });
  });
}

}  // namespace privleak::cpu
