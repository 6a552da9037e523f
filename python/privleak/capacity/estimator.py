"""Monte Carlo estimate of the Bayes capacity of a noise mechanism over a finite input set.

:func:`estimate` samples the mechanism's outputs from a mixture around proposal points and
averages importance weights; the noise families are :class:`GaussianNoise`, :class:`LaplaceNoise`
and :class:`VMFNoise` (named apart from the DP-SGD mechanisms of :mod:`privleak.dpsgd`).
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional

import numpy as np
from scipy.spatial.distance import cdist
from scipy.special import ndtri

from privleak import validation
from privleak._backend import num_threads

# A noise family gives log f(x)(y) = log Z + e(x, y), with the normaliser Z the same for every
# input, so that sup_x f(x)(y) / q(y) for a mixture q of the family depends on exponents only.
# Each family has: `metric`, the privleak.nearest reduction whose value v gives the sup of e;
# `exponent(v, out=None)`, that sup (into `out` where given); `pairwise_exponents(outputs,
# inputs)`, e for all pairs (float64, for the mixture, in place of the distances);
# `sample(means, rng)`, one output drawn around each row of `means`.


@dataclass(frozen=True)
class GaussianNoise:
    """Gaussian noise for :func:`estimate`: y = x + N(0, noise_std^2 I), e(x, y) = -||x - y||^2 / (2 noise_std^2)."""

    noise_std: float
    metric: ClassVar[str] = "squared_l2"

    def __post_init__(self) -> None:
        validation.positive(self.noise_std, "noise_std")

    def exponent(self, squared_distances: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return np.divide(squared_distances, -(2.0 * self.noise_std**2), out=out)

    def pairwise_exponents(self, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        distances = cdist(outputs, inputs, "sqeuclidean")
        return self.exponent(distances, out=distances)

    def sample(self, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return means + self.noise_std * rng.standard_normal(means.shape)


@dataclass(frozen=True)
class LaplaceNoise:
    """Laplace noise for :func:`estimate`: y = x + Lap(scale)^p, e(x, y) = -||x - y||_1 / scale."""

    scale: float
    metric: ClassVar[str] = "l1"

    def __post_init__(self) -> None:
        validation.positive(self.scale, "scale")

    def exponent(self, l1_distances: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return np.divide(l1_distances, -self.scale, out=out)

    def pairwise_exponents(self, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        distances = cdist(outputs, inputs, "cityblock")
        return self.exponent(distances, out=distances)

    def sample(self, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return means + rng.laplace(0.0, self.scale, means.shape)


@dataclass(frozen=True)
class VMFNoise:
    """VMF noise for :func:`estimate`: y ~ VMF(mean = x, kappa) on S^{p-1}, e(x, y) = kappa <x, y>.

    Inputs must be unit vectors. Sampling uses :func:`privleak.mechanisms.vmf_sample` and so
    needs torch.
    """

    kappa: float
    metric: ClassVar[str] = "inner_product"

    def __post_init__(self) -> None:
        validation.positive(self.kappa, "kappa")

    def exponent(self, inner_products: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return np.multiply(self.kappa, inner_products, out=out)

    def pairwise_exponents(self, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        products = outputs @ inputs.T
        return self.exponent(products, out=products)

    def sample(self, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Draws around e_1 in one call, then maps e_1 to each mean by an orthogonal reflection
        (VMF is invariant under them): H = I - 2 u u^T / u^T u with u = e_1 - x, or -H with
        u = e_1 + x when x_1 > 0, so that u^T u >= 2 and nothing cancels."""
        import torch

        from privleak.mechanisms import vmf_sample

        n, p = means.shape
        pole = torch.zeros(p, dtype=torch.float64)
        pole[0] = 1.0
        draws = vmf_sample(pole, self.kappa, n, key=int(rng.integers(2**63))).numpy()
        flip = means[:, 0] > 0
        u = np.where(flip[:, None], means, -means)
        u[:, 0] += 1.0
        reflected = draws - (2.0 * np.einsum("ij,ij->i", u, draws) / np.einsum("ij,ij->i", u, u))[:, None] * u
        return np.where(flip[:, None], -reflected, reflected)


NoiseFamily = (GaussianNoise, LaplaceNoise, VMFNoise)


class CapacityEstimate(NamedTuple):
    """A Monte Carlo estimate of a Bayes capacity C, with a confidence interval, in nats and bits."""

    log: float  #: estimate of log C
    bits: float  #: estimate of log2 C
    log_interval: tuple[float, float]  #: confidence interval for log C
    bits_interval: tuple[float, float]  #: the same interval in bits
    std_error: float  #: standard error of the estimate of log C (delta method)
    n_samples: int


def _bounded_weights_interval(top: float, mean: float, spread: float, n: int, inputs: int,
                              level: float) -> tuple[float, float]:
    """The empirical Bernstein interval for log C from n weights in [1, N] (N = ``inputs``) whose
    values are exp(top) times the ones of sample mean ``mean`` and sd ``spread`` (:func:`estimate`)."""
    log_term = math.log(4.0 / (1.0 - level))
    scale = math.exp(top)
    bound = math.sqrt(2.0 * log_term / n) * spread * scale + 7.0 * (inputs - 1) * log_term / (3.0 * (n - 1))
    centre = mean * scale
    return math.log(max(1.0, centre - bound)), math.log(min(float(inputs), centre + bound))


def estimate(
    mechanism: GaussianNoise | LaplaceNoise | VMFNoise,
    inputs: Any,
    n_samples: int = 10_000,
    *,
    proposal: Any = None,
    seed: Optional[int] = None,
    confidence: float = 0.95,
    batch_size: int = 4096,
    interval: str = "delta",
) -> CapacityEstimate:
    """Bayes capacity of ``mechanism`` over the finite input set ``inputs``, by importance sampling.

    The capacity ([004] Biswas et al., Def. III.1) of a mechanism f over inputs x_1 .. x_N is

        C = integral over y of max_i f(x_i)(y) dy = E_{y ~ q}[w(y)],  w(y) = max_i f(x_i)(y) / q(y)

    for any density q that is positive wherever some f(x_i) is. The proposal q is the mixture
    (1/M) sum_m f(z_m) over proposal points z_1 .. z_M, by default the inputs themselves: a
    sample picks m uniformly and draws y ~ f(z_m). With z = x the weights are bounded,
    1 <= w <= N (the max is at least the mean and at most N times it), so the variance is finite
    and the interval below is reliable. With the shared normaliser cancelled,

        log w(y) = max_i e(x_i, y) - log((1/M) sum_m exp(e(z_m, y)))

    where the mixture is a logsumexp over the M proposal points (scipy's cdist or a matrix product,
    in float64, in chunks), and the max over the N inputs is the mixture's largest exponent when
    the proposal points are the inputs (the default), else :func:`privleak.nearest` (min
    ||x - y||^2, max <x, y>, min ||x - y||_1 for Gaussian, VMF, Laplace).

    The estimate is log mean(w) = logsumexp(log w) - log n, with a confidence interval from the
    delta method: log C is approximately normal with standard error sd(w) / (mean(w) sqrt(n)).
    The delta method needs the sample variance to be near the true one. When the inputs' noise
    overlaps only where the n draws rarely land (inputs many noise widths apart), every weight
    can be the same to rounding and its interval far too narrow: at 99% it missed log C in 93 of
    100 seeds for two points 1.24 apart with noise std 0.133 and n = 4000. ``interval=
    "bernstein"`` gives instead the empirical Bernstein interval of the weights' mean, which
    holds for every n (Maurer and Pontil 2009, Thm. 4, both sides; the default proposal's
    weights lie in [1, N]):

        |mean(w) - C| <= sqrt(2 V ln(4 / alpha) / n) + 7 (N - 1) ln(4 / alpha) / (3 (n - 1)),

    V the sample variance and alpha = 1 - confidence, clipped to [1, N]. Its second term grows
    with N: it suits a few inputs (the case above: 0 misses in 100 seeds), and is loose for many.

    Cost: n_samples x (N + M) x p for the kernel and the mixture, on privleak's threads
    (:func:`privleak.set_num_threads`; the estimate does not depend on them). For a huge input set, pass a
    smaller ``proposal`` (e.g. a random subset of the inputs): the estimate stays unbiased for
    any proposal points (the families have full support), but the weights are no longer
    bounded and the interval needs more samples to be trusted.

    Args:
        mechanism: :class:`GaussianNoise`, :class:`VMFNoise` or :class:`LaplaceNoise`.
        inputs: (N, p) array of the inputs (float32 is kept for the kernel; other dtypes become
            float64). For VMF the rows must be unit vectors.
        n_samples: number of outputs y drawn, >= 2.
        proposal: (M, p) proposal points, default ``inputs``.
        seed: seed of numpy's generator (and of the VMF sampler's key); the same seed gives the
            same estimate.
        confidence: level of the interval, in (0, 1).
        batch_size: outputs drawn and reduced at a time (bounds memory).
        interval: "delta" (the delta method) or "bernstein" (empirical Bernstein, for the
            default proposal only).

    Returns:
        :class:`CapacityEstimate`.
    """
    if not isinstance(mechanism, NoiseFamily):
        raise TypeError(f"mechanism must be GaussianNoise, VMFNoise or LaplaceNoise, got {type(mechanism).__name__}")
    points = _check_points(inputs, "inputs", mechanism)
    centres = points if proposal is None else _check_points(proposal, "proposal", mechanism)
    if centres.shape[1] != points.shape[1]:
        raise ValueError(f"proposal must have {points.shape[1]} columns like inputs, got {centres.shape[1]}")
    n = validation.dimension(n_samples, "n_samples")
    if n < 2:
        raise ValueError(f"n_samples must be >= 2 (the interval needs a variance), got {n_samples!r}")
    batch = validation.dimension(batch_size, "batch_size")
    level = validation.confidence_level(confidence, "confidence")
    method = validation.choice(interval, "interval", ("delta", "bernstein"))
    if method == "bernstein" and proposal is not None:
        raise ValueError("interval='bernstein' needs the default proposal (the inputs), whose weights lie in [1, N]; "
                         "with other proposal points they are unbounded")

    from privleak.reductions import nearest

    rng = np.random.default_rng(None if seed is None else validation.integer(seed, "seed", low=0))
    centres64 = centres.astype(np.float64)
    chunk = max(1, 2**22 // batch)  # proposal points per logsumexp step: about 4M exponents
    log_weights = []
    with ThreadPoolExecutor(num_threads()) as pool:
        for start in range(0, n, batch):
            count = min(batch, n - start)
            outputs = mechanism.sample(centres64[rng.integers(len(centres), size=count)], rng).astype(points.dtype)
            outputs64 = outputs.astype(np.float64)
            # The outputs' rows are independent: each thread takes a slice of them (scipy's cdist
            # and numpy's ufuncs let go of the GIL), and the bits do not depend on the threads.
            bounds = np.linspace(0, count, min(num_threads(), count) + 1).astype(int)
            parts = list(pool.map(functools.partial(_mixture, mechanism, centres=centres64, chunk=chunk),
                                  [outputs64[a:b] for a, b in zip(bounds[:-1], bounds[1:])]))
            top, log_sum = (np.concatenate(column) for column in zip(*parts))
            if proposal is None:  # the proposal points are the inputs: the sup is the top exponent itself
                sup_minus_top = 0.0
            else:
                sup_minus_top = mechanism.exponent(nearest(outputs, points, mechanism.metric).value) - top
            log_weights.append(sup_minus_top - log_sum + math.log(len(centres)))
    log_w = np.concatenate(log_weights)

    top = float(log_w.max())
    weights = np.exp(log_w - top)  # in (0, 1]: the mean and sd are taken without overflow
    mean = float(weights.mean())
    log_c = top + math.log(mean)
    spread = float(weights.std(ddof=1))
    std_error = spread / (mean * math.sqrt(n))
    half_width = float(ndtri(0.5 + level / 2.0)) * std_error
    bounds = (log_c - half_width, log_c + half_width)
    if method == "bernstein" and len(points) > 1:
        bounds = _bounded_weights_interval(top, mean, spread, n, len(points), level)
    return CapacityEstimate(log_c, log_c / math.log(2.0), bounds,
                            (bounds[0] / math.log(2.0), bounds[1] / math.log(2.0)), std_error, n)


def _mixture(mechanism: Any, outputs: np.ndarray, centres: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(top, log_sum) per row of ``outputs`` (float64): the mixture's log sum_m exp(e(z_m, y)) as
    top + log_sum, top the largest exponent, over ``chunk`` proposal points at a time. Kept apart,
    log w = (sup - top) - log_sum + log M never subtracts two huge exponents: at kappa = 1e200
    both are about 1e200 and their difference would round away."""
    top = np.full(len(outputs), -np.inf)
    log_sum = np.full(len(outputs), -np.inf)
    for first in range(0, len(centres), chunk):
        exponents = mechanism.pairwise_exponents(outputs, centres[first:first + chunk])
        new_top = np.maximum(top, exponents.max(axis=1))
        # exp(e - top) in place, each <= 1: scipy's logsumexp shifts by its own max again, and
        # took 17 of the 29 s of docs/capacity.md's example (20x numpy's exp and sum here). A
        # chunk whose terms all underflow beside the top adds log 0 = -inf, which is their value.
        exponents -= new_top[:, None]
        np.exp(exponents, out=exponents)
        with np.errstate(divide="ignore"):
            log_sum = np.logaddexp(log_sum + (top - new_top), np.log(exponents.sum(axis=1)))
        top = new_top
    return top, log_sum


def _check_points(points: Any, name: str, mechanism: Any) -> np.ndarray:
    """A finite (N, p) float array, N, p >= 1; float32 stays float32, anything else becomes float64."""
    try:
        array = np.asarray(points)
    except Exception as exc:  # e.g. a CUDA tensor
        raise TypeError(f"{name} must be convertible to a numpy array: {exc}") from exc
    if array.dtype not in (np.float32, np.float64):
        if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
            raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
        array = array.astype(np.float64)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"{name} must be a non-empty 2-D array (points x coordinates), got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite")
    if isinstance(mechanism, VMFNoise):
        if array.shape[1] < 2:
            raise ValueError(f"{name} must have p >= 2 columns for VMF (points on S^(p-1)), got {array.shape[1]}")
        norms = np.linalg.norm(array.astype(np.float64), axis=1)
        tolerance = 1e-5 if array.dtype == np.float32 else 1e-12
        if np.abs(norms - 1.0).max() > tolerance:
            raise ValueError(f"{name} must be unit vectors for VMF "
                             f"(norms range from {norms.min():.6g} to {norms.max():.6g})")
    return np.ascontiguousarray(array)
