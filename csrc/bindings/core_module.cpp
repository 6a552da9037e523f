#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/marshal.h"
#include "common/chacha20.h"
#include "cpu/clip.h"
#include "cpu/column_stats.h"
#include "cpu/conv_grads.h"
#include "cpu/ghost_norm.h"
#include "cpu/nearest.h"
#include "cpu/noise.h"
#include "cpu/secure_noise.h"
#include "cpu/vmf.h"
#include "cpu/platform.h"

namespace py = pybind11;
using privleak::bindings::as_pointer;
namespace marshal = privleak::bindings;

namespace {

// The CPU path a kernel runs: None is the one chosen at load time. Tests name one to compare the
// paths' bits.
privleak::cpu::CpuCapability cpu_path(const std::optional<std::string>& capability) {
  privleak::cpu::CpuCapability path = privleak::cpu::cpu_capability_level();
  if (capability && !privleak::cpu::parse_capability(capability->c_str(), &path))
    throw std::invalid_argument("capability must be 'default', 'avx2' or 'avx512', got '" + *capability + "'");
  return path;
}

// A convolution kernel (x, output gradients, geometry, out) as the module's `name`.
template <class Out>
void def_conv_kernel(py::module_& m, const char* name,
                     void (*kernel)(privleak::NoiseDType, const void*, const void*, const privleak::ConvGeometry&, Out*,
                                    privleak::cpu::CpuCapability)) {
  m.def(
      name,
      [kernel](const std::string& dtype, std::uintptr_t x, std::uintptr_t output_grads,
               const std::array<int64_t, 15>& geometry, std::uintptr_t out, const std::optional<std::string>& capability) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const privleak::ConvGeometry g = marshal::conv_geometry(geometry);
        const privleak::cpu::CpuCapability path = cpu_path(capability);
        py::gil_scoped_release release;
        kernel(t, as_pointer(x), as_pointer(output_grads), g, as_pointer<Out>(out), path);
      },
      py::arg("dtype"), py::arg("x"), py::arg("output_grads"), py::arg("geometry"), py::arg("out"),
      py::arg("capability") = py::none());
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "privleak's C++ kernels. Private: call them through the privleak package.";

  m.def(
      "column_stats",
      [](unsigned stats, std::uintptr_t matrix, int64_t rows, int64_t cols, int64_t row_stride, const std::string& dtype,
         std::uintptr_t row_weights, std::uintptr_t out_max, std::uintptr_t out_argmax,
         std::uintptr_t out_min, std::uintptr_t out_sum) {
        const privleak::DType type = privleak::parse_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cpu::column_stats(type, stats, as_pointer(matrix), rows, cols, row_stride, as_pointer(row_weights),
                                    as_pointer(out_max), as_pointer<int64_t>(out_argmax), as_pointer(out_min),
                                    as_pointer<double>(out_sum));
      },
      py::arg("stats"), py::arg("matrix"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("dtype"),
      py::arg("row_weights"), py::arg("out_max"), py::arg("out_argmax"), py::arg("out_min"), py::arg("out_sum"));

  m.def(
      "nearest",
      [](const std::string& metric, const std::string& dtype, std::uintptr_t queries, int64_t n_queries,
         int64_t query_stride, std::uintptr_t inputs, int64_t n_inputs, int64_t input_stride, int64_t p,
         std::uintptr_t center, std::uintptr_t out_value, std::uintptr_t out_index,
         const std::optional<std::string>& capability) {
        const privleak::NearestMetric m = marshal::parse_metric(metric);
        const privleak::DType type = privleak::parse_dtype(dtype);
        const privleak::cpu::CpuCapability path = cpu_path(capability);
        py::gil_scoped_release release;
        privleak::cpu::nearest(type, m, as_pointer(queries), n_queries, query_stride, as_pointer(inputs), n_inputs,
                               input_stride, p, as_pointer(center), as_pointer<double>(out_value),
                               as_pointer<int64_t>(out_index), path);
      },
      py::arg("metric"), py::arg("dtype"), py::arg("queries"), py::arg("n_queries"), py::arg("query_stride"),
      py::arg("inputs"), py::arg("n_inputs"), py::arg("input_stride"), py::arg("p"), py::arg("center"),
      py::arg("out_value"), py::arg("out_index"), py::arg("capability") = py::none());

  m.def(
      "apply_noise",
      [](const std::string& distribution, const std::string& dtype, const std::vector<std::uintptr_t>& outs,
         const std::vector<int64_t>& numels, uint64_t key, uint64_t offset, double scale, bool add) {
        const privleak::Distribution d = marshal::parse_distribution(distribution);
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        py::gil_scoped_release release;
        marshal::each_in_stream(outs, numels, offset, [&](void* out, int64_t n, uint64_t at) {
          privleak::cpu::apply_noise(d, t, out, n, key, at, scale, add);
        });
      },
      py::arg("distribution"), py::arg("dtype"), py::arg("outs"), py::arg("numels"), py::arg("key"), py::arg("offset"),
      py::arg("scale"), py::arg("add"));

  m.def(
      "apply_secure_noise",
      [](const std::string& distribution, const std::string& dtype, const std::vector<std::uintptr_t>& outs,
         const std::vector<int64_t>& numels, const std::array<uint32_t, 8>& key, uint64_t offset, uint64_t scale,
         int grid_exponent, bool add) {
        const privleak::Distribution d = marshal::parse_distribution(distribution);
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const privleak::ChaChaKey k = marshal::to_chacha_key(key);
        py::gil_scoped_release release;
        marshal::each_in_stream(outs, numels, offset, [&](void* out, int64_t n, uint64_t at) {
          privleak::cpu::apply_secure_noise(d, t, out, n, k, at, scale, grid_exponent, add);
        });
      },
      py::arg("distribution"), py::arg("dtype"), py::arg("outs"), py::arg("numels"), py::arg("key"), py::arg("offset"),
      py::arg("scale"), py::arg("grid_exponent"), py::arg("add"));

  m.def(
      "vmf_sample",
      [](const std::string& dtype, std::uintptr_t mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset,
         std::uintptr_t out) {
        const privleak::DType t = privleak::parse_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cpu::vmf_sample(t, as_pointer(mu), p, kappa, n, key, offset, as_pointer(out));
      },
      py::arg("dtype"), py::arg("mu"), py::arg("p"), py::arg("kappa"), py::arg("n"), py::arg("key"), py::arg("offset"),
      py::arg("out"));

  m.def(
      "clip_accumulate",
      [](const std::string& dtype, const std::vector<std::uintptr_t>& grads, const std::vector<int64_t>& numels,
         const std::vector<std::uintptr_t>& outs, int64_t batch, int64_t num_columns, std::uintptr_t clip_norms,
         bool per_layer, int norm_type, double noise_std, uint64_t key, uint64_t offset, double scale,
         std::uintptr_t sums, std::uintptr_t factors) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        const auto tensors = marshal::per_sample_grads(grads, numels);
        const auto out_pointers = marshal::float_pointers(outs);
        const privleak::ClipNorm norm = privleak::parse_clip_norm(norm_type);
        py::gil_scoped_release release;
        privleak::cpu::clip_accumulate(t, tensors, out_pointers, batch, num_columns,
                                       as_pointer<const double>(clip_norms), per_layer, norm, noise_std, key, offset,
                                       scale, as_pointer<double>(sums), as_pointer<float>(factors));
      },
      py::arg("dtype"), py::arg("grads"), py::arg("numels"), py::arg("outs"), py::arg("batch"), py::arg("num_columns"),
      py::arg("clip_norms"), py::arg("per_layer"), py::arg("norm_type"), py::arg("noise_std"), py::arg("key"),
      py::arg("offset"), py::arg("scale"), py::arg("sums"), py::arg("factors"));

  m.def(
      "clip_factors",
      [](std::uintptr_t sums, std::uintptr_t clip_norms, int64_t batch, int64_t num_tensors, bool per_layer,
         int norm_type, std::uintptr_t factors) {
        const privleak::ClipNorm norm = privleak::parse_clip_norm(norm_type);
        py::gil_scoped_release release;
        privleak::cpu::clip_factors(as_pointer<const double>(sums), as_pointer<const double>(clip_norms), batch,
                                    num_tensors, per_layer, norm, as_pointer<float>(factors));
      },
      py::arg("sums"), py::arg("clip_norms"), py::arg("batch"), py::arg("num_tensors"), py::arg("per_layer"),
      py::arg("norm_type"), py::arg("factors"));

  m.def(
      "ghost_norm",
      [](const std::vector<std::string>& dtypes, const std::vector<std::uintptr_t>& activations,
         const std::vector<std::uintptr_t>& output_grads, int64_t batch, const std::vector<int64_t>& lengths,
         const std::vector<int64_t>& ds, const std::vector<int64_t>& ps, std::uintptr_t out,
         const std::optional<std::string>& capability) {
        const std::vector<privleak::NoiseDType> types = marshal::ghost_norm_layers(dtypes, activations, output_grads,
                                                                                  lengths, ds, ps);
        const privleak::cpu::CpuCapability path = cpu_path(capability);
        py::gil_scoped_release release;
        for (size_t k = 0; k < types.size(); ++k)
          privleak::cpu::ghost_norm(types[k], as_pointer(activations[k]), as_pointer(output_grads[k]), batch,
                                    lengths[k], ds[k], ps[k], as_pointer<double>(out) + k * batch, path);
      },
      "Layer k's ghost norms into row k of out (layers, batch).", py::arg("dtypes"), py::arg("activations"),
      py::arg("output_grads"), py::arg("batch"), py::arg("lengths"), py::arg("ds"), py::arg("ps"), py::arg("out"),
      py::arg("capability") = py::none());

  def_conv_kernel(m, "conv_ghost_norm", &privleak::cpu::conv_ghost_norm);

  m.def(
      "embedding_ghost_norm",
      [](const std::string& dtype, std::uintptr_t ids, std::uintptr_t output_grads, int64_t batch, int64_t length,
         int64_t p, std::uintptr_t out) {
        const privleak::NoiseDType t = marshal::parse_noise_dtype(dtype);
        py::gil_scoped_release release;
        privleak::cpu::embedding_ghost_norm(t, as_pointer<const int64_t>(ids), as_pointer(output_grads), batch, length,
                                            p, as_pointer<double>(out));
      },
      py::arg("dtype"), py::arg("ids"), py::arg("output_grads"), py::arg("batch"), py::arg("length"), py::arg("p"),
      py::arg("out"));

  def_conv_kernel(m, "conv_weight_grads", &privleak::cpu::conv_weight_grads);

  m.def(
      "chacha20_block",
      [](const std::array<uint32_t, 8>& key, uint32_t counter, const std::array<uint32_t, 3>& nonce) {
        const privleak::Words16 block = privleak::chacha20_block(key.data(), counter, nonce.data());
        return std::vector<uint32_t>(block.w, block.w + 16);
      },
      "The ChaCha20 block function (RFC 8439), exposed for its known-answer test.", py::arg("key"),
      py::arg("counter"), py::arg("nonce"));

  m.def("set_num_threads", [](int threads) {
    if (threads < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
    privleak::cpu::set_num_threads(threads);
  }, py::arg("threads"));
  m.def("num_threads", &privleak::cpu::max_threads);

  // The load-time choice of cpu/platform.h for the CPU features named in `features` (avx2, fma,
  // f16c, avx512f, avx512bw, avx512dq, avx512vl) and PRIVLEAK_CPU_CAPABILITY = `requested`: lets
  // tests check the choice for CPUs other than this one.
  m.def("choose_cpu_capability", [](const std::vector<std::string>& features,
                                    const std::optional<std::string>& requested) {
    privleak::cpu::CpuFeatures f;
    for (const std::string& name : features) {
      bool* flag = name == "avx2" ? &f.avx2 : name == "fma" ? &f.fma : name == "f16c" ? &f.f16c
                 : name == "avx512f" ? &f.avx512f : name == "avx512bw" ? &f.avx512bw
                 : name == "avx512dq" ? &f.avx512dq : name == "avx512vl" ? &f.avx512vl : nullptr;
      if (!flag) throw std::invalid_argument("unknown CPU feature '" + name + "'");
      *flag = true;
    }
    return std::string(privleak::cpu::capability_name(privleak::cpu::choose_capability(
        privleak::cpu::best_capability(f), requested ? requested->c_str() : nullptr)));
  }, py::arg("features"), py::arg("requested") = py::none());

  m.def("build_info", [] {
    py::dict info;
    info["compiler"] = PRIVLEAK_COMPILER;
    info["openmp"] = privleak::cpu::has_openmp();
    info["cpu_capability"] = privleak::cpu::cpu_capability();
    info["cpu_best_capability"] = privleak::cpu::capability_name(privleak::cpu::cpu_best_capability());
    info["openmp_threads"] = privleak::cpu::max_threads();
#if defined(PRIVLEAK_SANITIZE)
    info["sanitizers"] = "address,undefined";
#else
    info["sanitizers"] = py::none();
#endif
    return info;
  });
}
