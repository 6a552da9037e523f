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
import numbers
from typing import NamedTuple, Optional, Sequence, Union

import torch

from privleak import _arrays, _backend
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
    if isinstance(per_sample_grads, torch.Tensor) or not per_sample_grads:
        raise TypeError("per_sample_grads must be a non-empty sequence of tensors, one per parameter")
    grads = list(per_sample_grads)
    first = None
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"per_sample_grads[{i}] must be a torch tensor, got {type(g).__name__}")
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


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _clip_norms(clip_norm, count: int, per_layer: bool) -> list[float]:
    norms = list(clip_norm) if isinstance(clip_norm, (list, tuple)) else [clip_norm]
    if len(norms) != 1 and (not per_layer or len(norms) != count):
        raise ValueError(f"clip_norm must be one number, or (per_layer=True) one per tensor: {count}, got {len(norms)}")
    for c in norms:
        if not _is_real(c) or not math.isfinite(c) or c <= 0:
            raise ValueError(f"clip_norm must be finite and > 0, got {c!r}")
    return [float(c) for c in norms] * (count if per_layer and len(norms) == 1 else 1)


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
    norms_allowed = _clip_norms(clip_norm, len(grads), per_layer)
    if non_finite not in ("raise", "drop"):
        raise ValueError(f"non_finite must be 'raise' or 'drop', got {non_finite!r}")
    noise_std = _mechanisms._check_scale(noise_std, "noise_std")
    batch = grads[0].shape[0]
    if batch_size is not None and not _is_real(batch_size):
        raise ValueError(f"batch_size must be a number, got {batch_size!r}")
    scale_by = float(batch if batch_size is None else batch_size)
    if not math.isfinite(scale_by) or scale_by <= 0 or not math.isfinite(1.0 / scale_by):
        raise ValueError(f"batch_size must be finite and > 0 (and its reciprocal finite), got {batch_size!r}")

    secure_noise = noise_std > 0 and isinstance(generator, _mechanisms.SecureNoiseGenerator)
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
        raise ValueError(f"per-sample gradients of samples {bad.nonzero().flatten().tolist()} are not finite (or beyond 1.8e19); "
                         "pass non_finite='drop' to leave such samples out")
    norms = (squares if per_layer else squares.sum(dim=1)).sqrt()
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
    if not (isinstance(num_examples, int) and isinstance(batch_size, int) and 0 < batch_size <= num_examples):
        raise ValueError(f"need 0 < batch_size <= num_examples, got {batch_size} and {num_examples}")
    if _check_sampling(sampling) == "poisson":
        return torch.nonzero(torch.rand(num_examples, generator=generator) < batch_size / num_examples).flatten()
    return torch.randperm(num_examples, generator=generator)[:batch_size]


def _check_sampling(sampling: str) -> str:
    if sampling not in ("poisson", "fixed"):
        raise ValueError(f"sampling must be 'poisson' or 'fixed', got {sampling!r}")
    return sampling


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


def gaussian_noise_std(config: DPSGDConfig, num_tensors: int) -> float:
    """Standard deviation of Alg. 1's noise on the clipped sum of ``num_tensors`` tensors:
    noise_multiplier c (flat clipping), noise_multiplier |(c_t)|_2 (per layer)."""
    clip = _clip_norms(config.clip_norm, num_tensors, config.per_layer)
    return config.noise_multiplier * math.sqrt(sum(c * c for c in clip)) if config.per_layer else \
        config.noise_multiplier * clip[0]


def privatize(per_sample_grads: Sequence[torch.Tensor], config: DPSGDConfig, expected_batch_size: float,
              generator=None) -> list:
    """The update DP-SGD leaks for one batch (what an honest-but-curious server sees), per tensor."""
    if config.mechanism == "gaussian":
        return clip_and_accumulate(per_sample_grads, config.clip_norm, per_layer=config.per_layer,
                                   noise_std=gaussian_noise_std(config, len(per_sample_grads)),
                                   batch_size=expected_batch_size, generator=generator,
                                   non_finite=config.non_finite).grads
    if config.mechanism == "vmf":
        if config.kappa is None:
            raise ValueError("the VMF mechanism needs kappa")
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

    _check_sampling(sampling)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    q = expected_batch_size / dataset_size
    sizes = [math.prod(shape) for shape in parameter_shapes]
    if config.mechanism == "vmf":
        if config.kappa is None:
            raise ValueError("the VMF mechanism needs kappa")
        epsilon = accounting.vmf_privacy(config.kappa, steps, delta, sampling_rate=q).epsilon if steps else 0.0
        log_capacity = capacity.dpsgd_vmf(sum(sizes), config.kappa).log_capacity()
    elif config.mechanism == "gaussian":
        fixed = {"sampling": "fixed", "dataset_size": dataset_size, "accountant": "rdp"} if sampling == "fixed" else {}
        epsilon = accounting.gaussian_epsilon(config.noise_multiplier, steps, delta, sampling_rate=q,
                                              **fixed) if steps else 0.0
        clip = _clip_norms(config.clip_norm, len(sizes), config.per_layer)
        if config.per_layer:
            mechanism = capacity.dpsgd_gaussian_per_layer(sizes, clip, config.noise_multiplier, expected_batch_size)
        else:
            mechanism = capacity.dpsgd_gaussian(sum(sizes), clip[0], config.noise_multiplier, expected_batch_size)
        log_capacity = mechanism.log_capacity()
    else:
        raise ValueError(f"mechanism must be 'gaussian' or 'vmf', got {config.mechanism!r}")
    return PrivacyReport(epsilon, delta, steps, log_capacity.bits, log_capacity.log)


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
        self.sampling = _check_sampling(sampling)
        self.optimizer = optimizer
        self.config = config
        self.expected_batch_size = expected_batch_size
        self.generator = generator
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.steps = 0

    def privacy_report(self, dataset_size: int, delta: float) -> PrivacyReport:
        """:func:`privacy_report` for the steps taken so far."""
        return privacy_report(self.config, [p.shape for p in self.params], expected_batch_size=self.expected_batch_size,
                              dataset_size=dataset_size, steps=self.steps, delta=delta, sampling=self.sampling)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, per_sample_grads: Sequence[torch.Tensor]) -> list:
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
