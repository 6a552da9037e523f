"""DP-SGD building blocks: fused per-sample clipping, summation and noise.

DP-SGD (Abadi et al., CCS 2016; Alg. 1 of Biswas et al.) releases, for a batch of per-sample
gradients g_1 .. g_B and expected batch size L,

    g~ = (sum_b clip_c(g_b) + N(0, c^2 sigma^2 I)) / L,     clip_c(g) = g min(1, c / |g|_2).

With flat clipping |g| is the norm over all parameter tensors together; with per-layer clipping
each tensor t is clipped to its own c_t. :func:`clip_and_accumulate` does this in one kernel that
reads the per-sample gradients twice: pass 1 computes each sample's squared norm per tensor, the
clip factors follow, pass 2 forms the clipped sum, adds the noise (privleak's counter-based
Gaussian, the same bits as :func:`privleak.mechanisms.gaussian_noise`) and scales. On the CPU the
samples go through both passes in groups small enough to stay in cache, so the second read of
models up to a few million parameters comes from cache, not memory.

Non-finite per-sample gradients never reach the update. By default they raise a ValueError
naming the samples (a NaN or inf gradient is a bug upstream, and silently dropping data changes
what is being trained on); ``non_finite="drop"`` instead gives those samples weight 0, i.e.
treats them as absent from the batch. Squares are summed in float32 lanes (then in float64), so
a sample also counts as non-finite when one of its elements exceeds about 1.8e19 in magnitude
and its square overflows: a gradient that has diverged.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from privleak import _arrays, _backend, validation
from privleak import mechanisms as _mechanisms

GRAD_DTYPES = ("float32", "bfloat16", "float16")


@torch.library.custom_op("privleak::clip_accumulate", mutates_args=())
def _clip_accumulate_op(grads: Sequence[torch.Tensor], clip_norms: torch.Tensor, per_layer: bool, noise_std: float,
                        key: Sequence[int], offset: int, scale: float) -> list[torch.Tensor]:
    """The fused kernel: [out_0 .. out_{T-1}, squares], squares the (B, T) float64 squared norms."""
    batch, device = grads[0].shape[0], grads[0].device
    outs = [torch.empty(g.shape[1:], dtype=torch.float32, device=device) for g in grads]
    squares = torch.empty(batch, len(grads), dtype=torch.float64, device=device)
    numels = [math.prod(g.shape[1:]) for g in grads]
    args = (str(grads[0].dtype).removeprefix("torch."), [g.data_ptr() for g in grads], numels,
            [o.data_ptr() for o in outs], batch, clip_norms.data_ptr(), per_layer, noise_std, key[0] | (key[1] << 32),
            offset, scale, squares.data_ptr())
    if grads[0].is_cuda:
        module = _backend.cuda()
        workspace = torch.empty(module.clip_workspace_bytes(numels, batch), dtype=torch.uint8, device=device)
        module.clip_accumulate(*args, workspace.data_ptr(), device.index, torch.cuda.current_stream(device).cuda_stream)
    else:
        _backend.core.clip_accumulate(*args)
    return outs + [squares]


@_clip_accumulate_op.register_fake
def _(grads, clip_norms, per_layer, noise_std, key, offset, scale):
    outs = [torch.empty(g.shape[1:], dtype=torch.float32, device=g.device) for g in grads]
    return outs + [grads[0].new_empty(grads[0].shape[0], len(grads), dtype=torch.float64)]


class ClippedSum(NamedTuple):
    """Result of :func:`clip_and_accumulate`."""

    grads: list  #: float32 tensors shaped like one sample of each input: the noisy clipped average
    norms: torch.Tensor  #: per-sample norms before clipping, float64: (B,) flat, (B, T) per layer
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


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise validation.ArgumentTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _clip_norms(clip_norm, count: Optional[int], per_layer: bool, name: str = "clip_norm") -> list[float]:
    """The clip norms, one per tensor with per_layer (count None: as many as given), else one."""
    norms = list(clip_norm) if isinstance(clip_norm, (list, tuple)) else [clip_norm]
    if not norms or (len(norms) != 1 and (not per_layer or (count is not None and len(norms) != count))):
        raise ValueError(f"{name} must be one number, or (per_layer=True) one per tensor: {count}, got {len(norms)}")
    norms = [validation.positive(c, name if len(norms) == 1 else f"{name}[{i}]") for i, c in enumerate(norms)]
    return norms * (count if per_layer and len(norms) == 1 and count is not None else 1)


# The kernel computes in float32: the noise std and the scale 1 / batch_size are float32 numbers,
# and the released (sum + noise) / batch_size must be one.
_FLOAT32 = torch.finfo(torch.float32)
_MAX_GRAD_ELEMENT = 2.0**64  # a larger element's square overflows float32 and counts as non-finite


def _check_release_range(batch: int, clip_norms: list[float], noise_std: float, scale_by: float, secure: bool) -> None:
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
    noisy_sum = batch * min(max(clip_norms), _MAX_GRAD_ELEMENT) + unit_max * noise_std
    # Secure noise is added to the float32 sum before the scaling, so the sum must fit as well.
    largest = max(noisy_sum / scale_by, noisy_sum if secure else 0.0)
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


def _sum_columns_in_order(squares: torch.Tensor) -> torch.Tensor:
    """Row sums of the (B, T) float64 squares, column 0 + column 1 + ... left to right: the order
    the kernels' clip factors use, and the same bits on every device (torch's own reduction adds
    in an order that differs between CPU and CUDA)."""
    total = squares[:, 0].clone()
    for t in range(1, squares.shape[1]):
        total.add_(squares[:, t])
    return total


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float64 tensor, as the kernels' std::sqrt gives it.
    Torch's CPU sqrt of float64 is not: about 1 result in 75 is 1 ulp off, on every instruction
    set. numpy's is (the hardware's); CUDA's float64 sqrt is IEEE-exact."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.from_numpy(np.sqrt(x.numpy()))
    return x.sqrt()


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
            the secure (discretised) noise is added to it before scaling.
        non_finite: "raise" (default) or "drop"; see the module docstring.

    Returns:
        :class:`ClippedSum` with the float32 noisy average per tensor, the norms, the dropped samples.
    """
    grads = _check_grads(per_sample_grads)
    per_layer = _check_bool(per_layer, "per_layer")
    norms_allowed = _clip_norms(clip_norm, len(grads), per_layer)
    non_finite = validation.choice(non_finite, "non_finite", ("raise", "drop"))
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
    _check_release_range(batch, norms_allowed, noise_std, scale_by, secure_noise)
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
        squares = torch.empty(0, len(grads), dtype=torch.float64, device=grads[0].device)
    else:
        *outs, squares = torch.ops.privleak.clip_accumulate(grads, clip_norms, per_layer, kernel_noise, words,
                                                            stream_offset, kernel_scale)
    bad = ~torch.isfinite(squares).all(dim=1)
    if non_finite == "raise" and bool(bad.any()):
        raise ValueError(f"per-sample gradients of samples {bad.nonzero().flatten().tolist()} are not finite "
                         "(or beyond 1.8e19); pass non_finite='drop' to leave such samples out")
    norms = _sqrt(squares if per_layer else _sum_columns_in_order(squares))
    if secure_noise:  # the discretised noise needs the exact sum, so it is added before scaling
        for out in outs:
            _mechanisms.add_gaussian_noise_(out, noise_std, generator=generator)
            out.mul_(1.0 / scale_by)
    return ClippedSum(list(outs), norms, bad)


# ----------------------------------------------------------------------------- the DP-SGD step


def per_sample_gradients(model: torch.nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    """Per-sample gradients of ``loss_fn(model(x_b), y_b)`` for every trainable parameter.

    Computed with ``torch.func`` (``vmap`` of ``grad`` over a ``functional_call``), so any model
    without batch-coupled layers (BatchNorm in training mode) works. Returns one (B, *p.shape)
    tensor per parameter with ``requires_grad``, in ``model.parameters()`` order.
    """
    from torch.func import functional_call, grad, vmap

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_of_one(params, x, y):
        out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, inputs, targets)
    return [grads[name].contiguous() for name in names]


def sample_batch(num_examples: int, batch_size: int, sampling: str = "poisson",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Indices of one DP-SGD batch: Poisson sampling (each example independently with rate
    batch_size / num_examples; the batch size varies, the accountant's assumption for
    amplification by subsampling) or a fixed-size sample without replacement."""
    num_examples = validation.integer(num_examples, "num_examples", low=1)
    batch_size = validation.integer(batch_size, "batch_size", low=1)
    if batch_size > num_examples:
        raise ValueError(f"batch_size must be <= num_examples, got {batch_size} and {num_examples}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise validation.ArgumentTypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if _check_sampling(sampling) == "poisson":
        return torch.nonzero(torch.rand(num_examples, generator=generator) < batch_size / num_examples).flatten()
    return torch.randperm(num_examples, generator=generator)[:batch_size]


def _check_sampling(sampling: str) -> str:
    return validation.choice(sampling, "sampling", ("poisson", "fixed"))


class DPSGDConfig(NamedTuple):
    """How one DP-SGD step privatises the gradient.

    ``mechanism="gaussian"`` is Alg. 1 (Abadi et al.): clip to ``clip_norm``, sum, add
    N(0, (noise_multiplier c)^2 I), divide by the expected batch size; with per-layer clipping to
    (c_t) the noise std is noise_multiplier |(c_t)|_2 (the sensitivity of the concatenation).
    ``mechanism="vmf"`` is Alg. 2 of Biswas et al.: clip, average, scale to unit length, release a
    draw of VMF(that direction, ``kappa``).
    """

    clip_norm: Union[float, Sequence[float]]
    mechanism: str = "gaussian"
    noise_multiplier: float = 1.0
    kappa: Optional[float] = None
    per_layer: bool = False
    non_finite: str = "raise"


def _check_config(config: DPSGDConfig, num_tensors: Optional[int] = None) -> DPSGDConfig:
    """``config`` with every field checked (errors name the field) and numbers made Python floats;
    with ``num_tensors``, per-layer clip norms must number one or that many."""
    if not isinstance(config, DPSGDConfig):
        raise validation.ArgumentTypeError(f"config must be a DPSGDConfig, got {type(config).__name__}")
    mechanism = validation.choice(config.mechanism, "config.mechanism", ("gaussian", "vmf"))
    per_layer = _check_bool(config.per_layer, "config.per_layer")
    clip = _clip_norms(config.clip_norm, num_tensors, per_layer, "config.clip_norm")
    noise_multiplier = validation.non_negative(config.noise_multiplier, "config.noise_multiplier")
    kappa = config.kappa
    if mechanism == "vmf" and kappa is None:
        raise ValueError("the VMF mechanism needs kappa: config.kappa must be a number > 0, got None")
    if kappa is not None:
        kappa = validation.positive(kappa, "config.kappa")
    non_finite = validation.choice(config.non_finite, "config.non_finite", ("raise", "drop"))
    clip_norm = clip[0] if len(clip) == 1 and not isinstance(config.clip_norm, (list, tuple)) else list(clip)
    return DPSGDConfig(clip_norm, mechanism, noise_multiplier, kappa, per_layer, non_finite)


def _check_expected_batch_size(value) -> float:
    return validation.positive(value, "expected_batch_size")


def gaussian_noise_std(config: DPSGDConfig, num_tensors: int) -> float:
    """Standard deviation of Alg. 1's noise on the clipped sum of ``num_tensors`` tensors:
    noise_multiplier c (flat clipping), noise_multiplier |(c_t)|_2 (per layer)."""
    num_tensors = validation.integer(num_tensors, "num_tensors", low=1)
    config = _check_config(config, num_tensors)
    clip = _clip_norms(config.clip_norm, num_tensors, config.per_layer)
    return config.noise_multiplier * math.sqrt(sum(c * c for c in clip)) if config.per_layer else \
        config.noise_multiplier * clip[0]


def privatize(per_sample_grads: Sequence[torch.Tensor], config: DPSGDConfig, expected_batch_size: float,
              generator=None) -> list:
    """The update DP-SGD leaks for one batch (what an honest-but-curious server sees), per tensor."""
    grads = _check_grads(per_sample_grads)
    config = _check_config(config, len(grads))
    expected_batch_size = _check_expected_batch_size(expected_batch_size)
    per_sample_grads = grads
    if config.mechanism == "gaussian":
        return clip_and_accumulate(per_sample_grads, config.clip_norm, per_layer=config.per_layer,
                                   noise_std=gaussian_noise_std(config, len(per_sample_grads)),
                                   batch_size=expected_batch_size, generator=generator,
                                   non_finite=config.non_finite).grads
    if config.mechanism == "vmf":
        average = clip_and_accumulate(per_sample_grads, config.clip_norm, per_layer=config.per_layer,
                                      batch_size=expected_batch_size, non_finite=config.non_finite).grads
        return vmf_release(average, config.kappa, generator)
    raise ValueError(f"mechanism must be 'gaussian' or 'vmf', got {config.mechanism!r}")


def vmf_release(average: Sequence[torch.Tensor], kappa: float, generator=None) -> list:
    """Lines 10-11 of Alg. 2: scale the clipped average gradient (one tensor per parameter) to unit
    length over all tensors together and release one draw of VMF(that direction, kappa).

    A zero average (an empty batch, or every sample's gradient zero or dropped) has no direction;
    it releases a uniform draw on the sphere instead, a normalised standard Gaussian vector. The
    uniform law is the average of VMF(mu, kappa) over all mu, so the step stays 2 kappa-DP, and
    the data never decide whether the step raises.
    """
    if isinstance(average, (torch.Tensor, np.ndarray, str, bytes)) or not isinstance(average, Iterable):
        raise validation.ArgumentTypeError(f"average must be a sequence of tensors, got {type(average).__name__}")
    average = list(average)
    if not average or not all(isinstance(a, torch.Tensor) for a in average):
        raise validation.ArgumentTypeError("average must be a non-empty sequence of torch tensors")
    _mechanisms._check_generator(generator)
    flat = torch.cat([a.reshape(-1) for a in average])
    if bool(flat.any()):
        direction = _mechanisms.vmf_sample(flat, kappa, 1, generator=generator)[0]
    else:
        if isinstance(generator, _mechanisms.SecureNoiseGenerator):
            raise ValueError("vmf_release has no secure mode yet: pass a NoiseGenerator")
        gaussian = _mechanisms.gaussian_noise(flat.numel(), generator=generator, dtype=flat.dtype, device=flat.device)
        direction = gaussian / torch.linalg.vector_norm(gaussian)
    return [part.reshape(a.shape) for part, a in zip(direction.split([a.numel() for a in average]), average)]


class PrivacyReport(NamedTuple):
    """A DP-SGD run's privacy, as epsilon and as the Bayes capacity of one leaked update."""

    epsilon: float  #: epsilon(delta) over the run (accounting module)
    delta: float
    steps: int
    capacity_bits: float  #: log2 Bayes capacity of one leaked update (capacity module)
    capacity_log: float  #: the same, natural log


def privacy_report(config: DPSGDConfig, parameter_shapes: Sequence[Sequence[int]], *, expected_batch_size: float,
                   dataset_size: int, steps: int, delta: float, sampling: str = "poisson") -> PrivacyReport:
    """epsilon of ``steps`` DP-SGD steps, sampled at rate q = expected_batch_size / dataset_size,
    next to the Bayes capacity of the channel one step's update goes through.

    ``sampling`` says how the batches were drawn (:func:`sample_batch`): "poisson" (add/remove
    neighbours) or "fixed", batches of expected_batch_size examples without replacement
    (replace-one neighbours). Gaussian (Alg. 1): dp-accounting's PLD epsilon for Poisson, its RDP
    epsilon for fixed-size batches (its PLD has no such event); the capacity of
    N(x, (sigma c / L)^2 I) over the ball of radius c (flat clipping), or over the product of
    per-layer balls. VMF (Alg. 2): privleak's VMF accounting, whose amplification
    log(1 + q (e^eps - 1)) holds for both samplings (Balle, Barthe and Gaboardi 2018), each with
    its own neighbours; the capacity of VMF(kappa) on the sphere. No steps: epsilon 0.
    """
    from privleak import accounting, capacity

    sizes = _parameter_sizes(parameter_shapes)
    config = _check_config(config, len(sizes))
    sampling = _check_sampling(sampling)
    steps = validation.integer(steps, "steps", low=0)
    dataset_size = validation.integer(dataset_size, "dataset_size", low=1)
    expected_batch_size = _check_expected_batch_size(expected_batch_size)
    if expected_batch_size > dataset_size:
        raise ValueError(f"expected_batch_size must be <= dataset_size, got {expected_batch_size!r} and {dataset_size}")
    delta = validation.probability(delta, "delta", open_high=True)
    if config.mechanism == "gaussian":
        if config.noise_multiplier == 0:
            raise ValueError("config.noise_multiplier must be > 0 for a privacy report: without noise there is no "
                             "privacy to report")
        if delta == 0:
            raise ValueError("delta must be > 0 for the Gaussian mechanism (it is not pure DP)")
    if sum(sizes) == 0 or (config.per_layer and 0 in sizes):
        raise ValueError("parameter_shapes must have at least one element"
                         f"{' in each tensor' if config.per_layer else ''}, "
                         f"got {[tuple(shape) for shape in parameter_shapes]}")
    q = expected_batch_size / dataset_size
    if config.mechanism == "vmf":
        epsilon = accounting.vmf_privacy(config.kappa, steps, delta, sampling_rate=q).epsilon if steps else 0.0
        log_capacity = capacity.dpsgd_vmf(sum(sizes), config.kappa).log_capacity()
    elif config.mechanism == "gaussian":
        fixed = {"sampling": "fixed", "dataset_size": dataset_size, "accountant": "rdp"} if sampling == "fixed" else {}
        epsilon = accounting.gaussian_epsilon(config.noise_multiplier, steps, delta, sampling_rate=q,
                                              **fixed) if steps else 0.0
        clip = _clip_norms(config.clip_norm, len(sizes), config.per_layer)
        # The capacity depends on noise_multiplier / L only; capacity takes an integer L, so a
        # fractional expected batch size (Poisson sampling) goes in as L = 1 with sigma / L.
        sigma, batch = config.noise_multiplier, expected_batch_size
        if not float(batch).is_integer():
            sigma, batch = sigma / batch, 1
        batch = int(batch)
        if config.per_layer:
            mechanism = capacity.dpsgd_gaussian_per_layer(sizes, clip, sigma, batch)
        else:
            mechanism = capacity.dpsgd_gaussian(sum(sizes), clip[0], sigma, batch)
        log_capacity = mechanism.log_capacity()
    return PrivacyReport(epsilon, delta, steps, log_capacity.bits, log_capacity.log)


def _parameter_sizes(parameter_shapes) -> list[int]:
    """The element counts of ``parameter_shapes``, a non-empty sequence of shapes of ints >= 0."""
    if isinstance(parameter_shapes, (str, bytes, torch.Tensor, np.ndarray)) or \
            not isinstance(parameter_shapes, Iterable):
        raise validation.ArgumentTypeError(f"parameter_shapes must be a sequence of shapes, got "
                                           f"{type(parameter_shapes).__name__} {parameter_shapes!r}")
    shapes = list(parameter_shapes)
    if not shapes:
        raise ValueError("parameter_shapes must not be empty")
    sizes = []
    for i, shape in enumerate(shapes):
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise validation.ArgumentTypeError(f"parameter_shapes[{i}] must be a shape (a sequence of ints), got "
                                               f"{type(shape).__name__} {shape!r}")
        sizes.append(math.prod(validation.integer(d, f"parameter_shapes[{i}]", low=0) for d in shape))
    return sizes


class DPOptimizer:
    """DP-SGD around any torch optimizer.

    ``step(per_sample_grads)`` privatises the per-sample gradients (:func:`privatize`), writes the
    result into the parameters' ``.grad`` and steps the wrapped optimizer; it returns the leaked
    update. Per-sample gradients come in the order of the optimizer's parameters (param groups in
    order); a gradient whose shape is not its parameter's is rejected. ``sampling`` is how the
    batches are drawn ("poisson" or "fixed", :func:`sample_batch`), for the privacy report.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: DPSGDConfig, expected_batch_size: float,
                 generator=None, sampling: str = "poisson"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise validation.ArgumentTypeError("optimizer must be a torch.optim.Optimizer, "
                                               f"got {type(optimizer).__name__}")
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.sampling = _check_sampling(sampling)
        self.optimizer = optimizer
        self.config = _check_config(config, len(self.params))
        self.expected_batch_size = _check_expected_batch_size(expected_batch_size)
        _mechanisms._check_generator(generator)
        if self.config.mechanism == "vmf" and isinstance(generator, _mechanisms.SecureNoiseGenerator):
            raise ValueError("generator: the VMF mechanism has no secure mode yet; pass a NoiseGenerator")
        self.generator = generator
        self.steps = 0

    def privacy_report(self, dataset_size: int, delta: float) -> PrivacyReport:
        """:func:`privacy_report` for the steps taken so far."""
        return privacy_report(self.config, [p.shape for p in self.params], expected_batch_size=self.expected_batch_size,
                              dataset_size=dataset_size, steps=self.steps, delta=delta, sampling=self.sampling)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, per_sample_grads: Sequence[torch.Tensor]) -> list:
        per_sample_grads = _check_grads(per_sample_grads)
        if len(per_sample_grads) != len(self.params):
            raise ValueError(f"got {len(per_sample_grads)} per-sample gradients for {len(self.params)} parameters")
        for i, (g, p) in enumerate(zip(per_sample_grads, self.params)):
            if not isinstance(g, torch.Tensor) or g.shape[1:] != p.shape:
                shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise ValueError(f"per_sample_grads[{i}] must be (B, *{tuple(p.shape)}), the shape of the optimizer's "
                                 f"parameter {i}, got {shape}: give them in the optimizer's parameter order")
        update = privatize(per_sample_grads, self.config, self.expected_batch_size, self.generator)
        for p, u in zip(self.params, update):
            p.grad = u.to(p.dtype)
        self.optimizer.step()
        self.steps += 1
        return update
