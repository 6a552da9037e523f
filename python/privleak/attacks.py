"""Reconstruction attacks on leaked gradients, and how to score them.

:func:`invert_gradients` is Inverting Gradients (Geiping, Bauermeister, Droege, Moeller, NeurIPS
2020): find images x whose gradient points where the leaked one does,

    minimise over x in [lo, hi]^n:   1 - <grad L(x, y), g> / (|grad L(x, y)| |g|)  +  alpha TV(x),

with Adam on the sign of the gradient, the step divided by 10 at 3/8, 5/8 and 7/8 of the
iterations, the pixels clamped to the box after every step, and several random restarts of which
the one with the lowest objective wins. The cosine is taken over all parameters at once, so it
ignores the update's scale: it applies unchanged to the Gaussian update (sum of clipped gradients
plus noise, over L) and to the VMF update (a unit vector).

An update of a batch of B images is attacked with B dummy images at once: the dummy update is
what the client computes from them, each dummy's gradient clipped as the client clips (flat or per
layer, when the clipping is given) and the B averaged, and the TV term is the dummies' mean. The
labels come from the last layer (:func:`infer_labels`) or are given. A batch's reconstructions
come out in no particular order: :func:`match_batches` pairs them with the true images by a
minimum-cost assignment on MSE before scoring.

Many attacks run as one batched optimisation (``torch.func.vmap`` over updates, restarts, the
images of a batch and, if given, per-attack model parameters). The objective is a sum of
independent terms and Adam and the sign act element-wise, so this gives the same images as running
the attacks one at a time.

:class:`GradientAttack` is what the sweeps (:mod:`privleak.reproduce`, :mod:`privleak.estimation`)
take: any attack that reconstructs the B images behind each leaked update. A second attack is one
subclass with its settings as fields and a :meth:`~GradientAttack.reconstruct`;
:class:`InvertingGradients` is the first.

Scores: :func:`mse`, :func:`psnr` and :func:`ssim` (Wang et al. 2004).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from privleak import validation

if TYPE_CHECKING:
    from privleak.dpsgd import DPSGDConfig

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


def _label_evidence(model: nn.Module, leaked: Sequence[torch.Tensor], batch_size: int) -> torch.Tensor:
    """(A, classes): the per-class statistic whose most negative entries are the labels."""
    weight, bias = _last_linear(model)
    if batch_size == 1:
        return leaked[bias] if bias is not None else leaked[weight].sum(-1)
    return leaked[weight].amin(-1)


def infer_labels(model: nn.Module, leaked: Sequence[torch.Tensor], batch_size: int = 1) -> torch.Tensor:
    """The labels of each update of ``batch_size`` images, from the last linear layer.

    With softmax cross-entropy, image b adds s_b (p_bj - 1[j = y_b]) to the bias gradient b_j and
    that times its (non-negative, here sigmoid) features f_b to the weight row j, s_b > 0 its clip
    factor. So classes that are no image's label have rows and bias entries >= 0.

    - One image (Zhao et al., iDLG, 2020): the bias entry, or without a bias the weight row's sum,
      is negative at the label only; its argmin. Of the per-class statistics this one averages
      the most coordinates, so noise flips it least.
    - A batch (Yin et al., GradInversion, CVPR 2021): the B classes whose weight rows have the
      most negative entry, min_m dW[j, m]. A label's row is negative wherever its images'
      features outweigh the others' p_bj f_b; the bias, one number per class, often is not (at
      the start of training the network is confident in one class, whose bias entry the other
      images push positive). Right when the B labels are distinct and each shows
      (:func:`visible_labels` = B); a repeated label cannot be counted this way.

    Any positive scale (clipping, averaging, VMF's normalisation) leaves the result unchanged;
    noise can change it. ``leaked`` holds one tensor per trainable parameter, each with a leading
    batch-of-attacks dimension A; returns A x B labels, update a's at rows a B .. a B + B - 1, in
    increasing order.
    """
    batch_size = validation.integer(batch_size, "batch_size", low=1)
    evidence = _label_evidence(model, leaked, batch_size)
    if batch_size > evidence.shape[-1]:
        raise ValueError(f"batch_size {batch_size} exceeds the {evidence.shape[-1]} classes: the labels of a batch "
                         "can be inferred only when they are distinct")
    return evidence.topk(batch_size, -1, largest=False).indices.sort(-1).values.reshape(-1)


def visible_labels(model: nn.Module, leaked: Sequence[torch.Tensor]) -> torch.Tensor:
    """(A,): how many classes' last-layer weight rows have a negative entry, i.e. show up as some
    image's label (:func:`infer_labels`). Without noise it never counts a class that is no
    image's label, so when it equals the batch size the inferred labels are exactly the batch's."""
    weight, _ = _last_linear(model)
    return (leaked[weight].amin(-1) < 0).sum(-1)


class AttackLabels(NamedTuple):
    labels: torch.Tensor  #: (A B,): the labels the attack reconstructs with
    given: torch.Tensor  #: (A,) bool: the update did not determine them, so the true ones were given


def attack_labels(model: nn.Module, leaked: Sequence[torch.Tensor], batch_size: int,
                  true_labels: torch.Tensor) -> AttackLabels:
    """The labels an attacker works with: inferred (:func:`infer_labels`) where the update
    determines them, the true ones (side knowledge) elsewhere. One image: always inferred (iDLG
    gives a label for any update). A batch: inferred where exactly B classes are visible
    (:func:`visible_labels`), which without noise means B distinct labels, all found."""
    batch_size = validation.integer(batch_size, "batch_size", low=1)
    true_labels = torch.as_tensor(true_labels, dtype=torch.int64).reshape(-1, batch_size)
    inferred = infer_labels(model, leaked, batch_size).reshape(-1, batch_size)
    if batch_size == 1:
        given = torch.zeros(inferred.shape[0], dtype=torch.bool)
    else:
        given = visible_labels(model, leaked) != batch_size
    return AttackLabels(torch.where(given[:, None], true_labels, inferred).reshape(-1), given)


# ----------------------------------------------------------------------------- the attack


class Reconstruction(NamedTuple):
    """What an attack returns for A leaked updates of B images each."""

    images: torch.Tensor  #: (A B, C, H, W): the best restart's B images of each update, update a's at rows a B ..
    labels: torch.Tensor  #: (A B,): the label each image was reconstructed with, given or inferred
    objective: torch.Tensor  #: (A,): 1 - cosine + alpha TV of the returned images
    restart_objectives: torch.Tensor  #: (A, restarts): the same for every restart's final images
    batch_size: int = 1  #: B


class GradientAttack(ABC):
    """A reconstruction attack on leaked updates, as the sweeps use it.

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
                    batch_size: int = 1, config: Optional["DPSGDConfig"] = None,
                    generator: Optional[torch.Generator] = None,
                    progress: Optional[Callable[[int], None]] = None) -> Reconstruction:
        """``batch_size`` images per leaked update: ``leaked`` holds one (A, *p.shape) tensor per
        trainable parameter of ``model``; ``labels`` (A B,) if known, ``parameters`` per-attack
        model parameters if the updates were taken at different points of training; ``config``
        the clients' :class:`privleak.dpsgd.DPSGDConfig`, whose clipping the attack models
        (None: the update is taken to be the batch's mean gradient); ``generator`` seeds the
        attack; ``progress(done)`` is called as it goes, ``done`` up to :attr:`iterations`."""

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
                    batch_size: int = 1, config: Optional["DPSGDConfig"] = None,
                    generator: Optional[torch.Generator] = None,
                    progress: Optional[Callable[[int], None]] = None) -> Reconstruction:
        return invert_gradients(model, leaked, image_shape, labels=labels, parameters=parameters,
                                batch_size=batch_size, config=config, settings=self, generator=generator,
                                progress=progress)

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


def _clip_factors(norms: torch.Tensor, clip_norms: torch.Tensor, per_layer: bool, norm_type: int) -> torch.Tensor:
    """min(1, c / |g|) per sample (flat: one factor over all tensors) or per sample and tensor
    (per layer), differentiably, from ``norms`` (..., T): each tensor's squared L2 norm, or its L1
    norm; the rule of :func:`privleak.dpsgd.clip_and_accumulate`."""
    if not per_layer:
        norms = norms.sum(-1, keepdim=True)
    norms = norms.clamp_min(torch.finfo(norms.dtype).tiny)  # a zero gradient keeps factor 1, not NaN
    return (clip_norms / (norms.sqrt() if norm_type == 2 else norms)).clamp_max(1.0)


def invert_gradients(
    model: nn.Module,
    leaked: Sequence[torch.Tensor],
    image_shape: Sequence[int],
    *,
    labels: Optional[torch.Tensor] = None,
    parameters: Optional[Sequence[torch.Tensor]] = None,
    batch_size: int = 1,
    config: Optional["DPSGDConfig"] = None,
    settings: InvertingGradients = InvertingGradients(),
    loss_fn: Callable = F.cross_entropy,
    generator: Optional[torch.Generator] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Reconstruction:
    """Reconstruct the ``batch_size`` images behind each of A leaked updates (module docstring).

    The dummy update of B dummy images x_1 .. x_B with labels y_1 .. y_B is
    (1/B) sum_b clip(grad L(x_b, y_b)), clip as ``config`` says, and the objective per update is
    1 - cosine(dummy update, leaked update) + alpha (1/B) sum_b TV(x_b).

    Args:
        model: the architecture the clients train (the honest-but-curious server knows it).
        leaked: one tensor per trainable parameter, in ``model.parameters()`` order, each of
            shape (A, *parameter.shape): the updates to attack.
        image_shape: (C, H, W).
        labels: (A B,) or (A, B) labels if the attacker knows them (:func:`attack_labels`);
            inferred with :func:`infer_labels` otherwise.
        parameters: per-attack model parameters (A, *shape) each, if the updates were computed at
            different points of training; the model's own parameters otherwise.
        batch_size: B, the images behind each update.
        config: the :class:`privleak.dpsgd.DPSGDConfig` the clients clipped with (the server
            knows the protocol): each dummy's gradient is clipped the same way before averaging.
            A flat clip of a single image only scales the update, which the cosine ignores, so
            it is modelled only for B > 1 or per-layer clipping. None: no clipping.
        settings: iterations, restarts, step size, TV weight, pixel box.
        generator: seeds the random starting images.
        progress: called with the number of iterations done, every iteration.
    """
    from torch.func import functional_call, grad, vmap

    leaked = _per_attack(model, leaked, "leaked")
    if not bool(sum(g.double().flatten(1).pow(2).sum(1) for g in leaked).gt(0).all()):
        raise ValueError("a leaked update is zero: the cosine objective has no direction to match")
    batch_size = validation.integer(batch_size, "batch_size", low=1)
    attacks, restarts = leaked[0].shape[0], settings.restarts
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    if labels is None:
        labels = infer_labels(model, leaked, batch_size)
    labels = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
    if labels.numel() != attacks * batch_size:
        raise ValueError(f"labels holds {labels.numel()} labels for {attacks} attacks of {batch_size} images each")
    clipping = None
    if config is not None:
        from privleak import dpsgd

        config = dpsgd.config.check_config(config, len(names))
        if batch_size > 1 or config.per_layer:
            clipping = config.clipping(len(names))
            clip_norms = torch.tensor(clipping.norms, dtype=torch.float32)
            norm_type = config.mechanism.clip_norm_type
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

    # (candidates, B, *shape) per parameter: every dummy's own gradient at its update's parameters.
    gradients = vmap(vmap(gradient_of_one, in_dims=(None, 0, 0)), in_dims=(params_dim, 0, 0))
    targets = [g.repeat_interleave(restarts, 0).flatten(1) for g in leaked]
    target_norms = torch.sqrt(sum(t.double().pow(2).sum(1) for t in targets)).float()
    candidate_labels = labels.reshape(attacks, batch_size).repeat_interleave(restarts, 0)

    def dummy_updates(images):
        current = [g.flatten(2) for g in gradients(params, images, candidate_labels).values()]
        if clipping is not None:
            sizes = torch.stack([(g.pow(2) if norm_type == 2 else g.abs()).sum(-1) for g in current], -1)
            factors = _clip_factors(sizes, clip_norms, clipping.per_layer, norm_type).expand_as(sizes)
            current = [g * factors[..., t, None] for t, g in enumerate(current)]
        return [g.mean(1) for g in current]

    def objective(images):
        current = dummy_updates(images)
        dots = sum((c * t).sum(1) for c, t in zip(current, targets))
        norms = torch.sqrt(sum(c.pow(2).sum(1) for c in current))
        cosine = dots / (norms * target_norms).clamp_min(torch.finfo(torch.float32).tiny)
        prior = total_variation(images.flatten(0, 1)).reshape(images.shape[:2]).mean(1)
        return 1.0 - cosine + settings.tv_weight * prior

    low, high = settings.bounds
    start = torch.randn((attacks * restarts, batch_size, *image_shape), generator=generator)
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
    chosen = images.detach().reshape(attacks, restarts, batch_size, *image_shape)[torch.arange(attacks), best]
    return Reconstruction(chosen.flatten(0, 1), labels, final[torch.arange(attacks), best], final, batch_size)


class Matching(NamedTuple):
    """Reconstructions paired with the true images of their batches (:func:`match_batches`)."""

    order: torch.Tensor  #: (A, B): reconstruction order[a, i] of update a is paired with its true image i
    images: torch.Tensor  #: (A B, C, H, W): the reconstructions in the true images' order
    labels: torch.Tensor  #: (A B,): their labels, in the same order


def match_batches(reconstruction: Reconstruction, originals: torch.Tensor) -> Matching:
    """Pair each update's B reconstructions with its B true images (``originals``, (A B, C, H, W),
    update-major like ``reconstruction.images``) by the assignment of least total MSE (the
    Hungarian method, :func:`scipy.optimize.linear_sum_assignment`): a batch's gradient does not
    depend on the order of its images, so neither can the scores. One image per update is
    paired with itself."""
    from scipy.optimize import linear_sum_assignment

    b = reconstruction.batch_size
    _check_pair(reconstruction.images, originals)
    if originals.shape[0] % b:
        raise ValueError(f"originals holds {originals.shape[0]} images, not a whole number of batches of {b}")
    attacks = originals.shape[0] // b
    found = reconstruction.images.reshape(attacks, b, -1).double()
    truth = originals.reshape(attacks, b, -1).double()
    # cost[a, i, j]: MSE between true image i and reconstruction j of update a.
    cost = (truth.unsqueeze(2) - found.unsqueeze(1)).pow(2).mean(-1).numpy()
    order = torch.stack([torch.as_tensor(linear_sum_assignment(c)[1], dtype=torch.int64) for c in cost])
    rows = torch.arange(attacks).unsqueeze(1) * b + order
    return Matching(order, reconstruction.images[rows.reshape(-1)], reconstruction.labels[rows.reshape(-1)])


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
