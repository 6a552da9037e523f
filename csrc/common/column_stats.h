// Column statistics of a row-major matrix: max, argmax, min and sum over the rows of each column
// (any subset of them), optionally of the row-weighted matrix w[i] * M[i, j]. Shared by the CPU
// and CUDA kernels.
//
// Determinism: rows are cut into chunks whose size depends only on the number of rows, never on
// the thread count or the launch geometry. Each chunk is reduced row by row, and chunk partials
// are folded in chunk order. Both backends therefore perform the same floating-point additions
// in the same order and return identical bits.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/hostdevice.h"

namespace privleak {

struct ColumnStatsPlan {
  int64_t rows_per_chunk;
  int64_t num_chunks;
};

// At least 256 rows a chunk keeps the partials cheap; at most 1024 chunks bounds their memory.
constexpr int64_t kColumnStatsMinRowsPerChunk = 256;
constexpr int64_t kColumnStatsMaxChunks = 1024;

PRIVLEAK_HOST_DEVICE ColumnStatsPlan plan_column_stats(int64_t rows) {
  int64_t per_chunk = (rows + kColumnStatsMaxChunks - 1) / kColumnStatsMaxChunks;
  if (per_chunk < kColumnStatsMinRowsPerChunk) per_chunk = kColumnStatsMinRowsPerChunk;
  return {per_chunk, (rows + per_chunk - 1) / per_chunk};
}

template <class T>
PRIVLEAK_HOST_DEVICE bool is_nan(T v) {
  return v != v;
}

// NaN beats every number and the first NaN is kept, matching numpy's max/argmax/min.
// Bitwise rather than short-circuit operators keep the CPU column loop free of branches, so it vectorises.
template <class T>
PRIVLEAK_HOST_DEVICE bool replaces_max(T candidate, T current) {
  return (candidate > current) | (is_nan(candidate) & !is_nan(current));
}

template <class T>
PRIVLEAK_HOST_DEVICE bool replaces_min(T candidate, T current) {
  return (candidate < current) | (is_nan(candidate) & !is_nan(current));
}

// The element a column reduction sees at row `row`: M[row, col], times the row's weight if any.
template <class T>
PRIVLEAK_HOST_DEVICE T weighted_element(const T* matrix, int64_t row_stride, const T* row_weights,
                                        int64_t row, int64_t col) {
  const T v = matrix[row * row_stride + col];
  return row_weights ? row_weights[row] * v : v;
}

// Which statistics a kernel computes, as a compile-time mask: a metric that needs only the
// column maxima (Bayes capacity) then runs a plain vectorised max. Argmax needs max.
enum ColumnStat : unsigned { kStatMax = 1, kStatArgmax = 2, kStatMin = 4, kStatSum = 8, kStatAll = 15 };

PRIVLEAK_HOST_DEVICE constexpr bool wants(unsigned stats, unsigned stat) { return (stats & stat) != 0; }

PRIVLEAK_HOST_DEVICE constexpr bool valid_stats(unsigned stats) {
  return stats != 0 && stats <= kStatAll && (!wants(stats, kStatArgmax) || wants(stats, kStatMax));
}

// Calls f(std::integral_constant<unsigned, stats>{}) for a valid mask.
template <class F>
decltype(auto) dispatch_stats(unsigned stats, F&& f) {
  switch (stats) {
#define PRIVLEAK_STATS_CASE(mask) \
  case mask:                      \
    return f(std::integral_constant<unsigned, mask>{});
    PRIVLEAK_STATS_CASE(1) PRIVLEAK_STATS_CASE(3) PRIVLEAK_STATS_CASE(4) PRIVLEAK_STATS_CASE(5)
    PRIVLEAK_STATS_CASE(7) PRIVLEAK_STATS_CASE(8) PRIVLEAK_STATS_CASE(9) PRIVLEAK_STATS_CASE(11)
    PRIVLEAK_STATS_CASE(12) PRIVLEAK_STATS_CASE(13) PRIVLEAK_STATS_CASE(15)
#undef PRIVLEAK_STATS_CASE
  }
  throw std::invalid_argument("column_stats: invalid statistics mask " + std::to_string(stats));
}

template <class T>
struct ColumnPartial {
  T max;
  int64_t argmax;
  T min;
  double sum;  // float32 input is summed in double: a column of 10^4 probabilities loses ~1e-4 otherwise
};

template <class T>
PRIVLEAK_HOST_DEVICE ColumnPartial<T> column_partial_start(T v, int64_t row) {
  return {v, row, v, static_cast<double>(v)};
}

// Rows are visited in increasing order, so a strict comparison keeps the lowest index on ties.
template <unsigned kStats, class T>
PRIVLEAK_HOST_DEVICE void column_partial_add(ColumnPartial<T>& acc, T v, int64_t row) {
  if constexpr (wants(kStats, kStatMax)) {
    const bool new_max = replaces_max(v, acc.max);
    acc.max = new_max ? v : acc.max;
    if constexpr (wants(kStats, kStatArgmax)) acc.argmax = new_max ? row : acc.argmax;
  }
  if constexpr (wants(kStats, kStatMin)) acc.min = replaces_min(v, acc.min) ? v : acc.min;
  if constexpr (wants(kStats, kStatSum)) acc.sum += static_cast<double>(v);
}

// `later` covers rows after those of `acc`.
template <unsigned kStats, class T>
PRIVLEAK_HOST_DEVICE void column_partial_fold(ColumnPartial<T>& acc, const ColumnPartial<T>& later) {
  if constexpr (wants(kStats, kStatMax)) {
    if (replaces_max(later.max, acc.max)) {
      acc.max = later.max;
      acc.argmax = later.argmax;
    }
  }
  if constexpr (wants(kStats, kStatMin)) {
    if (replaces_min(later.min, acc.min)) acc.min = later.min;
  }
  if constexpr (wants(kStats, kStatSum)) acc.sum += later.sum;
}

// Reduces rows [row_begin, row_end) of one column, row_end > row_begin.
template <unsigned kStats, class T>
PRIVLEAK_HOST_DEVICE ColumnPartial<T> reduce_column_chunk(const T* matrix, int64_t row_stride,
                                                          const T* row_weights, int64_t col,
                                                          int64_t row_begin, int64_t row_end) {
  ColumnPartial<T> acc =
      column_partial_start(weighted_element(matrix, row_stride, row_weights, row_begin, col), row_begin);
  for (int64_t row = row_begin + 1; row < row_end; ++row)
    column_partial_add<kStats>(acc, weighted_element(matrix, row_stride, row_weights, row, col), row);
  return acc;
}

// Where a kernel writes its result: one array per statistic, each of length `cols`; only the
// arrays of requested statistics are touched (the others may be null).
template <class T>
struct ColumnStatsOutput {
  T* max;
  int64_t* argmax;
  T* min;
  double* sum;

  template <unsigned kStats>
  PRIVLEAK_HOST_DEVICE void store(int64_t col, const ColumnPartial<T>& p) const {
    if constexpr (wants(kStats, kStatMax)) max[col] = p.max;
    if constexpr (wants(kStats, kStatArgmax)) argmax[col] = p.argmax;
    if constexpr (wants(kStats, kStatMin)) min[col] = p.min;
    if constexpr (wants(kStats, kStatSum)) sum[col] = p.sum;
  }
  template <unsigned kStats>
  PRIVLEAK_HOST_DEVICE ColumnPartial<T> load(int64_t col) const {
    ColumnPartial<T> p{T(0), 0, T(0), 0.0};
    if constexpr (wants(kStats, kStatMax)) p.max = max[col];
    if constexpr (wants(kStats, kStatArgmax)) p.argmax = argmax[col];
    if constexpr (wants(kStats, kStatMin)) p.min = min[col];
    if constexpr (wants(kStats, kStatSum)) p.sum = sum[col];
    return p;
  }
};

}  // namespace privleak
