"""DP-SGD building blocks: fused per-sample clipping, summation and noise.

DP-SGD (Abadi et al., CCS 2016; Alg. 1 of Biswas et al.) releases, for a batch of per-sample
gradients g_1 .. g_B and expected batch size L,

    g~ = (sum_b clip_c(g_b) + N(0, c^2 sigma^2 I)) / L,     clip_c(g) = g min(1, c / |g|_2).

Laplace DP-SGD clips in the L1 norm instead, clip_c(g) = g min(1, c / |g|_1) (``norm_type=1``);
the sum, the scaling and the kernel's optional Gaussian noise are the same.

With flat clipping |g| is the norm over all parameter tensors together; with per-layer clipping
each tensor t is clipped to its own c_t. :func:`clip_and_accumulate` does this in one kernel that
reads the per-sample gradients twice: pass 1 computes each sample's norm sum per tensor (its
squared L2 norm, or its L1 norm), the clip factors follow, pass 2 forms the clipped sum, adds the
noise (privleak's counter-based Gaussian, the same bits as
:func:`privleak.mechanisms.gaussian_noise`) and scales. On the CPU the samples go through both
passes in groups small enough to stay in cache, so the second read of models up to a few million
parameters comes from cache, not memory.

Non-finite per-sample gradients never reach the update. By default they raise a ValueError
naming the samples (a NaN or inf gradient is a bug upstream, and silently dropping data changes
what is being trained on); ``non_finite="drop"`` instead gives those samples weight 0, i.e.
treats them as absent from the batch. Squares (absolute values for L1) are summed in float32
lanes (then in float64), so a sample also counts as non-finite when a lane's sum overflows
float32's 3.4e38: for L2 always past a norm of 2^64 (1.8e19; up to about 4 times that where its
elements are spread evenly over the lanes), for L1 past an L1 norm of 3.4e38 likewise: a gradient
that has diverged. At the other end a square below float32's smallest numbers (elements below
about 1e-22) is lost: such a sample's norm comes out too small, by 1% at 1e-22, and a clip norm
below about 1e-20 would not clip it; clip norms below 1e-15 are refused.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from privleak import _arrays, _backend, _ops, validation
from privleak import mechanisms as _mechanisms

GRAD_DTYPES = ("float32", "bfloat16", "float16")
_GRAD_TORCH_DTYPES = tuple(getattr(torch, name) for name in GRAD_DTYPES)


@_ops.operator("clip_accumulate")
def _clip_accumulate_op(grads: Sequence[torch.Tensor], clip_norms: torch.Tensor, per_layer: bool, noise_std: float,
                        key: Sequence[int], offset: int, scale: float, norm_type: int = 2,
                        other_sums: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """The fused kernel: [out_0 .. out_{T-1}, sums, factors]. sums (B, C) float64 are the norm sums
    (squared L2 norms for norm_type 2, L1 norms for 1) per column: the T tensors', then the
    columns of ``other_sums`` (B, C - T), norm sums of tensors the kernel does not read that count
    in the clip factors (book-keeping's ghost norms); factors (B, C) float32 the clip factors."""
    if (not grads or grads[0].ndim < 1 or grads[0].dtype not in _GRAD_TORCH_DTYPES
            or any(g.ndim < 1 or g.shape[0] != grads[0].shape[0] or g.dtype != grads[0].dtype or not g.is_contiguous()
                   for g in grads)
            or clip_norms.dtype != torch.float64 or not clip_norms.is_contiguous() or len(key) != 2
            or not 0 <= noise_std < math.inf or not math.isfinite(scale)
            or (other_sums is not None and (other_sums.ndim != 2 or other_sums.shape[0] != grads[0].shape[0]
                                            or other_sums.dtype != torch.float64))
            or clip_norms.numel() != ((len(grads) + (0 if other_sums is None else other_sums.shape[1]))
                                      if per_layer else 1)):
        # The kernel reads the tensors by address, as laid out here: anything else would read
        # past their ends or read other numbers.
        raise ValueError("privleak::clip_accumulate takes a non-empty list of contiguous (B, ...) grads of one "
                         f"dtype of {GRAD_DTYPES} and one B, contiguous float64 clip norms (one per column with "
                         "per_layer, else 1), a key of two words, a finite noise_std >= 0 and scale, and "
                         "other_sums (B, C) float64 (the kernel checks norm_type); clip_and_accumulate checks any "
                         "other input")
    batch, device = grads[0].shape[0], grads[0].device
    if any(g.device != device for g in grads) or clip_norms.device != device:
        # The kernel reads them all by address on one device: another's would be a memory fault.
        raise ValueError(f"privleak::clip_accumulate takes grads and clip_norms on one device, got grads on "
                         f"{sorted({str(g.device) for g in grads})} and clip_norms on {clip_norms.device}")
    outs = [torch.empty(g.shape[1:], dtype=torch.float32, device=device) for g in grads]
    columns = len(grads) + (0 if other_sums is None else other_sums.shape[1])
    sums = torch.empty(batch, columns, dtype=torch.float64, device=device)
    if other_sums is not None:
        sums[:, len(grads):] = other_sums
    factors = torch.empty(batch, columns, dtype=torch.float32, device=device)
    numels = [math.prod(g.shape[1:]) for g in grads]
    args = (_arrays.dtype_name(grads[0]), [g.data_ptr() for g in grads], numels,
            [o.data_ptr() for o in outs], batch, columns, clip_norms.data_ptr(), per_layer, norm_type, noise_std,
            key[0] | (key[1] << 32), offset, scale, sums.data_ptr(), factors.data_ptr())
    _backend.call("clip_accumulate", grads[0], *args,
                  workspace=lambda module: module.clip_workspace_bytes(numels, batch, columns))
    return outs + [sums, factors]


@_clip_accumulate_op.register_fake
def _(grads, clip_norms, per_layer, noise_std, key, offset, scale, norm_type=2, other_sums=None):
    outs = [torch.empty(g.shape[1:], dtype=torch.float32, device=g.device) for g in grads]
    columns = len(grads) + (0 if other_sums is None else other_sums.shape[1])
    sums = grads[0].new_empty(grads[0].shape[0], columns, dtype=torch.float64)
    return outs + [sums, torch.empty_like(sums, dtype=torch.float32)]


@_ops.operator("clip_factors")
def _clip_factors_op(sums: torch.Tensor, clip_norms: torch.Tensor, per_layer: bool, norm_type: int) -> torch.Tensor:
    """The fused kernel's clip factors (csrc/common/clip.h): (B, T) float32 from (B, T) float64
    norm sums and float64 clip norms (T with per_layer, else 1) on the sums' device."""
    if (sums.ndim != 2 or sums.dtype != torch.float64 or clip_norms.dtype != torch.float64
            or clip_norms.device != sums.device or sums.device.type not in ("cpu", "cuda")
            or clip_norms.numel() != (sums.shape[1] if per_layer else 1) or norm_type not in NORM_TYPES):
        raise ValueError("privleak::clip_factors takes (B, T) float64 sums, float64 clip norms on their device (T "
                         "with per_layer, else 1) and norm_type 1 or 2; clip_factors checks any other input")
    sums, clip_norms = sums.contiguous(), clip_norms.contiguous()
    factors = torch.empty(sums.shape, dtype=torch.float32, device=sums.device)
    if sums.numel():
        _backend.call("clip_factors", sums, sums.data_ptr(), clip_norms.data_ptr(), sums.shape[0], sums.shape[1],
                      per_layer, norm_type, factors.data_ptr())
    return factors


@_clip_factors_op.register_fake
def _(sums, clip_norms, per_layer, norm_type):
    return torch.empty_like(sums, dtype=torch.float32)


class ClippedSum(NamedTuple):
    """Result of :func:`clip_and_accumulate`."""

    grads: list  #: float32 tensors shaped like one sample of each input: the noisy clipped average
    #: per-sample norms before clipping (L2, or L1 with norm_type=1), float64: (B,) flat, (B, T) per layer
    norms: torch.Tensor
    dropped: torch.Tensor  #: (B,) bool, samples left out for non-finite gradients


def _check_grads(per_sample_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if (isinstance(per_sample_grads, (torch.Tensor, np.ndarray, str, bytes))
            or not isinstance(per_sample_grads, Iterable)):
        raise validation.ArgumentTypeError("per_sample_grads must be a non-empty sequence of tensors, "
                                           f"one per parameter, got {type(per_sample_grads).__name__}")
    grads = list(per_sample_grads)
    if not grads:
        raise validation.ArgumentTypeError("per_sample_grads must be a non-empty sequence of tensors, "
                                           "one per parameter, got an empty one")
    first = None
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise validation.ArgumentTypeError(f"per_sample_grads[{i}] must be a torch tensor, got {type(g).__name__}")
        if g.layout != torch.strided:
            raise validation.ArgumentTypeError(f"per_sample_grads[{i}] must be a dense (strided) tensor, "
                                               f"got {g.layout}")
        view = _arrays.view(g, f"per_sample_grads[{i}]", dtypes=GRAD_DTYPES)
        first = first or view
        if g.ndim < 1:
            raise ValueError(f"per_sample_grads[{i}] must have a leading batch dimension, got a 0-d tensor")
        if not g.is_contiguous():
            raise ValueError(f"per_sample_grads[{i}] must be contiguous (call .contiguous())")
        if g.shape[0] != grads[0].shape[0] or g.dtype != grads[0].dtype:
            raise ValueError(f"per_sample_grads[{i}] has batch {g.shape[0]} and dtype {g.dtype}; "
                             f"per_sample_grads[0] has {grads[0].shape[0]} and {grads[0].dtype}")
        _arrays.require_same_device(view, f"per_sample_grads[{i}]", first, "per_sample_grads[0]")
    return grads


def _clip_norms(clip_norm, count: Optional[int], per_layer: bool, name: str = "clip_norm") -> list[float]:
    """The clip norms, one per tensor with per_layer (count None: as many as given), else one."""
    norms = list(clip_norm) if isinstance(clip_norm, (list, tuple)) else [clip_norm]
    if not norms or (len(norms) != 1 and (not per_layer or (count is not None and len(norms) != count))):
        raise ValueError(f"{name} must be one number, or (per_layer=True) one per tensor: {count}, got {len(norms)}")
    norms = [validation.positive(c, name if len(norms) == 1 else f"{name}[{i}]") for i, c in enumerate(norms)]
    for i, c in enumerate(norms):
        if c < MIN_CLIP_NORM:
            raise ValueError(f"{name if len(norms) == 1 else f'{name}[{i}]'} = {c!r} is below {MIN_CLIP_NORM:g}: "
                             "the norms are summed in float32, where a gradient's elements below about 1e-22 "
                             "square to nothing, so a clip norm that small does not bound every gradient (a "
                             "review's repro: a sample released at 155 times 1e-27); scale the loss up instead")
    return norms * (count if per_layer and len(norms) == 1 and count is not None else 1)


# The smallest clip norm taken: the squares float32 loses or rounds below its normal range (of
# elements below 1.1e-19) take at most P 2.8e-45 from a squared norm, under 3e-3 of this one's
# square for a trillion parameters, so the shortfall cannot carry a norm past it by more than 0.14%.
MIN_CLIP_NORM = 1e-15
# The kernel computes in float32: the noise std and the scale 1 / batch_size are float32 numbers,
# and the released (sum + noise) / batch_size must be one.
_FLOAT32 = torch.finfo(torch.float32)
# The largest element of a sample the kernel keeps: a larger element's square overflows float32
# and counts as non-finite (L2); in L1 the float32 sum of absolute values must stay finite.
_MAX_GRAD_ELEMENT = {2: 2.0**64, 1: _FLOAT32.max}
NORM_TYPES = (1, 2)


def kernel_rows(rows: Sequence[torch.Tensor]) -> list:
    """Per-sample gradients as the clip kernel reads them: contiguous, of one of its dtypes
    (float32 where they differ or where theirs is not one, as float64's; the update is float32
    anyway)."""
    dtypes = {r.dtype for r in rows}
    common = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if str(common).removeprefix("torch.") not in GRAD_DTYPES:
        common = torch.float32
    return [r.to(common).contiguous() for r in rows]


def non_finite_error(samples: list, norm_type: int, of: str = "") -> ValueError:
    """The error for per-sample gradients of ``samples`` whose norms the kernel found non-finite
    (``of``: which samples the indices count, for the message)."""
    beyond = "their norm beyond 1.8e19" if norm_type == 2 else "their L1 norm beyond 3.4e38"
    return ValueError(f"per-sample gradients of samples {samples}{of} are not finite (or {beyond}); pass "
                      "non_finite='drop' to leave such samples out")


def _check_norm_type(norm_type) -> int:
    norm_type = validation.integer(norm_type, "norm_type")
    if norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type must be 1 (L1 clipping) or 2 (L2 clipping), got {norm_type}")
    return norm_type


def _check_release_range(batch: int, clip_norms: list[float], noise_std: float, scale_by: float, secure: bool,
                         norm_type: int = 2) -> None:
    """Refuse a noise_std and batch_size whose release (sum + noise) / batch_size could overflow
    float32, or whose std or 1 / batch_size float32 cannot hold."""
    if not _FLOAT32.tiny <= 1.0 / scale_by <= _FLOAT32.max:
        raise ValueError(f"batch_size = {scale_by!r} is out of range: the kernel scales by 1 / batch_size in float32, "
                         f"so batch_size must lie in [{1 / _FLOAT32.max:.3g}, {1 / _FLOAT32.tiny:.3g}]")
    if not secure and 0 < noise_std < _FLOAT32.tiny:
        raise ValueError(f"noise_std must be 0 or >= {_FLOAT32.tiny:.3g} (the kernel's noise is float32), "
                         f"got {noise_std!r}")
    unit_max = _mechanisms._SECURE_UNIT_MAX["gaussian"] if secure else \
        _mechanisms._UNIT_MAX[("gaussian", torch.float32)]
    noisy_sum = batch * min(max(clip_norms), _MAX_GRAD_ELEMENT[norm_type]) + unit_max * noise_std
    # The noise is added to the float32 sum before the scaling, so the sum must fit as well.
    largest = max(noisy_sum / scale_by, noisy_sum)
    if largest > _FLOAT32.max:
        raise ValueError(f"noise_std = {noise_std!r} and batch_size = {scale_by!r} overflow float32: the release "
                         f"(clipped sum + noise) / batch_size can reach {largest:.3g}, beyond {_FLOAT32.max:.4g}")


def _noise_alone(grads: list[torch.Tensor], noise_std: float, words: list[int], offset: int,
                 scale: float) -> list[torch.Tensor]:
    """The kernel's output for an empty batch (B = 0, which Poisson sampling draws): its noise
    alone, element i of the tensors laid end to end drawn at stream index offset + i, scaled."""
    sizes = [math.prod(g.shape[1:]) for g in grads]
    device = grads[0].device
    if noise_std > 0:
        flat = torch.ops.privleak.noise([sum(sizes)], "gaussian", noise_std, words, offset, 0, torch.float32, device)
    else:
        flat = torch.zeros(sum(sizes), device=device)
    return [part.mul(scale).reshape(g.shape[1:]) for part, g in zip(flat.split(sizes), grads)]


def _sum_columns_in_order(sums: torch.Tensor) -> torch.Tensor:
    """Row sums of the (B, T) float64 norm sums, column 0 + column 1 + ... left to right: the
    order the kernels' clip factors use, and the same bits on every device (torch's own reduction
    adds in an order that differs between CPU and CUDA)."""
    total = sums[:, 0].clone()
    for t in range(1, sums.shape[1]):
        total.add_(sums[:, t])
    return total


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float64 tensor, as the kernels' std::sqrt gives it.
    Torch's CPU sqrt of float64 is not: about 1 result in 75 is 1 ulp off, on every instruction
    set. numpy's is (the hardware's); CUDA's float64 sqrt is IEEE-exact."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.from_numpy(np.sqrt(x.numpy()))
    return x.sqrt()


def clip_factors(norm_sums: torch.Tensor, clip_norm: Union[float, Sequence[float]], *, per_layer: bool = False,
                 norm_type: int = 2) -> torch.Tensor:
    """Each sample's clip factors from its per-tensor norm sums, exactly as
    :func:`clip_and_accumulate`'s kernel forms them (csrc/common/clip.h), for norms computed
    another way (book-keeping's ghost norms):

        f_{i,t} = min(1, c / |g_i|),  |g_i| = sqrt(sum_t s_{i,t}) (L2) or sum_t s_{i,t} (L1)

    with flat clipping, f_{i,t} = min(1, c_t / |g_{i,t}|) per layer; the sums add left to right
    in float64, and a sample with a non-finite sum gets 0 (it is dropped).

    Args:
        norm_sums: (B, T) float64 on the CPU or a GPU: sample i's squared L2 norm (norm_type 2)
            or L1 norm (norm_type 1) of its gradient of tensor t.
        clip_norm, per_layer, norm_type: as :func:`clip_and_accumulate`.

    Returns:
        (B, T) float32, the factor of sample i's gradient of tensor t (with flat clipping every
        column is the same).
    """
    view = validation.tensor(norm_sums, "norm_sums", dtypes=("float64",))
    if norm_sums.ndim != 2 or norm_sums.shape[1] < 1:
        raise ValueError(f"norm_sums must be (B, T) with T >= 1 tensors, got shape {tuple(norm_sums.shape)}")
    if bool((norm_sums < 0).any()):  # the kernel would read sqrt(-s) as NaN, which compares as no clipping
        raise ValueError(f"norm_sums must be >= 0 (squared or L1 norms), got {float(norm_sums.min())!r}")
    if view.is_cuda:
        _mechanisms._check_cuda(norm_sums.device, "norm_sums' device")
    per_layer = validation.boolean(per_layer, "per_layer")
    norms = _clip_norms(clip_norm, norm_sums.shape[1], per_layer)
    clip_norms = torch.tensor(norms if per_layer else norms[:1], dtype=torch.float64, device=norm_sums.device)
    return torch.ops.privleak.clip_factors(norm_sums, clip_norms, per_layer, _check_norm_type(norm_type))


def clip_and_accumulate(
    per_sample_grads: Sequence[torch.Tensor],
    clip_norm: Union[float, Sequence[float]],
    *,
    per_layer: bool = False,
    noise_std: float = 0.0,
    batch_size: Optional[float] = None,
    generator=None,
    key: Optional[int] = None,
    offset: Optional[int] = None,
    non_finite: str = "raise",
    norm_type: int = 2,
) -> ClippedSum:
    """(sum_b clip(g_b) + N(0, noise_std^2 I)) / batch_size for per-sample gradients, fused.

    Args:
        per_sample_grads: one tensor per parameter, each (B, *param.shape), contiguous, float32,
            bfloat16 or float16, all with the same B, dtype and device (CPU or CUDA). B = 0 (an
            empty Poisson batch) releases the noise alone, as Alg. 1 does.
        clip_norm: c. With ``per_layer`` a single c applies to each tensor, or give one c_t per tensor.
        noise_std: standard deviation of the Gaussian noise added to the clipped sum: c sigma for
            Alg. 1 with noise multiplier sigma (flat clipping), sigma |(c_t)|_2 per layer.
        batch_size: the L that divides the sum: the expected batch size (Poisson sampling) or the
            fixed one; default B.
        generator, key, offset: the noise stream, as in :mod:`privleak.mechanisms`. With a
            :class:`~privleak.mechanisms.SecureNoiseGenerator` the sum is formed by the kernel and
            the secure (discretised) noise is added to it before scaling (at ``noise_std``:
            DP-SGD's Gaussian mechanism raises it to cover the grid's rounding,
            :func:`~privleak.mechanisms.secure_scale`).
        non_finite: "raise" (default) or "drop"; see the module docstring.
        norm_type: the norm samples are clipped in: 2 (L2, default; Gaussian DP-SGD) or 1 (L1,
            clip_c(g) = g min(1, c / |g|_1); Laplace DP-SGD). The returned norms are in it too.

    Returns:
        :class:`ClippedSum` with the float32 noisy average per tensor, the norms, the dropped samples.
    """
    grads = _check_grads(per_sample_grads)
    per_layer = validation.boolean(per_layer, "per_layer")
    norms_allowed = _clip_norms(clip_norm, len(grads), per_layer)
    non_finite = validation.choice(non_finite, "non_finite", ("raise", "drop"))
    norm_type = _check_norm_type(norm_type)
    noise_std = _mechanisms._check_scale(noise_std, "noise_std")
    _mechanisms._check_generator(generator)
    batch = grads[0].shape[0]
    if batch_size is None:
        if batch == 0:
            raise ValueError("batch_size must be given for an empty batch (its default, the batch's size B, is 0)")
        scale_by = float(batch)
    else:
        scale_by = validation.positive(batch_size, "batch_size")
    if grads[0].is_cuda:
        _mechanisms._check_cuda(grads[0].device, "per_sample_grads' device")

    secure_noise = noise_std > 0 and isinstance(generator, _mechanisms.SecureNoiseGenerator)
    _check_release_range(batch, norms_allowed, noise_std, scale_by, secure_noise, norm_type)
    kernel_noise = 0.0 if secure_noise else noise_std
    words, stream_offset = [0, 0], 0
    if kernel_noise > 0:
        total = sum(math.prod(g.shape[1:]) for g in grads)
        words, stream_offset = _mechanisms._resolve_stream(total, generator, key, offset)
    clip_norms = torch.tensor(norms_allowed if per_layer else norms_allowed[:1], dtype=torch.float64,
                              device=grads[0].device)
    kernel_scale = 1.0 if secure_noise else 1.0 / scale_by
    if batch == 0:
        outs = _noise_alone(grads, kernel_noise, words, stream_offset, kernel_scale)
        sums = torch.empty(0, len(grads), dtype=torch.float64, device=grads[0].device)
    else:
        *outs, sums, _ = torch.ops.privleak.clip_accumulate(grads, clip_norms, per_layer, kernel_noise, words,
                                                            stream_offset, kernel_scale, norm_type)
    bad = ~torch.isfinite(sums).all(dim=1)
    if non_finite == "raise" and bool(bad.any()):
        raise non_finite_error(bad.nonzero().flatten().tolist(), norm_type)
    norms = sums if per_layer else _sum_columns_in_order(sums)
    if norm_type == 2:
        norms = _sqrt(norms)
    if secure_noise:  # the discretised noise needs the exact sum, so it is added before scaling
        for out in outs:
            _mechanisms.add_gaussian_noise_(out, noise_std, generator=generator)
            out.mul_(1.0 / scale_by)
    return ClippedSum(list(outs), norms, bad)

