"""Bayes capacity of continuous mechanisms in closed form, in log space.

For a mechanism f from inputs X to densities on outputs Y, the continuous Bayes capacity is

    C_Bayes(f) = integral over y of sup_{x in X} f(x)(y) dy            ([004] Def. III.1, Eq. 4)

the largest multiplicative leakage of f to any Bayesian adversary; its log is Sibson's mutual
information of order infinity. For DP-SGD gradients (p = 10^3 to 10^9 coordinates) it is far
beyond float64 (e^(10^8) is common), so every function here returns a :class:`LogCapacity`
(natural log and bits) and never the capacity itself.

What is here, and where it differs from [004] (Biswas et al., *Bayes' capacity as a measure for
reconstruction attacks in federated learning*):

- Gaussian mechanism over an L2 ball (Thm III.1): the theorem's second term is twice the truth
  (its value at radius 0 is 2, but a mechanism with a single input has capacity 1); see
  :func:`gaussian_ball_log_capacity`.
- Gaussian mechanism over a product of balls (per-layer clipping): the exact capacity is the
  product of the blocks' capacities. [004] instead plugs "R = number of layers, each clipped to
  1" into Thm III.1, a ball that contains the product and gives a larger, loose value; see
  :func:`gaussian_product_of_balls_log_capacity`.
- VMF mechanism on the sphere (Thm IV.1): correct as stated; see :func:`vmf_log_capacity`.
- DP-SGD (Alg. 1 and 2): the theorems leave out the batch size. The noise of Alg. 1 has standard
  deviation c sigma / L around an average that can be anywhere in the ball of radius c, so the
  capacity depends on L / sigma (not on c); see :func:`dpsgd_gaussian`.

For any other input set given as a finite (possibly huge) set of points, :func:`estimate` gives a
Monte Carlo estimate with a confidence interval, for Gaussian, VMF and Laplace noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import numpy as np
from scipy.spatial.distance import cdist
from scipy.special import gammaln, logsumexp, ndtri, roots_legendre

from privleak import validation
from privleak.special import log_bessel_iv_normalised, log_bessel_ive, log_gamma_stirling_remainder

# The finite sum has p + 1 terms; beyond this it is slow and no more exact than the quadrature.
GAUSSIAN_SUM_MAX_DIM = 10**6

# Quadrature of the radial integral: 8 Gauss-Legendre panels of 20 nodes over a window of half
# width 10 (in units of the noise) around the integrand's peak; see _gaussian_tail_log_integral.
_WINDOW_HALF_WIDTH = 10.0
_PANELS = 8
_NODES, _WEIGHTS = roots_legendre(20)


class LogCapacity(NamedTuple):
    """A Bayes capacity C as its natural log (``log``, nats) and base-2 log (``bits``)."""

    log: float
    bits: float

    @classmethod
    def from_log(cls, log: float) -> "LogCapacity":
        return cls(float(log), float(log) / math.log(2.0))


# --- Gaussian mechanism ----------------------------------------------------------------------


def gaussian_ball_log_capacity(dim: int, radius: float, noise_std: float, *, method: str = "auto") -> LogCapacity:
    """Bayes capacity of y = x + N(0, noise_std^2 I_p) with x anywhere in the L2 ball of ``radius`` in R^p.

    Derivation. The density at y is largest for the input nearest to y, at distance
    max(0, ||y|| - R), so with rho = R / noise_std and t = ||y|| / noise_std (chi_p radial
    coordinates, |S^{p-1}| = 2 pi^(p/2) / Gamma(p/2)):

        C = int_0^inf t^(p-1) exp(-max(0, t - rho)^2 / 2) dt / int_0^inf t^(p-1) exp(-t^2 / 2) dt
          = rho^p / (2^(p/2) Gamma(p/2 + 1))                                        (y in the ball)
            + sum_{i=0}^{p-1} binom(p-1, i) rho^i Gamma((p-i)/2) 2^(-i/2) / Gamma(p/2)  (outside)

    It depends on R and noise_std only through rho, is 1 at rho = 0, and equals
    E[exp((T^2 - max(0, T - rho)^2) / 2)] for T ~ chi_p, about exp(rho sqrt(p) - rho^2/4) for
    1 << rho << sqrt(p).

    Where [004] differs. Thm III.1 states (with sigma = noise_std, Z its binomial sum)
    C = 2 Z / (Gamma(p/2) 2^(p/2) sigma^p) + R^p / (Gamma(p/2 + 1) 2^(p/2) sigma^p).
    Its proof finds int_0^inf (s + R)^(p-1) exp(-s^2 / (2 sigma^2)) ds = Z / 2 and the factor
    |S^{p-1}| (2 pi sigma^2)^(-p/2) = 2 / (Gamma(p/2) 2^(p/2) sigma^p), whose product has no
    leading 2: the theorem double-counts the outside-the-ball part. At R = 0 it gives 2 instead
    of 1, and for p = 1, R = sigma it gives 2.798 where direct integration gives 1.798 (tests).
    The proof also writes the density's constant as 1/sqrt(2 pi sigma^2), the p = 1 value, where
    (2 pi sigma^2)^(-p/2) is meant.

    Methods: ``"sum"``, the finite sum above in log space (logsumexp over p + 1 terms; exact but
    O(p), allowed up to p = 10^6, and its log Gamma terms of size p log p cost about
    1e-16 p log p of absolute accuracy); ``"quadrature"``, the radial integral by Gauss-Legendre
    quadrature around its peak, normalised by the chi_p density at its mode so that nothing of
    size p log p cancels: constant cost for any p, absolute error of the log about
    1e-16 * (|log C| + 10 sqrt(p)), i.e. a relative error of C below 1e-11 even at p = 10^9
    (see :func:`_gaussian_tail_log_integral`). ``"auto"`` is the
    quadrature. The tests check both against mpmath and direct integration, and each other.

    Raises ValueError naming the argument for dim < 1 or not an integer, radius < 0,
    noise_std <= 0, or anything non-finite.
    """
    p = validation.dimension(dim, "dim")
    radius = validation.non_negative(radius, "radius")
    noise_std = validation.positive(noise_std, "noise_std")
    validation.choice(method, "method", ("auto", "sum", "quadrature"))
    if radius == 0.0:
        return LogCapacity.from_log(0.0)
    # rho = radius / noise_std can overflow (1e300 / 1e-300) or underflow: carry its log.
    return LogCapacity.from_log(_gaussian_ball_log_capacity(p, math.log(radius) - math.log(noise_std), method))


def _gaussian_ball_log_capacity(p: int, log_rho: float, method: str) -> float:
    """log C for rho = e^log_rho > 0, at every rho a float64 log can describe.

    - rho > e^600: the tail part is p sqrt(pi/2) / rho (< 1e-240) times the in-ball part, so
      log C = p log rho - (p/2) log 2 - log Gamma(p/2 + 1) + log1p(p sqrt(pi/2) / rho), exactly to
      float64, with no rho^2 formed.
    - rho < 1e-5: the cumulant series of :func:`_gaussian_small_rho_log_capacity` (relative error
      below 1e-14), where the quadrature's absolute error of 1e-16 would be a large relative one.
    - otherwise ``method``.
    """
    if log_rho > _HUGE_LOG_RHO:
        log_inside = p * log_rho - 0.5 * p * math.log(2.0) - float(gammaln(p / 2.0 + 1.0))
        return log_inside + math.log1p(p * math.sqrt(0.5 * math.pi) * math.exp(-log_rho))
    rho = math.exp(log_rho)
    if rho < _SMALL_RHO:
        return _gaussian_small_rho_log_capacity(p, rho)
    if method == "sum":
        return _gaussian_ball_log_capacity_sum(p, rho)
    return _gaussian_ball_log_capacity_quadrature(p, rho)


# Beyond these, gaussian_ball_log_capacity leaves the quadrature (see _gaussian_ball_log_capacity).
_HUGE_LOG_RHO = 600.0
_SMALL_RHO = 1e-5


def _chi_mean_and_variance(p: int) -> tuple[float, float]:
    """Mean mu = sqrt(2) Gamma((p+1)/2) / Gamma(p/2) and variance p - mu^2 of the chi_p distribution.

    With x = p/2 and r = Gamma(x + 1/2) / (Gamma(x) sqrt(x)), mu = sqrt(p) r and the variance is
    -p (r - 1)(r + 1); for x >= 100, r - 1 comes from its asymptotic series (error < 1e-14 relative
    at x = 100, shrinking as x^-7) so that nothing cancels, below from math.gamma.
    """
    x = p / 2.0
    if x >= 100.0:
        r_minus_1 = (-1.0 / 8.0 + (1.0 / 128.0 + (5.0 / 1024.0 + (-21.0 / 32768.0 + (-399.0 / 262144.0
                                                                                     + 869.0 / 4194304.0 / x)
                                                                  / x) / x) / x) / x) / x
    else:
        r_minus_1 = math.gamma(x + 0.5) / (math.gamma(x) * math.sqrt(x)) - 1.0
    r = 1.0 + r_minus_1
    return math.sqrt(p) * r, -p * r_minus_1 * (r + 1.0)


def _gaussian_small_rho_log_capacity(p: int, rho: float) -> float:
    """log C for small rho from the cumulants of T ~ chi_p.

    Outside the ball the exponent (T^2 - (T - rho)^2) / 2 is rho T - rho^2 / 2, so
    C = E[exp(rho T)] e^(-rho^2/2) + (inside-the-ball correction) and
    log C = mu rho + (k2 - 1) rho^2 / 2 + k3 rho^3 / 6 + O(rho^4), k2 = Var T, k3 = mu (1 - 2 k2) the
    third cumulant of chi_p. The correction E[(e^(T^2/2) - e^(rho T - rho^2/2)) 1{T < rho}] is
    sqrt(2/pi) rho^3 / 6 for p = 1 and O(rho^4) beyond. Checked against mpmath in the tests.
    """
    mu, variance = _chi_mean_and_variance(p)
    third = mu * (1.0 - 2.0 * variance) + (math.sqrt(2.0 / math.pi) if p == 1 else 0.0)
    return rho * (mu + rho * (0.5 * (variance - 1.0) + rho * third / 6.0))


def gaussian_product_of_balls_log_capacity(
    dims: Sequence[int], radii: Sequence[float], noise_std: float, *, method: str = "auto"
) -> LogCapacity:
    """Bayes capacity of y = x + N(0, noise_std^2 I) with x in B_{R_1}^{p_1} x ... x B_{R_k}^{p_k}.

    This is the input set of per-layer clipping: block l (p_l coordinates) has L2 norm at most
    R_l. The isotropic Gaussian density is a product over blocks, and so is the input set, so
    the sup over inputs is the product of the blocks' sups and the integral over y factorises:

        log C = sum_l log C_Gauss(p_l, R_l, noise_std)        (exact; tests check it by integration)

    It is at most the capacity of the ball of radius sqrt(sum_l R_l^2) in sum_l p_l dimensions,
    the smallest ball holding the product (flat clipping at that norm), and usually much less.
    [004] models k layers clipped to 1 each as the ball of radius k in Thm III.1, larger still:
    for 2 layers of 1 coordinate, clipped to 1, with noise_std 1, the product (a square) gives
    log C = 1.1732, the ball of radius sqrt(2) 1.3277, and the ball of radius 2 (the paper's
    model, with the theorem corrected) 1.7060.
    """
    dims, radii = list(dims), list(radii)
    if len(dims) != len(radii) or not dims:
        raise ValueError(f"dims and radii must be non-empty and of equal length, got {len(dims)} and {len(radii)}")
    total = sum(
        gaussian_ball_log_capacity(
            validation.dimension(d, f"dims[{i}]"), validation.non_negative(r, f"radii[{i}]"), noise_std, method=method
        ).log
        for i, (d, r) in enumerate(zip(dims, radii))
    )
    return LogCapacity.from_log(total)


def _gaussian_ball_log_capacity_sum(p: int, rho: float) -> float:
    if p > GAUSSIAN_SUM_MAX_DIM:
        raise ValueError(
            f"method='sum' costs O(dim); dim must be <= {GAUSSIAN_SUM_MAX_DIM}, got {p} (use 'quadrature')"
        )
    i = np.arange(p, dtype=np.float64)
    log_binomial = gammaln(p) - gammaln(i + 1.0) - gammaln(p - i)
    outside = log_binomial + i * (math.log(rho) - 0.5 * math.log(2.0)) + gammaln((p - i) / 2.0) - gammaln(p / 2.0)
    inside = p * (math.log(rho) - 0.5 * math.log(2.0)) - gammaln(p / 2.0 + 1.0)
    return float(logsumexp(np.append(outside, inside)))


def _gaussian_ball_log_capacity_quadrature(p: int, rho: float) -> float:
    # Both parts of C = (ball + tail) / J_0, J_0 = int_0^inf t^(p-1) e^(-t^2/2) dt = 2^(p/2-1) Gamma(p/2):
    # inside the ball, int_0^rho t^(p-1) dt = rho^p / p exactly.
    log_inside = p * math.log(rho) - 0.5 * p * math.log(2.0) - float(gammaln(p / 2.0 + 1.0))
    return float(np.logaddexp(log_inside, _gaussian_tail_log_integral(p, rho)))


def _gaussian_tail_log_integral(p: int, rho: float) -> float:
    """log(int_0^inf (u + rho)^(p-1) exp(-u^2/2) du / J_0), by quadrature at any p.

    The log integrand l(u) = (p-1) log(u + rho) - u^2/2 is concave with l'' <= -1, peaked at
    u* = 2 (p-1) / (rho + sqrt(rho^2 + 4 (p-1))) (t* = u* + rho). So outside u* +- 10 the
    integrand is below e^(-50) of its peak, and the tails add less than 1e-22 relative: the
    window [max(0, u* - 10), u* + 10] has the same width at every p, and 8 Gauss-Legendre
    panels of 20 nodes integrate exp(l(u) - l(u*)) (a polynomial times a Gaussian, entire) there
    to about 1e-16. l(u) - l(u*) = (p-1) log1p((u - u*) / t*) - (u - u*)(u + u*)/2 has no
    cancellation.

    The peak value is taken relative to the chi_p density at its mode m = sqrt(p-1),
    log f(m) = (p-1) log m - m^2/2 - log J_0:
    l(u*) - log J_0 = log f(m) + (p-1) log(t*/m) + (m - u*)(m + u*)/2, with t* - m and m - u*
    written without subtraction, and log f(m) = 1/2 - log(pi)/2 - s(p/2) + (p/2 - 1/2) log1p(-1/p)
    through the Stirling remainder s of log Gamma. Then no term of size p log p is ever formed
    and the result keeps relative accuracy at p = 10^9.
    """
    m = math.sqrt(p - 1.0)
    root = math.hypot(rho, 2.0 * m)  # sqrt(rho^2 + 4 (p - 1)) without forming rho^2
    peak_u = 2.0 * (p - 1.0) / (rho + root)
    peak_t = peak_u + rho
    if p == 1:
        log_peak = 0.5 * math.log(2.0 / math.pi)  # u* = 0: the half-normal density at its mode 0
    else:
        n = p / 2.0
        log_mode_density = (
            0.5 - 0.5 * math.log(math.pi) - float(log_gamma_stirling_remainder(n)) + (n - 0.5) * math.log1p(-0.5 / n)
        )
        peak_t_minus_m = 0.5 * (rho + rho * (rho / (root + 2.0 * m)))
        m_minus_peak_u = 0.5 * rho * (4.0 * m * m / (root + rho) + 2.0 * m) / (root + 2.0 * m)
        log_peak = log_mode_density + (p - 1.0) * math.log1p(peak_t_minus_m / m) + 0.5 * m_minus_peak_u * (m + peak_u)

    edges = np.linspace(max(0.0, peak_u - _WINDOW_HALF_WIDTH), peak_u + _WINDOW_HALF_WIDTH, _PANELS + 1)
    half_widths = 0.5 * np.diff(edges)
    u = (0.5 * (edges[:-1] + edges[1:]))[:, None] + half_widths[:, None] * _NODES[None, :]
    offset = u - peak_u
    log_ratio = (p - 1.0) * np.log1p(offset / peak_t) - 0.5 * offset * (u + peak_u)
    integral = float(np.sum(half_widths[:, None] * _WEIGHTS[None, :] * np.exp(log_ratio)))
    return log_peak + math.log(integral)


# --- VMF mechanism ---------------------------------------------------------------------------


def vmf_log_capacity(dim: int, kappa: float) -> LogCapacity:
    """Bayes capacity of the VMF mechanism on S^{p-1} with concentration kappa ([004] Thm IV.1).

    Each input x (a unit vector) gives the density C_p(kappa) exp(kappa x.y) on the sphere; its
    sup over x is at x = y, the constant C_p(kappa) e^kappa, so

        C = |S^{p-1}| C_p(kappa) e^kappa = 2 kappa^(p/2-1) e^kappa / (Gamma(p/2) 2^(p/2) I_{p/2-1}(kappa))
          = e^kappa / 0F1(; p/2; kappa^2/4)

    which is Thm IV.1 (checked here by integration on S^1 and S^2 and by mpmath for larger p).
    It is 1 as kappa -> 0 and grows like kappa^(p/2-1/2) for kappa >> p. With nu = p/2 - 1 it is
    computed as kappa - log 0F1 (:func:`privleak.special.log_bessel_iv_normalised`) for
    kappa <= nu and as nu log(kappa/2) - log Gamma(nu + 1) - log(e^-kappa I_nu(kappa)) above,
    the forms in which nothing of the size of kappa cancels.

    Needs p >= 2 (S^0 is two points, not the VMF mechanism's domain) and kappa > 0; raises
    ValueError naming the argument otherwise.
    """
    p = validation.dimension(dim, "dim")
    if p < 2:
        raise ValueError(f"dim must be >= 2 for the VMF mechanism on S^(dim-1), got {dim!r}")
    kappa = validation.positive(kappa, "kappa")
    nu = p / 2.0 - 1.0
    if kappa <= nu:
        log_capacity = kappa - float(log_bessel_iv_normalised(nu, kappa))
    else:
        log_leading = 0.0 if nu == 0.0 else (
            # nu log(kappa/2) - log Gamma(nu + 1), through Stirling so that nu log nu cancels exactly.
            nu * (math.log(kappa / (2.0 * nu)) + 1.0)
            - 0.5 * math.log(2.0 * math.pi * nu)
            - float(log_gamma_stirling_remainder(nu))
        )
        log_capacity = log_leading - float(log_bessel_ive(nu, kappa))
    return LogCapacity.from_log(log_capacity)


# --- DP-SGD ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GaussianMechanism:
    """y = x + N(0, noise_std^2 I) with x in the product of L2 balls B_{radii[l]}^{dims[l]}.

    One block is a single ball (flat clipping); several blocks, per-layer clipping.
    """

    dims: tuple[int, ...]
    radii: tuple[float, ...]
    noise_std: float

    def log_capacity(self, *, method: str = "auto") -> LogCapacity:
        """Exact Bayes capacity (:func:`gaussian_product_of_balls_log_capacity`)."""
        return gaussian_product_of_balls_log_capacity(self.dims, self.radii, self.noise_std, method=method)


@dataclass(frozen=True)
class VMFMechanism:
    """y ~ VMF(mean = x, kappa) on S^{dim-1}, with x anywhere on the sphere."""

    dim: int
    kappa: float

    def log_capacity(self) -> LogCapacity:
        """Exact Bayes capacity (:func:`vmf_log_capacity`)."""
        return vmf_log_capacity(self.dim, self.kappa)


def dpsgd_gaussian(dim: int, clip_norm: float, noise_multiplier: float, batch_size: int) -> GaussianMechanism:
    """The channel of one step of DP-SGD with flat clipping ([004] Alg. 1), as a Gaussian mechanism.

    Alg. 1 clips each of L per-sample gradients to L2 norm c, averages them and adds
    N(0, c^2 sigma^2 I) / L; the leaked vector is that noisy average. As in [004] Sec. II (Lemma
    II.1), the secret is the batch and the map from batch to average is taken to be injective,
    so the capacity is that of the noise channel over the set of possible averages: the
    average of L vectors of norm <= c is any vector of norm <= c (the ball is convex), and the
    noise has standard deviation c sigma / L. Hence radius c, noise_std c sigma / L, and a
    capacity that depends only on (p, L / sigma). If the reachable averages are a subset of the
    ball, the true capacity is at most this. [004] Thm III.1 sets c = 1 and writes sigma for the
    noise scale, leaving out the 1/L. With Poisson subsampling at expected batch size L
    (Opacus), the B gradients actually drawn are summed, noised with N(0, c^2 sigma^2 I) and
    divided by L: given B, that is a ball of radius c B / L with the same noise, i.e. this
    mechanism with batch_size = B.
    """
    p = validation.dimension(dim, "dim")
    c = validation.positive(clip_norm, "clip_norm")
    sigma = validation.positive(noise_multiplier, "noise_multiplier")
    noise_std = _dpsgd_noise_std(c, sigma, validation.dimension(batch_size, "batch_size"), "clip_norm")
    return GaussianMechanism((p,), (c,), noise_std)


def _dpsgd_noise_std(sensitivity: float, sigma: float, batch_size: int, norm_name: str) -> float:
    """sensitivity * sigma / batch_size, refused where it leaves the normal float64 range (a
    subnormal or zero noise_std would make the capacity's rho wrong or infinite)."""
    log_std = math.log(sensitivity) + math.log(sigma) - math.log(batch_size)
    if not math.log(2.0**-1022) <= log_std <= math.log(1.7e308):
        raise ValueError(f"noise_multiplier: the noise std {norm_name} * noise_multiplier / batch_size = "
                         f"e^{log_std:.6g} is outside float64's normal range [2.2e-308, 1.7e308]; rescale "
                         "clip_norm (the capacity depends on batch_size / noise_multiplier only)")
    return sensitivity * sigma / batch_size


def dpsgd_gaussian_per_layer(
    layer_dims: Sequence[int], clip_norms: Sequence[float], noise_multiplier: float, batch_size: int
) -> GaussianMechanism:
    """One step of DP-SGD with per-layer clipping, as a Gaussian mechanism over a product of balls.

    Layer l (p_l coordinates) of each per-sample gradient is clipped to norm c_l, so the batch
    average lies in B_{c_1}^{p_1} x ... x B_{c_k}^{p_k} and fills it. The noise follows Opacus's
    per-layer convention: the clipped gradient as a whole has sensitivity ||c||_2 =
    sqrt(sum_l c_l^2), and N(0, sigma^2 ||c||_2^2 I) / L is added to the average. The capacity
    (:meth:`GaussianMechanism.log_capacity`) is exact and is the sum of the layers' log
    capacities; it is smaller than that of flat clipping at ||c||_2 with the same noise.
    """
    dims = tuple(validation.dimension(d, f"layer_dims[{i}]") for i, d in enumerate(layer_dims))
    norms = tuple(validation.positive(c, f"clip_norms[{i}]") for i, c in enumerate(clip_norms))
    if len(dims) != len(norms) or not dims:
        raise ValueError(
            f"layer_dims and clip_norms must be non-empty and of equal length, got {len(dims)} and {len(norms)}"
        )
    sigma = validation.positive(noise_multiplier, "noise_multiplier")
    batch_size = validation.dimension(batch_size, "batch_size")
    noise_std = _dpsgd_noise_std(math.hypot(*norms), sigma, batch_size, "clip_norms")
    return GaussianMechanism(dims, norms, noise_std)


def dpsgd_vmf(dim: int, kappa: float) -> VMFMechanism:
    """One step of DP-SGD with VMF noise ([004] Alg. 2), as a VMF mechanism on S^{dim-1}.

    Alg. 2 clips, averages and scales the average to unit length, then draws from
    VMF(mean = that direction, kappa) (the algorithm passes its "sigma" as kappa). The
    normalised average can be any unit vector whatever c, L or per-layer clipping, so the input
    set is the whole sphere and the capacity depends on (p, kappa) only. An all-zero average has
    no direction; Alg. 2 leaves that case undefined and so does this model.
    """
    return VMFMechanism(validation.dimension(dim, "dim"), validation.positive(kappa, "kappa"))


# --- Monte Carlo estimate over a finite input set --------------------------------------------
#
# A noise family gives log f(x)(y) = log Z + e(x, y), with the normaliser Z the same for every
# input, so that sup_x f(x)(y) / q(y) for a mixture q of the family depends on exponents only.
# Each family has: `metric`, the privleak.nearest reduction whose value v gives the sup of e;
# `exponent(v)`, that sup; `pairwise_exponents(outputs, inputs)`, e for all pairs (float64, for
# the mixture); `sample(means, rng)`, one output drawn around each row of `means`.


@dataclass(frozen=True)
class Gaussian:
    """Gaussian noise for :func:`estimate`: y = x + N(0, noise_std^2 I), e(x, y) = -||x - y||^2 / (2 noise_std^2)."""

    noise_std: float
    metric: ClassVar[str] = "squared_l2"

    def __post_init__(self) -> None:
        validation.positive(self.noise_std, "noise_std")

    def exponent(self, squared_distances: np.ndarray) -> np.ndarray:
        return -squared_distances / (2.0 * self.noise_std**2)

    def pairwise_exponents(self, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        return self.exponent(cdist(outputs, inputs, "sqeuclidean"))

    def sample(self, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return means + self.noise_std * rng.standard_normal(means.shape)


@dataclass(frozen=True)
class Laplace:
    """Laplace noise for :func:`estimate`: y = x + Lap(scale)^p, e(x, y) = -||x - y||_1 / scale."""

    scale: float
    metric: ClassVar[str] = "l1"

    def __post_init__(self) -> None:
        validation.positive(self.scale, "scale")

    def exponent(self, l1_distances: np.ndarray) -> np.ndarray:
        return -l1_distances / self.scale

    def pairwise_exponents(self, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        return self.exponent(cdist(outputs, inputs, "cityblock"))

    def sample(self, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return means + rng.laplace(0.0, self.scale, means.shape)


@dataclass(frozen=True)
class VMF:
    """VMF noise for :func:`estimate`: y ~ VMF(mean = x, kappa) on S^{p-1}, e(x, y) = kappa <x, y>.

    Inputs must be unit vectors. Sampling uses :func:`privleak.mechanisms.vmf_sample` and so
    needs torch.
    """

    kappa: float
    metric: ClassVar[str] = "inner_product"

    def __post_init__(self) -> None:
        validation.positive(self.kappa, "kappa")

    def exponent(self, inner_products: np.ndarray) -> np.ndarray:
        return self.kappa * inner_products

    def pairwise_exponents(self, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        return self.exponent(outputs @ inputs.T)

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


NoiseFamily = (Gaussian, Laplace, VMF)


class CapacityEstimate(NamedTuple):
    """A Monte Carlo estimate of a Bayes capacity C, with a confidence interval, in nats and bits."""

    log: float  #: estimate of log C
    bits: float  #: estimate of log2 C
    log_interval: tuple[float, float]  #: confidence interval for log C
    bits_interval: tuple[float, float]  #: the same interval in bits
    std_error: float  #: standard error of the estimate of log C (delta method)
    n_samples: int


def estimate(
    mechanism: Gaussian | Laplace | VMF,
    inputs: Any,
    n_samples: int = 10_000,
    *,
    proposal: Any = None,
    seed: Optional[int] = None,
    confidence: float = 0.95,
    batch_size: int = 4096,
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

    Cost: n_samples x (N + M) x p for the kernel and the mixture. For a huge input set, pass a
    smaller ``proposal`` (e.g. a random subset of the inputs): the estimate stays unbiased for
    any proposal points (the families have full support), but the weights are no longer
    bounded and the interval needs more samples to be trusted.

    Args:
        mechanism: :class:`Gaussian`, :class:`VMF` or :class:`Laplace`.
        inputs: (N, p) array of the inputs (float32 is kept for the kernel; other dtypes become
            float64). For VMF the rows must be unit vectors.
        n_samples: number of outputs y drawn, >= 2.
        proposal: (M, p) proposal points, default ``inputs``.
        seed: seed of numpy's generator (and of the VMF sampler's key); the same seed gives the
            same estimate.
        confidence: level of the interval, in (0, 1).
        batch_size: outputs drawn and reduced at a time (bounds memory).

    Returns:
        :class:`CapacityEstimate`.
    """
    if not isinstance(mechanism, NoiseFamily):
        raise TypeError(f"mechanism must be Gaussian, VMF or Laplace, got {type(mechanism).__name__}")
    points = _check_points(inputs, "inputs", mechanism)
    centres = points if proposal is None else _check_points(proposal, "proposal", mechanism)
    if centres.shape[1] != points.shape[1]:
        raise ValueError(f"proposal must have {points.shape[1]} columns like inputs, got {centres.shape[1]}")
    n = validation.dimension(n_samples, "n_samples")
    if n < 2:
        raise ValueError(f"n_samples must be >= 2 (the interval needs a variance), got {n_samples!r}")
    batch = validation.dimension(batch_size, "batch_size")
    level = validation.confidence_level(confidence, "confidence")

    from privleak.reductions import nearest

    rng = np.random.default_rng(None if seed is None else validation.integer(seed, "seed", low=0))
    centres64 = centres.astype(np.float64)
    chunk = max(1, 2**22 // batch)  # proposal points per logsumexp step: about 4M exponents
    log_weights = []
    for start in range(0, n, batch):
        count = min(batch, n - start)
        outputs = mechanism.sample(centres64[rng.integers(len(centres), size=count)], rng).astype(points.dtype)
        outputs64 = outputs.astype(np.float64)
        # The mixture's logsumexp is kept as (top exponent, log of the sum relative to it), so that
        # log w = (sup - top) - log(sum) + log M never subtracts two huge exponents: at kappa = 1e200
        # both are about 1e200 and their difference would round away.
        top = np.full(count, -np.inf)
        log_sum = np.full(count, -np.inf)
        for first in range(0, len(centres), chunk):
            exponents = mechanism.pairwise_exponents(outputs64, centres64[first:first + chunk])
            new_top = np.maximum(top, exponents.max(axis=1))
            log_sum = np.logaddexp(log_sum + (top - new_top), logsumexp(exponents - new_top[:, None], axis=1))
            top = new_top
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
    std_error = float(weights.std(ddof=1)) / (mean * math.sqrt(n))
    half_width = float(ndtri(0.5 + level / 2.0)) * std_error
    interval = (log_c - half_width, log_c + half_width)
    return CapacityEstimate(log_c, log_c / math.log(2.0), interval,
                            (interval[0] / math.log(2.0), interval[1] / math.log(2.0)), std_error, n)


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
    if isinstance(mechanism, VMF):
        if array.shape[1] < 2:
            raise ValueError(f"{name} must have p >= 2 columns for VMF (points on S^(p-1)), got {array.shape[1]}")
        norms = np.linalg.norm(array.astype(np.float64), axis=1)
        tolerance = 1e-5 if array.dtype == np.float32 else 1e-12
        if np.abs(norms - 1.0).max() > tolerance:
            raise ValueError(f"{name} must be unit vectors for VMF "
                             f"(norms range from {norms.min():.6g} to {norms.max():.6g})")
    return np.ascontiguousarray(array)
