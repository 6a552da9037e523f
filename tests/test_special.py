"""privleak.special against mpmath at 30 digits, over nu in [0, 5e8] and x in [1e-6, 1e12].

References: mpmath's own I_nu (hypergeometric series, or its large-x asymptotic series) where it
converges quickly, i.e. for nu < 50 or x^2 <= 4 (nu + 1); elsewhere, where the Debye expansion
works and mpmath's besseli does not converge, the integral
I_nu(x) = (x/2)^nu / (sqrt(pi) Gamma(nu + 1/2)) int_0^pi exp(x cos th) sin(th)^(2 nu) dth
by mpmath quadrature split around the integrand's peak. Neither shares code or method with
privleak. Accuracy asked: 1e-12 relative to max(1, |value|), plus the function's own
conditioning 1e-15 (nu + x) (see the module docstring of privleak.special).
"""
import functools
import math

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from privleak import special

DPS = 30
ORDERS = [0.0, 0.5, 1.0, 2.5, 10.0, 49.999, 50.0, 50.001, 100.0, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 5e8]
ARGUMENTS = [1e-6, 1e-3, 0.1, 1.0, 3.0, 10.0, 30.0, 100.0, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 3.3e8, 1e9, 3e9, 1e12]
GRID = [(nu, x) for nu in ORDERS for x in ARGUMENTS] + [
    # both sides of the switch from the power series at x = 2 sqrt(nu + 1)
    (nu, 2.0 * math.sqrt(nu + 1.0) * factor) for nu in (0.0, 20.0, 50.0, 1e4, 5e8) for factor in (1 - 1e-9, 1 + 1e-9)
] + [
    # both sides of the switch from scipy to the large-argument expansion at x = 1e6
    (nu, special.HANKEL_MIN_ARGUMENT * factor) for nu in (0.0, 7.5, 49.9) for factor in (1 - 1e-9, 1 + 1e-9)
]


def mp_log_integral(log_f, a, b, peak, width):
    """log of int_a^b exp(log_f(t)) dt for a unimodal integrand peaked at ``peak`` (mpmath)."""
    top = log_f(peak)
    inner = {peak + k * width for k in (-20, -4, 0, 4, 20) if a < peak + k * width < b}
    points = sorted({mp.mpf(a), mp.mpf(b)} | inner)
    return top + mp.log(mp.quad(lambda t: mp.exp(log_f(t) - top), points, method="gauss-legendre"))


@functools.lru_cache(maxsize=None)
def mp_log_iv(nu, x):
    """log I_nu(x) as an mpf at DPS digits."""
    with mp.workdps(DPS):
        nu, x = mp.mpf(nu), mp.mpf(x)
        if nu < 50 or x * x <= 4 * (nu + 1):
            return mp.log(mp.besseli(nu, x))
        cos_peak = x / (nu + mp.sqrt(nu * nu + x * x))  # where x sin^2 = 2 nu cos
        width = 1 / mp.sqrt(x * cos_peak + 2 * nu / (1 - cos_peak**2))
        log_integrand = lambda th: x * mp.cos(th) + 2 * nu * mp.log(mp.sin(th))  # noqa: E731
        integral = mp_log_integral(log_integrand, 0, mp.pi, mp.acos(cos_peak), width)
        return nu * mp.log(x / 2) - mp.log(mp.pi) / 2 - mp.loggamma(nu + mp.mpf(1) / 2) + integral


def tolerance(reference, nu, x):
    return 1e-12 * max(1.0, abs(reference)) + 1e-15 * (nu + x)


def assert_close(got, references, nus, xs):
    for value, reference, nu, x in zip(np.ravel(got), references, nus, xs):
        assert abs(value - reference) <= tolerance(reference, nu, x), (nu, x, value, reference)


NUS, XS = (np.array(column) for column in zip(*GRID))


def test_log_bessel_iv_matches_mpmath_over_the_whole_range():
    references = [float(mp_log_iv(nu, x)) for nu, x in GRID]
    got = special.log_bessel_iv(NUS, XS)
    assert got.shape == NUS.shape and np.all(np.isfinite(got))
    assert_close(got, references, NUS, XS)


def test_log_bessel_ive_matches_mpmath():
    with mp.workdps(DPS):
        references = [float(mp_log_iv(nu, x) - x) for nu, x in GRID]
    assert_close(special.log_bessel_ive(NUS, XS), references, NUS, XS)


def test_log_bessel_iv_normalised_matches_mpmath_with_relative_accuracy():
    # log 0F1(; nu + 1; x^2/4) is as small as 1e-22 here: it is checked relative to itself, with
    # 60 digits for the series (log of 1 + 1e-22) and 30 for the rest (where it is above 1).
    references = []
    for nu, x in GRID:
        if x * x <= 4 * (nu + 1):
            with mp.workdps(60):
                references.append(float(mp.log(mp.hyp0f1(nu + 1, mp.mpf(x) ** 2 / 4))))
        else:
            with mp.workdps(DPS):
                references.append(float(mp_log_iv(nu, x) - nu * mp.log(mp.mpf(x) / 2) + mp.loggamma(nu + 1)))
    np.testing.assert_allclose(special.log_bessel_iv_normalised(NUS, XS), references, rtol=1e-13, atol=0)


def test_near_the_zero_of_log_i_the_error_is_the_conditioning():
    # For huge nu, log I_nu(x) = 0 near x = 0.6627 nu: one ulp of x or nu moves it by ~eps * nu.
    for nu in (1e6, 5e8):
        x = 0.66274 * nu
        reference = float(mp_log_iv(nu, x))
        assert abs(reference) < 1e-4 * nu
        assert abs(special.log_bessel_iv(nu, x) - reference) <= tolerance(reference, nu, x)


def test_scipy_underflows_where_log_bessel_iv_does_not():
    from scipy.special import ive

    nus, xs = np.array([300.0, 1e4, 5e8]), np.array([1.0, 1e4, 5e8])
    assert np.all(ive(nus, xs) == 0.0)
    assert np.all(np.isfinite(special.log_bessel_iv(nus, xs)))


def test_bessel_iv_ratio_and_vmf_mean_resultant_length_match_mpmath():
    orders = [0.0, 0.5, 10.0, 49.5, 50.0, 1e3, 1e5, 5e6 - 1.0]
    arguments = [1e-6, 0.1, 1.0, 30.0, 1e3, 1e5, 3e6, 1e9, 1e12]
    pairs = [(nu, x) for nu in orders for x in arguments]
    with mp.workdps(DPS):
        references = [float(mp.exp(mp_log_iv(nu + 1, x) - mp_log_iv(nu, x))) for nu, x in pairs]
    nus, xs = (np.array(column) for column in zip(*pairs))
    got = special.bessel_iv_ratio(nus, xs)
    np.testing.assert_allclose(got, references, rtol=1e-13, atol=0)
    # A_p(kappa) = I_{p/2}(kappa) / I_{p/2-1}(kappa), p up to 10^7
    np.testing.assert_allclose(special.vmf_mean_resultant_length(2.0 * nus + 2.0, xs), got, rtol=0, atol=0)
    assert np.all((got > 0) & (got < 1))


def test_vmf_mean_resultant_length_closed_forms_in_low_dimension():
    kappa = np.array([1e-6, 0.3, 2.0, 40.0, 1e9])
    with mp.workdps(DPS):
        p2 = [float(mp.besseli(1, k) / mp.besseli(0, k)) for k in kappa]
        p3 = [float(1 / mp.tanh(k) - 1 / mp.mpf(k)) for k in kappa]  # coth(kappa) - 1/kappa
    np.testing.assert_allclose(special.vmf_mean_resultant_length(2, kappa), p2, rtol=1e-14)
    np.testing.assert_allclose(special.vmf_mean_resultant_length(3, kappa), p3, rtol=1e-14)


def test_vmf_log_normaliser_matches_mpmath_and_integrates_to_one_on_s2():
    for p in (2, 3, 10, 1000, 10**6, 10**7):
        for kappa in (1e-6, 1.0, 500.0, 1e6, 1e9):
            with mp.workdps(DPS):
                nu = mp.mpf(p) / 2 - 1
                reference = float(nu * mp.log(kappa) - mp.mpf(p) / 2 * mp.log(2 * mp.pi) - mp_log_iv(float(nu), kappa))
            got = special.vmf_log_normaliser(p, kappa)
            assert abs(got - reference) <= 1e-12 * max(1.0, abs(reference)) + 1e-15 * (p + kappa), (p, kappa)
    # On S^2 the density C e^(kappa cos th) integrates to 2 pi C int_0^pi e^(kappa cos th) sin th dth = 1.
    for kappa in (1e-6, 0.7, 30.0):
        c = math.exp(special.vmf_log_normaliser(3, kappa))
        polar = mp.quad(lambda th, kappa=kappa: mp.exp(kappa * mp.cos(th)) * mp.sin(th), [0, mp.pi])
        assert math.isclose(c * 2 * math.pi * float(polar), 1.0, rel_tol=1e-13)


@settings(deadline=None, max_examples=200)
@given(st.floats(1.0, 1e8), st.floats(1e-6, 1e12))
def test_recurrence_holds_across_regions(nu, x):
    # I_{nu-1}(x) = I_{nu+1}(x) + (2 nu / x) I_nu(x): all terms positive, so it holds in log space to rounding.
    left = special.log_bessel_iv(nu - 1.0, x)
    right = np.logaddexp(special.log_bessel_iv(nu + 1.0, x), math.log(2.0 * nu / x) + special.log_bessel_iv(nu, x))
    assert abs(left - right) <= 1e-13 * max(1.0, abs(left)) + 4e-16 * (nu + x)


@settings(deadline=None, max_examples=200)
@given(st.floats(0.0, 5e8), st.floats(1e-6, 1e12))
def test_ratio_within_amos_bounds(nu, x):
    # Amos (1974): x / (nu + 1 + sqrt((nu + 1)^2 + x^2)) <= I_{nu+1}/I_nu <= x / (nu + 1/2 + sqrt((nu + 1/2)^2 + x^2))
    ratio = special.bessel_iv_ratio(nu, x)
    rounding = 1 + 1e-14
    assert x / (nu + 1 + math.hypot(nu + 1, x)) <= ratio * rounding
    assert ratio <= rounding * x / (nu + 0.5 + math.hypot(nu + 0.5, x))


def test_stirling_remainder():
    n = np.array([0.5, 1.0, 9.99, 10.0, 10.01, 1e3, 5e8])
    with mp.workdps(50):  # log Gamma(5e8) ~ 1e10 and the remainder ~ 1e-10
        reference = [float(mp.loggamma(v) - ((mp.mpf(v) - 0.5) * mp.log(v) - v + mp.log(2 * mp.pi) / 2)) for v in n]
    # below n = 10 it is log Gamma minus its Stirling part in float64: a few 1e-15 absolute
    np.testing.assert_allclose(special.log_gamma_stirling_remainder(n), reference, rtol=1e-14, atol=5e-15)


def test_edge_values_and_shapes():
    assert special.log_bessel_iv(0.0, 0.0) == 0.0
    assert special.log_bessel_iv(2.0, 0.0) == -np.inf
    assert special.log_bessel_iv_normalised(7.0, 0.0) == 0.0
    assert isinstance(special.log_bessel_iv(3.0, 2.0), np.floating)
    assert special.log_bessel_iv(np.ones((2, 3)), np.ones(3)).shape == (2, 3)
    assert special.log_sphere_area(3) == pytest.approx(math.log(4 * math.pi), rel=1e-15)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: special.log_bessel_iv(-1.0, 1.0), "nu"),
        (lambda: special.log_bessel_iv(1.0, -1.0), "x"),
        (lambda: special.log_bessel_iv(np.nan, 1.0), "nu"),
        (lambda: special.log_bessel_ive(1.0, np.inf), "x"),
        (lambda: special.bessel_iv_ratio(1.0, [1.0, np.nan]), "x"),
        (lambda: special.vmf_log_normaliser(1, 1.0), "p"),
        (lambda: special.vmf_log_normaliser(2.5, 1.0), "p"),
        (lambda: special.vmf_log_normaliser(3, 0.0), "kappa"),
        (lambda: special.vmf_mean_resultant_length(3, -1.0), "kappa"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()


# --- extreme arguments, the low-order recurrence, and the scaled VMF normaliser --------------

EPS = np.finfo(np.float64).eps


@pytest.mark.parametrize("nu", [0.0, 0.5, 1.0, 3.0, 49.5, 50.0, 1e3, 1e5, 1e7, 1e9])
@pytest.mark.parametrize("x", [5e-324, 1e-320, 1e-310, 1e-300, 1e-200])
def test_log_bessel_iv_at_subnormal_and_tiny_x(nu, x):
    # log I_nu(x) = nu log(x/2) - lgamma(nu + 1) + O(x^2): log(x / 2) of a subnormal x rounded
    # (5e-324 / 2 = 0) and log_bessel_iv(3, 5e-324) was -inf.
    with mp.workdps(DPS):
        reference = float(nu * mp.log(mp.mpf(x) / 2) - mp.loggamma(nu + 1))
    got = float(special.log_bessel_iv(nu, x))
    assert abs(got - reference) <= 4 * np.spacing(max(abs(reference), 1.0))


def test_huge_arguments_raise_no_warning_and_stay_finite():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for nu in (0.0, 3.0, 100.0, 1e9):
            for x in (1e155, 1e200, 1e300):
                values = [special.log_bessel_iv(nu, x), special.log_bessel_ive(nu, x),
                          special.log_bessel_iv_normalised(nu, x), special.bessel_iv_ratio(nu, x)]
                assert np.all(np.isfinite(values))
                # log e^-x I_nu(x) -> -log(2 pi x) / 2 as x -> inf (DLMF 10.40.1)
                assert abs(special.log_bessel_ive(nu, x) + 0.5 * math.log(2 * math.pi * x)) < 1e-12


LOW_ORDERS = [0.0, 0.5, 1.0, 1.5, 2.5, 5.0, 10.5, 20.5, 30.0, 49.0, 49.5]
LOW_ARGUMENTS = [2.01, 4.0, 8.0, 16.0, 25.0, 100.0, 1e3, 1e4, 1e5, 9e5]


@pytest.mark.parametrize("nu", LOW_ORDERS)
def test_low_integer_and_half_integer_orders_are_accurate(nu):
    # Where scipy's ive was the method (nu < 50, 2 sqrt(nu + 1) < x <= 1e6) it is off by up to
    # 250 ulp at half-integer and large orders (ive(0.5, 4): 100 ulp). The backward recurrence
    # multiplies nu - nu0 ratios, each within about an ulp: ask for (8 + nu) eps in log ive and
    # 8 ulp in the ratio.
    for x in LOW_ARGUMENTS:
        if x * x <= 4 * (nu + 1):
            continue
        with mp.workdps(DPS):
            log_ive = mp.log(mp.besseli(nu, x)) - x
            ratio = mp.besseli(nu + 1, x) / mp.besseli(nu, x)
        assert abs(special.log_bessel_ive(nu, x) - float(log_ive)) <= (8 + nu) * EPS, (nu, x)
        assert abs(special.bessel_iv_ratio(nu, x) / float(ratio) - 1) <= 8 * EPS, (nu, x)


def mp_log_ive(nu, x):
    with mp.workdps(DPS):
        nu, x = mp.mpf(nu), mp.mpf(x)
        if x > 1e6 and x > 100 * nu * nu:  # the large-argument series at mpmath precision
            total, term = mp.mpf(1), mp.mpf(1)
            for k in range(1, 40):
                term = -term * (4 * nu * nu - (2 * k - 1) ** 2) / (8 * k * x)
                total += term
            return -mp.log(2 * mp.pi * x) / 2 + mp.log(total)
    with mp.workdps(DPS + 320):
        return mp_log_iv(float(nu), float(x)) - mp.mpf(x)


SCALED_GRID = [(p, kappa) for p in (2, 3, 4, 17, 101, 102, 2002, 200_002, 10**6, 2 * 10**9 + 2)
               for kappa in (5e-324, 1e-300, 1e-4, 0.1, 1.0, 4.0, 10.0, 800.0, 1e4, 1e6, 1e9, 1e12, 1e100, 1e300)]


@pytest.mark.parametrize("p, kappa", SCALED_GRID)
def test_vmf_log_scaled_normaliser_matches_mpmath(p, kappa):
    # log C_p(kappa) + kappa: each term it adds is within an ulp or so, so the error is a few ulp
    # of the largest term: of the value, except near its zero (p = 2, 3, 4 at kappa ~ 4; p = 17,
    # where |S^16| ~ 2.4 comes from terms ~ 10), where it is absolute. Tolerance: 8 ulp of
    # max(|value|, |log|S^{p-1}||, 1).
    nu = p / 2 - 1
    with mp.workdps(DPS + 320):
        reference = float(nu * mp.log(mp.mpf(kappa)) - (nu + 1) * mp.log(2 * mp.pi) - mp_log_ive(nu, kappa))
    got = float(special.vmf_log_scaled_normaliser(p, kappa))
    scale = max(abs(reference), abs(float(special.log_sphere_area(p))), 1.0)
    assert abs(got - reference) <= 8 * np.spacing(scale), (got, reference)
    # ... and log C_p(kappa) itself, which for large kappa is this minus kappa.
    plain = float(special.vmf_log_normaliser(p, kappa))
    assert abs(plain - (reference - kappa)) <= 8 * np.spacing(max(scale, abs(reference - kappa), kappa))


def test_compensated_sums_are_exact_to_rounding_and_order_free():
    from fractions import Fraction

    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 7, 100, 1001):
        a, b = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n), rng.standard_normal(n)
        hi, lo = special.two_product(a, b)
        assert all(Fraction(h) + Fraction(e) == Fraction(x) * Fraction(y) for h, e, x, y in zip(hi, lo, a, b))
        s, e = special.compensated_sum(hi, lo)
        exact = sum(Fraction(x) * Fraction(y) for x, y in zip(a, b))
        assert s + e == float(exact)  # correctly rounded here (the bound is eps^2-level)
        order = rng.permutation(n)
        s2, e2 = special.compensated_sum(hi[order], lo[order])
        assert s2 + e2 == s + e
