// Column statistics of a row-major matrix: max, argmax, min and sum over the rows of each column,
// optionally of the row-weighted matrix w[i] * M[i, j]. Shared by the CPU and CUDA kernels.
//
// Determinism: rows are cut into chunks whose size depends only on the number of rows, never on
// the thread count or the launch geometry. Each chunk is reduced row by row, and chunk partials
// are folded in chunk order. Both backends therefore perform the same floating-point additions
// in the same order and return identical bits.
#pragma once

#include <cstdint>

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
template <class T>
PRIVLEAK_HOST_DEVICE void column_partial_add(ColumnPartial<T>& acc, T v, int64_t row) {
  if (replaces_max(v, acc.max)) {
    acc.max = v;
    acc.argmax = row;
  }
  if (replaces_min(v, acc.min)) acc.min = v;
  acc.sum += static_cast<double>(v);
}

// `later` covers rows after those of `acc`.
template <class T>
PRIVLEAK_HOST_DEVICE void column_partial_fold(ColumnPartial<T>& acc, const ColumnPartial<T>& later) {
  if (replaces_max(later.max, acc.max)) {
    acc.max = later.max;
    acc.argmax = later.argmax;
  }
  if (replaces_min(later.min, acc.min)) acc.min = later.min;
  acc.sum += later.sum;
}

// Reduces rows [row_begin, row_end) of one column, row_end > row_begin.
template <class T>
PRIVLEAK_HOST_DEVICE ColumnPartial<T> reduce_column_chunk(const T* matrix, int64_t row_stride,
                                                          const T* row_weights, int64_t col,
                                                          int64_t row_begin, int64_t row_end) {
  ColumnPartial<T> acc =
      column_partial_start(weighted_element(matrix, row_stride, row_weights, row_begin, col), row_begin);
  for (int64_t row = row_begin + 1; row < row_end; ++row)
    column_partial_add(acc, weighted_element(matrix, row_stride, row_weights, row, col), row);
  return acc;
}

// Where a kernel writes its result: one array per statistic, each of length `cols`.
template <class T>
struct ColumnStatsOutput {
  T* max;
  int64_t* argmax;
  T* min;
  double* sum;

  PRIVLEAK_HOST_DEVICE void store(int64_t col, const ColumnPartial<T>& p) const {
    max[col] = p.max;
    argmax[col] = p.argmax;
    min[col] = p.min;
    sum[col] = p.sum;
  }
  PRIVLEAK_HOST_DEVICE ColumnPartial<T> load(int64_t col) const {
    return {max[col], argmax[col], min[col], sum[col]};
  }
};

}  // namespace privleak
