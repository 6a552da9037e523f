"""Per-sample weight gradients of a convolution, the book-keeping rule for Conv1d/Conv2d layers
that keep them (:class:`privleak.dpsgd.layers.ConvLayer`).

Sample n's weight gradient is that of the convolution of its input alone:

    G[n, o, c, u, v] = sum_{h, w} g[n, o, h, w] x_pad[n, c, h s_h + u d_h, w s_w + v d_w]

for input x (B, C, H, W), output gradient g (B, O, H_out, W_out), stride s, dilation d and zero
padding; a grouped convolution is one such sum per group, over the group's channels. The number
of multiply-adds is that of the ordinary (batch-summed) weight gradient: only the output is B
times larger. Torch has no op for it; its usual forms are the weight gradient of a convolution
with the batch folded into B G groups (Opacus's functorch path, and privleak's before this
kernel) and unfold + einsum (Opacus's hooks). On the CPU both run at a fraction of the speed of
the ordinary weight gradient on small convolutions (oneDNN's grouped kernels, a (B, C k^2, L)
copy of the input), which made them most of book-keeping's overhead on small CNNs.

:func:`conv_weight_grads` runs privleak's kernel (``torch.ops.privleak.conv_weight_grads``, CPU
and CUDA): an implicit GEMM per sample, no unfolded copy (csrc/cpu/conv_grads.cpp).
:func:`conv_weight_grads_reference` is the float64 torch formula it is tested against. The
kernel's arithmetic is fixed (csrc/common/conv_grads.h): each element is one fma chain over the
output positions in order, in float32 (float64 for float64 inputs; bfloat16 and float16 are
widened exactly first), so the result does not depend on the thread count, the CPU's instruction
set or the device. Its error is at most, to first order, H_out W_out 2^-24 sum_t |g_t x_t| per
element (2^-53 for float64).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from privleak import _arrays, _backend, _ops, validation
from privleak import mechanisms as _mechanisms

#: Input dtypes of the kernel; inputs and output gradients of two dtypes are both converted to the
#: wider one first (exact).
INPUT_DTYPES = ("float32", "float64", "bfloat16", "float16")

Size = Union[int, Sequence[int]]


@_ops.operator("conv_weight_grads")
def _conv_weight_grads_op(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: list[int],
                          stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The kernel on 2-d convolutions without groups: (N, O, C, k_h, k_w), float32 (float64 for
    float64 inputs), for inputs (N, C, H, W) and output_grads (N, O, H_out, W_out) of one dtype
    and device."""
    x, g, geometry = op_arguments("conv_weight_grads", inputs, output_grads, kernel_size, stride, padding, dilation)
    batch, channels = x.shape[:2]
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.empty(batch, g.shape[1], channels, *kernel_size, dtype=accumulate, device=x.device)
    if batch:
        _backend.call("conv_weight_grads", x, _arrays.dtype_name(x), x.data_ptr(), g.data_ptr(), geometry,
                      out.data_ptr())
    return out


def op_arguments(op: str, inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: list[int],
                 stride: list[int], padding: list[int], dilation: list[int]) -> tuple:
    """(x, g, geometry) for the core's convolution kernel ``op``: the tensors contiguous, and the
    15 sizes it reads; a ValueError for what the kernel cannot read (the public functions check
    and convert their arguments first)."""
    x, g = inputs.contiguous(), output_grads.contiguous()
    if (x.ndim != 4 or g.ndim != 4 or x.shape[0] != g.shape[0] or x.dtype != g.dtype or x.device != g.device
            or x.device.type not in ("cpu", "cuda") or _arrays.dtype_name(x) not in INPUT_DTYPES):
        raise ValueError(f"privleak::{op} takes inputs (N, C, H, W) and output_grads (N, O, H_out, W_out) of one float "
                         "dtype and device (cpu or cuda); the public functions check and convert any other input")
    for name, sizes in (("kernel_size", kernel_size), ("stride", stride), ("padding", padding),
                        ("dilation", dilation)):
        if len(sizes) != 2:  # the core reads 2 of each: other lengths would shift its fields
            raise ValueError(f"privleak::{op} takes 2 values of {name}, got {list(sizes)}")
    return x, g, [*x.shape, *g.shape[1:], *kernel_size, *stride, *padding, *dilation]


@_conv_weight_grads_op.register_fake
def _(inputs, output_grads, kernel_size, stride, padding, dilation):
    accumulate = torch.float64 if inputs.dtype == torch.float64 else torch.float32
    return inputs.new_empty(inputs.shape[0], output_grads.shape[1], inputs.shape[1], *kernel_size, dtype=accumulate)


def _sizes(value: Size, name: str, dims: int, low: int) -> list[int]:
    values = [value] * dims if isinstance(value, int) else list(value)
    if len(values) != dims:
        raise ValueError(f"{name} must be an int or {dims} ints for a {dims}-d convolution, got {value!r}")
    return [validation.integer(v, name, low=low) for v in values]


def conv_weight_grads(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: Size, stride: Size = 1,
                      padding: Size = 0, dilation: Size = 1, groups: int = 1) -> torch.Tensor:
    """Each sample's weight gradient of a Conv1d or Conv2d (module docstring's formula):
    (B, O, C / groups, *kernel_size), float32 (float64 for float64 inputs).

    Args:
        inputs: the layer's inputs x, (B, C, L) for Conv1d or (B, C, H, W) for Conv2d, float32,
            float64, bfloat16 or float16.
        output_grads: the gradients of the per-sample losses by the layer's outputs, (B, O, L_out)
            or (B, O, H_out, W_out), on the device of ``inputs`` (CPU or CUDA).
        kernel_size, stride, padding, dilation: as the module has them (an int or one per
            spatial dim); ``padding`` is zeros on both sides of each dim: apply other padding
            modes to ``inputs`` first.
        groups: the convolution's groups; C and O must be multiples of it.
    """
    checked = checked_arguments(inputs, output_grads, kernel_size, stride, padding, dilation, groups)
    return per_sample_conv_grads(inputs, output_grads, *checked)


def checked_arguments(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: Size, stride: Size,
                      padding: Size, dilation: Size, groups: int) -> tuple:
    """(kernel, strides, pads, dilations, groups), one int of each size per spatial dim, for the
    arguments of :func:`conv_weight_grads` (or of a function that takes the same), checked: a
    ValueError names the argument that is wrong."""
    view_x = validation.tensor(inputs, "inputs", dtypes=INPUT_DTYPES)
    view_g = validation.tensor(output_grads, "output_grads", dtypes=INPUT_DTYPES)
    _arrays.require_same_device(view_g, "output_grads", view_x, "inputs")
    if inputs.ndim not in (3, 4) or output_grads.ndim != inputs.ndim or inputs.shape[0] != output_grads.shape[0]:
        raise ValueError(f"inputs has shape {tuple(inputs.shape)} and output_grads {tuple(output_grads.shape)}: they "
                         "must be (B, C, L) and (B, O, L_out), or (B, C, H, W) and (B, O, H_out, W_out), with one B")
    if view_x.is_cuda:
        _mechanisms._check_cuda(inputs.device, "inputs' device")
    dims = inputs.ndim - 2
    kernel = _sizes(kernel_size, "kernel_size", dims, 1)
    strides = _sizes(stride, "stride", dims, 1)
    pads = _sizes(padding, "padding", dims, 0)
    dilations = _sizes(dilation, "dilation", dims, 1)
    groups = validation.integer(groups, "groups", low=1)
    channels, outputs = inputs.shape[1], output_grads.shape[1]
    if channels % groups or outputs % groups:
        raise ValueError(f"groups={groups} must divide the input's channels ({channels}) and the output "
                         f"gradient's ({outputs})")
    expected = [(size + 2 * p - d * (k - 1) - 1) // s + 1
                for size, k, s, p, d in zip(inputs.shape[2:], kernel, strides, pads, dilations)]
    if min(expected) < 1 or list(output_grads.shape[2:]) != expected:
        raise ValueError(f"output_grads has spatial size {tuple(output_grads.shape[2:])}, but this convolution of "
                         f"inputs {tuple(inputs.shape)} gives {tuple(expected)}")
    return kernel, strides, pads, dilations, groups


def folded(inputs: torch.Tensor, output_grads: torch.Tensor, kernel: list[int], strides: list[int],
           pads: list[int], dilations: list[int], groups: int) -> tuple:
    """(x, g, kernel, strides, pads, dilations) of the 2-d convolution without groups that the
    kernels take: groups folded into the samples, (B, C) -> (B G, C / G), a view of a contiguous
    tensor; a Conv1d as a Conv2d of height 1; one dtype, the wider of the two (exact)."""
    batch, channels = inputs.shape[:2]
    outputs = output_grads.shape[1]
    dtype = torch.promote_types(inputs.dtype, output_grads.dtype)
    x = inputs.detach().to(dtype).contiguous().reshape(batch * groups, channels // groups, *inputs.shape[2:])
    g = output_grads.detach().to(dtype).contiguous().reshape(batch * groups, outputs // groups,
                                                             *output_grads.shape[2:])
    if inputs.ndim == 3:
        return x.unsqueeze(2), g.unsqueeze(2), [1] + kernel, [1] + strides, [0] + pads, [1] + dilations
    return x, g, kernel, strides, pads, dilations


def per_sample_conv_grads(inputs: torch.Tensor, output_grads: torch.Tensor, kernel: list[int], strides: list[int],
                          pads: list[int], dilations: list[int], groups: int) -> torch.Tensor:
    """:func:`conv_weight_grads` of arguments it has checked, the sizes as one int per spatial dim
    (book-keeping's convolution layers call it with their modules' own, skipping the checks)."""
    batch, channels = inputs.shape[:2]
    grads = torch.ops.privleak.conv_weight_grads(*folded(inputs, output_grads, kernel, strides, pads, dilations,
                                                        groups))
    return grads.reshape(batch, output_grads.shape[1], channels // groups, *kernel)


def conv_weight_grads_reference(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: Size,
                                stride: Size = 1, padding: Size = 0, dilation: Size = 1,
                                groups: int = 1) -> torch.Tensor:
    """(B, O, C / groups, *kernel) float64 per-sample weight gradients from torch's own convolution
    backward, one sample at a time (the float64 reference the kernel is tested against)."""
    x, g = inputs.double(), output_grads.double()
    dims = x.ndim - 2
    kernel = [kernel_size] * dims if isinstance(kernel_size, int) else list(kernel_size)
    weight = x.new_empty(g.shape[1], x.shape[1] // groups, *kernel)

    def listed(value):
        return [value] * dims if isinstance(value, int) else list(value)

    return torch.stack([
        torch.ops.aten.convolution_backward(g[i:i + 1], x[i:i + 1], weight, None, listed(stride), listed(padding),
                                            listed(dilation), False, [0] * dims, groups, [False, True, False])[1]
        for i in range(x.shape[0])]) if x.shape[0] else x.new_empty(0, *weight.shape)

