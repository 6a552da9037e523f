// Runs privleak's CUDA entry points (compiled for the emulator) on cases described by a manifest.
//
//   driver MANIFEST
//
// Manifest lines (files hold raw little-endian element bytes):
//   ghost B K OUT                then K lines: L DTYPE T d p AFILE GFILE
//   noise DIST DTYPE KEY OFFSET SCALE ADD N      then N lines: A NUMEL IN OUT
//   secure DIST DTYPE W0..W7 OFFSET SCALE GRID ADD N   then N lines: A NUMEL IN OUT
//   conv DTYPE XFILE GFILE F0..F14 OUT      (ConvGeometry fields in order)
//   emb DTYPE IDSFILE GFILE B T p OUT
//   clip DTYPE B C PER_LAYER NORM NOISE_STD KEY OFFSET SCALE CLIPFILE SUMSFILE SUMSOUT FACTORSOUT N
//                                then N lines: A NUMEL IN OUT   (IN holds B x NUMEL elements)
//   factors B T PER_LAYER NORM SUMSFILE CLIPFILE OUT
//   convgrad DTYPE XFILE GFILE F0..F14 OUT
//   vmf DTYPE P N KAPPA KEY OFFSET MUFILE OUT
//   colstats DTYPE STATS ROWS COLS STRIDE MATFILE WFILE MAXOUT ARGMAXOUT MINOUT SUMOUT   (- for none)
//   nearest DTYPE METRIC NQ QSTRIDE NI XSTRIDE P QFILE XFILE CENTERFILE VALOUT IDXOUT  (- for no centre)
// NOISE_STD, SCALE and KAPPA are C hex floats (Python float.hex()). Every "device" buffer is its own malloc of
// exactly its size: under AddressSanitizer an access past any of them is reported; without it,
// 4 KiB canaries on both sides are checked after each call. Inputs are checked unchanged,
// workspace and outputs start as 0xFF bytes (NaN).
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/clip.h"
#include "cuda/column_stats.h"
#include "cuda/conv_grads.h"
#include "cuda/ghost_norm.h"
#include "cuda/nearest.h"
#include "cuda/noise.h"
#include "cuda/secure_noise.h"
#include "cuda/vmf.h"

namespace emu {
long emu_errors();
}

using namespace privleak;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kGuard = 0;
#else
constexpr size_t kGuard = 4096;
#endif
constexpr unsigned char kCanary = 0xA5;

long g_failures = 0;

void fail(const std::string& what) {
  ++g_failures;
  std::printf("FAIL: %s\n", what.c_str());
  std::fflush(stdout);
}

struct Buffer {
  unsigned char* base = nullptr;
  size_t bytes = 0;
  std::string name;
  unsigned char* data() const { return base + kGuard; }
  Buffer(size_t n, const std::string& label, unsigned char fill) : bytes(n), name(label) {
    base = static_cast<unsigned char*>(std::malloc(n + 2 * kGuard));
    std::memset(base, kCanary, kGuard);
    std::memset(base + kGuard, fill, n);
    std::memset(base + kGuard + n, kCanary, kGuard);
  }
  Buffer(const Buffer&) = delete;
  ~Buffer() {
    check_guards();
    std::free(base);
  }
  void check_guards() const {
    for (size_t i = 0; i < kGuard; ++i)
      if (base[i] != kCanary || base[kGuard + bytes + i] != kCanary) {
        fail("canary overwritten around " + name + (base[i] != kCanary ? " (before)" : " (after)"));
        return;
      }
  }
};

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const void* p, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
}

NoiseDType parse_dtype(const std::string& s) {
  if (s == "float32") return NoiseDType::float32;
  if (s == "float64") return NoiseDType::float64;
  if (s == "bfloat16") return NoiseDType::bfloat16;
  if (s == "float16") return NoiseDType::float16;
  throw std::invalid_argument("dtype " + s);
}

size_t element_size(NoiseDType t) {
  switch (t) {
    case NoiseDType::float32: return 4;
    case NoiseDType::float64: return 8;
    default: return 2;
  }
}

Distribution parse_distribution(const std::string& s) {
  if (s == "gaussian") return Distribution::gaussian;
  if (s == "laplace") return Distribution::laplace;
  throw std::invalid_argument("distribution " + s);
}

// An input buffer loaded from a file, checked unchanged at the end.
struct Input {
  std::vector<unsigned char> contents;
  Buffer buffer;
  Input(const std::string& path, size_t expected)
      : contents(read_file(path)), buffer(contents.size(), path, 0) {
    if (contents.size() != expected)
      throw std::runtime_error(path + ": " + std::to_string(contents.size()) + " bytes, expected " +
                               std::to_string(expected));
    if (!contents.empty()) std::memcpy(buffer.data(), contents.data(), contents.size());
  }
  void check_unchanged() const {
    if (!contents.empty() && std::memcmp(buffer.data(), contents.data(), contents.size()) != 0)
      fail("input modified: " + buffer.name);
  }
};

void run_ghost(std::istream& in, const std::string& header) {
  std::istringstream h(header);
  std::string cmd, out_path;
  int64_t batch, k;
  h >> cmd >> batch >> k >> out_path;
  std::vector<cuda::GhostLayer> layers;
  std::vector<std::unique_ptr<Input>> inputs;
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < k; ++i) {
    std::string line, tag, dtype, a_path, g_path;
    std::getline(in, line);
    std::istringstream l(line);
    int64_t t, d, p;
    l >> tag >> dtype >> t >> d >> p >> a_path >> g_path;
    const NoiseDType type = parse_dtype(dtype);
    const size_t es = element_size(type);
    inputs.push_back(std::make_unique<Input>(a_path, static_cast<size_t>(batch * t * d) * es));
    inputs.push_back(std::make_unique<Input>(g_path, static_cast<size_t>(batch * t * p) * es));
    layers.push_back({type, inputs[inputs.size() - 2]->buffer.data(), inputs.back()->buffer.data(), t, d, p});
    lengths.push_back(t);
  }
  const int64_t ws = cuda::ghost_norm_workspace_bytes(batch, lengths);
  Buffer workspace(static_cast<size_t>(ws), "ghost workspace", 0xFF);
  Buffer out(static_cast<size_t>(k * batch) * 8, "ghost out", 0xFF);
  std::printf("ghost B=%" PRId64 " K=%" PRId64 " workspace %" PRId64 " bytes\n", batch, k, ws);
  cuda::ghost_norm(layers, batch, reinterpret_cast<double*>(out.data()), workspace.data(), 0, nullptr);
  for (auto& i : inputs) i->check_unchanged();
  write_file(out_path, out.data(), out.bytes);
}

// One "A NUMEL IN OUT" line of a list of arrays.
struct ArrayLine {
  int64_t numel = 0;
  std::string in_path, out_path;
  explicit ArrayLine(std::istream& in) {
    std::string line, tag;
    std::getline(in, line);
    std::istringstream l(line);
    l >> tag >> numel >> in_path >> out_path;
  }
};

struct Arrays {
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<std::string> outs;
  std::vector<void*> pointers;
  std::vector<int64_t> numels;
  void read(std::istream& in, int n, size_t es) {
    for (int i = 0; i < n; ++i) {
      const ArrayLine a(in);
      const std::string& in_path = a.in_path;
      const int64_t numel = a.numel;
      const std::vector<unsigned char> c = read_file(in_path);
      if (c.size() != static_cast<size_t>(numel) * es) throw std::runtime_error(in_path + ": size");
      buffers.push_back(std::make_unique<Buffer>(c.size(), in_path, 0));
      if (!c.empty()) std::memcpy(buffers.back()->data(), c.data(), c.size());
      outs.push_back(a.out_path);
      pointers.push_back(buffers.back()->data());
      numels.push_back(numel);
    }
  }
  void write() {
    for (size_t i = 0; i < buffers.size(); ++i) write_file(outs[i], buffers[i]->data(), buffers[i]->bytes);
  }
};

void run_noise(std::istream& in, const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dist, dtype, scale_text;
  uint64_t key, offset;
  int add, n;
  h >> cmd >> dist >> dtype >> key >> offset >> scale_text >> add >> n;
  const double scale = std::strtod(scale_text.c_str(), nullptr);
  const NoiseDType type = parse_dtype(dtype);
  Arrays arrays;
  arrays.read(in, n, element_size(type));
  cuda::apply_noise(parse_distribution(dist), type, arrays.pointers, arrays.numels, key, offset, scale, add != 0, 0,
                    nullptr);
  arrays.write();
}

void run_secure(std::istream& in, const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dist, dtype;
  ChaChaKey key;
  uint64_t offset, scale;
  int grid, add, n;
  h >> cmd >> dist >> dtype;
  for (auto& w : key.w) h >> w;
  h >> offset >> scale >> grid >> add >> n;
  const NoiseDType type = parse_dtype(dtype);
  Arrays arrays;
  arrays.read(in, n, element_size(type));
  cuda::apply_secure_noise(parse_distribution(dist), type, arrays.pointers, arrays.numels, key, offset, scale, grid,
                           add != 0, 0, nullptr);
  arrays.write();
}

// A convolution's case: "CMD DTYPE XFILE GFILE F0..F14 OUT", its inputs loaded.
struct ConvCase {
  NoiseDType type;
  ConvGeometry c;
  std::string out_path;
  std::unique_ptr<Input> x, g;
  explicit ConvCase(const std::string& header) {
    std::istringstream h(header);
    std::string cmd, dtype, x_path, g_path;
    int64_t f[15];
    h >> cmd >> dtype >> x_path >> g_path;
    for (auto& v : f) h >> v;
    h >> out_path;
    c = ConvGeometry{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], f[13], f[14]};
    type = parse_dtype(dtype);
    const size_t es = element_size(type);
    x = std::make_unique<Input>(x_path, static_cast<size_t>(c.batch * c.channels * c.height * c.width) * es);
    g = std::make_unique<Input>(g_path, static_cast<size_t>(c.batch * c.outputs * c.positions()) * es);
  }
  void check_unchanged() const {
    x->check_unchanged();
    g->check_unchanged();
  }
};

void run_conv(const std::string& header) {
  const ConvCase k(header);
  const ConvGeometry& c = k.c;
  const int64_t ws = cuda::conv_ghost_norm_workspace_bytes(c.batch, c.height * c.width, c.positions());
  Buffer workspace(static_cast<size_t>(ws), "conv workspace", 0xFF);
  Buffer out(static_cast<size_t>(c.batch) * 8, "conv out", 0xFF);
  cuda::conv_ghost_norm(k.type, k.x->buffer.data(), k.g->buffer.data(), c, reinterpret_cast<double*>(out.data()),
                        workspace.data(), 0, nullptr);
  k.check_unchanged();
  write_file(k.out_path, out.data(), out.bytes);
}

void run_embedding(const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dtype, ids_path, g_path, out_path;
  int64_t batch, length, p;
  h >> cmd >> dtype >> ids_path >> g_path >> batch >> length >> p >> out_path;
  const NoiseDType type = parse_dtype(dtype);
  Input ids(ids_path, static_cast<size_t>(batch * length) * 8);
  Input g(g_path, static_cast<size_t>(batch * length * p) * element_size(type));
  const int64_t ws = cuda::embedding_ghost_norm_workspace_bytes(batch, length);
  Buffer workspace(static_cast<size_t>(ws), "embedding workspace", 0xFF);
  Buffer out(static_cast<size_t>(batch) * 8, "embedding out", 0xFF);
  cuda::embedding_ghost_norm(type, reinterpret_cast<const int64_t*>(ids.buffer.data()), g.buffer.data(), batch,
                             length, p, reinterpret_cast<double*>(out.data()), workspace.data(), 0, nullptr);
  ids.check_unchanged();
  g.check_unchanged();
  write_file(out_path, out.data(), out.bytes);
}

double hex_double(const std::string& text) { return std::strtod(text.c_str(), nullptr); }

// An output buffer of `bytes` bytes, 0xFF at first, or none for the path "-".
struct Output {
  std::string path;
  std::unique_ptr<Buffer> buffer;
  Output(const std::string& p, size_t bytes) : path(p) {
    if (p != "-") buffer = std::make_unique<Buffer>(bytes, p, 0xFF);
  }
  void* data() const { return buffer ? buffer->data() : nullptr; }
  void write() const {
    if (buffer) write_file(path, buffer->data(), buffer->bytes);
  }
};

void run_clip(std::istream& in, const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dtype, std_text, scale_text, clip_path, sums_path, sums_out, factors_out;
  int64_t batch, columns;
  int per_layer, norm, n;
  uint64_t key, offset;
  h >> cmd >> dtype >> batch >> columns >> per_layer >> norm >> std_text >> key >> offset >> scale_text >> clip_path >>
      sums_path >> sums_out >> factors_out >> n;
  const NoiseDType type = parse_dtype(dtype);
  std::vector<std::unique_ptr<Input>> grads;
  std::vector<std::unique_ptr<Output>> outs;
  std::vector<PerSampleGrads> tensors;
  std::vector<float*> out_pointers;
  std::vector<int64_t> numels;
  for (int i = 0; i < n; ++i) {
    const ArrayLine a(in);
    grads.push_back(std::make_unique<Input>(a.in_path, static_cast<size_t>(batch * a.numel) * element_size(type)));
    outs.push_back(std::make_unique<Output>(a.out_path, static_cast<size_t>(a.numel) * 4));
    tensors.push_back({grads.back()->buffer.data(), a.numel});
    out_pointers.push_back(static_cast<float*>(outs.back()->data()));
    numels.push_back(a.numel);
  }
  Input clip_norms(clip_path, static_cast<size_t>(per_layer ? columns : 1) * 8);
  const std::vector<unsigned char> sums_in = read_file(sums_path);  // the columns of other tensors
  Output sums(sums_out, static_cast<size_t>(batch * columns) * 8), factors(factors_out, static_cast<size_t>(batch * columns) * 4);
  if (sums_in.size() != sums.buffer->bytes) throw std::runtime_error(sums_path + ": size");
  std::memcpy(sums.data(), sums_in.data(), sums_in.size());
  Buffer workspace(static_cast<size_t>(cuda::clip_workspace_bytes(numels, batch, columns)), "clip workspace", 0xFF);
  cuda::clip_accumulate(type, tensors, out_pointers, batch, columns, reinterpret_cast<const double*>(clip_norms.buffer.data()),
                        per_layer != 0, static_cast<ClipNorm>(norm), hex_double(std_text), key, offset,
                        hex_double(scale_text), static_cast<double*>(sums.data()), static_cast<float*>(factors.data()),
                        workspace.data(), 0, nullptr);
  for (auto& g : grads) g->check_unchanged();
  clip_norms.check_unchanged();
  for (auto& o : outs) o->write();
  sums.write();
  factors.write();
}

void run_factors(const std::string& header) {
  std::istringstream h(header);
  std::string cmd, sums_path, clip_path, out_path;
  int64_t batch, columns;
  int per_layer, norm;
  h >> cmd >> batch >> columns >> per_layer >> norm >> sums_path >> clip_path >> out_path;
  Input sums(sums_path, static_cast<size_t>(batch * columns) * 8);
  Input clip_norms(clip_path, static_cast<size_t>(per_layer ? columns : 1) * 8);
  Output factors(out_path, static_cast<size_t>(batch * columns) * 4);
  cuda::clip_factors(reinterpret_cast<const double*>(sums.buffer.data()),
                     reinterpret_cast<const double*>(clip_norms.buffer.data()), batch, columns, per_layer != 0,
                     static_cast<ClipNorm>(norm), static_cast<float*>(factors.data()), 0, nullptr);
  sums.check_unchanged();
  clip_norms.check_unchanged();
  factors.write();
}

void run_conv_grads(const std::string& header) {
  const ConvCase k(header);
  const ConvGeometry& c = k.c;
  Output out(k.out_path, static_cast<size_t>(c.batch * c.grad_size()) * (k.type == NoiseDType::float64 ? 8 : 4));
  cuda::conv_weight_grads(k.type, k.x->buffer.data(), k.g->buffer.data(), c, out.data(), 0, nullptr);
  k.check_unchanged();
  out.write();
}

void run_vmf(const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dtype, kappa_text, mu_path, out_path;
  int64_t p, n;
  uint64_t key, offset;
  h >> cmd >> dtype >> p >> n >> kappa_text >> key >> offset >> mu_path >> out_path;
  const DType type = privleak::parse_dtype(dtype);
  const size_t es = type == DType::float64 ? 8 : 4;
  Input mu(mu_path, static_cast<size_t>(p) * es);
  Output out(out_path, static_cast<size_t>(n * p) * es);
  Buffer workspace(static_cast<size_t>(cuda::vmf_workspace_bytes(p, n)), "vmf workspace", 0xFF);
  cuda::vmf_sample(type, mu.buffer.data(), p, hex_double(kappa_text), n, key, offset, out.data(), workspace.data(), 0,
                   nullptr);
  mu.check_unchanged();
  out.write();
}

void run_column_stats(const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dtype, matrix_path, weights_path, max_path, argmax_path, min_path, sum_path;
  unsigned stats;
  int64_t rows, cols, stride;
  h >> cmd >> dtype >> stats >> rows >> cols >> stride >> matrix_path >> weights_path >> max_path >> argmax_path >>
      min_path >> sum_path;
  const DType type = privleak::parse_dtype(dtype);
  const size_t es = type == DType::float64 ? 8 : 4;
  Input matrix(matrix_path, static_cast<size_t>(rows * stride) * es);
  std::unique_ptr<Input> weights;
  if (weights_path != "-") weights = std::make_unique<Input>(weights_path, static_cast<size_t>(rows) * es);
  Output max(max_path, static_cast<size_t>(cols) * es), argmax(argmax_path, static_cast<size_t>(cols) * 8),
      min(min_path, static_cast<size_t>(cols) * es), sum(sum_path, static_cast<size_t>(cols) * 8);
  Buffer workspace(static_cast<size_t>(cuda::column_stats_workspace_bytes(type, rows, cols)), "column_stats workspace",
                   0xFF);
  cuda::column_stats(type, stats, matrix.buffer.data(), rows, cols, stride, weights ? weights->buffer.data() : nullptr,
                     max.data(), static_cast<int64_t*>(argmax.data()), min.data(), static_cast<double*>(sum.data()),
                     workspace.data(), 0, nullptr);
  matrix.check_unchanged();
  if (weights) weights->check_unchanged();
  for (const Output* o : {&max, &argmax, &min, &sum}) o->write();
}

NearestMetric parse_metric(const std::string& s) {
  if (s == "inner_product") return NearestMetric::inner_product;
  if (s == "squared_l2") return NearestMetric::squared_l2;
  if (s == "l1") return NearestMetric::l1;
  throw std::invalid_argument("metric " + s);
}

void run_nearest(const std::string& header) {
  std::istringstream h(header);
  std::string cmd, dtype, metric_name, q_path, x_path, center_path, value_path, index_path;
  int64_t n_queries, query_stride, n_inputs, input_stride, p;
  h >> cmd >> dtype >> metric_name >> n_queries >> query_stride >> n_inputs >> input_stride >> p >> q_path >> x_path >>
      center_path >> value_path >> index_path;
  const DType type = privleak::parse_dtype(dtype);
  const NearestMetric metric = parse_metric(metric_name);
  const size_t es = type == DType::float64 ? 8 : 4;
  Input queries(q_path, static_cast<size_t>(n_queries * query_stride) * es);
  Input inputs(x_path, static_cast<size_t>(n_inputs * input_stride) * es);
  std::unique_ptr<Input> center;
  if (center_path != "-") center = std::make_unique<Input>(center_path, static_cast<size_t>(p) * es);
  Output value(value_path, static_cast<size_t>(n_queries) * 8), index(index_path, static_cast<size_t>(n_queries) * 8);
  const int64_t ws = cuda::nearest_workspace_bytes(type, metric, n_queries, n_inputs, false, 0);
  Buffer workspace(static_cast<size_t>(ws), "nearest workspace", 0xFF);
  cuda::nearest(type, metric, queries.buffer.data(), n_queries, query_stride, inputs.buffer.data(), n_inputs,
                input_stride, p, center ? center->buffer.data() : nullptr, static_cast<double*>(value.data()),
                static_cast<int64_t*>(index.data()), false, workspace.data(), 0, nullptr);
  queries.check_unchanged();
  inputs.check_unchanged();
  if (center) center->check_unchanged();
  value.write();
  index.write();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MANIFEST\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::string cmd = line.substr(0, line.find(' '));
    try {
      if (cmd == "ghost") run_ghost(in, line);
      else if (cmd == "noise") run_noise(in, line);
      else if (cmd == "secure") run_secure(in, line);
      else if (cmd == "conv") run_conv(line);
      else if (cmd == "emb") run_embedding(line);
      else if (cmd == "clip") run_clip(in, line);
      else if (cmd == "factors") run_factors(line);
      else if (cmd == "convgrad") run_conv_grads(line);
      else if (cmd == "vmf") run_vmf(line);
      else if (cmd == "colstats") run_column_stats(line);
      else if (cmd == "nearest") run_nearest(line);
      else throw std::runtime_error("unknown command " + cmd);
    } catch (const std::exception& e) {
      fail(std::string("exception in '") + line.substr(0, 80) + "': " + e.what());
    }
  }
  const long emu_errors = emu::emu_errors();
  std::printf("driver done: %ld failures, %ld emulator errors\n", g_failures, emu_errors);
  return g_failures || emu_errors ? 1 : 0;
}
