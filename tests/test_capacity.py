"""privleak.capacity closed forms against independent numerical integration.

- p = 1, 2, 3: direct quadrature over the output space of sup_x f(x)(y), the sup found by
  projecting y onto the input set (scipy quad / nquad in Cartesian, polar, spherical or
  cylindrical coordinates).
- any p: the radial integral of the Gaussian, or the polar-angle integral of the VMF
  normaliser, by mpmath quadrature at 30 digits (up to p = 10^9).
Capacities are compared in log space: an absolute error d of log C is a relative error d of C,
and 1e-10 is asked. Where log C is huge (p = 10^9) float64 inputs themselves fix it only to
about 1e-16 |log C|, so 1e-14 |log C| is allowed on top.
"""
import math

import mpmath as mp
import numpy as np
import pytest
from privleak import capacity as cap
from scipy import integrate
from test_special import DPS, mp_log_integral

QUAD = dict(epsabs=0.0, epsrel=1e-13, limit=200)
DIMS = [1, 2, 3, 5, 10, 100, 1000, 10**4, 10**6, 10**9]
RATIOS = [1e-6, 0.1, 1.0, 10.0, 256.0, 1e4, 1e6]  # radius / noise_std


def assert_log_close(got, reference, relative_of_log=1e-14):
    assert abs(got - reference) <= 1e-10 + relative_of_log * abs(reference), (got, reference)


# --- references ------------------------------------------------------------------------------


def gaussian_density(offset_squared, dim, sigma):
    return math.exp(-offset_squared / (2 * sigma**2)) / (2 * math.pi * sigma**2) ** (dim / 2)


def distance_squared_to_ball(y, radius):
    """|y - x*|^2 for x* the point of the L2 ball nearest to y (y scaled into the ball)."""
    norm = math.sqrt(sum(v * v for v in y))
    return max(0.0, norm - radius) ** 2


def direct_gaussian_log_capacity(dim, radius, sigma):
    """log int sup_{|x| <= R} N(y; x, sigma^2 I) dy over R^dim by scipy quadrature, dim = 1, 2, 3."""
    far = radius + 40 * sigma
    radial = [(0, radius), (radius, far)] if radius > 0 else [(0, far)]
    if dim == 1:
        pieces = [(-far, -radius), (-radius, radius), (radius, far)] if radius > 0 else [(-far, far)]
        f = lambda y: gaussian_density(distance_squared_to_ball([y], radius), 1, sigma)  # noqa: E731
        total = sum(integrate.quad(f, a, b, **QUAD)[0] for a, b in pieces)
    elif dim == 2:  # polar (r, theta)
        def f(r, th):
            y = [r * math.cos(th), r * math.sin(th)]
            return r * gaussian_density(distance_squared_to_ball(y, radius), 2, sigma)
        total = sum(integrate.nquad(f, [(a, b), (0, 2 * math.pi)], opts=[QUAD, QUAD])[0] for a, b in radial)
    else:  # spherical (r, polar angle, azimuth)
        def f(r, th, ph):
            y = [r * math.sin(th) * math.cos(ph), r * math.sin(th) * math.sin(ph), r * math.cos(th)]
            return r * r * math.sin(th) * gaussian_density(distance_squared_to_ball(y, radius), 3, sigma)
        total = sum(integrate.nquad(f, [(a, b), (0, math.pi), (0, 2 * math.pi)], opts=[QUAD] * 3)[0] for a, b in radial)
    return math.log(total)


def mp_gaussian_log_capacity(dim, rho):
    """log of int_0^inf t^(p-1) e^(-max(0, t - rho)^2 / 2) dt / int_0^inf t^(p-1) e^(-t^2/2) dt (mpmath)."""
    with mp.workdps(DPS):
        p, rho = mp.mpf(dim), mp.mpf(rho)
        inside = p * mp.log(rho) - mp.log(p)  # int_0^rho t^(p-1) dt
        peak = 2 * (p - 1) / (rho + mp.sqrt(rho**2 + 4 * (p - 1)))
        width = 1 / mp.sqrt(1 + (p - 1) / (peak + rho) ** 2)
        outside = mp_log_integral(lambda s: (p - 1) * mp.log(s + rho) - s * s / 2, 0, mp.inf, peak, width)
        chi_normaliser = (p / 2 - 1) * mp.log(2) + mp.loggamma(p / 2)
        return float(mp.log(mp.exp(inside) + mp.exp(outside)) - chi_normaliser)


def mp_vmf_log_capacity(dim, kappa):
    """log(|S^{p-1}| e^kappa / int_{S^{p-1}} e^(kappa y_1) dy), the sphere integral over the polar angle (mpmath)."""
    with mp.workdps(DPS):
        p, kappa = mp.mpf(dim), mp.mpf(kappa)
        half = (p - 2) / 2
        cos_peak = (mp.sqrt(half**2 + kappa**2) - half) / kappa  # kappa sin^2 = (p - 2) cos
        width = 1 / mp.sqrt(kappa * cos_peak + ((p - 2) / (1 - cos_peak**2) if dim > 2 else 0))
        log_f = lambda th: kappa * mp.cos(th) + ((p - 2) * mp.log(mp.sin(th)) if dim > 2 else 0)  # noqa: E731
        polar = mp_log_integral(log_f, 0, mp.pi, mp.acos(cos_peak), width)
        log_area_ratio = mp.log(mp.pi) / 2 + mp.loggamma((p - 1) / 2) - mp.loggamma(p / 2)  # |S^{p-1}| / |S^{p-2}|
        return float(log_area_ratio + kappa - polar)


# --- Gaussian over a ball --------------------------------------------------------------------


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("radius, sigma", [(0.0, 1.0), (1e-3, 1.0), (1.0, 1.0), (2.5, 0.7), (30.0, 1.5)])
def test_gaussian_ball_matches_direct_integration_in_low_dimension(dim, radius, sigma):
    reference = direct_gaussian_log_capacity(dim, radius, sigma)
    for method in ("sum", "quadrature"):
        assert_log_close(cap.gaussian_ball_log_capacity(dim, radius, sigma, method=method).log, reference)


@pytest.mark.parametrize("dim", DIMS)
def test_gaussian_ball_matches_the_mpmath_radial_integral(dim):
    for rho in RATIOS:
        result = cap.gaussian_ball_log_capacity(dim, rho * 0.37, 0.37)
        reference = mp_gaussian_log_capacity(dim, rho)
        assert_log_close(result.log, reference)
        assert result.bits == pytest.approx(result.log / math.log(2), rel=1e-15)
        if dim <= 10**5:  # beyond, the sum's own error (~1e-16 p log p) passes 1e-10
            assert_log_close(cap.gaussian_ball_log_capacity(dim, rho, 1.0, method="sum").log, reference)


@pytest.mark.parametrize("dim", [1, 2, 3, 7, 64, 500, 3000, 10**5, cap.GAUSSIAN_SUM_MAX_DIM])
def test_finite_sum_and_quadrature_agree(dim):
    # The sum's log Gamma terms (size p log p) cost it ~1e-16 p log p absolutely.
    for rho in (1e-4, 0.03, 0.5, 2.0, 40.0, math.sqrt(dim), 3e3):
        by_sum = cap.gaussian_ball_log_capacity(dim, rho, 1.0, method="sum").log
        by_quadrature = cap.gaussian_ball_log_capacity(dim, rho, 1.0, method="quadrature").log
        allowed = 1e-13 + 1e-15 * dim * math.log(dim + 1) + 1e-14 * abs(by_sum)
        assert abs(by_sum - by_quadrature) <= allowed, (rho, by_sum, by_quadrature)


def test_large_dimension_is_finite_monotone_and_scale_free():
    p = 10**9
    radii = [0.0, 1e-6, 1e-2, 1.0, 10.0, 1e3, 1e5, 1e7]
    by_radius = [cap.gaussian_ball_log_capacity(p, r, 1.0).log for r in radii]
    assert all(math.isfinite(v) for v in by_radius) and by_radius[0] == 0.0
    assert all(a < b for a, b in zip(by_radius, by_radius[1:]))
    by_sigma = [cap.gaussian_ball_log_capacity(p, 1.0, s).log for s in (1e-3, 0.1, 1.0, 10.0, 1e6)]
    assert all(a > b for a, b in zip(by_sigma, by_sigma[1:])) and by_sigma[-1] > 0
    assert cap.gaussian_ball_log_capacity(p, 3.0, 2.0) == cap.gaussian_ball_log_capacity(p, 1.5, 1.0)
    # For rho << sqrt(p), log C ~ rho sqrt(p) - rho^2/4 (chi_p has mean ~ sqrt(p), variance ~ 1/2).
    assert cap.gaussian_ball_log_capacity(p, 1e-3, 1.0).log == pytest.approx(1e-3 * math.sqrt(p), rel=1e-6)


def paper_theorem_iii1_log(dim, radius, sigma):
    """[004] Thm III.1 exactly as printed, in mpmath."""
    with mp.workdps(DPS):
        p, R, s = mp.mpf(dim), mp.mpf(radius), mp.mpf(sigma)
        z = mp.fsum(mp.gamma((p - i) / 2) * (mp.sqrt(2) * s) ** (p - i) * mp.binomial(p - 1, i) * R**i
                    for i in range(dim))
        scale = 2 ** (p / 2) * s**p
        return float(mp.log(2 * z / (mp.gamma(p / 2) * scale) + R**p / (mp.gamma(p / 2 + 1) * scale)))


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_paper_theorem_iii1_double_counts_the_outside_of_the_ball(dim):
    assert paper_theorem_iii1_log(dim, 0.0, 1.0) == pytest.approx(math.log(2.0), rel=1e-15)  # one input, capacity 1
    for radius, sigma in [(1.0, 1.0), (2.5, 0.7)]:
        truth = direct_gaussian_log_capacity(dim, radius, sigma)
        assert paper_theorem_iii1_log(dim, radius, sigma) > truth + 0.1
        # Paper = truth + (outside part): subtracting the ball part once from twice the truth gives it.
        with mp.workdps(DPS):
            inside = float((mp.mpf(radius) / sigma) ** dim / (mp.gamma(mp.mpf(dim) / 2 + 1) * 2 ** (mp.mpf(dim) / 2)))
        paper = math.exp(paper_theorem_iii1_log(dim, radius, sigma))
        assert paper == pytest.approx(2 * math.exp(truth) - inside, rel=1e-10)


# --- Gaussian over a product of balls (per-layer clipping) -----------------------------------


def test_product_of_two_intervals_matches_integration_over_the_plane():
    (c1, c2), sigma = (1.0, 0.3), 0.8
    def sup_density(y2, y1):
        return gaussian_density(distance_squared_to_ball([y1], c1) + distance_squared_to_ball([y2], c2), 2, sigma)
    far = 40 * sigma
    total = integrate.nquad(sup_density, [(-c2 - far, c2 + far), (-c1 - far, c1 + far)],
                            opts=[dict(QUAD, points=[-c2, c2]), dict(QUAD, points=[-c1, c1])])[0]
    assert_log_close(cap.gaussian_product_of_balls_log_capacity([1, 1], [c1, c2], sigma).log, math.log(total))


def test_product_of_disk_and_interval_matches_integration_in_cylindrical_coordinates():
    (disk, interval), sigma = (1.2, 0.5), 0.6
    def sup_density(z, r):  # constant in the angle: 2 pi r
        offset = distance_squared_to_ball([r], disk) + distance_squared_to_ball([z], interval)
        return 2 * math.pi * r * gaussian_density(offset, 3, sigma)
    far = 40 * sigma
    total = integrate.nquad(sup_density, [(-interval - far, interval + far), (0, disk + far)],
                            opts=[dict(QUAD, points=[-interval, interval]), dict(QUAD, points=[disk])])[0]
    result = cap.gaussian_product_of_balls_log_capacity([2, 1], [disk, interval], sigma)
    assert_log_close(result.log, math.log(total))
    # log capacities of the blocks add
    parts = cap.gaussian_ball_log_capacity(2, disk, sigma).log + cap.gaussian_ball_log_capacity(1, interval, sigma).log
    assert result.log == pytest.approx(parts, rel=1e-15)


def test_product_is_below_the_enclosing_ball():
    dims, radii, sigma = [3, 1000, 10**6], [1.0, 0.5, 2.0], 0.05
    product = cap.gaussian_product_of_balls_log_capacity(dims, radii, sigma).log
    enclosing = cap.gaussian_ball_log_capacity(sum(dims), math.hypot(*radii), sigma).log
    assert product < enclosing
    # the docstring's example: two 1-D layers clipped to 1, noise 1
    assert cap.gaussian_product_of_balls_log_capacity([1, 1], [1, 1], 1).log == pytest.approx(1.1732, abs=1e-4)
    assert cap.gaussian_ball_log_capacity(2, math.sqrt(2), 1).log == pytest.approx(1.3277, abs=1e-4)
    assert cap.gaussian_ball_log_capacity(2, 2, 1).log == pytest.approx(1.7060, abs=1e-4)


# --- VMF -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kappa", [1e-6, 0.5, 3.0, 50.0, 1e3])
def test_vmf_matches_integration_on_the_circle_and_the_sphere(kappa):
    # sup over inputs is at x = y: C_p(kappa) e^kappa, with 1/C_p(kappa) = int e^(kappa x.y) dy by quadrature.
    peak = [min(math.pi, 40 / math.sqrt(kappa))]
    circle = 2 * integrate.quad(lambda th: math.exp(kappa * (math.cos(th) - 1)), 0, math.pi, points=peak, **QUAD)[0]
    assert_log_close(cap.vmf_log_capacity(2, kappa).log, math.log(2 * math.pi / circle))
    polar = integrate.quad(lambda th: math.exp(kappa * (math.cos(th) - 1)) * math.sin(th), 0, math.pi,
                           points=peak, **QUAD)[0]
    sphere = 2 * math.pi * polar
    assert_log_close(cap.vmf_log_capacity(3, kappa).log, math.log(4 * math.pi / sphere))


@pytest.mark.parametrize("dim", [2, 3, 4, 10, 100, 1000, 10**4, 10**6, 10**7, 10**9])
def test_vmf_matches_mpmath_for_any_dimension(dim):
    for kappa in (1e-6, 1e-2, 1.0, 10.0, 1e3, 1e5, 1e7, 1e9, dim / 2 - 1, dim / 2 - 0.5):
        if kappa > 0:
            got = cap.vmf_log_capacity(dim, kappa).log
            reference = mp_vmf_log_capacity(dim, kappa)
            assert abs(got - reference) <= 1e-14 * abs(reference), (kappa, got, reference)


def test_vmf_paper_theorem_iv1_is_right():
    for dim in (2, 3, 10, 100):
        for kappa in (0.5, 5.0, 50.0):
            with mp.workdps(DPS):
                p, k = mp.mpf(dim), mp.mpf(kappa)
                paper = 2 / mp.gamma(p / 2) * k ** (p / 2 - 1) / (2 ** (p / 2) * mp.besseli(p / 2 - 1, k)) * mp.exp(k)
            assert cap.vmf_log_capacity(dim, kappa).log == pytest.approx(float(mp.log(paper)), rel=1e-13)


def test_vmf_limits_and_monotonicity():
    assert cap.vmf_log_capacity(10**6, 1e-6).log == pytest.approx(1e-6, rel=1e-6)  # -> 1 as kappa -> 0
    values = [cap.vmf_log_capacity(1000, k).log for k in (1e-3, 1.0, 100.0, 1e4, 1e6)]
    assert all(a < b for a, b in zip(values, values[1:]))
    # kappa >> p: C ~ (kappa / 2 pi)^((p-1)/2) |S^{p-1}| ... grows like kappa^((p-1)/2)
    slope = (cap.vmf_log_capacity(11, 2e9).log - cap.vmf_log_capacity(11, 1e9).log) / math.log(2)
    assert slope == pytest.approx(5.0, rel=1e-6)


# --- DP-SGD ----------------------------------------------------------------------------------


def test_dpsgd_gaussian_is_a_ball_of_radius_c_with_noise_c_sigma_over_l():
    mechanism = cap.dpsgd_gaussian(dim=13_700, clip_norm=2.0, noise_multiplier=1.1, batch_size=64)
    assert mechanism == cap.GaussianBallChannel((13_700,), (2.0,), 2.0 * 1.1 / 64)
    # the capacity depends on L / sigma only, not on c
    other_clip = cap.dpsgd_gaussian(13_700, 0.1, 1.1, 64).log_capacity()
    assert mechanism.log_capacity().log == pytest.approx(other_clip.log, rel=1e-14)
    assert mechanism.log_capacity() == cap.gaussian_ball_log_capacity(13_700, 64 / 1.1, 1.0)


def test_dpsgd_per_layer_is_a_product_of_balls_below_flat_clipping():
    layer_dims, norms = [1000, 10, 5000], [1.0, 0.2, 0.5]
    mechanism = cap.dpsgd_gaussian_per_layer(layer_dims, norms, noise_multiplier=1.0, batch_size=32)
    total_norm = math.hypot(*norms)
    assert mechanism.noise_std == pytest.approx(total_norm / 32, rel=1e-15)
    per_layer = mechanism.log_capacity().log
    layers = [cap.gaussian_ball_log_capacity(d, c, total_norm / 32).log for d, c in zip(layer_dims, norms)]
    assert per_layer == pytest.approx(sum(layers), rel=1e-15)
    flat = cap.dpsgd_gaussian(sum(layer_dims), total_norm, 1.0, 32).log_capacity().log
    assert per_layer < flat
    one_layer = cap.dpsgd_gaussian_per_layer([50], [2.0], 0.8, 4)
    assert one_layer.log_capacity() == cap.dpsgd_gaussian(50, 2.0, 0.8, 4).log_capacity()


def test_dpsgd_vmf_is_vmf_on_the_whole_sphere():
    mechanism = cap.dpsgd_vmf(13_700, 5000.0)
    assert mechanism == cap.VMFChannel(13_700, 5000.0)
    assert mechanism.log_capacity() == cap.vmf_log_capacity(13_700, 5000.0)


# --- argument checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: cap.gaussian_ball_log_capacity(0, 1.0, 1.0), "dim"),
        (lambda: cap.gaussian_ball_log_capacity(2.5, 1.0, 1.0), "dim"),
        (lambda: cap.gaussian_ball_log_capacity(True, 1.0, 1.0), "dim"),
        (lambda: cap.gaussian_ball_log_capacity(3, -1.0, 1.0), "radius"),
        (lambda: cap.gaussian_ball_log_capacity(3, math.inf, 1.0), "radius"),
        (lambda: cap.gaussian_ball_log_capacity(3, 1.0, 0.0), "noise_std"),
        (lambda: cap.gaussian_ball_log_capacity(3, 1.0, math.nan), "noise_std"),
        (lambda: cap.gaussian_ball_log_capacity(3, 1.0, 1.0, method="simpson"), "method"),
        (lambda: cap.gaussian_ball_log_capacity(10**7, 1.0, 1.0, method="sum"), "method"),
        (lambda: cap.gaussian_product_of_balls_log_capacity([1, 2], [1.0], 1.0), "dims"),
        (lambda: cap.gaussian_product_of_balls_log_capacity([1, 0], [1.0, 1.0], 1.0), r"dims\[1\]"),
        (lambda: cap.gaussian_product_of_balls_log_capacity([1, 2], [1.0, -2.0], 1.0), r"radii\[1\]"),
        (lambda: cap.vmf_log_capacity(1, 1.0), "dim"),
        (lambda: cap.vmf_log_capacity(3, 0.0), "kappa"),
        (lambda: cap.vmf_log_capacity(3, math.inf), "kappa"),
        (lambda: cap.dpsgd_gaussian(10, 0.0, 1.0, 8), "clip_norm"),
        (lambda: cap.dpsgd_gaussian(10, 1.0, -1.0, 8), "noise_multiplier"),
        (lambda: cap.dpsgd_gaussian(10, 1.0, 1.0, 0), "batch_size"),
        (lambda: cap.dpsgd_gaussian_per_layer([10, 5], [1.0, math.nan], 1.0, 8), r"clip_norms\[1\]"),
        (lambda: cap.dpsgd_gaussian_per_layer([10], [1.0, 1.0], 1.0, 8), "layer_dims"),
        (lambda: cap.dpsgd_vmf(10, -3.0), "kappa"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        call()


# --- extremes of the representable range, against mpmath ---------------------------------------


def _mp_gaussian_ball_log_capacity(p, radius, noise_std):
    """log of int_0^inf t^(p-1) exp(-max(0, t - rho)^2 / 2) dt / J_0 at 80 digits (rho exact, no overflow)."""
    import mpmath as mp

    with mp.workdps(80):
        p, rho = mp.mpf(p), mp.mpf(radius) / mp.mpf(noise_std)
        log_j0 = (p / 2 - 1) * mp.log(2) + mp.loggamma(p / 2)
        log_inside = p * mp.log(rho) - mp.log(p)
        peak = 2 * (p - 1) / (rho + mp.sqrt(rho**2 + 4 * (p - 1))) if p > 1 else mp.mpf(0)
        log_peak = (p - 1) * mp.log(peak + rho) - peak**2 / 2
        points = sorted({mp.mpf(0), *[x for x in (peak - 40, peak - 10, peak, peak + 10, peak + 40) if x > 0]})
        tail = log_peak + mp.log(mp.quad(lambda u: mp.exp((p - 1) * mp.log(u + rho) - u**2 / 2 - log_peak),
                                         points + [mp.inf]))
        top = max(log_inside, tail)
        return top + mp.log(mp.exp(log_inside - top) + mp.exp(tail - top)) - log_j0


@pytest.mark.parametrize("dim, radius, noise_std", [
    (2**60, 1.0, 1.0), (2**60, 1e-6, 1.0), (2**60, 1e154, 1.0), (2**60, 1e300, 1e-300),
    (10, 1e300, 1.0), (10, 1.0, 1e-300), (10, 1e154, 1.0), (10, 1e300, 1e-300), (1, 1e300, 1e-300),
    (2**62, 1e10, 1e-10), (10**6, 1e100, 1.0),
    # small rho: the cumulant series (the quadrature's absolute error would be a large relative one)
    (1, 1e-10, 1.0), (1, 9.9e-6, 1.0), (2, 1e-6, 1.0), (10, 1e-8, 1.0), (201, 1e-6, 1.0), (10**9, 1e-6, 1.0),
])
def test_gaussian_ball_at_the_extremes_matches_mpmath(dim, radius, noise_std):
    exact = float(_mp_gaussian_ball_log_capacity(dim, radius, noise_std))
    got = cap.gaussian_ball_log_capacity(dim, radius, noise_std).log
    assert math.isfinite(got) and got >= 0
    assert got == pytest.approx(exact, rel=1e-13)


def test_gaussian_ball_with_rho_below_the_smallest_float_is_tiny_but_positive():
    got = cap.gaussian_ball_log_capacity(10, 1e-300, 1.0).log
    mean_chi_10 = math.sqrt(2) * math.gamma(5.5) / math.gamma(5)  # log C ~ rho E[chi_10]
    assert got == pytest.approx(1e-300 * mean_chi_10, rel=1e-14)
    assert cap.gaussian_ball_log_capacity(10, 1e-300, 1e300).log == 0.0  # rho underflows to 0 exactly


@pytest.mark.parametrize("dim, kappa", [(10, 1e300), (3, 1e154), (2**20, 1e300), (2**60, 1e300), (2**60, 1.0)])
def test_vmf_at_the_extremes_matches_mpmath(dim, kappa):
    import mpmath as mp

    with mp.workdps(40 + int(math.log10(kappa))):
        p, k = mp.mpf(dim), mp.mpf(kappa)
        nu = p / 2 - 1
        exact = mp.log(2) + nu * mp.log(k) + k - mp.loggamma(p / 2) - (p / 2) * mp.log(2) - mp.log(mp.besseli(nu, k))
    assert cap.vmf_log_capacity(dim, kappa).log == pytest.approx(float(exact), rel=1e-13)


def test_dpsgd_gaussian_with_tiny_noise_is_finite_and_right():
    mechanism = cap.dpsgd_gaussian(10, 1.0, 1e-300, 1)
    assert mechanism.log_capacity().log == pytest.approx(float(_mp_gaussian_ball_log_capacity(10, 1.0, 1e-300)),
                                                         rel=1e-13)


@pytest.mark.parametrize("args", [(10, 1.0, 1e-300, 2**60), (10, 1e300, 1e300, 1), (10, 1e-300, 1e-10, 1)])
def test_dpsgd_gaussian_noise_outside_float64_is_refused(args):
    with pytest.raises(ValueError, match="^noise_multiplier: the noise std"):
        cap.dpsgd_gaussian(*args)


@pytest.mark.parametrize("call, name", [
    (lambda: cap.gaussian_ball_log_capacity("3", 1.0, 1.0), "dim"),
    (lambda: cap.gaussian_ball_log_capacity(3.5, 1.0, 1.0), "dim"),
    (lambda: cap.gaussian_ball_log_capacity(2**70, 1.0, 1.0), "dim"),
    (lambda: cap.gaussian_ball_log_capacity(3, "1", 1.0), "radius"),
    (lambda: cap.gaussian_ball_log_capacity(3, 1.0, True), "noise_std"),
    (lambda: cap.gaussian_ball_log_capacity(3, 1.0, None), "noise_std"),
    (lambda: cap.vmf_log_capacity(3, "1"), "kappa"),
    (lambda: cap.dpsgd_gaussian(10, 1.0, 1.0, 2**70), "batch_size"),
    (lambda: cap.dpsgd_vmf(None, 1.0), "dim"),
    (lambda: cap.GaussianNoise("1"), "noise_std"),
])
def test_wrong_types_are_named(call, name):
    with pytest.raises((TypeError, ValueError), match=rf"^{name}"):
        call()


def test_whole_float_dims_and_batch_sizes_are_accepted():
    # dpsgd.privacy_report passes a float expected batch size when it is whole (64.0).
    assert cap.dpsgd_gaussian(10, 1.0, 1.0, 64.0) == cap.dpsgd_gaussian(10, 1.0, 1.0, 64)
    assert cap.gaussian_ball_log_capacity(1e9, 1.0, 1.0) == cap.gaussian_ball_log_capacity(10**9, 1.0, 1.0)


@pytest.mark.parametrize("kappa", [1e3, 1e200])
def test_estimate_keeps_exact_weights_where_the_exponents_are_huge(kappa):
    # N orthonormal inputs under VMF of large kappa: the densities' overlap is below e^-(kappa/2),
    # so C = N to working precision (every weight is N). At kappa = 1e200 the exponents are about
    # 1e200 and a difference of two of them used to round to 0, giving log C = 0.
    inputs = np.eye(4)
    for proposal in (None, inputs[::-1].copy()):
        est = cap.estimate(cap.VMFNoise(kappa), inputs, 200, seed=3, proposal=proposal)
        assert est.log == pytest.approx(math.log(4), rel=1e-12)
