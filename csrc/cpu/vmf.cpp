// CPU VMF sampling in three passes over the output: Gaussians and their chunk sums, then per
// sample Wood's step and the Householder frame, then the map y_i = t z_i + beta s mu_i. Work is
// split into (sample, tile) pieces, so one huge sample (DP-SGD's case) and many small ones both
// use every thread; the sums follow the fixed chunk order of common/vmf.h either way.
#include "cpu/vmf.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/vmf.h"
#include "cpu/noise.h"
#include "cpu/platform.h"

namespace privleak::cpu {
namespace {

constexpr int64_t kTileChunks = 16;

template <class T>
void vmf_sample_typed(const T* mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset, T* out) {
  const int64_t m = p - 1;  // tangent coordinates of a sample
  const int64_t chunks = vmf_num_chunks(p);
  const int64_t tiles_per_sample = (chunks + kTileChunks - 1) / kTileChunks;
  const int64_t tiles = n * tiles_per_sample;
  constexpr int k = kValuesPerBlock<T>;
  auto chunk_end = [&](int64_t chunk) { return std::min(m, (chunk + 1) * kVmfChunk); };
  auto tangent = [&](int64_t sample) { return out + sample * p + 1; };

  std::vector<double> norm_sq(static_cast<size_t>(n * chunks)), dot(static_cast<size_t>(n * chunks));
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t sample = tile / tiles_per_sample;
    const int64_t first_chunk = (tile % tiles_per_sample) * kTileChunks;
    const int64_t last_chunk = std::min(chunks, first_chunk + kTileChunks);
    T* z = tangent(sample);
    const int64_t begin = first_chunk * kVmfChunk;
    const uint64_t global = offset + static_cast<uint64_t>(sample);  // S in common/vmf.h's counter space
    fill_unit_gaussians<T>(vmf_tangent_stream(global), z + begin, chunk_end(last_chunk - 1) - begin, key,
                           vmf_tangent_first_element(global, k) + static_cast<uint64_t>(begin));
    for (int64_t chunk = first_chunk; chunk < last_chunk; ++chunk) {
      double chunk_norm_sq = 0.0, chunk_dot = 0.0;
      for (int64_t i = chunk * kVmfChunk; i < chunk_end(chunk); ++i) {
        const double zi = static_cast<double>(z[i]);
        chunk_norm_sq += zi * zi;
        chunk_dot += zi * static_cast<double>(mu[i + 1]);
      }
      norm_sq[sample * chunks + chunk] = chunk_norm_sq;
      dot[sample * chunks + chunk] = chunk_dot;
    }
  }

  std::vector<VmfFrame> frames(static_cast<size_t>(n));
  int64_t exhausted = -1;  // a sample whose rejection loop ran out of counters (never in practice)
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t sample = 0; sample < n; ++sample) {
    double sample_norm_sq = norm_sq[sample * chunks], sample_dot = dot[sample * chunks];
    for (int64_t chunk = 1; chunk < chunks; ++chunk) {
      sample_norm_sq += norm_sq[sample * chunks + chunk];
      sample_dot += dot[sample * chunks + chunk];
    }
    if (sample_norm_sq == 0.0) {  // every Gaussian was 0: any tangent direction will do, take e_1
      tangent(sample)[0] = T(1);
      sample_norm_sq = 1.0;
      sample_dot = static_cast<double>(mu[1]);
    }
    const double mu0 = static_cast<double>(mu[0]);
    const VmfW w = vmf_w(p, kappa, key, offset + static_cast<uint64_t>(sample));
    if (w.w != w.w) {
#pragma omp critical(privleak_vmf_exhausted)
      exhausted = sample;
    }
    frames[sample] = VmfFrame::make(w, mu0, sample_norm_sq, sample_dot);
    out[sample * p] = static_cast<T>(frames[sample].first(mu0, sample_dot));
  }

  if (exhausted >= 0)
    throw std::runtime_error("vmf_sample: Wood's rejection step for sample offset + " + std::to_string(exhausted) +
                             " used up its 2^32 Philox blocks");

#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t sample = tile / tiles_per_sample;
    const int64_t first_chunk = (tile % tiles_per_sample) * kTileChunks;
    const int64_t end = chunk_end(std::min(chunks, first_chunk + kTileChunks) - 1);
    const VmfFrame frame = frames[sample];
    T* z = tangent(sample);
    for (int64_t i = first_chunk * kVmfChunk; i < end; ++i)
      z[i] = static_cast<T>(frame.other(static_cast<double>(z[i]), static_cast<double>(mu[i + 1])));
  }
}

}  // namespace

void vmf_sample(DType dtype, const void* mu, int64_t p, double kappa, int64_t n, uint64_t key, uint64_t offset,
                void* out) {
  if (p < 2 || n < 0 || !(kappa > 0.0) || !(kappa <= 1.7976931348623157e308))
    throw std::invalid_argument("vmf_sample needs p >= 2, n >= 0, finite kappa > 0");
  if (p - 1 > kVmfMaxTangent) throw std::invalid_argument("vmf_sample: mu must have p - 1 <= 2^31 coordinates");
  if (offset > kVmfSampleLimit || static_cast<uint64_t>(n) > kVmfSampleLimit - offset)
    throw std::invalid_argument("vmf_sample: offset + n must be <= 2^63 (VMF's counter space)");
  if (n == 0) return;
  dispatch_float(dtype, [&](auto zero) {
    using T = decltype(zero);
    vmf_sample_typed<T>(static_cast<const T*>(mu), p, kappa, n, key, offset, static_cast<T*>(out));
  });
}

}  // namespace privleak::cpu
