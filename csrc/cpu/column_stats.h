#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace privleak::cpu {

// See common/column_stats.h. `stats` is a mask of ColumnStat; only the outputs it names are
// written (the others may be null). `row_weights` may be null; `row_stride` is in elements and may be
// any value (columns must be contiguous). Outputs hold `cols` elements; max/min have `dtype`.
void column_stats(DType dtype, unsigned stats, const void* matrix, int64_t rows, int64_t cols, int64_t row_stride,
                  const void* row_weights, void* out_max, int64_t* out_argmax, void* out_min,
                  double* out_sum);

}  // namespace privleak::cpu
