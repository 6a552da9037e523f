"""privleak.bayesian_privacy: the MBP / ABP estimators of [000] App. C-D against exact values.

The synthetic mechanism: three data values with a known prior, a 3 x 3 channel, and the Bayes-
optimal attack that guesses by drawing from the posterior, so that f(d | w) is exactly the
posterior and the estimands are the exact MBP and ABP of privleak.channels (themselves checked
against plain loops in test_channels.py). Every count is what that attack produces; the error
bounds are checked against exact binomial probabilities (scipy.stats) and the loop JS divergence
of tests/discrete_channels.py. Monte Carlo runs use fixed seeds; coverage is judged by a one-sided
binomial test at level 1e-3, not by a hand-picked count.
"""
import math

import discrete_channels as ref
import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from privleak import bayesian_privacy as bp
from privleak import channels as ch
from privleak import relations as rel
from scipy.optimize import brentq
from scipy.stats import binom

# Joint counts J[d, w] with equal column sums 9: the posterior P(d | w) = J[d, w] / 9 is a whole
# number of ninths, so 9 k attack runs can produce exactly the expected counts.
JOINT = np.array([[6, 1, 2], [2, 4, 1], [1, 4, 6]], dtype=float)
PRIOR = JOINT.sum(axis=1) / JOINT.sum()
CHANNEL = JOINT / JOINT.sum(axis=1, keepdims=True)
POSTERIOR = (JOINT / JOINT.sum(axis=0)).T  # POSTERIOR[w, d]: what the attack draws its guess from
SECRET = 0  # the private data value the mechanism is run on
EVERY_RELEASE = np.arange(3)
# Releases of SECRET in exact proportion to CHANNEL[SECRET] = (6, 1, 2) / 9.
PROPORTIONAL_RELEASES = np.repeat(EVERY_RELEASE, JOINT[SECRET].astype(int))
TRUE_XI = ch.mbp_xi(CHANNEL, PRIOR)
TRUE_C1 = ch.abp_epsilons(CHANNEL, PRIOR)[SECRET]


def attack_counts(rng, releases, trials, repetitions=None):
    """Counts of the posterior-sampling attack: each run on release w guesses d ~ POSTERIOR[w]."""
    size = None if repetitions is None else (repetitions, len(releases))
    return rng.multinomial(trials, POSTERIOR[releases], size=size)


def xi_over(releases):
    """The exact MBP over the given releases: max |log(P(d | w) / P(d))|."""
    return float(np.abs(np.log(POSTERIOR[releases] / PRIOR)).max())


def assert_coverage(failures, repetitions, confidence):
    """Fail if `failures` misses out of `repetitions` are too many for a rate of 1 - confidence."""
    p_value = binom.sf(failures - 1, repetitions, 1.0 - confidence)
    assert p_value > 1e-3, f"{failures} of {repetitions} intervals missed the truth at confidence {confidence}"


def js(a, b):
    """JS divergence by the plain loop, with rounding below 0 clipped (for the square roots)."""
    return max(ref.js_divergence([float(v) for v in a], [float(v) for v in b]), 0.0)


def paper_c1_bound(epsilon):
    """[000] Thm D.1 as printed."""
    return math.sqrt((1 + epsilon) * math.log((1 + epsilon) / (1 - epsilon)) / 2
                     + (epsilon + max(math.log1p(epsilon), -math.log1p(-epsilon))) / 2)


def two_sided_failure(trials, p, epsilon):
    """Exact P(|X / trials - p| > epsilon p) for X ~ Binomial(trials, p)."""
    mu = trials * p
    above = binom.sf(math.floor(mu * (1 + epsilon)), trials, p)
    below = binom.cdf(math.ceil(mu * (1 - epsilon)) - 1, trials, p)
    return above + below


# --- counting ------------------------------------------------------------------------------------


def test_count_recoveries_applies_the_criterion_to_every_run():
    scores = np.random.default_rng(0).random((4, 7, 5))
    above = bp.count_recoveries(scores, "above", 0.6)
    below = bp.count_recoveries(scores, "below", 0.3, batch_size=3)
    banded = bp.count_recoveries(scores, lambda s, t: np.abs(s - 0.5) < t, 0.1)
    for m in range(4):
        for d in range(5):
            runs = scores[m, :, d]
            assert above.successes[m, d] == sum(s > 0.6 for s in runs)
            assert below.successes[m, d] == sum(s < 0.3 for s in runs)
            assert banded.successes[m, d] == sum(abs(s - 0.5) < 0.1 for s in runs)
    assert (above.trials, above.batch_size, below.batch_size) == (7, 5, 3)
    np.testing.assert_array_equal(above.posteriors, above.successes / 35)
    np.testing.assert_array_equal(above.belief, above.successes.mean(axis=0) / 35)


def test_posterior_sampling_attack_end_to_end():
    """Runs, scores, counts and estimates, as the FL loop will produce them, on the synthetic mechanism."""
    rng = np.random.default_rng(1)
    releases, trials = rng.choice(3, size=300, p=CHANNEL[SECRET]), 200
    guesses = np.array([rng.choice(3, size=trials, p=POSTERIOR[w]) for w in releases])
    distances = np.abs(guesses[:, :, None] - np.arange(3)).astype(float)  # scores[m, t, d]
    counts = bp.count_recoveries(distances, "below", 0.5, batch_size=1)  # success: the guess is d
    for m in range(len(releases)):
        np.testing.assert_array_equal(counts.successes[m], np.bincount(guesses[m], minlength=3))
    mbp = bp.estimate_mbp(counts, PRIOR)
    abp = bp.estimate_abp(counts, PRIOR)
    assert mbp.contains(xi_over(np.unique(releases))) and mbp.contains(TRUE_XI)
    assert abp.c1_interval[0] <= TRUE_C1 <= abp.c1_interval[1]
    # xi^ is a maximum over 900 noisy cells, about 200 of them estimating the worst one (log of a
    # posterior 1/9 from 200 runs, standard deviation sqrt(8 / 200) = 0.2): the largest of 200 such
    # draws lies about 2.7 standard deviations up. docs/bayesian_privacy.md quotes this run.
    assert mbp.xi > TRUE_XI + 1.5 * math.sqrt(8 / 200)


# --- the estimators are exact where the counts are --------------------------------------------


def test_estimators_equal_the_exact_mbp_and_abp_on_expected_counts():
    """9 runs per release recover each d exactly 9 P(d | w) times: then xi^ and C1^ are the truth."""
    every = bp.RecoveryCounts(JOINT.T, trials=9, batch_size=1)  # row w: the counts 9 P(. | w)
    mbp = bp.estimate_mbp(every, PRIOR)
    assert mbp.xi == pytest.approx(TRUE_XI, rel=1e-12)
    assert mbp.xi == pytest.approx(max(ref.lip_epsilons(CHANNEL, list(PRIOR))), rel=1e-12)
    proportional = bp.RecoveryCounts(JOINT.T[PROPORTIONAL_RELEASES], trials=9, batch_size=1)
    abp = bp.estimate_abp(proportional, PRIOR)
    assert abp.c1 == pytest.approx(TRUE_C1, rel=1e-12)
    np.testing.assert_allclose(abp.belief, CHANNEL[SECRET] @ POSTERIOR, rtol=1e-12)
    assert abp.c2 == pytest.approx((math.exp(2 * xi_over(EVERY_RELEASE)) - 1) / 2, rel=1e-12)
    assert abp.epsilon_p(0.25) == pytest.approx(2 * abp.c1 - 0.25 * abp.c2, rel=1e-12)
    known = bp.estimate_abp(proportional, PRIOR, c2=1.5)
    assert known.c2_interval == (1.5, 1.5) and known.epsilon_p(0.0) == 2 * known.c1


def test_uniform_prior_and_batch_normalisation():
    """Defaults: f_D uniform over the n samples and S = n, so f^(d | w) / f_D(d) is the recovery rate."""
    counts = bp.count_recoveries(np.array([[[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]]), "above", 0.5)
    assert counts.batch_size == 2
    mbp = bp.estimate_mbp(counts)
    np.testing.assert_allclose(mbp.log_ratios, np.log([[3 / 4, 3 / 4]]))
    abp = bp.estimate_abp(counts)
    assert abp.c1 == pytest.approx(math.sqrt(js([3 / 8, 3 / 8], [1 / 2, 1 / 2])), rel=1e-12)


def test_a_sample_never_recovered_gives_an_infinite_xi_and_a_finite_c1():
    counts = bp.RecoveryCounts(np.array([[5, 0, 3]]), trials=8, batch_size=1)
    mbp = bp.estimate_mbp(counts, PRIOR)
    assert mbp.xi == math.inf and mbp.worst == (0, 1) and mbp.log_ratios[0, 1] == -math.inf
    assert mbp.interval[1] == math.inf and mbp.interval[0] < math.inf
    abp = bp.estimate_abp(counts, PRIOR, releases="given")
    assert abp.c1 == pytest.approx(math.sqrt(js([5 / 8, 0, 3 / 8], PRIOR)), rel=1e-12)
    assert abp.c2 == math.inf and abp.c2_interval[1] == math.inf
    assert abp.epsilon_p(0.0) == 2 * abp.c1 and abp.epsilon_p_interval(0.5)[0] == -math.inf


# --- convergence as T grows ----------------------------------------------------------------------


def test_xi_estimate_converges_like_one_over_sqrt_trials():
    """sqrt(T) RMS(xi^ - xi) tends to the delta-method value sqrt((1 - p) / p) of the worst cell."""
    rng = np.random.default_rng(2)
    worst_cell = np.unravel_index(np.argmax(np.abs(np.log(POSTERIOR / PRIOR))), POSTERIOR.shape)
    p = POSTERIOR[worst_cell]
    asymptotic = math.sqrt((1 - p) / p)
    repetitions, confidence = 400, 0.9
    for trials in (1600, 6400, 25600):
        errors, misses = [], 0
        for counts in attack_counts(rng, EVERY_RELEASE, trials, repetitions):
            estimate = bp.estimate_mbp(bp.RecoveryCounts(counts, trials, 1), PRIOR, confidence=confidence)
            errors.append(estimate.xi - TRUE_XI)
            misses += not estimate.contains(TRUE_XI)
        rms = math.sqrt(np.mean(np.square(errors)))
        # The RMS of 400 draws has a relative standard deviation of about 1/sqrt(800) = 3.5%: 15%
        # leaves four of them for the noise and the O(1/T) terms of the delta method.
        assert abs(math.sqrt(trials) * rms / asymptotic - 1) < 0.15, (trials, math.sqrt(trials) * rms)
        assert_coverage(misses, repetitions, confidence)


def test_c1_estimate_converges_like_one_over_sqrt_trials():
    """Releases listed in proportion: sqrt(T) RMS(C1^ - C1) tends to the delta-method value."""
    rng = np.random.default_rng(3)
    belief = CHANNEL[SECRET] @ POSTERIOR
    # dC1/dk1(d) = log(2 k1 / (k1 + k2)) / (4 C1); Cov(k1^) T = mean over releases of the
    # multinomial covariance, divided by M.
    gradient = np.log(2 * belief / (belief + PRIOR)) / (4 * TRUE_C1)
    releases = POSTERIOR[PROPORTIONAL_RELEASES]
    covariance = np.mean([np.diag(q) - np.outer(q, q) for q in releases], axis=0) / len(releases)
    asymptotic = math.sqrt(gradient @ covariance @ gradient)
    repetitions, confidence = 400, 0.9
    previous_width = None
    for trials in (1600, 6400, 25600):
        errors, misses, widths = [], 0, []
        for counts in attack_counts(rng, PROPORTIONAL_RELEASES, trials, repetitions):
            estimate = bp.estimate_abp(bp.RecoveryCounts(counts, trials, 1), PRIOR, releases="given",
                                       confidence=confidence)
            errors.append(estimate.c1 - TRUE_C1)
            low, high = estimate.c1_interval
            misses += not low <= TRUE_C1 <= high
            widths.append(high - low)
        rms = math.sqrt(np.mean(np.square(errors)))
        assert abs(math.sqrt(trials) * rms / asymptotic - 1) < 0.15, (trials, math.sqrt(trials) * rms)
        assert_coverage(misses, repetitions, confidence)
        # The interval shrinks like 1/sqrt(T) too: half as wide for 4 times the runs (within 10%).
        if previous_width is not None:
            assert np.mean(widths) / previous_width == pytest.approx(0.5, rel=0.1)
        previous_width = np.mean(widths)


# --- coverage of the reported intervals ----------------------------------------------------------


@pytest.mark.parametrize("n_releases, trials", [(40, 100), (5, 2000)])
@pytest.mark.parametrize("confidence", [0.5, 0.9])
def test_abp_intervals_hold_together_for_drawn_releases(n_releases, trials, confidence):
    """Releases drawn from the mechanism: C1 of f^O = E_w f(. | w), C2 of the MBP over the draws and
    2 C1 - C2 TV must all lie in their intervals in at least `confidence` of the repetitions. With 5
    releases, f^O^ is far from f^O whatever T is: counting runs instead of releases would fail."""
    rng = np.random.default_rng(4)
    repetitions, tv = 300, 0.3
    misses = 0
    for _ in range(repetitions):
        releases = rng.choice(3, size=n_releases, p=CHANNEL[SECRET])
        counts = bp.RecoveryCounts(attack_counts(rng, releases, trials), trials, 1)
        estimate = bp.estimate_abp(counts, PRIOR, confidence=confidence)
        true_c2 = math.expm1(2 * xi_over(releases)) / 2
        low, high = estimate.epsilon_p_interval(tv)
        inside = (estimate.c1_interval[0] <= TRUE_C1 <= estimate.c1_interval[1]
                  and estimate.c2_interval[0] <= true_c2 <= estimate.c2_interval[1]
                  and low <= 2 * TRUE_C1 - true_c2 * tv <= high)
        misses += not inside
    assert_coverage(misses, repetitions, confidence)


def test_mbp_interval_holds_with_few_runs():
    """T = 20: many zero counts and relative errors well above 1."""
    rng = np.random.default_rng(5)
    repetitions, confidence = 500, 0.8
    misses = 0
    for _ in range(repetitions):
        releases = rng.choice(3, size=10, p=CHANNEL[SECRET])
        estimate = bp.estimate_mbp(bp.RecoveryCounts(attack_counts(rng, releases, 20), 20, 1), PRIOR,
                                   confidence=confidence)
        misses += not estimate.contains(xi_over(releases))
    assert_coverage(misses, repetitions, confidence)


# --- Lemma C.1 -----------------------------------------------------------------------------------

CHERNOFF_GRID = [(trials, p, confidence) for trials in (10, 100, 1000) for p in (0.001, 0.01, 0.05, 0.3, 0.9)
                 for confidence in (0.5, 0.9, 0.99)]


@pytest.mark.parametrize("trials, p, confidence", CHERNOFF_GRID)
def test_corrected_chernoff_relative_error_holds_exactly(trials, p, confidence):
    epsilon = bp.chernoff_relative_error(trials * p, confidence)
    assert two_sided_failure(trials, p, epsilon) <= 1 - confidence
    # Where the printed form applies (its eps <= 1), the corrected eps is smaller.
    printed = math.sqrt(3 * math.log(2 / (1 - confidence)) / (trials * p))
    if printed <= 1:
        assert epsilon <= printed


@pytest.mark.parametrize("trials, confidence", [(20, 0.8), (200, 0.95), (2000, 0.99)])
def test_chernoff_interval_covers_every_p_exactly(trials, confidence):
    """Exact coverage P(p in interval(X)), X ~ Binomial(trials, p), over a grid of p."""
    counts = np.arange(trials + 1)
    low, high = bp.chernoff_interval(counts, trials, confidence)
    for p in np.concatenate([np.geomspace(1e-5, 0.5, 60), 1 - np.geomspace(1e-5, 0.5, 30), [0.0, 1.0]]):
        covered = (low <= p) & (p <= high)
        assert binom.pmf(counts[covered], trials, p).sum() >= confidence - 1e-12, p


LEMMA_C1_LIMIT = 1.8169605  # root of (1 + eps) ln(1 + eps) - eps = eps^2 / 3


def test_lemma_c1_limit_is_where_the_poisson_exponent_drops_below_eps_squared_over_three():
    """For eps >= 1 only the upper tail exists, and it is at most exp(-mu ((1 + eps) ln(1 + eps) - eps)),
    which is at most the printed exp(-mu eps^2 / 3) exactly while eps <= 1.8170."""
    gap = lambda e: (1 + e) * math.log1p(e) - e - e * e / 3  # noqa: E731
    assert brentq(gap, 1.0, 3.0, xtol=1e-12) == pytest.approx(LEMMA_C1_LIMIT, abs=1e-7)
    assert all(gap(e) >= 0 for e in np.linspace(1e-6, LEMMA_C1_LIMIT - 1e-7, 2000))
    assert gap(LEMMA_C1_LIMIT + 1e-6) < 0


def test_printed_lemma_c1_holds_for_relative_errors_up_to_1_8():
    worst = 0.0
    for trials in (10, 100, 1000, 10000):
        for p in (0.001, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9):
            for epsilon in np.linspace(0.01, 1.8, 180):
                claim = 2 * math.exp(-epsilon ** 2 * trials * p / 3)
                failure = two_sided_failure(trials, p, epsilon)
                assert failure <= claim, (trials, p, epsilon)
                if claim > 0:  # it underflows for T k1 eps^2 above ~2200, where the tail is 0 too
                    worst = max(worst, failure / claim)
    assert worst == pytest.approx(0.589, abs=1e-3)  # T = 10, k1 = 0.05, eps = 0.99


@pytest.mark.parametrize("trials, p, epsilon, ratio", [
    (10 ** 6, 7.65e-5, 2.07, 1.0637),  # mu = 76.5: failure is X >= 235
    (10 ** 6, 1.275e-4, 2.0, 1.0153),  # mu = 127.5: X >= 383
    (10 ** 4, 1.145e-2, 2.1, 1.0135),  # mu = 114.5: X >= 355
])
def test_printed_lemma_c1_fails_past_its_limit(trials, p, epsilon, ratio):
    """Exact binomial tails above the promised 2 exp(-eps^2 T k1 / 3), a little past eps = 1.817."""
    log_claim = math.log(2) - epsilon ** 2 * trials * p / 3
    log_exact = binom.logsf(math.floor(trials * p * (1 + epsilon)), trials, p)  # the lower tail is empty
    assert math.exp(log_exact - log_claim) == pytest.approx(ratio, abs=1e-4)


def test_printed_lemma_c1_fails_far_past_its_limit():
    """T = 100 runs, k1 = 0.001, eps = 18: two recoveries already miss by more than 18 k1."""
    claim = 2 * math.exp(-18 ** 2 * 100 * 0.001 / 3)
    exact = two_sided_failure(100, 0.001, 18)
    assert claim == pytest.approx(4.1e-5, rel=0.01) and exact == pytest.approx(4.64e-3, rel=0.01)
    assert exact > 100 * claim
    assert two_sided_failure(100, 0.001, bp.chernoff_relative_error(0.1, 1 - claim)) <= claim


def mixture_count_distribution(recovery_probabilities, trials, n_releases):
    """Exact pmf of sum_m M^m over independent releases, each a uniform mixture of Binomial(trials, q)."""
    one = np.mean([binom.pmf(np.arange(trials + 1), trials, q) for q in recovery_probabilities], axis=0)
    total = np.ones(1)
    for _ in range(n_releases):
        total = np.convolve(total, one)
    return total


def test_printed_lemma_c1_fails_for_the_belief_averaged_over_releases():
    """k1 = f^O: its error depends on the number of releases M, not on T (two equally likely
    releases recover d with probability 0.2 and 0.6, so k1 = 0.4)."""
    trials, epsilon, belief = 400, 0.25, 0.4
    pmf = mixture_count_distribution([0.2, 0.6], trials, 1)
    estimates = np.arange(pmf.size) / trials
    within = pmf[np.abs(estimates - belief) <= epsilon * belief].sum()
    claimed = 1 - 2 * math.exp(-epsilon ** 2 * trials * belief / 3)
    assert claimed > 0.92 and within < 1e-4


@pytest.mark.parametrize("n_releases", [1, 3, 8])
@pytest.mark.parametrize("confidence", [0.6, 0.9, 0.99])
def test_corrected_chernoff_for_the_belief_counts_releases(n_releases, confidence):
    """f^O from M independent releases (T = 15 runs each): eps from mu = M k1 holds exactly."""
    trials, belief = 15, 0.4
    pmf = mixture_count_distribution([0.2, 0.6], trials, n_releases)
    estimates = np.arange(pmf.size) / (trials * n_releases)
    epsilon = bp.chernoff_relative_error(n_releases * belief, confidence)
    assert pmf[np.abs(estimates - belief) > epsilon * belief].sum() <= 1 - confidence
    low, high = bp.chernoff_interval(np.arange(pmf.size) / trials, n_releases, confidence)
    assert pmf[(low <= belief) & (belief <= high)].sum() >= confidence


# --- Theorems D.1 and D.2 ------------------------------------------------------------------------

MEASURES = arrays(np.float64, 3, elements=st.one_of(st.just(0.0), st.floats(1e-4, 2.0)))


def root_js(a, b):
    """sqrt(JS(a || b)) of two float vectors, an mpf at 100 digits: in float64 the JS of vectors a
    few ulps apart rounds to +-1e-16, whose square root (1e-8) swamps the bounds tested here."""
    with mpmath.workdps(100):
        def term(x, middle):
            return 0 if x == 0 else x * mpmath.log(x / middle)
        total = 0
        for x, y in zip(a, b):
            x, y = mpmath.mpf(float(x)), mpmath.mpf(float(y))
            middle = (x + y) / 2
            total += (term(x, middle) + term(y, middle)) / 2
        return mpmath.sqrt(total)


@settings(deadline=None, max_examples=200)
@given(MEASURES, MEASURES, MEASURES)
def test_sqrt_js_is_a_metric_on_non_negative_measures(a, b, c):
    """The triangle inequality that the corrected Thm D.1 rests on, for unnormalised vectors."""
    assert root_js(a, c) <= root_js(a, b) + root_js(b, c) + 1e-15


@settings(deadline=None, max_examples=300)
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(
    arrays(np.float64, n, elements=st.floats(1e-3, 1.0)), arrays(np.float64, n, elements=st.floats(1e-3, 1.0)),
    arrays(np.float64, n, elements=st.floats(-1.0, 1.0)), st.floats(0.0, 3.0), st.floats(0.1, 1.0))))
def test_corrected_c1_bound_holds(case):
    """|C1^ - C1| <= c1_error_bound(eps, sum k1) whenever every |k1^ - k1| <= eps k1."""
    k1, k2, directions, epsilon, mass = case
    k1 = mass * k1 / k1.sum()
    k2 = k2 / k2.sum()
    estimate = k1 * np.maximum(1 + epsilon * directions, 0.0)
    epsilon = max(epsilon, float(np.max(np.abs(estimate - k1) / k1)))  # as rounded: 1 + 1e-17 is 1 + 2^-52
    error = abs(root_js(estimate, k2) - root_js(k1, k2))  # rounded once, after the subtraction
    assert float(error) <= bp.c1_error_bound(epsilon, mass) * (1 + 1e-9)


def test_c1_bound_is_exact_for_tiny_and_large_errors():
    """c1_error_bound against sqrt(K max(js(1 + eps, 1), js(1 - eps, 1))) at high precision, from
    eps = 1e-300 (the float64 formula cancels to nothing below 1e-8) to 1.7e308 (past 2**54 its
    u = eps / (2 + eps) rounds to 1, where log1p(-u) failed)."""
    def root_js_against_one(x):  # sqrt(js(1 + x, 1)), x an mpf at the working precision
        a = 1 + x
        return mpmath.sqrt(((a * mpmath.log(2 * a / (a + 1)) if a else 0) + mpmath.log(2 / (a + 1))) / 2)

    for epsilon in [0.0, *np.logspace(-300, 300, 240), 1e-3, 1.0, 2.0**54, 1.7e308]:
        with mpmath.workdps(700):  # 1 + 1e-300 resolved, and its JS (1e-600) after the cancellation
            e = mpmath.mpf(float(epsilon))
            exact = float(0.5 * max(root_js_against_one(e), root_js_against_one(-min(e, 1))))
        assert bp.c1_error_bound(epsilon, 0.25) == pytest.approx(exact, rel=1e-12, abs=0)


@pytest.mark.parametrize("epsilon", [0.01, 0.1, 0.5, 0.9, 1.0, 2.0, 5.0])
def test_corrected_c1_bound_is_reached(epsilon):
    """k2 = k1 and k1^ = (1 +- eps) k1: C1 = 0 and C1^ is the bound."""
    k1 = np.array([0.2, 0.3, 0.5])
    reached = max(math.sqrt(js(k1 * (1 + epsilon), k1)), math.sqrt(js(k1 * max(1 - epsilon, 0.0), k1)))
    assert reached == pytest.approx(bp.c1_error_bound(epsilon), rel=1e-12)


def test_printed_c1_bound_holds_but_is_loose():
    ratios = [paper_c1_bound(e) / bp.c1_error_bound(e) for e in np.linspace(1e-3, 0.999, 500)]
    assert min(ratios) > 4.5 and max(ratios) > 40
    assert bp.c1_error_bound(0.1) == pytest.approx(0.0363, abs=1e-4)
    assert paper_c1_bound(0.1) == pytest.approx(0.4616, abs=1e-4)
    assert math.isfinite(bp.c1_error_bound(1.0)) and math.isfinite(bp.c1_error_bound(3.0))


def test_epsilon_p_error_bound_is_twice_the_c1_bound_and_is_reached():
    """With C2 known, eps_p^ - eps_p = 2 (C1^ - C1): k1 = k2 = (1/2, 1/2), k1^ = 0.8 k1."""
    counts = bp.RecoveryCounts(np.array([[4, 4]]), trials=10, batch_size=1)
    estimate = bp.estimate_abp(counts, np.array([0.5, 0.5]), c2=2.0)  # true C1 = 0
    error = estimate.epsilon_p(0.4) - (2 * 0.0 - 2.0 * 0.4)
    assert error == pytest.approx(bp.epsilon_p_error_bound(0.2), rel=1e-12)
    assert bp.epsilon_p_error_bound(0.2) == 2 * bp.c1_error_bound(0.2)


# --- the mechanism's own MBP ---------------------------------------------------------------------


def test_estimate_agrees_with_the_mbp_an_ldp_mechanism_implies():
    """Randomised response on 3 values with eps = 1: xi^ is consistent with the channel's MBP, which
    is below the LDP bound; the estimate refutes a bound below the truth."""
    rr = np.full((3, 3), 1.0)
    np.fill_diagonal(rr, math.e)
    rr /= rr.sum(axis=1, keepdims=True)
    prior = np.array([0.2, 0.3, 0.5])
    posterior = (prior[:, None] * rr / (prior @ rr)).T
    counts = bp.RecoveryCounts(np.random.default_rng(6).multinomial(20000, posterior), 20000, 1)
    estimate = bp.estimate_mbp(counts, prior, confidence=0.99)
    assert bp.implied_mbp(rr, prior) == ch.mbp_xi(rr, prior)
    assert bp.implied_mbp_bound(1.0, prior) == rel.mbp_from_ldp(1.0, prior)
    assert estimate.contains(bp.implied_mbp(rr, prior))
    assert not estimate.exceeds(bp.implied_mbp_bound(1.0, prior))
    assert estimate.exceeds(0.8 * bp.implied_mbp(rr, prior))
    assert bp.implied_mbp_bound(math.inf) == math.inf  # the Gaussian mechanism


# --- bad input -----------------------------------------------------------------------------------

GOOD = bp.RecoveryCounts(np.array([[1, 2], [3, 0]]), trials=4, batch_size=2)


@pytest.mark.parametrize("make, match", [
    (lambda: bp.RecoveryCounts(np.array([1, 2]), 4, 1), "successes must have shape"),
    (lambda: bp.RecoveryCounts(np.array([[1.5, 2]]), 4, 1), "whole numbers"),
    (lambda: bp.RecoveryCounts(np.array([[5, 2]]), 4, 2), r"successes must lie in \[0, trials"),
    (lambda: bp.RecoveryCounts(np.array([[-1, 2]]), 4, 2), r"successes must lie in \[0, trials"),
    (lambda: bp.RecoveryCounts(np.array([[3, 2]]), 4, 1), "batch_size"),
    (lambda: bp.RecoveryCounts(np.array([[3, 2]]), 0, 1), "trials must be >= 1"),
    (lambda: bp.RecoveryCounts(np.array([[3, 2]]), 4, True), "batch_size must be an int"),
    (lambda: bp.count_recoveries(np.zeros((2, 3)), "above", 0.5), "scores must have shape"),
    (lambda: bp.count_recoveries(np.full((1, 2, 2), np.nan), "above", 0.5), "scores has NaN"),
    (lambda: bp.count_recoveries(np.zeros((1, 2, 2)), "above", math.inf), "threshold must be"),
    (lambda: bp.count_recoveries(np.zeros((1, 2, 2)), "over", 0.5), "criterion must be"),
    (lambda: bp.count_recoveries(np.zeros((1, 2, 2)), lambda s, t: s[0] > t, 0.5), "criterion must return"),
    (lambda: bp.estimate_mbp(GOOD, np.array([1.0, 0.0])), "prior must give every data sample"),
    (lambda: bp.estimate_mbp(GOOD, np.array([0.5, 0.5, 0.0])), "prior must have shape"),
    (lambda: bp.estimate_mbp(GOOD, confidence=1.0), "confidence must be < 1"),
    (lambda: bp.estimate_abp(GOOD, releases="some"), "releases must be"),
    (lambda: bp.estimate_abp(GOOD, c2=-1.0), "c2 must be"),
    (lambda: bp.estimate_abp(GOOD).epsilon_p(1.5), "tv_distance must be <= 1"),
    (lambda: bp.chernoff_relative_error(-1.0, 0.9), "expected_successes"),
    (lambda: bp.chernoff_interval([5], 4, 0.9), "at most n_terms"),
    (lambda: bp.chernoff_interval([5], 2**53 + 1, 0.9), "n_terms must be <= 9007199254740992"),
    (lambda: bp.RecoveryCounts(np.array([[3, 2]]), 10**400, 1), r"batch_size \* trials must be at most 2\*\*53"),
    (lambda: bp.RecoveryCounts(np.array([[2**62, 0]]), 2**52, 4), r"batch_size \* trials must be at most 2\*\*53"),
    (lambda: bp.c1_error_bound(float("nan")), "relative_error"),
])
def test_bad_input_raises_value_error_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_release_with_more_recoveries_than_runs_is_refused_past_int64():
    """1025 counts of 2**53 add up past 2**63: summed in int64 they wrapped to a negative total,
    which passed the check; the largest counts that fit are taken exactly."""
    with pytest.raises(ValueError, match="more recoveries than batch_size"):
        bp.RecoveryCounts(np.full((1, 1025), 2**53, dtype=np.int64), 2**53, 1)
    counts = bp.RecoveryCounts(np.array([[2**53, 0], [2**52 + 1, 2**52 - 1]], dtype=np.uint64), 2**53, 1)
    assert counts.posteriors.tolist() == [[1.0, 0.0], [0.5 + 2.0**-53, 0.5 - 2.0**-53]]
    low, high = bp.estimate_mbp(bp.RecoveryCounts(counts.successes[1:], 2**53, 1)).interval
    assert low == 0.0 and 2.0**-52 < high < 1e-6  # the exact xi is log(1 + 2**-52)


def test_chernoff_relative_error_for_huge_means():
    """The root of eps^2 mu / (2 + eps) = L (mpmath) where 8 mu overflowed float64 (NaN at 1e308)."""
    log_term = math.log(2.0 / 0.05)
    for mu in (1e300, 5e307, 1e308):
        with mpmath.workdps(50):
            per_success = log_term / mpmath.mpf(mu)
            exact = mpmath.findroot(lambda e, a=per_success: e * e / (2 + e) - a, math.sqrt(2 * log_term / mu))
        assert bp.chernoff_relative_error(mu, 0.95) == pytest.approx(float(exact), rel=1e-12)


def test_abp_takes_every_confidence_the_mbp_takes():
    """The largest float below 1: estimate_abp gave estimate_mbp 1 - (1 - c) / 2, which rounds to 1."""
    confidence = 1.0 - 2.0**-53
    mbp = bp.estimate_mbp(GOOD, confidence=confidence)
    abp = bp.estimate_abp(GOOD, confidence=confidence)
    assert abp.confidence == mbp.confidence == confidence
    assert abp.c2_interval[0] <= abp.c2 <= abp.c2_interval[1]


def test_c1_of_a_belief_next_to_the_prior_is_accurate():
    """A belief 1e-15 from the prior: the two relative entropies cancelled to a C1^ of 1e-8."""
    prior = np.array([0.3425790644243874, 0.1464504173481952, 0.5109705182274173])
    successes = np.floor(prior * 1e15)
    successes[0] += 1e15 - successes.sum()
    estimate = bp.estimate_abp(bp.RecoveryCounts(successes[None], 10**15, 1), prior, releases="given")
    with mpmath.workdps(60):
        belief = [mpmath.mpf(int(k)) / 10**15 for k in successes]
        exact = mpmath.sqrt(sum((a * mpmath.log(2 * a / (a + b)) + b * mpmath.log(2 * b / (a + b))) / 2
                                for a, b in zip(belief, map(mpmath.mpf, prior))))
    assert estimate.c1 == pytest.approx(float(exact), rel=1e-6)


def test_counts_must_be_recovery_counts():
    with pytest.raises(TypeError, match="counts must be a RecoveryCounts"):
        bp.estimate_mbp(np.array([[1, 2]]))
