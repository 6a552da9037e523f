// Host-side declarations of the CUDA sup-over-inputs kernels; plain C++ so the bindings need no CUDA headers.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/nearest.h"

namespace privleak::cuda {

// Scratch bytes nearest needs for this problem on `device` (it splits the inputs into ranges by
// the device's multiprocessor count).
int64_t nearest_workspace_bytes(DType dtype, NearestMetric metric, int64_t n_queries, int64_t n_inputs,
                                bool tensor_cores, int device);

// privleak::cpu::nearest on device memory, on `stream` (a cudaStream_t) of device `device`;
// `workspace` holds nearest_workspace_bytes bytes. With tensor_cores = false the fp32/fp64
// kernel performs the operations of common/nearest.h for every pair, so it returns the CPU's
// winners and values bit for bit. With tensor_cores = true (float32, inner product or squared
// L2, compute capability 8.0 or later) the products run on TF32 tensor cores: coordinates are
// rounded to 10-bit mantissas, so scores carry a relative error of about 1e-3 of
// ||x - c|| ||y - c|| and the winner can differ from the fp32 one among inputs that close;
// the returned value is still the winner's, recomputed exactly in float64.
void nearest(DType dtype, NearestMetric metric, const void* queries, int64_t n_queries, int64_t query_stride,
             const void* inputs, int64_t n_inputs, int64_t input_stride, int64_t p, const void* center,
             double* out_value, int64_t* out_index, bool tensor_cores, void* workspace, int device, void* stream);

}  // namespace privleak::cuda
