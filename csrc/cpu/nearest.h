#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/nearest.h"
#include "cpu/platform.h"

namespace privleak::cpu {

// For each of the n_queries rows of `queries`, the best of the n_inputs rows of `inputs` under
// `metric` (common/nearest.h): its index (out_index) and its <x, y>, ||x - y||^2 or ||x - y||_1
// recomputed in float64 (out_value). Rows hold p contiguous coordinates of `dtype`; strides are
// in elements. `center` (p values, squared L2 only, may be null) translates both sets. Needs
// n_inputs >= 1 and p >= 1. The result does not depend on the thread count. `path` picks the
// tile kernel: portable, AVX2 or AVX-512 (callers pass cpu_capability_level() unless a test asks
// for another); all give the same bits. A path the CPU lacks is refused (std::invalid_argument).
void nearest(DType dtype, NearestMetric metric, const void* queries, int64_t n_queries, int64_t query_stride,
             const void* inputs, int64_t n_inputs, int64_t input_stride, int64_t p, const void* center,
             double* out_value, int64_t* out_index, CpuCapability path);

}  // namespace privleak::cpu
