#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "bindings/marshal.h"
#include "cuda/clip.h"
#include "cuda/column_stats.h"
#include "cuda/conv_grads.h"
#include "cuda/ghost_norm.h"
#include "cuda/nearest.h"
#include "cuda/noise.h"
#include "cuda/secure_noise.h"
#include "cuda/vmf.h"
#include "cuda/device.h"

namespace py = pybind11;
using privleak::bindings::as_pointer;
namespace marshal = privleak::bindings;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "privleak's CUDA kernels. Private: call them through the privleak package.";

  m.def(
      "column_stats_workspace_bytes",
      [](const std::string& dtype, int64_t rows, int64_t cols) {
        return privleak::cuda::column_stats_workspace_bytes(privleak::parse_dtype(dtype), rows, cols);
      },
      py::arg("dtype"), py::arg("rows"), py::arg("cols"));

  m.def(
      "column_stats",
      [](unsigned stats, std::uintptr_t matrix, int64_t rows, int64_t cols, int64_t row_stride, const std::string& dtype,
         std::uintptr_t row_weights, std::uintptr_t out_max, std::uintptr_t out_argmax,
         std::uintptr_t out_min, std::uintptr_t out_sum, std::uintptr_t workspace, int device,
         std::uintptr_t stream) {
        const privleak::DType type = privleak::parse_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cuda::column_stats(type, stats, as_pointer(matrix), rows, cols, row_stride, as_pointer(row_weights),
                                     as_pointer(out_max), as_pointer<int64_t>(out_argmax), as_pointer(out_min),
                                     as_pointer<double>(out_sum), as_pointer(workspace), device,
                                     as_pointer(stream));
      },
      py::arg("stats"), py::arg("matrix"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("dtype"),
      py::arg("row_weights"), py::arg("out_max"), py::arg("out_argmax"), py::arg("out_min"), py::arg("out_sum"),
      py::arg("workspace"), py::arg("device"), py::arg("stream"));

  m.def(
      "nearest_workspace_bytes",
      [](const std::string& metric, const std::string& dtype, int64_t n_queries, int64_t n_inputs, bool tensor_cores,
         int device) {
        return privleak::cuda::nearest_workspace_bytes(privleak::parse_dtype(dtype), marshal::parse_metric(metric),
                                                       n_queries, n_inputs, tensor_cores, device);
      },
      py::arg("metric"), py::arg("dtype"), py::arg("n_queries"), py::arg("n_inputs"), py::arg("tensor_cores"),
      py::arg("device"));

  m.def(
      "nearest",
      [](const std::string& metric, const std::string& dtype, std::uintptr_t queries, int64_t n_queries,
         int64_t query_stride, std::uintptr_t inputs, int64_t n_inputs, int64_t input_stride, int64_t p,
         std::uintptr_t center, std::uintptr_t out_value, std::uintptr_t out_index, bool tensor_cores,
         std::uintptr_t workspace, int device, std::uintptr_t stream) {
        const privleak::NearestMetric m = marshal::parse_metric(metric);
        const privleak::DType type = privleak::parse_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cuda::nearest(type, m, as_pointer(queries), n_queries, query_stride, as_pointer(inputs), n_inputs,
                                input_stride, p, as_pointer(center), as_pointer<double>(out_value),
                                as_pointer<int64_t>(out_index), tensor_cores, as_pointer(workspace), device,
                                as_pointer(stream));
      },
      py::arg("metric"), py::arg("dtype"), py::arg("queries"), py::arg("n_queries"), py::arg("query_stride"),
      py::arg("inputs"), py::arg("n_inputs"), py::arg("input_stride"), py::arg("p"), py::arg("center"),
      py::arg("out_value"), py::arg("out_index"), py::arg("tensor_cores"), py::arg("workspace"), py::arg("device"),
      py::arg("stream"));

  m.def(
      "apply_noise",
      [](const std::string& distribution, const std::string& dtype, const std::vector<std::uintptr_t>& outs,
         const std::vector<int64_t>& numels, uint64_t key, uint64_t offset, double scale, bool add, int device,
         std::uintptr_t stream) {
        const privleak::Distribution d = marshal::parse_distribution(distribution);
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const std::vector<void*> arrays = marshal::void_pointers(outs);
        py::gil_scoped_release release;
        privleak::cuda::apply_noise(d, t, arrays, numels, key, offset, scale, add, device, as_pointer(stream));
      },
      py::arg("distribution"), py::arg("dtype"), py::arg("outs"), py::arg("numels"), py::arg("key"), py::arg("offset"),
      py::arg("scale"), py::arg("add"), py::arg("device"), py::arg("stream"));

  m.def(
      "apply_secure_noise",
      [](const std::string& distribution, const std::string& dtype, const std::vector<std::uintptr_t>& outs,
         const std::vector<int64_t>& numels, const std::array<uint32_t, 8>& key, uint64_t offset, uint64_t scale,
         int grid_exponent, bool add, int device, std::uintptr_t stream) {
        const privleak::Distribution d = marshal::parse_distribution(distribution);
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const privleak::ChaChaKey k = marshal::to_chacha_key(key);
        const std::vector<void*> arrays = marshal::void_pointers(outs);
        py::gil_scoped_release release;
        privleak::cuda::apply_secure_noise(d, t, arrays, numels, k, offset, scale, grid_exponent, add, device,
                                           as_pointer(stream));
      },
      py::arg("distribution"), py::arg("dtype"), py::arg("outs"), py::arg("numels"), py::arg("key"), py::arg("offset"),
      py::arg("scale"), py::arg("grid_exponent"), py::arg("add"), py::arg("device"), py::arg("stream"));

  m.def("vmf_workspace_bytes", &privleak::cuda::vmf_workspace_bytes, py::arg("p"), py::arg("n"));
  m.def(
      "vmf_sample",
      [](const std::string& dtype, std::uintptr_t mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset,
         std::uintptr_t out, std::uintptr_t workspace, int device, std::uintptr_t stream) {
        const privleak::DType t = privleak::parse_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cuda::vmf_sample(t, as_pointer(mu), p, kappa, n, key, offset, as_pointer(out), as_pointer(workspace), device, as_pointer(stream));
      },
      py::arg("dtype"), py::arg("mu"), py::arg("p"), py::arg("kappa"), py::arg("n"), py::arg("key"), py::arg("offset"),
      py::arg("out"), py::arg("workspace"), py::arg("device"), py::arg("stream"));

  m.def("clip_workspace_bytes", &privleak::cuda::clip_workspace_bytes, py::arg("numels"), py::arg("batch"),
        py::arg("num_columns"));

  m.def(
      "clip_accumulate",
      [](const std::string& dtype, const std::vector<std::uintptr_t>& grads, const std::vector<int64_t>& numels,
         const std::vector<std::uintptr_t>& outs, int64_t batch, int64_t num_columns, std::uintptr_t clip_norms,
         bool per_layer, int norm_type, double noise_std, uint64_t key, uint64_t offset, double scale,
         std::uintptr_t sums, std::uintptr_t factors,
         std::uintptr_t workspace, int device, std::uintptr_t stream) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const auto tensors = marshal::per_sample_grads(grads, numels);
        const auto out_pointers = marshal::float_pointers(outs);
        const privleak::ClipNorm norm = privleak::parse_clip_norm(norm_type);
        py::gil_scoped_release release;
        privleak::cuda::clip_accumulate(t, tensors, out_pointers, batch, num_columns,
                                        as_pointer<const double>(clip_norms), per_layer, norm, noise_std, key, offset,
                                        scale, as_pointer<double>(sums), as_pointer<float>(factors),
                                        as_pointer(workspace), device, as_pointer(stream));
      },
      py::arg("dtype"), py::arg("grads"), py::arg("numels"), py::arg("outs"), py::arg("batch"), py::arg("num_columns"),
      py::arg("clip_norms"), py::arg("per_layer"), py::arg("norm_type"), py::arg("noise_std"), py::arg("key"),
      py::arg("offset"), py::arg("scale"), py::arg("sums"), py::arg("factors"), py::arg("workspace"),
      py::arg("device"), py::arg("stream"));

  m.def(
      "clip_factors",
      [](std::uintptr_t sums, std::uintptr_t clip_norms, int64_t batch, int64_t num_tensors, bool per_layer,
         int norm_type, std::uintptr_t factors, int device, std::uintptr_t stream) {
        const privleak::ClipNorm norm = privleak::parse_clip_norm(norm_type);
        py::gil_scoped_release release;
        privleak::cuda::clip_factors(as_pointer<const double>(sums), as_pointer<const double>(clip_norms), batch,
                                     num_tensors, per_layer, norm, as_pointer<float>(factors), device,
                                     as_pointer(stream));
      },
      py::arg("sums"), py::arg("clip_norms"), py::arg("batch"), py::arg("num_tensors"), py::arg("per_layer"),
      py::arg("norm_type"), py::arg("factors"), py::arg("device"), py::arg("stream"));

  m.def("ghost_norm_workspace_bytes", &privleak::cuda::ghost_norm_workspace_bytes, py::arg("batch"),
        py::arg("lengths"));

  m.def(
      "ghost_norm",
      [](const std::vector<std::string>& dtypes, const std::vector<std::uintptr_t>& activations,
         const std::vector<std::uintptr_t>& output_grads, int64_t batch, const std::vector<int64_t>& lengths,
         const std::vector<int64_t>& ds, const std::vector<int64_t>& ps, std::uintptr_t out, std::uintptr_t workspace,
         int device, std::uintptr_t stream) {
        const std::vector<privleak::NoiseDType> types = marshal::ghost_norm_layers(dtypes, activations, output_grads,
                                                                                  lengths, ds, ps);
        std::vector<privleak::cuda::GhostLayer> layers;
        for (size_t k = 0; k < types.size(); ++k)
          layers.push_back({types[k], as_pointer<const void>(activations[k]), as_pointer<const void>(output_grads[k]),
                            lengths[k], ds[k], ps[k]});
        py::gil_scoped_release release;
        privleak::cuda::ghost_norm(layers, batch, as_pointer<double>(out), as_pointer(workspace), device,
                                   as_pointer(stream));
      },
      "Layer k's ghost norms into row k of out (layers, batch).", py::arg("dtypes"), py::arg("activations"),
      py::arg("output_grads"), py::arg("batch"), py::arg("lengths"), py::arg("ds"), py::arg("ps"), py::arg("out"),
      py::arg("workspace"), py::arg("device"), py::arg("stream"));

  m.def("conv_ghost_norm_workspace_bytes", &privleak::cuda::conv_ghost_norm_workspace_bytes, py::arg("batch"),
        py::arg("pixels"), py::arg("length"));

  m.def(
      "conv_ghost_norm",
      [](const std::string& dtype, std::uintptr_t x, std::uintptr_t output_grads, const std::array<int64_t, 15>& geometry,
         std::uintptr_t out, std::uintptr_t workspace, int device, std::uintptr_t stream) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const privleak::ConvGeometry g = marshal::conv_geometry(geometry);
        py::gil_scoped_release release;
        privleak::cuda::conv_ghost_norm(t, as_pointer(x), as_pointer(output_grads), g, as_pointer<double>(out),
                                        as_pointer(workspace), device, as_pointer(stream));
      },
      py::arg("dtype"), py::arg("x"), py::arg("output_grads"), py::arg("geometry"), py::arg("out"),
      py::arg("workspace"), py::arg("device"), py::arg("stream"));

  m.def("embedding_ghost_norm_workspace_bytes", &privleak::cuda::embedding_ghost_norm_workspace_bytes,
        py::arg("batch"), py::arg("length"));

  m.def(
      "embedding_ghost_norm",
      [](const std::string& dtype, std::uintptr_t ids, std::uintptr_t output_grads, int64_t batch, int64_t length,
         int64_t p, std::uintptr_t out, std::uintptr_t workspace, int device, std::uintptr_t stream) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cuda::embedding_ghost_norm(t, as_pointer<const int64_t>(ids), as_pointer(output_grads), batch,
                                             length, p, as_pointer<double>(out), as_pointer(workspace), device,
                                             as_pointer(stream));
      },
      py::arg("dtype"), py::arg("ids"), py::arg("output_grads"), py::arg("batch"), py::arg("length"), py::arg("p"),
      py::arg("out"), py::arg("workspace"), py::arg("device"), py::arg("stream"));

  m.def(
      "conv_weight_grads",
      [](const std::string& dtype, std::uintptr_t x, std::uintptr_t output_grads, const std::array<int64_t, 15>& geometry,
         std::uintptr_t out, int device, std::uintptr_t stream) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const privleak::ConvGeometry g = marshal::conv_geometry(geometry);
        py::gil_scoped_release release;
        privleak::cuda::conv_weight_grads(t, as_pointer(x), as_pointer(output_grads), g, as_pointer(out), device,
                                          as_pointer(stream));
      },
      py::arg("dtype"), py::arg("x"), py::arg("output_grads"), py::arg("geometry"), py::arg("out"), py::arg("device"),
      py::arg("stream"));

  m.def("device_count", [] {
    std::string error;
    const int count = privleak::cuda::device_count(error);
    return py::make_tuple(count, error.empty() ? py::object(py::none()) : py::object(py::str(error)));
  }, "(number of usable devices, error message or None)");

  m.def("device_name", &privleak::cuda::device_name, py::arg("device"));

  m.def("build_info", [] {
    py::dict info;
    info["architectures"] = PRIVLEAK_CUDA_ARCHS;
    info["cuda_version"] = PRIVLEAK_CUDA_VERSION;
    return info;
  });
}
