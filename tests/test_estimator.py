"""privleak.capacity.estimate against capacities computed independently of it.

- 1-D grids: the sup over a finite set of points is the density of the nearest point, so the
  capacity is a sum over Voronoi cells (intervals) of the density's mass there: normal CDF
  differences (Gaussian), exponentials (Laplace).
- 2-D product grids: the noise and the input set are both products, so the capacity is the
  product of the 1-D ones.
- A few points in the plane: brute-force numerical integration of max_i f(x_i)(y) on a grid.
- Points on the circle (VMF): each Voronoi arc gives the same integral, by scipy quadrature.
- A grid filling a disk: between rigorous bounds from the closed form of the ball
  (capacity.gaussian_ball_log_capacity) and a radial integral, i.e. convergence to the closed
  form as the grid gets finer.
Each estimate must hold the reference inside its 99% interval, and the interval must be narrow
enough for that to mean something. Seeds are fixed, so the tests are deterministic.
"""
import math

import numpy as np
import pytest
from privleak import capacity as cap
from scipy import integrate
from scipy.special import i0e, ndtr

CONFIDENCE = 0.99


def assert_within_interval(result, log_reference, max_width=0.03):
    low, high = result.log_interval
    assert low <= log_reference <= high, (result, log_reference)
    assert high - low < max_width, result
    assert result.bits == pytest.approx(result.log / math.log(2))


def voronoi_cells(points):
    """Cell [a_i, b_i] of each of the sorted 1-D points: halfway to its neighbours."""
    midpoints = (points[1:] + points[:-1]) / 2
    return np.concatenate([[-np.inf], midpoints]), np.concatenate([midpoints, [np.inf]])


def gaussian_capacity_1d(points, sigma):
    a, b = voronoi_cells(np.sort(points))
    x = np.sort(points)
    return float(np.sum(ndtr((b - x) / sigma) - ndtr((a - x) / sigma)))


def laplace_capacity_1d(points, scale):
    # The Laplace density's mass on [x - s, x + t] is (1 - e^(-s/b)) / 2 + (1 - e^(-t/b)) / 2.
    a, b = voronoi_cells(np.sort(points))
    x = np.sort(points)
    return float(np.sum(-np.expm1(-(x - a) / scale) / 2 - np.expm1(-(b - x) / scale) / 2))


def grid(radius, count):
    return np.linspace(-radius, radius, count)


def column(values):
    return np.asarray(values, dtype=np.float64)[:, None]


def test_gaussian_on_a_fine_1d_grid_matches_the_voronoi_sum_and_the_interval_closed_form():
    points = grid(2.0, 401)  # spacing 0.01 sigma
    exact = gaussian_capacity_1d(points, 1.0)
    # The grid fills [-2, 2]: its capacity is within 1e-4 of the interval's closed form.
    assert exact == pytest.approx(math.exp(cap.gaussian_ball_log_capacity(1, 2.0, 1.0).log), rel=1e-4)
    result = cap.estimate(cap.GaussianNoise(1.0), column(points), 20_000, seed=1, confidence=CONFIDENCE)
    assert_within_interval(result, math.log(exact))


def test_laplace_on_a_1d_grid_matches_the_voronoi_sum():
    points = grid(3.0, 301)
    exact = laplace_capacity_1d(points, 0.5)
    # Against the interval [-R, R], C = 1 + R / b: the density's cusp makes each cell lose a
    # first-order fraction of about h / (4 b) = 1% (h = 0.02 the spacing).
    assert exact == pytest.approx(1 + 3.0 / 0.5, rel=0.01)
    result = cap.estimate(cap.LaplaceNoise(0.5), column(points), 20_000, seed=2, confidence=CONFIDENCE)
    assert_within_interval(result, math.log(exact))


@pytest.mark.parametrize("family, capacity_1d", [(cap.GaussianNoise(0.7), gaussian_capacity_1d),
                                                 (cap.LaplaceNoise(0.7), laplace_capacity_1d)])
def test_product_grids_in_the_plane_have_the_product_capacity(family, capacity_1d):
    first, second = grid(1.0, 41), np.array([-0.5, 0.0, 0.3, 2.0])
    points = np.stack(np.meshgrid(first, second, indexing="ij"), axis=-1).reshape(-1, 2)
    scale = family.noise_std if isinstance(family, cap.GaussianNoise) else family.scale
    exact = capacity_1d(first, scale) * capacity_1d(second, scale)
    result = cap.estimate(family, points, 20_000, seed=3, confidence=CONFIDENCE)
    assert_within_interval(result, math.log(exact))


def test_a_few_points_in_the_plane_match_brute_force_integration():
    points = np.array([[0.0, 0.0], [1.5, 0.2], [-0.7, 1.1], [0.4, -2.0], [0.45, -1.9]])
    sigma = 0.8
    step = 0.01
    axis = np.arange(-7.0, 7.0, step) + step / 2  # midpoint rule; the integrand is below e^-30 outside
    y1, y2 = np.meshgrid(axis, axis, indexing="ij")
    nearest_squared = np.min([(y1 - x) ** 2 + (y2 - z) ** 2 for x, z in points], axis=0)
    exact = np.exp(-nearest_squared / (2 * sigma**2)).sum() * step**2 / (2 * math.pi * sigma**2)
    result = cap.estimate(cap.GaussianNoise(sigma), points, 40_000, seed=4, confidence=CONFIDENCE)
    assert_within_interval(result, math.log(exact))


@pytest.mark.parametrize("kappa, count", [(10.0, 60), (1000.0, 800)])
def test_vmf_on_the_circle_matches_quadrature_and_converges_to_theorem_iv1(kappa, count):
    angles = 2 * math.pi * np.arange(count) / count
    points = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    # Each of the count arcs of half-width pi / count carries int e^(kappa cos t) dt / (2 pi I_0(kappa)).
    arc, _ = integrate.quad(lambda t: math.exp(kappa * (math.cos(t) - 1)), -math.pi / count, math.pi / count,
                            epsabs=0, epsrel=1e-12)
    exact = count * arc / (2 * math.pi * i0e(kappa))
    # Against the whole circle (Thm IV.1): the arcs lose at most a factor e^(kappa (cos(pi / count) - 1)).
    log_circle = cap.vmf_log_capacity(2, kappa).log
    assert log_circle + kappa * (math.cos(math.pi / count) - 1) <= math.log(exact) <= log_circle
    result = cap.estimate(cap.VMFNoise(kappa), points, 20_000, seed=5, confidence=CONFIDENCE)
    assert_within_interval(result, math.log(exact))


def test_gaussian_on_a_grid_filling_a_disk_converges_to_the_ball_closed_form():
    # The grid points of spacing h inside the disk of radius R cover the disk of radius
    # R - h / sqrt(2) to within h / sqrt(2), so for every output y the nearest point is at most
    # d(y, B(R - h / sqrt 2)) + h / sqrt 2 away: C is at least the radial integral below, and at
    # most the capacity of the whole disk (a superset).
    radius, sigma, h = 1.5, 1.0, 0.03
    axis = np.arange(-radius, radius + h / 2, h)
    points = np.stack(np.meshgrid(axis, axis, indexing="ij"), axis=-1).reshape(-1, 2)
    points = points[np.linalg.norm(points, axis=1) <= radius]
    inner, slack = radius - h / math.sqrt(2), h / math.sqrt(2)

    def density(distance):
        return math.exp(-distance**2 / (2 * sigma**2)) / (2 * math.pi * sigma**2)

    log_lower = math.log(math.pi * inner**2 * density(slack) + integrate.quad(
        lambda t: 2 * math.pi * t * density(t - inner + slack), inner, inner + 40, epsabs=0, epsrel=1e-12)[0])
    log_upper = cap.gaussian_ball_log_capacity(2, radius, sigma).log
    assert log_upper - log_lower < 0.035  # first order in h: 0.03 here
    result = cap.estimate(cap.GaussianNoise(sigma), points, 20_000, seed=6, confidence=CONFIDENCE)
    low, high = result.log_interval
    assert log_lower <= high and low <= log_upper, (result, log_lower, log_upper)


def test_a_subset_proposal_is_still_unbiased():
    points = grid(2.0, 201)
    result = cap.estimate(cap.GaussianNoise(0.5), column(points), 20_000, proposal=column(points[::10]), seed=7,
                          confidence=CONFIDENCE)
    assert_within_interval(result, math.log(gaussian_capacity_1d(points, 0.5)))


def test_float32_inputs_give_the_same_estimate_to_float32_precision():
    points = grid(2.0, 101)
    double = cap.estimate(cap.GaussianNoise(1.0), column(points), 5_000, seed=8)
    single = cap.estimate(cap.GaussianNoise(1.0), column(points).astype(np.float32), 5_000, seed=8)
    assert single.log == pytest.approx(double.log, abs=1e-5)


def test_a_single_input_has_capacity_one_exactly():
    result = cap.estimate(cap.LaplaceNoise(1.0), np.array([[0.3, -2.0, 5.0]]), 100, seed=9)
    assert result.log == 0.0 and result.std_error == 0.0 and result.log_interval == (0.0, 0.0)


def test_the_same_seed_gives_the_same_estimate():
    points = np.random.default_rng(10).standard_normal((50, 3))
    first = cap.estimate(cap.GaussianNoise(1.0), points, 1000, seed=11)
    assert cap.estimate(cap.GaussianNoise(1.0), points, 1000, seed=11) == first
    assert cap.estimate(cap.GaussianNoise(1.0), points, 1000, seed=12) != first
    # batches are cut from one stream of draws per batch; the batch size changes the draws but not the law
    other = cap.estimate(cap.GaussianNoise(1.0), points, 1000, seed=11, batch_size=100)
    assert other.n_samples == first.n_samples == 1000
    # Two estimates of the same log C, each with its own delta-method standard error: their
    # difference has standard deviation at most hypot(se1, se2) (their shared first-batch indices
    # correlate them positively, which only shrinks it), so a correct estimator exceeds Z = 4 of
    # it with probability < 1e-4. Here z = -0.30 (over 80 seed pairs the spread of z was 0.77).
    assert abs(other.log - first.log) < 4 * math.hypot(first.std_error, other.std_error)


@pytest.mark.parametrize(
    "mechanism, inputs, kwargs, error, words",
    [
        ("gaussian", np.zeros((2, 2)), {}, TypeError, "mechanism must be GaussianNoise, VMFNoise or LaplaceNoise"),
        (cap.GaussianNoise(1.0), np.zeros(3), {}, ValueError, "inputs must be a non-empty 2-D array"),
        (cap.GaussianNoise(1.0), np.zeros((0, 2)), {}, ValueError, "inputs must be a non-empty 2-D array"),
        (cap.GaussianNoise(1.0), np.array([[np.nan, 0.0]]), {}, ValueError, "inputs must be finite"),
        (cap.GaussianNoise(1.0), np.array([["a", "b"]]), {}, TypeError, "inputs must hold real numbers"),
        (cap.GaussianNoise(1.0), np.zeros((2, 2)), {"n_samples": 1}, ValueError, "n_samples must be >= 2"),
        (cap.GaussianNoise(1.0), np.zeros((2, 2)), {"confidence": 1.0}, ValueError, "confidence must be < 1"),
        (cap.GaussianNoise(1.0), np.zeros((2, 2)), {"proposal": np.zeros((2, 3))}, ValueError,
         "proposal must have 2 columns"),
        (cap.VMFNoise(1.0), np.array([[1.0, 1.0]]), {}, ValueError, "inputs must be unit vectors"),
        (cap.VMFNoise(1.0), np.array([[1.0]]), {}, ValueError, "p >= 2 columns"),
    ],
)
def test_bad_arguments_are_rejected_with_the_argument_named(mechanism, inputs, kwargs, error, words):
    with pytest.raises(error, match=words):
        cap.estimate(mechanism, inputs, **kwargs)


@pytest.mark.parametrize("make, name", [(lambda: cap.GaussianNoise(0.0), "noise_std"),
                                        (lambda: cap.VMFNoise(-1.0), "kappa"),
                                        (lambda: cap.LaplaceNoise(float("nan")), "scale")])
def test_bad_noise_parameters_are_rejected(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_inputs_whose_noise_barely_overlaps_need_the_bernstein_interval():
    """Two points 1.24 apart, noise std 0.133: their densities overlap where 4000 draws rarely
    land, so the weights are all 2 to rounding. The delta method's 99% interval then misses the
    exact log C = log(2 Phi(d / 2 s)) in most seeds; the empirical Bernstein one never does here,
    and it is refused with a proposal other than the inputs (unbounded weights)."""
    from scipy.stats import norm

    sigma, distance = 0.13299657909531676, 1.242717389838876
    exact = math.log(2 * norm.cdf(distance / (2 * sigma)))
    points = np.array([[0.0], [distance]])
    delta_misses = bernstein_misses = 0
    for seed in range(20):
        for method in ("delta", "bernstein"):
            low, high = cap.estimate(cap.GaussianNoise(sigma), points, 4000, seed=seed, confidence=CONFIDENCE,
                                     interval=method).log_interval
            missed = not low <= exact <= high
            delta_misses += missed and method == "delta"
            bernstein_misses += missed and method == "bernstein"
            assert method == "delta" or 0.0 <= low <= high <= math.log(2)  # clipped to [log 1, log N]
    assert delta_misses >= 10 and bernstein_misses == 0  # 93 of 100 seeds missed with the delta method
    with pytest.raises(ValueError, match="interval='bernstein' needs the default proposal"):
        cap.estimate(cap.GaussianNoise(sigma), points, 100, proposal=points[:1], interval="bernstein")
    with pytest.raises(ValueError, match="interval must be one of"):
        cap.estimate(cap.GaussianNoise(sigma), points, 100, interval="wald")


@pytest.mark.parametrize("mechanism", [cap.GaussianNoise(0.3), cap.LaplaceNoise(0.3), cap.VMFNoise(20.0)],
                         ids=["gaussian", "laplace", "vmf"])
def test_the_estimate_does_not_depend_on_the_threads(mechanism):
    """Each of privleak's threads takes a share of the draws: every draw's weight is computed alike
    whatever the share, so 1, 2 and 3 threads give the same bits (three batches, the last short)."""
    import privleak

    inputs = np.random.default_rng(0).normal(size=(300, 17))
    inputs /= np.linalg.norm(inputs, axis=1, keepdims=True)  # on the sphere, for VMF
    before = privleak.num_threads()
    try:
        found = []
        for threads in (1, 2, 3):
            privleak.set_num_threads(threads)
            found.append(cap.estimate(mechanism, inputs, 2500, seed=3, batch_size=1000))
    finally:
        privleak.set_num_threads(before)
    assert found[0] == found[1] == found[2]
