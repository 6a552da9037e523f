"""Laplace DP-SGD (privleak.dpsgd.Laplace): the step against a hand-written one, its epsilon
against a brute-force composition and dp-accounting's Laplace PLD, its Bayes capacity against
direct integration and the Monte Carlo estimator."""
import itertools
import math

import mpmath
import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch
from dp_accounting.pld import privacy_loss_distribution
from privleak import capacity, dpsgd, mechanisms
from privleak.dpsgd.laplace import log_l1_ball_capacity

SHAPES = [(5, 6), (5,), (3, 2, 2)]


def _grads(batch: int, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *shape, generator=generator) * 0.7 for shape in SHAPES]


def _hand_written_step(grads, clip_norms, per_layer, noise_multiplier, batch_size, seed) -> list:
    """Clip in L1 (float64), sum, divide by L, add Laplace(noise_multiplier c_1 / L) per coordinate
    drawn tensor by tensor from one NoiseGenerator."""
    flat = torch.cat([g.double().flatten(1) for g in grads], dim=1)
    sizes = [math.prod(g.shape[1:]) for g in grads]
    if per_layer:
        parts = flat.split(sizes, dim=1)
        clipped = [p * torch.clamp(c / p.abs().sum(1, keepdim=True), max=1.0) for p, c in zip(parts, clip_norms)]
        total = sum(clip_norms)
    else:
        factor = torch.clamp(clip_norms[0] / flat.abs().sum(1, keepdim=True), max=1.0)
        clipped = (flat * factor).split(sizes, dim=1)
        total = clip_norms[0]
    generator = mechanisms.NoiseGenerator(seed)
    scale = noise_multiplier * total / batch_size
    return [(c.sum(0) / batch_size).float().reshape(g.shape[1:]) + mechanisms.laplace_noise(g[0].numel(), scale,
            generator=generator).reshape(g.shape[1:]) for c, g in zip(clipped, grads)]


@pytest.mark.parametrize("per_layer, clip_norm", [(False, [2.0]), (True, [1.0, 0.5, 2.0])])
def test_step_equals_hand_written(per_layer, clip_norm):
    grads = _grads(7)
    config = dpsgd.DPSGDConfig(clip_norm if per_layer else clip_norm[0], "laplace", noise_multiplier=0.3,
                               per_layer=per_layer)
    released = dpsgd.privatize(grads, config, 8.0, mechanisms.NoiseGenerator(11))
    expected = _hand_written_step(grads, clip_norm, per_layer, 0.3, 8.0, 11)
    for r, e in zip(released, expected):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)


def test_noise_is_laplace_of_the_stated_scale():
    """Zero gradients: the release is the noise alone, Laplace(noise_multiplier c / L)."""
    grads = [torch.zeros(3, 20_000)]
    released = dpsgd.privatize(grads, dpsgd.DPSGDConfig(1.5, "laplace", noise_multiplier=2.0), 4.0,
                               mechanisms.NoiseGenerator(3))[0]
    statistic = scipy.stats.kstest(released.double().numpy(), scipy.stats.laplace(scale=2.0 * 1.5 / 4.0).cdf)
    assert statistic.pvalue > 1e-3


def test_clipping_is_in_l1():
    """One sample of L1 norm 4 clipped to 1: its L1 norm after clipping is 1 (its L2 norm is not)."""
    g = torch.tensor([[3.0, -1.0]])
    config = dpsgd.DPSGDConfig(1.0, dpsgd.ClipOnly(norm_type=1))
    average = dpsgd.privatize([g], config, 1.0)[0]
    torch.testing.assert_close(average, torch.tensor([0.75, -0.25]))


def test_secure_generator_draws_laplace():
    """Laplace noise of the scale b / L = 0.5 raised to cover the grid's rounding of 50 000 values
    (1.048 times: mechanisms.secure_scale; at 0.5 itself the test failed one run in a few)."""
    grads = [torch.zeros(2, 50_000)]
    released = dpsgd.privatize(grads, dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=1.0), 2.0,
                               mechanisms.SecureNoiseGenerator())[0]
    scale = mechanisms.secure_scale("laplace", 0.5, 0.5, 50_000)
    assert 1.04 < scale / 0.5 < 1.06
    # Fresh OS entropy every run: a threshold that fails falsely once in a million runs.
    assert scipy.stats.kstest(released.double().numpy(), scipy.stats.laplace(scale=scale).cdf).pvalue > 1e-6


def _brute_force_rr_epsilon(epsilon: float, q: float, steps: int, delta: float) -> float:
    """The least eps_T with max(H_{e^eps_T}(P'^T || Q^T), H(Q^T || P'^T)) <= delta, P = RR(eps),
    P' = q P + (1 - q) Q, by enumerating all 2^T outcome sequences."""
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    first = (q * p + (1 - q) * (1 - p), 1 - (q * p + (1 - q) * (1 - p)))
    second = (1 - p, p)

    def divergence(eps_t: float, a, b) -> float:
        total = 0.0
        for outcome in itertools.product((0, 1), repeat=steps):
            pa = math.prod(a[o] for o in outcome)
            pb = math.prod(b[o] for o in outcome)
            total += max(0.0, pa - math.exp(eps_t) * pb)
        return total

    def excess(eps_t: float) -> float:
        return max(divergence(eps_t, first, second), divergence(eps_t, second, first)) - delta

    return scipy.optimize.brentq(excess, 0.0, steps * epsilon + 1e-9, xtol=1e-12) if excess(0.0) > 0 else 0.0


@pytest.mark.parametrize("noise_multiplier, q, steps, delta", [
    (1.0, 1.0, 6, 1e-3), (0.5, 0.3, 8, 1e-4), (2.0, 0.1, 10, 1e-5), (0.8, 0.5, 7, 1e-2)])
def test_epsilon_equals_brute_force_composition(noise_multiplier, q, steps, delta):
    config = dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=noise_multiplier)
    report = dpsgd.privacy_report(config, [(4,)], expected_batch_size=q * 1000, dataset_size=1000, steps=steps,
                                  delta=delta)
    expected = _brute_force_rr_epsilon(1.0 / noise_multiplier, q, steps, delta)
    assert report.epsilon == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_fixed_size_batches_use_replace_one_sensitivity():
    """Fixed-size batches: replace-one neighbours move the clipped sum by 2 c_1, so the step
    epsilon doubles."""
    config = dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=2.0)
    report = dpsgd.privacy_report(config, [(4,)], expected_batch_size=100, dataset_size=1000, steps=6, delta=1e-4,
                                  sampling="fixed")
    assert report.epsilon == pytest.approx(_brute_force_rr_epsilon(1.0, 0.1, 6, 1e-4), rel=1e-6)


@pytest.mark.parametrize("noise_multiplier, q, steps", [(1.0, 1.0, 10), (0.5, 0.2, 20), (2.0, 0.05, 50)])
def test_epsilon_is_sound_for_the_laplace_mechanism(noise_multiplier, q, steps):
    """dp-accounting's PLD of the (subsampled) Laplace mechanism itself is at most privleak's
    epsilon (randomised response dominates every pure-DP mechanism), and not far below it."""
    delta = 1e-5
    config = dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=noise_multiplier)
    ours = dpsgd.privacy_report(config, [(4,)], expected_batch_size=q * 1000, dataset_size=1000, steps=steps,
                                delta=delta).epsilon
    pld = privacy_loss_distribution.from_laplace_mechanism(noise_multiplier, sensitivity=1.0, sampling_prob=q,
                                                          value_discretization_interval=1e-4)
    peer = pld.self_compose(steps).get_epsilon_for_delta(delta)
    assert peer <= ours * (1 + 1e-6)
    assert ours <= 2.0 * peer


def test_one_update_epsilon_and_calibration():
    mechanism = dpsgd.Laplace.calibrate(3.0, 0.0)
    assert mechanism.noise_multiplier == pytest.approx(2.0 / 3.0)
    assert mechanism.update_epsilon(0.0) == pytest.approx(3.0)


def _sup_density_l1_ball(y1, y2, radius, scale):
    return math.exp(-max(0.0, abs(y1) + abs(y2) - radius) / scale) / (2 * scale) ** 2


@pytest.mark.parametrize("a", [0.05, 1.0, 3.7])
def test_capacity_closed_form_equals_direct_integration(a):
    """dim 1: C = 1 + a exactly; dim 2: the integral of sup_x f(x)(y) over the plane."""
    assert math.exp(log_l1_ball_capacity(1, a)) == pytest.approx(1 + a, rel=1e-14)
    def inner(y1):  # over y2 >= 0, split where |y1| + y2 reaches the ball's edge
        kink = max(0.0, a - y1)
        return sum(scipy.integrate.quad(lambda y2: _sup_density_l1_ball(y1, y2, a, 1.0), lo, hi, epsabs=1e-14,
                                         epsrel=1e-12)[0] for lo, hi in ((0.0, kink), (kink, kink + 60.0)))

    quadrant = sum(scipy.integrate.quad(inner, lo, hi, epsabs=1e-13, epsrel=1e-11)[0]
                   for lo, hi in ((0.0, a), (a, a + 60.0)))
    integral = 4.0 * quadrant  # the sup density is symmetric in each coordinate
    assert math.exp(log_l1_ball_capacity(2, a)) == pytest.approx(integral, rel=1e-7)


@pytest.mark.parametrize("dim, a", [(3, 0.5), (50, 10.0), (13_000, 2.0), (13_000, 5e5), (10, 11.0001), (10**6, 1e9)])
def test_capacity_closed_form_equals_series_in_high_precision(dim, a):
    mpmath.mp.dps = 40
    a_mp, total, term = mpmath.mpf(a), mpmath.mpf(0), mpmath.mpf(1)
    if dim <= 20_000:
        for j in range(dim + 1):
            total += term
            term = term * a_mp / (j + 1)
        expected = float(mpmath.log(total))
    else:  # a >> dim: e^a P(Poisson(a) <= dim) through mpmath's regularised incomplete gamma
        expected = float(a_mp + mpmath.log(mpmath.gammainc(dim + 1, a_mp, mpmath.inf, regularized=True)))
    assert log_l1_ball_capacity(dim, a) == pytest.approx(expected, rel=1e-12)


def test_per_layer_capacity_is_the_product_integral():
    """Two layers of one coordinate, radii 0.5 and 1.5: the input set is a rectangle and the sup
    density is exp(-(d_1 + d_2) / s) / (2 s)^2, d_t the distance outside each side."""
    config = dpsgd.DPSGDConfig([0.5, 1.5], "laplace", noise_multiplier=1.0, per_layer=True)
    report = dpsgd.privacy_report(config, [(1,), (1,)], expected_batch_size=1, dataset_size=10, steps=1, delta=0.0)
    scale = 2.0  # noise_multiplier (0.5 + 1.5) / L

    def sup_density(y2, y1):
        return math.exp(-(max(0.0, abs(y1) - 0.5) + max(0.0, abs(y2) - 1.5)) / scale) / (2 * scale) ** 2

    integral = scipy.integrate.dblquad(sup_density, -80, 80, -80, 80, epsabs=1e-12)[0]
    assert math.exp(report.capacity_log) == pytest.approx(integral, rel=1e-6)


def test_flat_capacity_in_the_report_and_the_estimator():
    """The report's capacity (dim 2, a = L / noise_multiplier) equals the closed form; the Monte
    Carlo estimator over a dense finite subset of the L1 ball approaches it from below."""
    config = dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=0.5)
    report = dpsgd.privacy_report(config, [(2,)], expected_batch_size=1, dataset_size=10, steps=1, delta=0.0)
    assert report.capacity_log == pytest.approx(math.log(1 + 2.0 + 2.0**2 / 2), rel=1e-12)
    grid = np.linspace(-1, 1, 21)
    points = np.array([(x, y) for x in grid for y in grid if abs(x) + abs(y) <= 1.0 + 1e-12])
    result = capacity.estimate(capacity.LaplaceNoise(0.5), points, 40_000, seed=0)
    # direct integration of max_i f(x_i)(y) by the midpoint rule on [-7, 7]^2 (the mass beyond is e^-12)
    step = 0.02
    axis = np.arange(-7.0 + step / 2, 7.0, step)
    total = 0.0
    for y1 in np.array_split(axis, 70):
        ys = np.stack(np.meshgrid(y1, axis, indexing="ij"), -1).reshape(-1, 1, 2)
        total += np.exp(-np.abs(ys - points).sum(-1).min(1) / 0.5).sum()
    direct = math.log(total * step**2 / (2 * 0.5) ** 2)
    assert result.log_interval[0] - 1e-3 <= direct <= result.log_interval[1] + 1e-3
    assert direct <= report.capacity_log
    assert direct == pytest.approx(report.capacity_log, abs=0.15)


def test_bad_parameters_name_the_argument():
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=0.0)
    with pytest.raises(TypeError, match="kappa"):
        dpsgd.DPSGDConfig(1.0, "laplace", kappa=1.0)
