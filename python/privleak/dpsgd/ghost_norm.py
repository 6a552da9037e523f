"""Ghost norms: each sample's squared gradient norm of a layer from the layer's inputs and output
gradients, without forming the per-sample gradient (Goodfellow 2015; Li et al., ICLR 2022; Bu et
al., ICML 2023).

A layer y_t = W a_t (+ b) applied at positions t = 1..T of sample i has the per-sample weight
gradient G_i = sum_t g_{i,t} a_{i,t}^T, with g_{i,t} = dL_i / dy_{i,t}. Its squared Frobenius norm is

    |G_i|_F^2 = sum_{t,s} (a_{i,t} . a_{i,s}) (g_{i,t} . g_{i,s}),

which costs O(T^2 (d + p)) instead of O(T d p). An Embedding's input is one-hot, so
a_t . a_s = [id_t == id_s], and the sum is sum_v |sum_{t: id_t = v} g_t|^2 over the ids v of the
sample: O(T p).

:func:`ghost_norm_squared` and :func:`embedding_ghost_norm_squared` run privleak's kernels
(``torch.ops.privleak.ghost_norm`` and ``torch.ops.privleak.embedding_ghost_norm``, on the CPU
and CUDA); :func:`ghost_norm_squared_reference` and :func:`embedding_ghost_norm_squared_reference`
are the float64 torch formulas they are tested against.

The dense kernel never stores a T x T Gram matrix: it walks the lower triangle (w_ts = w_st) in
tiles, so it does about half the work of the two batched matrix products (Opacus's formula) and
moves none of their T x T output through memory. Its arithmetic is fixed (csrc/common/ghost_norm.h):
each Gram entry x_t . x_s is a float32 fma chain per chunk of 128 coordinates (float64 for
float64 inputs; bfloat16 and float16 are widened exactly first), the chunks added in float64; the
products w_ts and every sum over positions are float64, in a fixed order. So the result does not
depend on the thread count, the CPU's instruction set or the device: CPU and CUDA give the same
bits. Its error against exact arithmetic on the same inputs is at most, to first order,

    ((min(d, 128) + min(p, 128)) u + (T + T / 64 + 67) 2^-53) (sum_t |a_t| |g_t|)^2

with u = 2^-24 (2^-53 for float64 inputs): the float32 chains' ``n u`` bound with n capped by the
chunk, times Cauchy-Schwarz; (sum_t |a_t| |g_t|)^2 >= |G|_F^2, with equality at T = 1. The second
term is the float64 sums over the T^2 products (a tile of 64 columns, the tiles, the rows in
turn), which counts only for float64 inputs (at T = 16000 their error was 26 x 2^-53 of the
result, against the first term's 2 x 2^-53 at d = p = 1). A result whose exact
value is 0 can come out slightly negative by rounding: it is clamped to 0. The Embedding kernel
sums each id's gradients in float64 (its error is that of float64). Where the gradient cancels,
that bound is far above the norm: book-keeping clips with norms :func:`vouched` for by it
(``ghost_norms(..., clipping=True)``), never under the exact norm by more than 2^-7.

Non-finite values: a sample with a NaN input gives NaN; one with an infinite input, or whose
float32 Gram entries overflow (a row with squared norm past 3.4e38, i.e. elements near 1.8e19),
gives +inf (the Embedding form gives NaN where +inf and -inf gradients meet under one id, whose
sum has no value); finite inputs never give NaN. The caller treats a non-finite norm as a bad
sample.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from privleak import _arrays, _backend, _ops, validation
from privleak import mechanisms as _mechanisms
from privleak.dpsgd import conv_grads

#: Input dtypes of the kernels. Activations and output gradients of different dtypes are both
#: converted to the wider one first (torch.promote_types), which is exact.
INPUT_DTYPES = ("float32", "float64", "bfloat16", "float16")
#: Input pixels a channel :func:`conv_ghost_norm_squared` takes (csrc/common/ghost_norm.h).
MAX_PIXELS = 2**14
_ID_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")


class GhostNormInputs(NamedTuple):
    """A layer's activations (B, T, d) and output gradients (B, T, p), of one dtype, whose ghost
    norm :func:`ghost_norms` computes with other layers' in one kernel call."""

    activations: torch.Tensor
    output_grads: torch.Tensor
    #: where given, :func:`vouched` appends to it the rows whose norms it computed again in float64,
    #: for the caller's clipped sum to add those samples' gradients apart in float64
    lost: Optional[list] = None


def ghost_norms(layers: list[GhostNormInputs], *, clipping: bool = False, may_sync: bool = True) -> list[torch.Tensor]:
    """Each layer's (B,) float64 ghost norm sum_{t,s} (a_t . a_s)(g_t . g_s), by one call of the
    kernel (inputs as :class:`GhostNormInputs` says, unchecked: :func:`ghost_norm_squared` checks);
    ``clipping``: each one :func:`vouched` for by the module docstring's rounding bound (without
    ``may_sync``, where no host read may wait for the device: a CUDA graph's capture, only raised)."""
    norms = torch.ops.privleak.ghost_norm([x.activations for x in layers], [x.output_grads for x in layers]).unbind(0)
    if not clipping:
        return list(norms)
    return [vouched(n, _dense_bound(x), None if x.activations.dtype == torch.float64 or not may_sync
                    else functools.partial(_dense_again, x), x.lost) for n, x in zip(norms, layers)]


def _dense_bound(layer: GhostNormInputs) -> torch.Tensor:
    a, g = layer.activations, layer.output_grads
    return rounding_bound(float_norms(a, 2), float_norms(g, 2), d=a.shape[2], p=g.shape[2], positions=a.shape[1],
                          dtype=a.dtype)


def float_norms(rows: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Norms along ``dim`` in float32 at least (float16's would overflow past 65504), without a
    converted copy."""
    return torch.linalg.vector_norm(rows, dim=dim, keepdim=keepdim, dtype=torch.promote_types(rows.dtype,
                                                                                                torch.float32))


def _dense_again(layer: GhostNormInputs, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    again = GhostNormInputs(layer.activations[rows].double(), layer.output_grads[rows].double())
    return ghost_norms([again])[0], _dense_bound(again)


#: The share of a squared norm that the rounding bound of its ghost norm may reach before
#: :func:`vouched` adds it (a norm clipped below its exact value by at most half of that, 0.4%),
#: and the share past which it computes the norm again in float64.
VOUCHED, LOST = 2.0**-7, 2.0**-4
#: A bound under this (a squared norm; a norm of 2^-30) is added, never computed again, however
#: it compares with the norm: such a raise moves a clip factor of a clip norm of 2^-20 (1e-6) or
#: more by 2^-21 a layer at most, and that to the safe side. It keeps the float64 recomputation
#: off a sample whose gradient is 0 (a masked sample, a saturated loss, a graph's padding), whose
#: norm, 0, the underflow term of its bound (:func:`underflow_bound`: 3e-27 for a sample of unit
#: activations at T 512, d = p = 1024; 1.3e-23 at T 4096, d = p = 8192) would otherwise exceed.
RAISED_ONLY = 2.0**-60


def rounding_bound(activation_norms: torch.Tensor, grad_norms: torch.Tensor, *, d: int, p: int, positions: int,
                   dtype: torch.dtype, activation_terms: Optional[int] = None) -> torch.Tensor:
    """(N,) float64: the module docstring's bound on the kernel's error,
    ((min(d, 128) + min(p, 128)) u + (T + T / 64 + 67) 2^-53) (sum_t |a_t| |g_t|)^2, from the
    rows' norms |a_t| and |g_t|, (N, T) (for a convolution, its patches' and output positions');
    d and p the lengths of the kernel's Gram entries' float32 chains (a convolution's: its pixels'
    channels and its output channels, a group's), T = ``positions`` the terms of its sums, u from
    the inputs' ``dtype``. Raised by 3%: room for the rounding of the norms (float32 at least) and
    of the bound's second-order terms. Plus :func:`underflow_bound`'s term, with
    ``activation_terms`` (default d) the roundings of an activations' Gram entry (a convolution's
    patch: its kernel's offsets times d) and p those of an output gradients'."""
    u = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    coefficient = ((min(d, 128) + min(p, 128)) * u + (positions + positions / 64 + 67) * 2.0**-53) * 1.03
    a, g = activation_norms.double(), grad_norms.double()
    return (coefficient * torch.linalg.vecdot(a, g).square()
            + underflow_bound(a.sum(-1), g.sum(-1), d if activation_terms is None else activation_terms, p, dtype))


def underflow_bound(activation_spread: torch.Tensor, grad_spread: torch.Tensor, activation_terms: int,
                    grad_terms: int, dtype: torch.dtype) -> torch.Tensor:
    """(N,) float64: what the Gram entries' roundings below the normal range can lose from a sum
    sum_{t,s} (a_t . a_s)(g_t . g_s), tiny (n_a S_g^2 + n_g S_a^2), from S_a = sum_t |a_t| and
    S_g = sum_t |g_t| (``*_spread``, (N,) float64) and the roundings n_a, n_g of one Gram entry
    (``*_terms``). The relative bound u |x| |y| of a dot product fails there: a rounding loses up
    to ``tiny``, float32's 2^-126 (its smallest normal: a flush to zero loses that much; gradual
    underflow, 2^-150), float64's 2^-1022, whatever the size of the inputs. So a sample with
    activations of 1e-24 and output gradients of 1e18 had a ghost norm of 0 (every a_t . a_s
    underflowed), and its gradient of norm 1e-6 went out unclipped at 36 times C = 1e-7 (T 2).
    On ordinary data the term is a vanishing share of the squared norm (5e-29 at unit activations
    and output gradients of 1e-3, T 4096, d = p = 8192); where it is not, :func:`vouched` computes
    the norm again in float64 (above :data:`RAISED_ONLY`)."""
    return smallest_normal(dtype) * (activation_terms * grad_spread.square() + grad_terms * activation_spread.square())


def smallest_normal(dtype: torch.dtype) -> float:
    """The most a rounding of the kernels' arithmetic for inputs of ``dtype`` loses below the
    normal range: float64's smallest normal for float64, float32's for the others (widened to
    float32 exactly first)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny


def vouched(norms: torch.Tensor, bound: torch.Tensor, again: Optional[Callable],
            lost: Optional[list] = None) -> torch.Tensor:
    """Ghost norms (squared) that clipping can take, whatever cancels in them. The kernel's error
    is relative to (sum_t |a_t| |g_t|)^2, not to the norm: where the gradient cancels (positions of
    equal inputs whose output gradients nearly cancel; attention keys, whose gradients sum to 0 over
    the positions, on inputs with a large part common to them), a norm came out far under its value
    and the sample's clipped gradient had 169 times the clip norm. So each norm is taken as the
    kernel gave it where its rounding ``bound`` is at most :data:`VOUCHED` of it; raised by the
    bound, which no rounding leaves under the exact value, up to :data:`LOST` of it (clipped at
    most 3% more than it needs); past that, ``again(rows)`` computes those samples' norms and
    bounds once more from float64 inputs (the kernel's float64 arithmetic: 2^-53 for 2^-24), and
    their bound is added (``again`` None: the inputs were float64, or no host read of the rows may
    wait for the device, as in a CUDA graph's capture: only raised by the bound; a bound under
    :data:`RAISED_ONLY` is only added). A norm that is not finite is computed again too: a float32
    Gram entry overflows (a row of norm past 1.8e19) where the gradient need not (activations of
    1e20, output gradients of 1e-10; in a graph's capture, such a sample stays not finite). Where nothing
    cancels, the bound is about 256 T u of the norm (d, p >= 128): it is added from T of about 500
    on (2% T / 1300 of the norm), and the norm computed again past T 4000. The rows computed again
    are appended to ``lost`` where given: their gradients cancel so far that a float32 clipped sum
    would round them as much as their norms (its error is relative to sum_t |a_t| |g_t| too), and
    the caller adds them apart in float64."""
    raised = torch.where(bound > VOUCHED * norms, norms + bound, norms)
    if again is None:
        return raised
    rows = (((bound > LOST * norms) & (bound > RAISED_ONLY)) | ~torch.isfinite(norms)).nonzero()[:, 0]
    if not len(rows):
        return raised
    if lost is not None:
        lost.append(rows)
    exact, exact_bound = again(rows)
    return raised.index_put((rows,), exact + exact_bound)


@_ops.operator("ghost_norm")
def _ghost_norm_op(activations: list[torch.Tensor], output_grads: list[torch.Tensor]) -> torch.Tensor:
    """The dense kernel on K layers at once: (K, B) float64, row k sum_{t,s} (a_t . a_s)(g_t . g_s)
    for activations[k] (B, T_k, d_k) and output_grads[k] (B, T_k, p_k) of one dtype, all of one B
    and device. One call for a step's layers: on a small model the calls cost more than the
    kernels (the tiny transformer's nine Linear layers, with the stack of their norms: 55 -> 40 us
    on the CPU)."""
    pairs = [(a.contiguous(), g.contiguous()) for a, g in zip(activations, output_grads)]
    first = pairs[0][0] if pairs else torch.empty(())
    batch, device = (first.shape[0], first.get_device()) if first.ndim else (-1, 0)
    dtypes = [_arrays.dtype_name(a) for a, _ in pairs]
    if (not pairs or len(activations) != len(output_grads)
            or any(a.ndim != 3 or g.ndim != 3 or a.shape[0] != batch or g.shape[0] != batch or a.shape[1] != g.shape[1]
                   or a.dtype != g.dtype or a.get_device() != device or g.get_device() != device for a, g in pairs)
            or not all(name in INPUT_DTYPES for name in dtypes)):
        raise ValueError("privleak::ghost_norm takes one or more layers' activations (B, T, d) and output_grads (B, "
                         "T, p), each pair of one float dtype, all of one B and device; ghost_norm_squared checks and "
                         "converts any other input")
    lengths = [a.shape[1] for a, _ in pairs]
    out = torch.empty(len(pairs), batch, dtype=torch.float64, device=first.device)
    if batch:
        _backend.call("ghost_norm", first, dtypes, [a.data_ptr() for a, _ in pairs],
                      [g.data_ptr() for _, g in pairs], batch, lengths, [a.shape[2] for a, _ in pairs],
                      [g.shape[2] for _, g in pairs], out.data_ptr(),
                      workspace=lambda module: module.ghost_norm_workspace_bytes(batch, lengths))
    return out


@_ghost_norm_op.register_fake
def _(activations, output_grads):
    return activations[0].new_empty(len(activations), activations[0].shape[0], dtype=torch.float64)


@_ops.operator("conv_ghost_norm")
def _conv_ghost_norm_op(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: list[int], stride: list[int],
                        padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The convolution kernel: (N,) float64 sum_{t,s} (a_t . a_s)(g_t . g_s), a_t the patches of a
    2-d convolution without groups, for inputs (N, C, H, W) and output_grads (N, O, H_out, W_out)
    of one dtype and device."""
    x, g, geometry = conv_grads.op_arguments("conv_ghost_norm", inputs, output_grads, kernel_size, stride, padding,
                                             dilation)
    batch, pixels, positions = x.shape[0], x.shape[2] * x.shape[3], g.shape[2] * g.shape[3]
    out = torch.empty(batch, dtype=torch.float64, device=x.device)
    if batch:
        _backend.call("conv_ghost_norm", x, _arrays.dtype_name(x), x.data_ptr(), g.data_ptr(), geometry, out.data_ptr(),
                      workspace=lambda module: module.conv_ghost_norm_workspace_bytes(batch, pixels, positions))
    return out


@_conv_ghost_norm_op.register_fake
def _(inputs, output_grads, kernel_size, stride, padding, dilation):
    return inputs.new_empty(inputs.shape[0], dtype=torch.float64)


@_ops.operator("embedding_ghost_norm")
def _embedding_ghost_norm_op(ids: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """The Embedding kernel: (B,) float64 sum_{t,s} [id_t == id_s](g_t . g_s) for int64 ids (B, T)
    and output gradients (B, T, p) on one device."""
    ids, g = ids.contiguous(), output_grads.contiguous()
    if (g.ndim != 3 or ids.shape != g.shape[:2] or ids.dtype != torch.int64 or ids.device != g.device
            or _arrays.dtype_name(g) not in INPUT_DTYPES):
        raise ValueError("privleak::embedding_ghost_norm takes int64 ids (B, T) and output_grads (B, T, p) of a float "
                         "dtype on one device; embedding_ghost_norm_squared checks and converts any other input")
    batch, length, p = g.shape
    out = torch.empty(batch, dtype=torch.float64, device=g.device)
    if batch:
        _backend.call("embedding_ghost_norm", g, _arrays.dtype_name(g), ids.data_ptr(), g.data_ptr(), batch, length, p,
                      out.data_ptr(),
                      workspace=lambda module: module.embedding_ghost_norm_workspace_bytes(batch, length))
    return out


@_embedding_ghost_norm_op.register_fake
def _(ids, output_grads):
    return output_grads.new_empty(output_grads.shape[0], dtype=torch.float64)


def _check_grads(output_grads) -> _arrays.ArrayView:
    view = validation.tensor(output_grads, "output_grads", dtypes=INPUT_DTYPES)
    if output_grads.ndim < 2:
        raise ValueError("output_grads must be (B, T, p) (or (B, p), or (B, ..., p)), "
                         f"got shape {tuple(output_grads.shape)}")
    if view.is_cuda:
        _mechanisms._check_cuda(output_grads.device, "output_grads' device")
    return view


def _positions(shape: torch.Size) -> int:
    """T: the positions of a (B, ..., features) tensor, its middle dimensions laid end to end."""
    return math.prod(shape[1:-1])


def ghost_norm_squared(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64 squared per-sample norms of a Linear-like layer's weight gradient:
    sum_{t,s} (a_t . a_s)(g_t . g_s) per sample (module docstring; Li et al., ICLR 2022, Sec. 4).

    Args:
        activations: the layer's inputs a, (B, T, d), or (B, d) (T = 1), or (B, ..., d) (the
            middle dimensions are the positions), float32, float64, bfloat16 or float16.
        output_grads: the gradients g of the per-sample losses with respect to the layer's
            outputs, (B, T, p) with the same B and positions, on the same device (CPU or CUDA).

    Non-contiguous inputs are copied to contiguous ones; inputs of two dtypes are both converted
    to the wider one. Accuracy and non-finite inputs: see the module docstring.
    """
    view_g = _check_grads(output_grads)
    view_a = validation.tensor(activations, "activations", dtypes=INPUT_DTYPES)
    if activations.shape[:-1] != output_grads.shape[:-1] or activations.ndim < 2:
        raise ValueError(f"activations has shape {tuple(activations.shape)} and output_grads "
                         f"{tuple(output_grads.shape)}: they must be (B, T, d) and (B, T, p), with the same B and T")
    _arrays.require_same_device(view_a, "activations", view_g, "output_grads")
    dtype = torch.promote_types(activations.dtype, output_grads.dtype)
    batch, length = activations.shape[0], _positions(activations.shape)
    a = activations.detach().to(dtype).reshape(batch, length, activations.shape[-1])
    g = output_grads.detach().to(dtype).reshape(batch, length, output_grads.shape[-1])
    return ghost_norms([GhostNormInputs(a, g)])[0]


def pixel_gram_pays(pixels: int, positions: int, kernel: int) -> bool:
    """Whether :func:`conv_ghost_norm_squared` (a pixel Gram, N^2 C / 2 multiply-adds for N input
    pixels of C channels) should replace the Gram of the T patches (T^2 k C / 2 for k kernel
    offsets): when it does no more of them, N^2 <= T^2 k, the patches overlapping enough (a
    stride-1 convolution with a kernel of k > 1 has N ~ T). Measured (one thread, B 64, 8 x 8 and
    16 x 16 inputs, 64-512 channels): 1.3-12x faster where this holds, 0.6-0.8x where N^2 = 16 T^2 k
    (a 1 x 1 convolution of stride 2)."""
    return pixels <= MAX_PIXELS and pixels * pixels <= positions * positions * kernel


def conv_ghost_norm_squared(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: conv_grads.Size,
                            stride: conv_grads.Size = 1, padding: conv_grads.Size = 0, dilation: conv_grads.Size = 1,
                            groups: int = 1) -> torch.Tensor:
    """(B,) float64 squared per-sample norms of a Conv1d's or Conv2d's weight gradient,
    sum_{t,s} (a_t . a_s)(g_t . g_s) per sample with a_t output position t's patch of the input
    (its C / groups channels under the kernel's k offsets; groups add their squared norms), without
    forming the patches: a_t . a_s = sum_k P[u_k(t), u_k(s)] over the input's pixel Gram
    P[u, v] = x_u . x_v, u_k(t) the pixel under offset k (padding: 0). That is N^2 C / 2
    multiply-adds for N input pixels where the patches' Gram takes T^2 k C / 2, k times fewer for a
    stride-1 convolution (its patches overlap k-fold).

    Args: as :func:`privleak.dpsgd.conv_grads.conv_weight_grads`'s: ``inputs`` (B, C, L) or (B, C,
        H, W), ``output_grads`` (B, O, L_out) or (B, O, H_out, W_out), and the convolution's
        ``kernel_size``, ``stride``, zero ``padding``, ``dilation`` and ``groups``. At most 2^14
        input pixels (the pixel Gram, N^2 doubles per sample, is held whole).

    Accuracy: the module docstring's bound with d = min(C / groups, 128): each P entry is a Gram
    entry of C / groups coordinates (csrc/common/ghost_norm.h), and |sum_k P_k| <= |a_t| |a_s|.
    Non-finite inputs as for :func:`ghost_norm_squared`.
    """
    checked = conv_grads.checked_arguments(inputs, output_grads, kernel_size, stride, padding, dilation, groups)
    if math.prod(inputs.shape[2:]) > MAX_PIXELS:
        raise ValueError(f"inputs has {math.prod(inputs.shape[2:])} pixels a channel; conv_ghost_norm_squared takes "
                         f"at most {MAX_PIXELS} (use ghost_norm_squared on the patches)")
    return conv_ghost_norms(inputs, output_grads, *checked)


def conv_ghost_norms(inputs: torch.Tensor, output_grads: torch.Tensor, kernel: list[int], strides: list[int],
                     pads: list[int], dilations: list[int], groups: int, *, clipping: bool = False,
                     may_sync: bool = True, lost: Optional[list] = None) -> torch.Tensor:
    """:func:`conv_ghost_norm_squared` of arguments it has checked, the sizes as one int per
    spatial dim (book-keeping's convolution layers call it with their modules' own); ``clipping``
    and ``may_sync`` as :func:`ghost_norms`'s, each group's norm vouched for; ``lost`` as
    :class:`GhostNormInputs`', its rows (sample, group) sample-major."""
    x, g, *geometry = conv_grads.folded(inputs, output_grads, kernel, strides, pads, dilations, groups)
    norms = torch.ops.privleak.conv_ghost_norm(x, g, *geometry)
    if clipping:
        again = None if x.dtype == torch.float64 or not may_sync else functools.partial(_conv_again, x, g, geometry)
        norms = vouched(norms, _conv_bound(x, g, geometry), again, lost)
    return group_totals(norms, groups)


def _conv_bound(x: torch.Tensor, g: torch.Tensor, geometry: list) -> torch.Tensor:
    """:func:`rounding_bound` of a folded convolution (N, C, H, W) -> (N, O, H', W'), its rows the
    patches, whose squared norms are a box filter of the pixels'."""
    kernel, strides, pads, dilations = geometry
    pixels = float_norms(x, 1, keepdim=True).square()
    patches = torch.conv2d(pixels, pixels.new_ones(1, 1, *kernel), None, strides, pads, dilations).clamp_min(0).sqrt()
    return rounding_bound(patches.flatten(1), float_norms(g, 1).flatten(1), d=x.shape[1], p=g.shape[1],
                          positions=patches[0].numel() * math.prod(kernel), dtype=x.dtype,
                          activation_terms=x.shape[1] * math.prod(kernel))


def _conv_again(x: torch.Tensor, g: torch.Tensor, geometry: list, rows: torch.Tensor) -> tuple:
    x, g = x[rows].double(), g[rows].double()
    return torch.ops.privleak.conv_ghost_norm(x, g, *geometry), _conv_bound(x, g, geometry)


def group_totals(norms: torch.Tensor, groups: int) -> torch.Tensor:
    """(B,): the (B G,) norms of a grouped layer's groups (sample-major) added per sample in a
    fixed tree: groups 2j and 2j + 1, then pairs of those sums, and so on (a zero after an odd
    count), log2 G elementwise adds. torch's sum over a dim adds in an order of its own on each
    device (vector lanes on the CPU, a warp tree on CUDA): the kernels' CPU and CUDA bits would
    differ after it."""
    totals = norms.view(-1, groups)
    while totals.shape[1] > 1:
        totals = F.pad(totals, [0, totals.shape[1] % 2])
        totals = totals[:, 0::2] + totals[:, 1::2]
    return totals[:, 0]


def embedding_ghost_norm_squared(ids: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64 squared per-sample norms of an Embedding's weight gradient:
    sum_{t,s} [id_t == id_s](g_t . g_s) = sum_v |sum_{t: id_t = v} g_t|^2 per sample (module
    docstring).

    Args:
        ids: the token ids, (B, T) (or (B, ...) matching ``output_grads``), any integer dtype. Only
            equality matters: ids need not be in the vocabulary's range. A padding id's positions
            count like any other; zero their ``output_grads`` to leave them out.
        output_grads: the gradients of the per-sample losses with respect to the Embedding's
            outputs, (B, T, p), float32, float64, bfloat16 or float16, on the device of ``ids``.
    """
    view_g = _check_grads(output_grads)
    view_ids = validation.tensor(ids, "ids", dtypes=_ID_DTYPES)
    if ids.shape != output_grads.shape[:-1]:
        raise ValueError(f"ids has shape {tuple(ids.shape)} and output_grads {tuple(output_grads.shape)}: ids must "
                         "be (B, T) for output_grads (B, T, p), with the same B and T")
    _arrays.require_same_device(view_ids, "ids", view_g, "output_grads")
    batch, length = output_grads.shape[0], _positions(output_grads.shape)
    g = output_grads.detach().reshape(batch, length, output_grads.shape[-1])
    return torch.ops.privleak.embedding_ghost_norm(ids.to(torch.int64).reshape(batch, length), g)


def ghost_norm_squared_reference(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64: sum_{t,s} (a_t . a_s)(g_t . g_s) per sample, for activations (B, T, d) and
    output gradients (B, T, p), from the two T x T Gram matrices in float64."""
    a, g = activations.double(), output_grads.double()
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))


def conv_patches_reference(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: conv_grads.Size,
                           stride: conv_grads.Size = 1, padding: conv_grads.Size = 0, dilation: conv_grads.Size = 1,
                           groups: int = 1) -> list:
    """Per group, float64 (patches (B, T, C / groups k), output gradients (B, T, O / groups)) of a
    Conv1d or Conv2d, the patches from F.unfold."""
    x, g = inputs.double(), output_grads.double()
    if x.ndim == 3:  # a Conv1d as a Conv2d of height 1
        x, g = x.unsqueeze(2), g.unsqueeze(2)

        def as_2d(value, low):
            return [low] + ([value] if isinstance(value, int) else list(value))
        kernel_size, stride, padding, dilation = (as_2d(kernel_size, 1), as_2d(stride, 1), as_2d(padding, 0),
                                                  as_2d(dilation, 1))
    channels, outputs = x.shape[1] // groups, g.shape[1] // groups
    return [(torch.nn.functional.unfold(x[:, group * channels:(group + 1) * channels], kernel_size, dilation=dilation,
                                        padding=padding, stride=stride).transpose(1, 2),
             g[:, group * outputs:(group + 1) * outputs].flatten(2).transpose(1, 2)) for group in range(groups)]


def conv_ghost_norm_squared_reference(inputs: torch.Tensor, output_grads: torch.Tensor, kernel_size: conv_grads.Size,
                                      stride: conv_grads.Size = 1, padding: conv_grads.Size = 0,
                                      dilation: conv_grads.Size = 1, groups: int = 1) -> torch.Tensor:
    """(B,) float64 :func:`conv_ghost_norm_squared` from the patches of each group
    (:func:`conv_patches_reference`) and :func:`ghost_norm_squared_reference`."""
    pairs = conv_patches_reference(inputs, output_grads, kernel_size, stride, padding, dilation, groups)
    return sum(ghost_norm_squared_reference(a, g) for a, g in pairs)


def embedding_ghost_norm_squared_reference(ids: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64: sum_{t,s} [id_t == id_s](g_t . g_s) per sample, for token ids (B, T) and output
    gradients (B, T, p): the squared norm of an Embedding's per-sample weight gradient."""
    g = output_grads.double()
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).double()
    return (same * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))
