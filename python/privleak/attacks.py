"""Reconstruction attacks on leaked gradients, and how to score them.

:func:`invert_gradients` is Inverting Gradients (Geiping, Bauermeister, Droege, Moeller, NeurIPS
2020): find images x whose gradient points where the leaked one does,

    minimise over x in [lo, hi]^n:   1 - <grad L(x, y), g> / (|grad L(x, y)| |g|)  +  alpha TV(x),

with Adam on the sign of the gradient, the step divided by 10 at 3/8, 5/8 and 7/8 of the
iterations, the pixels clamped to the box after every step, and several random restarts of which
the one with the lowest objective wins. The cosine is taken over all parameters at once, so it
ignores the update's scale: it applies unchanged to the Gaussian update (sum of clipped gradients
plus noise, over L) and to the VMF update (a unit vector).

Many attacks run as one batched optimisation (``torch.func.vmap`` over images, restarts and, if
given, per-attack model parameters). The objective is a sum of independent terms and Adam and the
sign act element-wise, so this gives the same images as running the attacks one at a time.

:class:`GradientAttack` is what the sweeps (:mod:`privleak.reproduce`, :mod:`privleak.estimation`)
take: any attack that reconstructs images from leaked one-image updates. A second attack is one
subclass with its settings as fields and a :meth:`~GradientAttack.reconstruct`;
:class:`InvertingGradients` is the first.

Scores: :func:`mse`, :func:`psnr` and :func:`ssim` (Wang et al. 2004).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- label inference


def _last_linear(model: nn.Module) -> tuple[int, Optional[int]]:
    """Positions of the last linear layer's weight and bias among the trainable parameters."""
    positions = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("label inference needs a model whose last layer is nn.Linear")
    last = linears[-1]
    bias = positions.get(id(last.bias)) if last.bias is not None else None
    return positions[id(last.weight)], bias


def infer_labels(model: nn.Module, leaked: Sequence[torch.Tensor]) -> torch.Tensor:
    """The label of a one-image update, from the last layer (Zhao et al., iDLG, 2020).

    With softmax cross-entropy, d loss / d b_j = p_j - 1[j = y] is negative at the true class only,
    and the weight row j is that times the (non-negative, here sigmoid) features. The true label is
    the argmin of the bias gradient, or of the weight rows' sums when there is no bias. Any positive
    scale (clipping, averaging, VMF's normalisation) leaves it unchanged; noise can flip it.

    ``leaked`` holds one tensor per trainable parameter, each with a leading batch-of-attacks
    dimension A; returns A labels.
    """
    weight, bias = _last_linear(model)
    evidence = leaked[bias] if bias is not None else leaked[weight].sum(-1)
    return evidence.argmin(-1)


# ----------------------------------------------------------------------------- the attack


class Reconstruction(NamedTuple):
    images: torch.Tensor  #: (A, C, H, W): the best restart of each attack
    labels: torch.Tensor  #: (A,): given or inferred
    objective: torch.Tensor  #: (A,): 1 - cosine + alpha TV of the returned images
    restart_objectives: torch.Tensor  #: (A, restarts): the same for every restart's final images


class GradientAttack(ABC):
    """A reconstruction attack on leaked one-image updates, as the sweeps use it.

    Subclasses are frozen dataclasses whose fields are the attack's settings. ``iterations`` is
    how many times :meth:`reconstruct` calls ``progress``; ``restarts`` how many independent runs
    it makes per update before keeping one (1 when every run is its own attempt, as
    :mod:`privleak.estimation` needs).
    """

    iterations: int
    restarts: int = 1

    @abstractmethod
    def reconstruct(self, model: nn.Module, leaked: Sequence[torch.Tensor], image_shape: Sequence[int], *,
                    labels: Optional[torch.Tensor] = None, parameters: Optional[Sequence[torch.Tensor]] = None,
                    generator: Optional[torch.Generator] = None,
                    progress: Optional[Callable[[int], None]] = None) -> Reconstruction:
        """One image per leaked update: ``leaked`` holds one (A, *p.shape) tensor per trainable
        parameter of ``model``; ``labels`` (A,) if known, ``parameters`` per-attack model parameters
        if the updates were taken at different points of training; ``generator`` seeds the attack;
        ``progress(done)`` is called as it goes, ``done`` up to :attr:`iterations`."""

    @abstractmethod
    def describe(self) -> str:
        """The settings in words, for reports."""


@dataclass(frozen=True)
class InvertingGradients(GradientAttack):
    """Inverting Gradients (:func:`invert_gradients`) with these settings; the defaults are
    Geiping et al.'s, with fewer iterations."""

    iterations: int = 2000
    restarts: int = 1
    learning_rate: float = 0.1
    tv_weight: float = 1e-4
    bounds: tuple = (0.0, 1.0)

    def __post_init__(self):
        if not (isinstance(self.iterations, int) and self.iterations >= 1):
            raise ValueError(f"iterations must be an int >= 1, got {self.iterations!r}")
        if not (isinstance(self.restarts, int) and self.restarts >= 1):
            raise ValueError(f"restarts must be an int >= 1, got {self.restarts!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate!r}")
        if not (self.tv_weight >= 0 and math.isfinite(self.tv_weight)):
            raise ValueError(f"tv_weight must be >= 0, got {self.tv_weight!r}")
        if not (len(self.bounds) == 2 and self.bounds[0] < self.bounds[1]):
            raise ValueError(f"bounds must be (low, high) with low < high, got {self.bounds!r}")

    def reconstruct(self, model: nn.Module, leaked: Sequence[torch.Tensor], image_shape: Sequence[int], *,
                    labels: Optional[torch.Tensor] = None, parameters: Optional[Sequence[torch.Tensor]] = None,
                    generator: Optional[torch.Generator] = None,
                    progress: Optional[Callable[[int], None]] = None) -> Reconstruction:
        return invert_gradients(model, leaked, image_shape, labels=labels, parameters=parameters, settings=self,
                                generator=generator, progress=progress)

    def describe(self) -> str:
        return (f"{self.iterations} iterations, {self.restarts} restarts, step {self.learning_rate:g}, "
                f"TV weight {self.tv_weight:g}")


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of vertical and of horizontal neighbours, per image (Geiping et al.)."""
    vertical = (images[..., 1:, :] - images[..., :-1, :]).abs().flatten(1).mean(1)
    horizontal = (images[..., :, 1:] - images[..., :, :-1]).abs().flatten(1).mean(1)
    return vertical + horizontal


def _per_attack(model: nn.Module, tensors: Sequence[torch.Tensor], name: str, attacks: Optional[int] = None) -> list:
    """Check one (A, *parameter.shape) tensor per trainable parameter; return them as float32."""
    params = [p for p in model.parameters() if p.requires_grad]
    tensors = list(tensors)
    if len(tensors) != len(params):
        raise ValueError(f"{name} holds {len(tensors)} tensors; the model has {len(params)} trainable parameters")
    for i, (t, p) in enumerate(zip(tensors, params)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape[1:]) != tuple(p.shape):
            raise ValueError(f"{name}[{i}] must have shape (A, {', '.join(map(str, p.shape))}), "
                             f"got {tuple(getattr(t, 'shape', ()))}")
        attacks = t.shape[0] if attacks is None else attacks
        if t.shape[0] != attacks:
            raise ValueError(f"{name}[{i}] holds {t.shape[0]} attacks, expected {attacks}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}[{i}] is not finite")
    return [t.detach().to(torch.float32) for t in tensors]


def invert_gradients(
    model: nn.Module,
    leaked: Sequence[torch.Tensor],
    image_shape: Sequence[int],
    *,
    labels: Optional[torch.Tensor] = None,
    parameters: Optional[Sequence[torch.Tensor]] = None,
    settings: InvertingGradients = InvertingGradients(),
    loss_fn: Callable = F.cross_entropy,
    generator: Optional[torch.Generator] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Reconstruction:
    """Reconstruct one image from each of A leaked one-image updates (module docstring).

    Args:
        model: the architecture the clients train (the honest-but-curious server knows it).
        leaked: one tensor per trainable parameter, in ``model.parameters()`` order, each of
            shape (A, *parameter.shape): the updates to attack.
        image_shape: (C, H, W).
        labels: (A,) true labels if the attacker knows them; inferred with
            :func:`infer_labels` otherwise.
        parameters: per-attack model parameters (A, *shape) each, if the updates were computed at
            different points of training; the model's own parameters otherwise.
        settings: iterations, restarts, step size, TV weight, pixel box.
        generator: seeds the random starting images.
        progress: called with the number of iterations done, every iteration.
    """
    from torch.func import functional_call, grad, vmap

    leaked = _per_attack(model, leaked, "leaked")
    if not bool(sum(g.double().flatten(1).pow(2).sum(1) for g in leaked).gt(0).all()):
        raise ValueError("a leaked update is zero: the cosine objective has no direction to match")
    attacks, restarts = leaked[0].shape[0], settings.restarts
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    if labels is None:
        labels = infer_labels(model, leaked)
    labels = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
    if labels.numel() != attacks:
        raise ValueError(f"labels holds {labels.numel()} labels for {attacks} attacks")
    if parameters is None:
        params, params_dim = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, None
    else:
        parameters = _per_attack(model, parameters, "parameters", attacks)
        params = {n: p.repeat_interleave(restarts, 0) for n, p in zip(names, parameters)}
        params_dim = 0

    def gradient_of_one(p, image, label):
        def loss(q):
            return loss_fn(functional_call(model, (q, buffers), (image.unsqueeze(0),)), label.unsqueeze(0))
        return grad(loss)(p)

    gradients = vmap(gradient_of_one, in_dims=(params_dim, 0, 0))
    targets = [g.repeat_interleave(restarts, 0).flatten(1) for g in leaked]
    target_norms = torch.sqrt(sum(t.double().pow(2).sum(1) for t in targets)).float()
    candidate_labels = labels.repeat_interleave(restarts)

    def objective(images):
        current = gradients(params, images, candidate_labels)
        dots = sum((current[n].flatten(1) * t).sum(1) for n, t in zip(names, targets))
        norms = torch.sqrt(sum(current[n].flatten(1).pow(2).sum(1) for n in names))
        cosine = dots / (norms * target_norms).clamp_min(torch.finfo(torch.float32).tiny)
        return 1.0 - cosine + settings.tv_weight * total_variation(images)

    low, high = settings.bounds
    start = torch.randn((attacks * restarts, *image_shape), generator=generator)
    images = start.clamp(low, high).requires_grad_(True)
    optimizer = torch.optim.Adam([images], lr=settings.learning_rate)
    milestones = sorted({max(1, int(settings.iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
    for iteration in range(settings.iterations):
        optimizer.zero_grad(set_to_none=True)
        objective(images).sum().backward()
        images.grad.sign_()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            images.clamp_(low, high)
        if progress is not None:
            progress(iteration + 1)

    with torch.no_grad():
        final = objective(images.detach()).reshape(attacks, restarts)
    best = final.argmin(1)
    chosen = images.detach().reshape(attacks, restarts, *image_shape)[torch.arange(attacks), best]
    return Reconstruction(chosen, labels, final[torch.arange(attacks), best], final)


# ----------------------------------------------------------------------------- scores


def _check_pair(reconstructed: torch.Tensor, original: torch.Tensor) -> None:
    if reconstructed.shape != original.shape or reconstructed.dim() != 4:
        raise ValueError(f"reconstructed and original must both be (N, C, H, W), got "
                         f"{tuple(reconstructed.shape)} and {tuple(original.shape)}")


def mse(reconstructed: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Mean squared pixel error per image, (N,)."""
    _check_pair(reconstructed, original)
    return (reconstructed.double() - original.double()).pow(2).flatten(1).mean(1)


def psnr(reconstructed: torch.Tensor, original: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio per image in dB: 10 log10(range^2 / MSE); +inf for a perfect copy."""
    return 10.0 * torch.log10(data_range ** 2 / mse(reconstructed, original))


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    window = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    return window / window.sum()


def ssim(reconstructed: torch.Tensor, original: torch.Tensor, data_range: float = 1.0, *,
         window: int = 11, sigma: float = 1.5, k1: float = 0.01, k2: float = 0.03) -> torch.Tensor:
    """Structural similarity per image (Wang, Bovik, Sheikh, Simoncelli, IEEE TIP 2004).

    SSIM = (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2)) with
    C1 = (k1 R)^2, C2 = (k2 R)^2, the local moments weighted by a Gaussian window (11 x 11,
    sigma 1.5), averaged over the positions where the window fits inside the image and over
    channels. For images smaller than the window (8 x 8 digits) the window shrinks to the largest
    odd size that fits (7 x 7, same sigma).
    """
    _check_pair(reconstructed, original)
    smallest = min(original.shape[-2:])
    size = min(window, smallest if smallest % 2 else smallest - 1)
    if size < 1:
        raise ValueError(f"images of shape {tuple(original.shape[-2:])} are too small for SSIM")
    weights = _gaussian_window(size, sigma)
    kernel = (weights[:, None] * weights[None, :]).expand(original.shape[1], 1, size, size)
    x, y = reconstructed.double(), original.double()
    channels = original.shape[1]

    def local_mean(z):
        return F.conv2d(z, kernel, groups=channels)

    mu_x, mu_y = local_mean(x), local_mean(y)
    var_x = local_mean(x * x) - mu_x ** 2
    var_y = local_mean(y * y) - mu_y ** 2
    cov = local_mean(x * y) - mu_x * mu_y
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    index = (2 * mu_x * mu_y + c1) * (2 * cov + c2) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return index.flatten(1).mean(1)
