// Ghost norms (Goodfellow 2015; Li et al., ICLR 2022; Bu et al., ICML 2023): each sample's squared
// Frobenius norm of a layer's per-sample weight gradient G = sum_t g_t a_t^T, from the layer's
// inputs a_t (d values) and output gradients g_t (p values) at positions t < T, without forming G:
//
//   |G|_F^2 = sum_{t,s} (a_t . a_s)(g_t . g_s) = sum_t [ w_tt + 2 sum_{s<t} w_ts ],   w_ts = (a_t . a_s)(g_t . g_s),
//
// and its Embedding form, where a_t is one-hot: |G|_F^2 = sum_v |sum_{t: id_t = v} g_t|^2.
//
// The arithmetic, identical on every CPU path and on CUDA (so the bits are too):
// - A Gram entry x_t . x_s (x = a or g, n coordinates) is a sum over chunks of kGhostChunk
//   coordinates, each a float32 fma chain in coordinate order from 0 (float64 inputs: a float64
//   chain), the chunk sums added in order to a double from 0. Half-precision inputs are widened
//   exactly first. Chunks bound the float32 rounding error to about kGhostChunk ulp of
//   |x_t| |x_s| whatever n is; their double sum adds nothing measurable.
// - w_ts = (a_t . a_s) * (g_t . g_s) in double. Row t's `below` = sum_{s<t} w_ts in two levels:
//   the columns s in tiles of kGhostRowTile, each tile's w_ts added in order of s from +0, and the
//   tiles' sums added in order from +0 (so that a GPU can give each tile its own block); its total
//   is ghost_row_total; the sample's is the sum of its rows in order of t,
//   finished by ghost_finish. Gram entries are symmetric bit for bit (fma commutes in its product),
//   so the lower triangle is all that is computed.
// - Embedding: positions with equal ids form a group, led by its first position t. The group's
//   row is q = |v|^2, v_j = sum of its members' g_j in double in order of position; the squares go
//   into kEmbeddingLanes lanes (coordinate j into lane j mod kEmbeddingLanes, fma in order of j),
//   and the lanes are added in lane order. The other positions' rows are 0. The sample total is
//   the same ordered sum of rows.
// - Convolution form (a Conv1d/Conv2d's weight, groups folded into the samples, a Conv1d of
//   height 1): a_t is output position t's patch, so a_t . a_s = sum_k x_{u_k(t)} . x_{u_k(s)} over
//   the kernel offsets k, where u_k(t) = conv_pixel(t, k) is the input pixel under offset k (none in
//   the padding, whose terms are 0). The pixel Gram entries P_uv = x_u . x_v (C channels) are Gram
//   entries by the first rule; the patch Gram entry is sum_k P_{u_k(t) u_k(s)}, added to a double
//   from +0 in order of k, offsets in the padding skipped; the g side and everything after are the
//   dense form's. For s <= t, u_k(s) <= u_k(t) (pixels and positions are both row-major and the
//   offsets shift both alike), so the lower triangle of P is all that is read. This does
//   N^2 C / 2 multiply-adds for a sample's N pixels where the patches' Gram does T^2 k C / 2.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "common/conv_grads.h"
#include "common/element.h"
#include "common/fp_math.h"
#include "common/hostdevice.h"
#include "common/noise.h"

namespace privleak {

// Coordinates per float32 fma chain of a Gram entry. A multiple of the CUDA kernel's k tile.
constexpr int64_t kGhostChunk = 128;
// Columns s of a tile whose products w_ts a row adds on their own before adding them to `below`.
constexpr int64_t kGhostRowTile = 64;
constexpr int kEmbeddingLanes = 32;  // one per thread of a CUDA warp

// The type a Gram entry's chunk accumulates in: float for float32 and the half types, double for
// float64 inputs.
template <class In> struct GhostAcc { using type = float; };
template <> struct GhostAcc<double> { using type = double; };

// fma rounded once, the same on the host (std::fma) and on the device.
PRIVLEAK_HOST_DEVICE float ghost_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
PRIVLEAK_HOST_DEVICE double ghost_fma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The quiet NaN and +inf every path returns (numeric_limits is not callable from CUDA device code).
PRIVLEAK_HOST_DEVICE double ghost_nan() { return fp::bit_cast<double>(uint64_t(0x7FF8000000000000)); }
PRIVLEAK_HOST_DEVICE double ghost_inf() { return fp::bit_cast<double>(uint64_t(0x7FF0000000000000)); }

// Row t's total 2 below + w_tt from its Gram diagonals aa = |a_t|^2 and gg = |g_t|^2. A NaN
// diagonal means a NaN input in row t (a sum of squares of non-NaN numbers is never NaN): the row
// is NaN. Otherwise a non-finite total comes from an infinite input or a Gram entry past the
// float32 range, and is +inf (never NaN: inf * 0 and inf - inf must not turn finite inputs into NaN).
PRIVLEAK_HOST_DEVICE double ghost_row_total(double below, double aa, double gg) {
  if (aa != aa || gg != gg) return ghost_nan();
  const double total = 2.0 * below + aa * gg;
  return total - total == 0.0 ? total : ghost_inf();
}

// The sample's squared norm from its rows' totals, added in order of t. NaN (a NaN input) stays
// NaN, +-inf becomes +inf; a finite total is clamped at 0: it is a squared norm, and rounding can
// leave a total whose exact value is 0 slightly negative.
PRIVLEAK_HOST_DEVICE double ghost_sample_total(const double* rows, int64_t length) {
  double total = 0.0;
  for (int64_t t = 0; t < length; ++t) total += rows[t];
  if (total != total) return ghost_nan();
  if (total - total != 0.0) return ghost_inf();
  return total > 0.0 ? total : 0.0;
}

// An Embedding group's row from its lanes (common/ghost_norm.h's order).
PRIVLEAK_HOST_DEVICE double embedding_lanes_total(const double* lanes) {
  double q = 0.0;
  for (int l = 0; l < kEmbeddingLanes; ++l) q += lanes[l];
  return q;
}

// The input pixel (row-major in the sample's height x width) under kernel offset k (row-major in
// the kernel) of output position t (row-major), or -1 where that offset falls in the padding.
PRIVLEAK_HOST_DEVICE int64_t conv_pixel(const ConvGeometry& c, int64_t t, int64_t k) {
  const int64_t y = t / c.out_width * c.stride_h - c.pad_h + k / c.kernel_w * c.dilation_h;
  const int64_t x = t % c.out_width * c.stride_w - c.pad_w + k % c.kernel_w * c.dilation_w;
  return y >= 0 && y < c.height && x >= 0 && x < c.width ? y * c.width + x : -1;
}

// a_t . a_s for s <= t from a sample's pixel Gram (its lower triangle, gram[u N + v], v <= u < N),
// in the order common/ghost_norm.h gives.
PRIVLEAK_HOST_DEVICE double conv_patch_gram(const ConvGeometry& c, const double* gram, int64_t t, int64_t s) {
  const int64_t pixels = c.height * c.width;
  double sum = 0.0;
  for (int64_t k = 0; k < c.kernel_size(); ++k) {
    const int64_t u = conv_pixel(c, t, k), v = conv_pixel(c, s, k);
    if (u >= 0 && v >= 0) sum += gram[u * pixels + v];
  }
  return sum;
}

// Pixels a sample of the convolution form may have: its pixel Gram (N^2 doubles) is stored whole.
constexpr int64_t kConvGhostMaxPixels = int64_t(1) << 14;

inline void check_conv_ghost_geometry(const ConvGeometry& c) {
  check_conv_geometry(c, "conv_ghost_norm");
  if (c.height * c.width > kConvGhostMaxPixels)
    throw std::invalid_argument("conv_ghost_norm: an input of more than 2^14 pixels (its pixel Gram would take over "
                                "2 GiB); use ghost_norm on its patches");
}

// Calls f(In{}) with In the element type of the activations and output gradients.
template <class F>
void dispatch_ghost_dtype(NoiseDType dtype, F&& f) {
  switch (dtype) {
    case NoiseDType::float32: return f(float{});
    case NoiseDType::float64: return f(double{});
    case NoiseDType::bfloat16: return f(BFloat16{});
    case NoiseDType::float16: return f(Float16{});
  }
  throw std::invalid_argument("ghost norms take float32, float64, bfloat16 or float16 inputs");
}

inline void check_ghost_sizes(int64_t batch, int64_t length, int64_t d, int64_t p) {
  if (batch < 0 || length < 0 || d < 0 || p < 0)
    throw std::invalid_argument("ghost_norm: batch, length, d and p must be >= 0");
}

}  // namespace privleak
