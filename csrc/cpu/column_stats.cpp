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

// 512 float32 columns read 2 KiB of each row; the tile's accumulators (12 KiB) stay in L1.
constexpr int64_t kBlockCols = 512;

// Structure of arrays, so that the update below is a branch-free, vectorisable loop.
template <class T>
struct Tile {
  T max[kBlockCols];
  int64_t argmax[kBlockCols];
  T min[kBlockCols];
  double sum[kBlockCols];

  ColumnPartial<T> partial(int64_t j) const { return {max[j], argmax[j], min[j], sum[j]}; }
};

// The hot loop: folds row `r` into the accumulators of `width` columns.
template <class T, bool kWeighted>
PRIVLEAK_SIMD_CLONES void add_row(const T* __restrict row, T weight, int64_t width, int64_t r,
                                  T* __restrict max, int64_t* __restrict argmax, T* __restrict min,
                                  double* __restrict sum) {
  for (int64_t j = 0; j < width; ++j) {
    const T v = kWeighted ? weight * row[j] : row[j];
    const bool new_max = replaces_max(v, max[j]);
    max[j] = new_max ? v : max[j];
    argmax[j] = new_max ? r : argmax[j];
    min[j] = replaces_min(v, min[j]) ? v : min[j];
    sum[j] += static_cast<double>(v);
  }
}

template <class T, bool kWeighted>
void reduce_tile(const T* matrix, int64_t row_stride, const T* row_weights, int64_t row_begin,
                 int64_t row_end, int64_t col_begin, int64_t width, Tile<T>& tile) {
  auto row = [&](int64_t r) { return matrix + r * row_stride + col_begin; };
  auto weight = [&](int64_t r) { return kWeighted ? row_weights[r] : T(1); };
  for (int64_t j = 0; j < width; ++j) {
    const T v = kWeighted ? weight(row_begin) * row(row_begin)[j] : row(row_begin)[j];
    tile.max[j] = v;
    tile.argmax[j] = row_begin;
    tile.min[j] = v;
    tile.sum[j] = static_cast<double>(v);
  }
  for (int64_t r = row_begin + 1; r < row_end; ++r)
    add_row<T, kWeighted>(row(r), weight(r), width, r, tile.max, tile.argmax, tile.min, tile.sum);
}

template <class T, bool kWeighted>
void column_stats_typed(const T* matrix, int64_t rows, int64_t cols, int64_t row_stride,
                        const T* row_weights, ColumnStatsOutput<T> out) {
  const ColumnStatsPlan plan = plan_column_stats(rows);
  const int64_t num_blocks = (cols + kBlockCols - 1) / kBlockCols;
  auto chunk_end = [&](int64_t chunk) { return std::min(rows, (chunk + 1) * plan.rows_per_chunk); };
  auto reduce = [&](int64_t chunk, int64_t block, Tile<T>& tile) {
    const int64_t col_begin = block * kBlockCols;
    reduce_tile<T, kWeighted>(matrix, row_stride, row_weights, chunk * plan.rows_per_chunk,
                              chunk_end(chunk), col_begin, std::min(kBlockCols, cols - col_begin), tile);
  };

  if (num_blocks >= max_threads() || plan.num_chunks == 1) {
    // Enough column blocks to keep every thread busy: each folds its chunks as it goes.
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t block = 0; block < num_blocks; ++block) {
      auto running = std::make_unique<Tile<T>>();
      auto chunk_tile = std::make_unique<Tile<T>>();
      const int64_t col_begin = block * kBlockCols;
      const int64_t width = std::min(kBlockCols, cols - col_begin);
      reduce(0, block, *running);
      std::vector<ColumnPartial<T>> acc(width);
      for (int64_t j = 0; j < width; ++j) acc[j] = running->partial(j);
      for (int64_t chunk = 1; chunk < plan.num_chunks; ++chunk) {
        reduce(chunk, block, *chunk_tile);
        for (int64_t j = 0; j < width; ++j) column_partial_fold(acc[j], chunk_tile->partial(j));
      }
      for (int64_t j = 0; j < width; ++j) out.store(col_begin + j, acc[j]);
    }
    return;
  }

  // Few, tall column blocks: reduce (chunk, block) tiles in parallel, then fold each column's
  // chunk partials in chunk order. Partials take at most 1024 x cols entries, and cols is small here.
  std::vector<ColumnPartial<T>> partials(static_cast<size_t>(plan.num_chunks * cols));
  const int64_t num_tiles = plan.num_chunks * num_blocks;
#pragma omp parallel
  {
    auto tile = std::make_unique<Tile<T>>();
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t chunk = t / num_blocks, block = t % num_blocks;
      const int64_t col_begin = block * kBlockCols;
      reduce(chunk, block, *tile);
      for (int64_t j = 0; j < std::min(kBlockCols, cols - col_begin); ++j)
        partials[chunk * cols + col_begin + j] = tile->partial(j);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t col = 0; col < cols; ++col) {
    ColumnPartial<T> acc = partials[col];
    for (int64_t chunk = 1; chunk < plan.num_chunks; ++chunk)
      column_partial_fold(acc, partials[chunk * cols + col]);
    out.store(col, acc);
  }
}

}  // namespace

void column_stats(DType dtype, const void* matrix, int64_t rows, int64_t cols, int64_t row_stride,
                  const void* row_weights, void* out_max, int64_t* out_argmax, void* out_min,
                  double* out_sum) {
  if (rows < 1 || cols < 0) throw std::invalid_argument("column_stats needs rows >= 1 and cols >= 0");
  if (cols == 0) return;
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    const ColumnStatsOutput<T> out{static_cast<T*>(out_max), out_argmax, static_cast<T*>(out_min), out_sum};
    const T* m = static_cast<const T*>(matrix);
    const T* w = static_cast<const T*>(row_weights);
    if (w)
      column_stats_typed<T, true>(m, rows, cols, row_stride, w, out);
    else
      column_stats_typed<T, false>(m, rows, cols, row_stride, nullptr, out);
  });
}

}  // namespace privleak::cpu
