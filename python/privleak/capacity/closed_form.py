"""Bayes capacity of the Gaussian and VMF mechanisms and of one DP-SGD step, in closed form.

See :mod:`privleak.capacity` for what is computed and where it differs from [004] (Biswas et
al.). The channel classes are named for the channel they model (a Gaussian over a product of L2
balls, VMF over the sphere), apart from the DP-SGD mechanisms of :mod:`privleak.dpsgd`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
from scipy.special import gammaln, logsumexp, roots_legendre

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
class GaussianBallChannel:
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
class VMFChannel:
    """y ~ VMF(mean = x, kappa) on S^{dim-1}, with x anywhere on the sphere."""

    dim: int
    kappa: float

    def log_capacity(self) -> LogCapacity:
        """Exact Bayes capacity (:func:`vmf_log_capacity`)."""
        return vmf_log_capacity(self.dim, self.kappa)


def dpsgd_gaussian(dim: int, clip_norm: float, noise_multiplier: float, batch_size: int) -> GaussianBallChannel:
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
    return GaussianBallChannel((p,), (c,), noise_std)


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
) -> GaussianBallChannel:
    """One step of DP-SGD with per-layer clipping, as a Gaussian mechanism over a product of balls.

    Layer l (p_l coordinates) of each per-sample gradient is clipped to norm c_l, so the batch
    average lies in B_{c_1}^{p_1} x ... x B_{c_k}^{p_k} and fills it. The noise follows Opacus's
    per-layer convention: the clipped gradient as a whole has sensitivity ||c||_2 =
    sqrt(sum_l c_l^2), and N(0, sigma^2 ||c||_2^2 I) / L is added to the average. The capacity
    (:meth:`GaussianBallChannel.log_capacity`) is exact and is the sum of the layers' log
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
    return GaussianBallChannel(dims, norms, noise_std)


def dpsgd_vmf(dim: int, kappa: float) -> VMFChannel:
    """One step of DP-SGD with VMF noise ([004] Alg. 2), as a VMF mechanism on S^{dim-1}.

    Alg. 2 clips, averages and scales the average to unit length, then draws from
    VMF(mean = that direction, kappa) (the algorithm passes its "sigma" as kappa). The
    normalised average can be any unit vector whatever c, L or per-layer clipping, so the input
    set is the whole sphere and the capacity depends on (p, kappa) only. An all-zero average has
    no direction; Alg. 2 leaves that case undefined and so does this model.
    """
    return VMFChannel(validation.dimension(dim, "dim"), validation.positive(kappa, "kappa"))
