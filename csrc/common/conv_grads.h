// Per-sample weight gradients of a convolution (the book-keeping rule for Conv1d/Conv2d layers
// whose per-sample gradients are small enough to keep): sample n's gradient is that of the
// convolution of its input alone,
//
//   G[n, o, c, u, v] = sum_{h < H_out, w < W_out} g[n, o, h, w] x_pad[n, c, h s_h + u d_h, w s_w + v d_w],
//
// for input x (N, C, H, W), output gradient g (N, O, H_out, W_out), kernel (k_h, k_w), stride s,
// zero padding p and dilation d (x_pad: x with p_h, p_w zeros on both sides). A grouped
// convolution is G such convolutions per sample, one per group: the caller folds the groups into
// N. Conv1d is the case H = H_out = k_h = 1.
//
// The arithmetic, identical on every CPU path and on CUDA (so the bits are too): each element is
// one fma chain from +0 over the output positions t = h W_out + w in increasing order, padding
// positions included (their x is +0), in float32 for float32 and half inputs (widened exactly
// first) and float64 for float64 inputs. Rounding error, to first order: H_out W_out 2^-24 times
// sum_t |g_t x_t| (2^-53 for float64). A NaN result is stored as the canonical quiet NaN: FMA
// units differ in which NaN payload they pass on (x86 keeps an operand's, CUDA makes its own).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/fp_math.h"
#include "common/hostdevice.h"

namespace privleak {

struct ConvGeometry {
  int64_t batch, channels, height, width;            // x: (batch, channels, height, width)
  int64_t outputs, out_height, out_width;            // g: (batch, outputs, out_height, out_width)
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;

  PRIVLEAK_HOST_DEVICE int64_t positions() const { return out_height * out_width; }
  PRIVLEAK_HOST_DEVICE int64_t kernel_size() const { return kernel_h * kernel_w; }
  PRIVLEAK_HOST_DEVICE int64_t padded_height() const { return height + 2 * pad_h; }
  PRIVLEAK_HOST_DEVICE int64_t padded_width() const { return width + 2 * pad_w; }
  // Elements of one sample's gradient: outputs x channels x kernel.
  PRIVLEAK_HOST_DEVICE int64_t grad_size() const { return outputs * channels * kernel_h * kernel_w; }
};

// The output size the convolution has along one dim (what torch computes).
inline int64_t conv_out_size(int64_t size, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
  return (size + 2 * pad - dilation * (kernel - 1) - 1) / stride + 1;
}

// Elements a sample's scratch may hold (its padded input, and its gradient): 2^34, 64 GiB of
// float32. Larger sizes are refused before anything is allocated (and their products stay far
// from int64's range).
constexpr int64_t kConvMaxScratch = int64_t(1) << 34;

// Throws std::invalid_argument unless the sizes describe a convolution: positive kernel, stride
// and dilation, non-negative padding, g's spatial size the one x gives, and scratch within
// kConvMaxScratch.
inline void check_conv_geometry(const ConvGeometry& c, const std::string& op = "conv_weight_grads") {
  if (c.batch < 0 || c.channels < 1 || c.height < 1 || c.width < 1 || c.outputs < 1)
    throw std::invalid_argument(op + ": batch must be >= 0 and channels, sizes and outputs >= 1");
  if (c.kernel_h < 1 || c.kernel_w < 1 || c.stride_h < 1 || c.stride_w < 1 || c.dilation_h < 1 ||
      c.dilation_w < 1 || c.pad_h < 0 || c.pad_w < 0)
    throw std::invalid_argument(op + ": kernel, stride and dilation must be >= 1 and padding >= 0");
  constexpr int64_t limit = int64_t(1) << 31;
  for (int64_t v : {c.channels, c.height, c.width, c.outputs, c.out_height, c.out_width, c.kernel_h, c.kernel_w,
                    c.stride_h, c.stride_w, c.pad_h, c.pad_w, c.dilation_h, c.dilation_w})
    if (v >= limit) throw std::invalid_argument(op + ": every size, stride, padding and dilation must be "
                                                "below 2^31");
  const double padded = double(c.padded_height()) * double(c.padded_width()) * double(c.channels + 32);
  const double grad = double(c.kernel_size() * c.channels + 16) * double(c.outputs + 32);
  if (padded > double(kConvMaxScratch) || grad > double(kConvMaxScratch))
    throw std::invalid_argument(op + ": a sample's padded input or gradient exceeds 2^34 elements");
  const int64_t oh = conv_out_size(c.height, c.kernel_h, c.stride_h, c.pad_h, c.dilation_h);
  const int64_t ow = conv_out_size(c.width, c.kernel_w, c.stride_w, c.pad_w, c.dilation_w);
  if (oh < 1 || ow < 1 || oh != c.out_height || ow != c.out_width)
    throw std::invalid_argument(op + ": the output gradient's size is not the convolution's");
}

// A result as stored: the canonical quiet NaN for any NaN (common/conv_grads.h's top).
PRIVLEAK_HOST_DEVICE float conv_result(float v) { return v == v ? v : fp::bit_cast<float>(uint32_t(0x7FC00000)); }
PRIVLEAK_HOST_DEVICE double conv_result(double v) {
  return v == v ? v : fp::bit_cast<double>(uint64_t(0x7FF8000000000000));
}

}  // namespace privleak
