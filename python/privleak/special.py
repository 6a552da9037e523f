"""Modified Bessel functions of the first kind in log space, and the VMF quantities built on them.

The von Mises-Fisher (VMF) mechanism on the sphere S^{p-1} ([004] Biswas et al., Appendix A;
Weggenmann and Kerschbaum 2021) needs I_nu(kappa) with nu = p/2 - 1: for gradients of p = 10^3
to 10^9 coordinates that is nu up to 5e8, with kappa anywhere from 1e-6 to 1e9. I_nu(kappa) then
ranges over exp(+-1e10), far outside float64, and ``scipy.special.ive`` underflows to 0 (nu in
the hundreds with kappa below about nu, or nu in the thousands with kappa near nu). Everything
here is computed in log space and is float64 throughout, vectorised over numpy broadcasting.

Methods, by region (nu >= 0, x >= 0):

- **Power series**, x <= 2 sqrt(nu + 1), any nu. I_nu(x) = (x/2)^nu / Gamma(nu + 1) * S with
  S = 0F1(; nu + 1; x^2/4) = sum_k (x^2/4)^k / (k! (nu + 1)_k). Here the ratio of successive
  terms is at most 1/k, so 24 positive terms reach 1/24! < 1e-23 with no cancellation, and
  log S = log1p(sum_{k >= 1}) keeps full relative accuracy even when S - 1 ~ 1e-20. This is
  where scipy underflows for moderate and large nu.
- **Uniform asymptotic (Debye) expansion**, nu >= 50 and x > 2 sqrt(nu + 1) (DLMF 10.41.3):
  I_nu(nu z) ~ exp(nu eta) / (sqrt(2 pi nu) (1 + z^2)^(1/4)) * sum_k U_k(t) / nu^k with
  t = 1/sqrt(1 + z^2) and eta = sqrt(1 + z^2) - arcsinh(1/z). It is uniform in z in (0, inf), so
  it covers every x for these orders. The polynomials U_k come from the exact recurrence
  DLMF 10.41.10 in rational arithmetic. With 11 terms the first omitted one is below
  max_t |U_12(t)| / 50^12 < 1e-19 for nu >= 50; the tests measure the result against mpmath.
- **Backward recurrence**, nu < 50 and 2 sqrt(nu + 1) < x <= 1e6, nu an integer or a half-integer
  (the orders p/2 - 1 that VMF needs): the ratios r_mu = I_{mu+1}(x) / I_mu(x) from
  1 / r_mu = 2 (mu + 1) / x + r_{mu+1} (DLMF 10.29.1; all terms positive, so each step is accurate
  and errors shrink going down), started at order nu0 + 50 from the Debye form of the ratio, and
  e^-x I_nu = e^-x I_nu0 * prod_{nu0 <= mu < nu} r_mu with nu0 = 0 (scipy's ``ive(0, x)``, a few ulp)
  or nu0 = 1/2 (e^-x I_{1/2}(x) = -expm1(-2x) / sqrt(2 pi x)). scipy's ``ive`` itself is off by up
  to 250 ulp there at half-integer and large orders (ive(0.5, 4): 100 ulp; ive(30, 100): 87 ulp);
  it remains the method for other fractional orders only.
- **Large-argument (Hankel) expansion**, nu < 50 and x > 1e6 (DLMF 10.40.1):
  e^-x I_nu(x) ~ (2 pi x)^(-1/2) sum_k (-1)^k a_k(nu) / x^k, a_k = prod_{j<=k} (4 nu^2 - (2j-1)^2) / (8j).
  The terms fall by at least 4 nu^2 / (8 k x) < 1.25e-3 / k each, so 8 terms are below 1e-25.
  AMOS stops at x ~ 1.07e9 (it returns NaN beyond), so this region is needed.

Accuracy. Each result is computed from nu and x with relative error a few ulp in each term, so
the absolute error of log I_nu(x) is about 1e-16 * (|log I_nu(x)| + nu + x) at worst. That is
the conditioning of the function: a change of one ulp in nu or x moves log I_nu(x) by
eps * (nu |d/dnu| + x |d/dx|) log I_nu(x) ~ eps * (nu arcsinh(nu/x) + hypot(nu, x)), so near
the zero of log I_nu for huge nu (x ~ 0.66 nu) no float64 method does better. Elsewhere the
error is a few 1e-16 relative to |log I_nu(x)| (or absolute where it is below 1): the tests
compare with mpmath at 30 digits over nu in [0, 5e8], x in [1e-6, 1e12], and ask for 1e-12 plus
the conditioning term 1e-15 (nu + x). Below nu = 50, where scipy's ``ive`` is up to 250 ulp off at
half-integer orders (odd p), integer and half-integer orders come from a backward recurrence
anchored at the exact I_{1/2} or at ive(0, x), within (8 + nu) ulp of mpmath.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
from scipy.special import gammaln, ive

from privleak import validation

DEBYE_MIN_ORDER = 50.0
_DEBYE_TERMS = 11
_SERIES_TERMS = 24
HANKEL_MIN_ARGUMENT = 1e6
_HANKEL_TERMS = 8
_LOG_2PI = math.log(2.0 * math.pi)
_LOG_2 = math.log(2.0)


# --- Debye polynomials -----------------------------------------------------------------------


def _polynomial_derivative(coefficients: list[Fraction]) -> list[Fraction]:
    return [k * c for k, c in enumerate(coefficients)][1:] or [Fraction(0)]


def _polynomial_add(a: list[Fraction], b: list[Fraction]) -> list[Fraction]:
    size = max(len(a), len(b))
    return [(a[k] if k < len(a) else 0) + (b[k] if k < len(b) else 0) for k in range(size)]


def _times_power(coefficients: list[Fraction], power: int, factor: Fraction = Fraction(1)) -> list[Fraction]:
    """factor * t^power * polynomial."""
    return [Fraction(0)] * power + [factor * c for c in coefficients]


def _debye_polynomials(count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """U_1..U_count and W_1..W_count as float64 coefficients (lowest power first).

    U_{k+1}(t) = t^2 (1 - t^2) U_k'(t) / 2 + (1/8) int_0^t (1 - 5 s^2) U_k(s) ds (DLMF 10.41.10).
    The polynomials V_k of the derivative expansion (DLMF 10.41.11) satisfy
    V_k - U_k = t (t^2 - 1) (U_{k-1} / 2 + t U_{k-1}') = (1 - t^2) W_k, so
    W_k = -t (U_{k-1} / 2 + t U_{k-1}'). Keeping the factor (1 - t^2) = z^2 t^2 out of W_k is what
    lets the Bessel ratio be evaluated without cancellation at small z.
    """
    u = [[Fraction(1)]]
    w = []
    for _ in range(count):
        previous = u[-1]
        derivative = _polynomial_derivative(previous)
        half_t2_dt = _polynomial_add(
            _times_power(derivative, 2, Fraction(1, 2)), _times_power(derivative, 4, Fraction(-1, 2))
        )
        integrand = _polynomial_add(previous, _times_power(previous, 2, Fraction(-5)))
        integral = [Fraction(0)] + [c / (k + 1) for k, c in enumerate(integrand)]
        u.append(_polynomial_add(half_t2_dt, [c / 8 for c in integral]))
        w.append(_polynomial_add(_times_power(previous, 1, Fraction(-1, 2)), _times_power(derivative, 2, Fraction(-1))))
    return _as_float64(u[1:]), _as_float64(w)


def _as_float64(polynomials: list[list[Fraction]]) -> list[np.ndarray]:
    return [np.array([float(c) for c in p]) for p in polynomials]


_DEBYE_U, _DEBYE_W = _debye_polynomials(_DEBYE_TERMS)


def _series_in_inverse_order(polynomials: list[np.ndarray], t: np.ndarray, nu: np.ndarray) -> np.ndarray:
    """sum_{k >= 1} P_k(t) / nu^k, summed from the smallest term for accuracy."""
    total = np.zeros(np.broadcast(t, nu).shape)
    for k in range(len(polynomials), 0, -1):
        total = total + np.polynomial.polynomial.polyval(t, polynomials[k - 1]) / nu**k
    return total


# --- Stirling remainder ----------------------------------------------------------------------

# B_{2k} / (2k (2k - 1)) for k = 1..8: the Stirling series of log Gamma.
_STIRLING_COEFFICIENTS = (1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188, -691 / 360360, 1 / 156, -3617 / 122400)


def log_gamma_stirling_remainder(n: Any) -> Any:
    """log Gamma(n) - ((n - 1/2) log n - n + log(2 pi) / 2), for n > 0 (elementwise).

    This is O(1/(12 n)), while log Gamma(n) itself is O(n log n): formulas that need log Gamma(n)
    minus its Stirling part (the chi density at its mode, the normalised Bessel function) use
    this to avoid subtracting numbers of size 1e10 that agree to 10 digits. For n >= 10 the
    8-term Stirling series is used (error below 1e-18); below that, log Gamma minus the Stirling
    part in float64 (absolute error a few 1e-15, on a remainder above 0.008).
    """
    n = np.asarray(n, dtype=np.float64)
    large = np.maximum(n, 10.0)
    inverse_square = 1.0 / (large * large)
    series = np.zeros_like(large)
    for coefficient in reversed(_STIRLING_COEFFICIENTS):
        series = series * inverse_square + coefficient
    direct_n = np.minimum(n, 10.0)
    direct = gammaln(direct_n) - ((direct_n - 0.5) * np.log(direct_n) - direct_n + 0.5 * _LOG_2PI)
    return np.where(n >= 10.0, series / large, direct)[()]


# --- the three log forms of I_nu -------------------------------------------------------------


class _BesselLogs:
    """log I_nu(x), log(e^-x I_nu(x)) and log(Gamma(nu + 1) (2/x)^nu I_nu(x)), each accurate."""

    def __init__(self, nu: Any, x: Any):
        nu, x = np.broadcast_arrays(validation.reals(nu, "nu", low=0.0), validation.reals(x, "x", low=0.0))
        self.iv = np.empty(nu.shape)
        self.ive = np.empty(nu.shape)
        self.normalised = np.empty(nu.shape)
        series, debye, hankel, amos = _regions(nu, x)
        self._fill_series(nu[series], x[series], series)
        self._fill_debye(nu[debye], x[debye], debye)
        self._fill_from_log_ive(nu[hankel], x[hankel], hankel, _log_ive_large_argument(nu[hankel], x[hankel]))
        self._fill_from_log_ive(nu[amos], x[amos], amos, _log_ive_and_ratio_low_order(nu[amos], x[amos])[0])

    def _fill_series(self, nu: np.ndarray, x: np.ndarray, where: np.ndarray) -> None:
        normalised = np.log1p(_hyp0f1_series_tail(nu, x))
        # nu log(x/2) with the convention 0 log 0 = 0: I_0(0) = 1. log x - log 2 rather than
        # log(x/2): halving a subnormal x rounds (5e-324 / 2 is 0, which gave -inf).
        leading = np.where(nu == 0.0, 0.0, nu * (np.log(np.where(x > 0.0, x, 1.0)) - _LOG_2))
        leading = np.where((x == 0.0) & (nu > 0.0), -np.inf, leading)
        self.normalised[where] = normalised
        self.iv[where] = normalised + leading - gammaln(nu + 1.0)
        self.ive[where] = self.iv[where] - x

    def _fill_debye(self, nu: np.ndarray, x: np.ndarray, where: np.ndarray) -> None:
        z = x / nu
        root = np.hypot(1.0, z)  # sqrt(1 + z^2)
        t = 1.0 / root
        root_minus_one = z * (z / (1.0 + root))
        with np.errstate(over="ignore"):  # z^2 overflows only where the second form is taken
            quarter_log_root2 = np.where(z < 1e150, 0.25 * np.log1p(z * z), 0.5 * np.log(root))  # (1/4) log(1 + z^2)
        common = np.log1p(_series_in_inverse_order(_DEBYE_U, t, nu)) - quarter_log_root2
        half_log_2pi_nu = 0.5 * (_LOG_2PI + np.log(nu))
        # nu eta = hypot(nu, x) - nu arcsinh(1/z); minus x: nu / (root + z) - nu arcsinh(1/z).
        self.iv[where] = np.hypot(nu, x) - nu * np.arcsinh(1.0 / z) - half_log_2pi_nu + common
        self.ive[where] = nu / (root + z) - nu * np.arcsinh(1.0 / z) - half_log_2pi_nu + common
        # nu eta - nu log(x/2) + log Gamma(nu + 1) - log sqrt(2 pi nu)
        #   = nu (root - 1 - log((1 + root)/2)) + (Stirling remainder of Gamma(nu)).
        self.normalised[where] = (
            nu * (root_minus_one - np.log1p(root_minus_one / 2.0)) + log_gamma_stirling_remainder(nu) + common
        )

    def _fill_from_log_ive(self, nu: np.ndarray, x: np.ndarray, where: np.ndarray, log_ive: np.ndarray) -> None:
        self.ive[where] = log_ive
        self.iv[where] = log_ive + x
        self.normalised[where] = log_ive + x - nu * np.log(x / 2.0) + gammaln(nu + 1.0)


def _regions(nu: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Masks of the power series, Debye, Hankel and AMOS regions (module docstring)."""
    with np.errstate(over="ignore"):  # x^2 = inf for x > 1.3e154 is simply not in the series region
        series = x * x <= 4.0 * (nu + 1.0)
    debye = ~series & (nu >= DEBYE_MIN_ORDER)
    hankel = ~series & ~debye & (x > HANKEL_MIN_ARGUMENT)
    return series, debye, hankel, ~series & ~debye & ~hankel


def _hankel_sum(nu: np.ndarray, x: np.ndarray) -> np.ndarray:
    """sum_k (-1)^k a_k(nu) / x^k of e^-x I_nu(x) sqrt(2 pi x), for nu < 50 and x > 1e6."""
    four_nu2 = 4.0 * nu * nu
    term = np.ones_like(x)
    terms = []
    for k in range(1, _HANKEL_TERMS + 1):
        term = -term * (four_nu2 - (2 * k - 1) ** 2) / (8.0 * k * x)
        terms.append(term)
    return 1.0 + np.sum(terms[::-1], axis=0)


def _log_ive_large_argument(nu: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.log(_hankel_sum(nu, x)) - 0.5 * (_LOG_2PI + np.log(x))


_RECURRENCE_STEPS = 50


def _log_ive_and_ratio_low_order(nu: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log(e^-x I_nu(x)) and I_{nu+1}(x) / I_nu(x) for nu < 50, x > 2 sqrt(nu + 1) (module docstring).

    Integer and half-integer orders by backward recurrence from order nu0 + 50 down to
    nu0 = nu - floor(nu); other orders by scipy's ``ive``.
    """
    base = nu - np.floor(nu)
    log_ive = np.log(ive(nu, x))
    ratio = ive(nu + 1.0, x) / ive(nu, x)
    exact = (base == 0.0) | (base == 0.5)
    if not np.any(exact):
        return log_ive, ratio
    n, v, b = nu[exact], x[exact], base[exact]
    r = bessel_iv_ratio(b + _RECURRENCE_STEPS, v)  # order >= 50: the power series or Debye
    product = np.ones_like(v)
    ratio_at_nu = np.empty_like(v)
    for j in range(_RECURRENCE_STEPS - 1, -1, -1):
        order = b + j
        r = 1.0 / (2.0 * (order + 1.0) / v + r)  # r_order from r_{order+1}
        product = np.where(order < n, product * r, product)
        ratio_at_nu = np.where(order == n, r, ratio_at_nu)
    log_base = np.where(b == 0.0, np.log(ive(0.0, v)), np.log(-np.expm1(-2.0 * v)) - 0.5 * (_LOG_2PI + np.log(v)))
    log_ive[exact] = log_base + np.log(product)
    ratio[exact] = ratio_at_nu
    return log_ive, ratio


def _hyp0f1_series_tail(nu: np.ndarray, x: np.ndarray) -> np.ndarray:
    """sum_{k >= 1} (x^2/4)^k / (k! (nu + 1)_k), for x^2 <= 4 (nu + 1) (then 24 terms suffice)."""
    quarter_x2 = x * x / 4.0
    term = np.ones_like(x)
    terms = []
    for k in range(1, _SERIES_TERMS + 1):
        term = term * quarter_x2 / (k * (nu + k))
        terms.append(term)
    return np.sum(terms[::-1], axis=0)


# --- public functions ------------------------------------------------------------------------


def log_bessel_iv(nu: Any, x: Any) -> Any:
    """log I_nu(x), the modified Bessel function of the first kind, for nu >= 0 and x >= 0.

    Vectorised over numpy broadcasting; returns a float64 array (a numpy scalar for scalar
    input). log I_0(0) = 0 and log I_nu(0) = -inf for nu > 0. See the module docstring for the
    method in each region and the accuracy. Raises ValueError naming ``nu`` or ``x`` for
    negative or non-finite values.
    """
    return _BesselLogs(nu, x).iv[()]


def log_bessel_ive(nu: Any, x: Any) -> Any:
    """log(e^-x I_nu(x)) = log I_nu(x) - x, computed without forming log I_nu(x) for large x.

    The exponentially scaled form is the accurate one when x >> nu: then log I_nu(x) ~ x and
    subtracting x from it would lose the digits of the O(log x) remainder.
    """
    return _BesselLogs(nu, x).ive[()]


def log_bessel_iv_normalised(nu: Any, x: Any) -> Any:
    """log(Gamma(nu + 1) (2/x)^nu I_nu(x)) = log 0F1(; nu + 1; x^2 / 4) >= 0.

    I_nu(x) divided by its small-x leading term (x/2)^nu / Gamma(nu + 1). It is 0 at x = 0, about
    x^2 / (4 (nu + 1)) for small x, and is computed with full relative accuracy there (the Debye
    form subtracts Gamma's Stirling part analytically). The VMF normaliser and the VMF Bayes
    capacity are simple functions of it.
    """
    return _BesselLogs(nu, x).normalised[()]


def bessel_iv_ratio(nu: Any, x: Any) -> Any:
    """I_{nu+1}(x) / I_nu(x) for nu >= 0, x >= 0, with relative error of a few ulp.

    Taken directly rather than as exp(log I_{nu+1} - log I_nu), which would lose
    eps * |log I_nu(x)| relative accuracy (1e-8 at nu = 5e8). Methods as for
    :func:`log_bessel_iv`: the ratio of the two power series where x <= 2 sqrt(nu + 1); for
    nu >= 50 the Debye expansion of I_nu'/I_nu (DLMF 10.41.4) with I_{nu+1}/I_nu = I_nu'/I_nu - nu/x,
    rearranged as z ((sum V_k/nu^k)/(1 + sqrt(1 + z^2)) + t^2 sum W_k/nu^k) / (sum U_k/nu^k) so
    that nothing cancels; otherwise the ratio of the two Hankel sums (x > 1e6) or of scipy's
    scaled ``ive``.
    """
    nu, x = np.broadcast_arrays(validation.reals(nu, "nu", low=0.0), validation.reals(x, "x", low=0.0))
    ratio = np.empty(nu.shape)
    series, debye, hankel, amos = _regions(nu, x)

    n, v = nu[series], x[series]
    ratio[series] = v / (2.0 * (n + 1.0)) * (1.0 + _hyp0f1_series_tail(n + 1.0, v)) / (1.0 + _hyp0f1_series_tail(n, v))

    n, v = nu[debye], x[debye]
    z = v / n
    root = np.hypot(1.0, z)
    t = 1.0 / root
    u_sum = 1.0 + _series_in_inverse_order(_DEBYE_U, t, n)
    w_sum = _series_in_inverse_order(_DEBYE_W, t, n)
    v_sum = u_sum + (z * t) ** 2 * w_sum  # V_k = U_k + (1 - t^2) W_k and 1 - t^2 = (z t)^2
    ratio[debye] = z * (v_sum / (1.0 + root) + t * t * w_sum) / u_sum

    n, v = nu[hankel], x[hankel]
    ratio[hankel] = _hankel_sum(n + 1.0, v) / _hankel_sum(n, v)

    ratio[amos] = _log_ive_and_ratio_low_order(nu[amos], x[amos])[1]
    return ratio[()]


def log_sphere_area(p: Any) -> Any:
    """log |S^{p-1}| = log(2 pi^(p/2) / Gamma(p/2)), the surface area of the unit sphere in R^p."""
    p = np.asarray(p, dtype=np.float64)
    return (math.log(2.0) + 0.5 * p * math.log(math.pi) - gammaln(p / 2.0))[()]


def vmf_log_normaliser(p: Any, kappa: Any) -> Any:
    """log C_p(kappa) of the VMF density C_p(kappa) exp(kappa mu.y) on S^{p-1} ([004] Appendix A).

    C_p(kappa) = kappa^(p/2-1) / ((2 pi)^(p/2) I_{p/2-1}(kappa)). Computed as the equal
    -log|S^{p-1}| - log 0F1(; p/2; kappa^2/4) (:func:`log_sphere_area`,
    :func:`log_bessel_iv_normalised`), which has no cancellation as kappa -> 0 (the density
    tends to the uniform one, 1/|S^{p-1}|). [004] Appendix A writes the normaliser as
    (2 pi)^(nu+1) I_nu(kappa) / r^nu: "r" is a typo for kappa, and there C_{p,kappa} is the
    reciprocal of the C_p(kappa) here. Needs p >= 2 and kappa > 0 (ValueError otherwise).
    """
    p, kappa = _check_vmf(p, kappa)
    return (-log_sphere_area(p) - log_bessel_iv_normalised(p / 2.0 - 1.0, kappa))[()]


def vmf_log_scaled_normaliser(p: Any, kappa: Any) -> Any:
    """log(C_p(kappa) e^kappa) = log C_p(kappa) + kappa, the VMF log density at y = mu.

    The log density is kappa (mu.y - 1) + this: both terms are O(p + log kappa) where
    log C_p(kappa) and kappa mu.y are each O(kappa) and cancel (at p = 2, kappa = 800 the sum of
    -795 and 800 lost 40 ulp of the result). Computed without cancellation:

    - kappa^2 <= 4 (nu + 1), nu = p/2 - 1 (power-series region): (kappa - log 0F1(; nu + 1; kappa^2/4))
      - log|S^{p-1}|, where log 0F1 <= kappa / 2 so the first difference keeps full accuracy;
    - otherwise: nu log(kappa / (2 pi)) - log(2 pi) - log(e^-kappa I_nu(kappa)), from the scaled
      Bessel function (:func:`log_bessel_ive`), whose terms do not cancel there (kappa > 2 sqrt(nu + 1)
      and kappa > 14 where nu >= 50).

    Each term is accurate to a few ulp, so the error is a few ulp of the largest term: a few ulp
    of the value except near its zero (then absolute, a few 1e-16 times the terms). Needs p >= 2
    and finite kappa > 0 (ValueError otherwise).
    """
    p, kappa = np.broadcast_arrays(*_check_vmf(p, kappa))
    nu = p / 2.0 - 1.0
    out = np.empty(p.shape)
    series = _regions(nu, kappa)[0]
    n, k = nu[series], kappa[series]
    out[series] = (k - log_bessel_iv_normalised(n, k)) - log_sphere_area(2.0 * n + 2.0)
    n, k = nu[~series], kappa[~series]
    out[~series] = n * (np.log(k) - _LOG_2PI) - _LOG_2PI - log_bessel_ive(n, k)
    return out[()]


def vmf_mean_resultant_length(p: Any, kappa: Any) -> Any:
    """A_p(kappa) = I_{p/2}(kappa) / I_{p/2-1}(kappa) = E[mu . y] for y ~ VMF(mu, kappa) on S^{p-1}.

    For p >= 2 and kappa > 0 (ValueError otherwise); see :func:`bessel_iv_ratio` for the method.
    """
    p, kappa = _check_vmf(p, kappa)
    return bessel_iv_ratio(p / 2.0 - 1.0, kappa)


def _check_vmf(p: Any, kappa: Any) -> tuple[np.ndarray, np.ndarray]:
    """The VMF dimension p (whole, >= 2: a sphere S^(p-1) with a direction) and concentration kappa > 0."""
    return validation.reals(p, "p", low=2.0, whole=True), validation.reals(kappa, "kappa", low=0.0, low_open=True)


# --- reproducible, compensated sums (numpy arrays or torch tensors) ---------------------------
#
# Only elementwise +, -, * and slicing: every one is a correctly rounded IEEE operation on numpy,
# torch CPU and torch CUDA alike (no fused multiply-add across separate ops), and the order of
# the additions is fixed by the array length alone, so the results are the same bits on every
# device, thread count and instruction set, unlike a library reduction.


def two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    """Veltkamp's split a = hi + lo, each half of the 53 bits (|a| < 1e300)."""
    c = 134217729.0 * a  # 2^27 + 1
    hi = c - (c - a)
    return hi, a - hi


def two_product(a, b):
    """(p, e) with p = fl(a b) and p + e = a b exactly (Dekker), barring under- and overflow."""
    p = a * b
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    return p, a_lo * b_lo - (((p - a_hi * b_hi) - a_lo * b_hi) - a_hi * b_lo)


def compensated_sum(values, errors):
    """(s, e): sum over the last axis of values + errors as an unevaluated s + e, in a fixed order.

    A pairwise tree of error-free additions (Ogita, Rump and Oishi's Sum2 in tree order): s + e
    is the sum with error below about eps |sum| + log2(n) eps^2 sum |values|, as if computed in
    twice the precision. ``errors`` (same shape) are small corrections added along (the low parts
    of exact products). Inputs must be finite. An empty last axis sums to 0.
    """
    s, e = values, errors
    n = s.shape[-1]
    if n == 0:
        return s.sum(-1), e.sum(-1)
    while n > 1:
        half = n // 2
        head, low = two_sum(s[..., :half], s[..., half:2 * half])
        low = low + (e[..., :half] + e[..., half:2 * half])
        if n % 2:  # the odd one out joins the first pair
            head[..., :1], extra = two_sum(head[..., :1], s[..., 2 * half:])
            low[..., :1] = low[..., :1] + (extra + e[..., 2 * half:])
        s, e, n = head, low, half
    return s[..., 0], e[..., 0]


def sum_of_squares(values):
    """sum of values^2 over the last axis, as (s, e) from exact squares (see compensated_sum)."""
    return compensated_sum(*two_product(values, values))


def scaled_norm(values) -> tuple[Any, float]:
    """(values 2^-k, |values 2^-k|) for a 1-D float64 array or tensor, k making max |.| in [1/2, 1).

    The norm is a Python float from the exact squares' compensated sum, so it is the correctly
    rounded norm in all but rare ties, and the same bits on every device and in every order of
    the elements (the permutation changes only the tree's rounding of a twice-precision sum).
    The scaling by a power of two is exact and keeps huge or subnormal vectors in range. The norm
    is 0 for a zero vector and NaN or inf for a non-finite one.
    """
    largest = float(abs(values).max()) if values.shape[-1] else 0.0
    if largest == 0.0 or not math.isfinite(largest):
        return values, largest
    exponent = math.frexp(largest)[1]
    down = -exponent // 2
    scaled = values * 2.0**down * 2.0 ** (-exponent - down)  # two exact steps: 2^(+-1074) does not fit
    squares, errors = sum_of_squares(scaled)
    return scaled, math.sqrt(float(squares) + float(errors))
