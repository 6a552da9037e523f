// Host-side declarations of the CUDA column statistics; plain C++ so the bindings need no CUDA headers.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace privleak::cuda {

// Scratch bytes column_stats needs for a matrix of this shape (0 when one chunk covers all rows).
int64_t column_stats_workspace_bytes(DType dtype, int64_t rows, int64_t cols);

// Same contract as privleak::cpu::column_stats, with device pointers; runs on `stream` (a
// cudaStream_t) of device `device`. `workspace` holds column_stats_workspace_bytes bytes.
void column_stats(DType dtype, unsigned stats, const void* matrix, int64_t rows, int64_t cols, int64_t row_stride,
                  const void* row_weights, void* out_max, int64_t* out_argmax, void* out_min,
                  double* out_sum, void* workspace, int device, void* stream);

}  // namespace privleak::cuda
