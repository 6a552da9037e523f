// CUDA column statistics. One thread reduces one (column, row chunk) pair with the scalar code of
// common/column_stats.h: neighbouring threads read neighbouring columns, so loads coalesce. With
// more than one chunk, a second kernel folds each column's partials in chunk order. The chunking
// is the CPU's, so the two backends agree bit for bit; there are no atomics.
#include "cuda/column_stats.h"

#include <cuda_runtime.h>

#include "common/column_stats.h"
#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kThreads = 256;

// Chunk partials, structure of arrays, chunk-major: entry (chunk, col) at chunk * cols + col.
template <class T>
ColumnStatsOutput<T> workspace_view(void* workspace, int64_t entries) {
  auto* bytes = static_cast<char*>(workspace);
  auto* sum = reinterpret_cast<double*>(bytes);
  auto* argmax = reinterpret_cast<int64_t*>(sum + entries);
  auto* max = reinterpret_cast<T*>(argmax + entries);
  auto* min = max + entries;
  return {max, argmax, min, sum};
}

template <unsigned kStats, class T>
__global__ void reduce_chunks(const T* __restrict__ matrix, int64_t rows, int64_t cols,
                              int64_t row_stride, const T* __restrict__ row_weights,
                              ColumnStatsPlan plan, ColumnStatsOutput<T> partials) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (col >= cols) return;
  const int64_t row_begin = chunk * plan.rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + plan.rows_per_chunk);
  partials.template store<kStats>(
      chunk * cols + col, reduce_column_chunk<kStats>(matrix, row_stride, row_weights, col, row_begin, row_end));
}

template <unsigned kStats, class T>
__global__ void fold_chunks(int64_t cols, int64_t num_chunks, ColumnStatsOutput<T> partials,
                            ColumnStatsOutput<T> out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  ColumnPartial<T> acc = partials.template load<kStats>(col);
  for (int64_t chunk = 1; chunk < num_chunks; ++chunk)
    column_partial_fold<kStats>(acc, partials.template load<kStats>(chunk * cols + col));
  out.template store<kStats>(col, acc);
}

int64_t entry_bytes(DType dtype) {
  return dispatch_float(dtype, [](auto zero) -> int64_t { return 2 * sizeof(zero) + sizeof(int64_t) + sizeof(double); });
}

}  // namespace

int64_t column_stats_workspace_bytes(DType dtype, int64_t rows, int64_t cols) {
  const ColumnStatsPlan plan = plan_column_stats(rows);
  return plan.num_chunks > 1 ? plan.num_chunks * cols * entry_bytes(dtype) : 0;
}

void column_stats(DType dtype, unsigned stats, const void* matrix, int64_t rows, int64_t cols, int64_t row_stride,
                  const void* row_weights, void* out_max, int64_t* out_argmax, void* out_min,
                  double* out_sum, void* workspace, int device, void* stream) {
  if (rows < 1 || cols < 0) throw std::invalid_argument("column_stats needs rows >= 1 and cols >= 0");
  if (cols == 0) return;
  const ColumnStatsPlan plan = plan_column_stats(rows);
  if (plan.num_chunks > 65535) throw std::invalid_argument("column_stats: too many row chunks");
  const DeviceGuard guard(device);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const unsigned col_blocks = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    const ColumnStatsOutput<T> out{static_cast<T*>(out_max), out_argmax, static_cast<T*>(out_min), out_sum};
    const ColumnStatsOutput<T> partials =
        plan.num_chunks > 1 ? workspace_view<T>(workspace, plan.num_chunks * cols) : out;
    dispatch_stats(stats, [&](auto mask) {
      constexpr unsigned kStats = decltype(mask)::value;
      reduce_chunks<kStats, T><<<dim3(col_blocks, static_cast<unsigned>(plan.num_chunks)), kThreads, 0, cuda_stream>>>(
          static_cast<const T*>(matrix), rows, cols, row_stride, static_cast<const T*>(row_weights), plan, partials);
      check(cudaGetLastError(), "column_stats: reduce_chunks launch");
      if (plan.num_chunks > 1) {
        fold_chunks<kStats, T><<<col_blocks, kThreads, 0, cuda_stream>>>(cols, plan.num_chunks, partials, out);
        check(cudaGetLastError(), "column_stats: fold_chunks launch");
      }
    });
  });
}

}  // namespace privleak::cuda
