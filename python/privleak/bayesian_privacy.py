"""Maximum and Average Bayesian Privacy measured from how often an attack recovers the data.

The estimators of [000] Zhang, Fei, Chen, Jin (Appendix C and D) and [001] Zhang, Chen
(Appendix E-I, the same estimators), with confidence intervals that hold as stated. A mechanism
releases models (or updates) w_1..w_M from the private data; the attack runs T times on each
release; a run recovers data sample d when its score passes a success criterion Omega with
threshold t. With M_d^m the number of runs on w_m that recover d and S the number of samples one
run reconstructs (the batch size of [000] C.1):

    f^(d | w_m) = M_d^m / (S T)                                         [000] C.1
    f^O(d)      = (1/M) sum_m f^(d | w_m)                               [000] Eq. 17
    xi^         = max_{m, d} |log(f^(d | w_m) / f_D(d))|                [000] Eq. 10 and 12
    C1^         = sqrt(JS(f^O || f^B)),  f^B = f_D, the attacker's prior [000] D.1
    C2^         = (e^(2 xi^) - 1) / 2                                   [000] Eq. 20
    eps_p^      = 2 C1^ - C2^ TV(P^O || P^D)                            [000] App. D, from Zhang et al. 2023d

S f(d | w) is the probability that one run on w recovers d. For the Bayes-optimal attack that
draws its guess from the posterior (S = 1), f(. | w) is that posterior and the estimators converge
to the exact MBP xi and ABP of :mod:`privleak.channels`.

What differs from the papers (each checked numerically in ``tests/test_bayesian_privacy.py``; the
numbers are in ``docs/bayesian_privacy.md``):

* Lemma C.1 (multiplicative Chernoff, P(|k^ - k| > eps k) <= 2 exp(-eps^2 T k / 3)) puts no
  limit on eps. It holds for every T and k while eps <= 1.8170, the root of
  (1 + eps) ln(1 + eps) - eps = eps^2 / 3 (for eps >= 1 only the upper tail is possible, and it
  is at most exp(-T k ((1 + eps) ln(1 + eps) - eps))); for every larger eps some T, k violate it
  (exact binomial: T = 10^6, k = 7.65e-5, eps = 2.07 fails with 1.06 times the promised
  probability; closer to the root it takes a larger T k). Its exponent T k is the expected count for
  f(d | w) at one fixed release (S T k when a run reconstructs S samples), but not for f^O, the
  only k1 the papers define: f^O averages over releases, so its error depends on the number M of
  releases and does not vanish as T grows with M fixed. privleak uses the Chernoff tails
  exp(-D^2 / (2 mu + D)) (upper, every D > 0) and exp(-D^2 / (2 mu)) (lower), valid for sums of
  independent [0, 1] variables, with T terms for f(d | w_m) and M terms for f^O (M T terms
  when the releases are fixed rather than drawn: see :func:`estimate_abp`).
* Theorem D.1 holds for eps < 1 but is loose (4.5 times the truth or more; 13 times at eps = 0.1)
  and undefined for eps >= 1. The sharp bound is
  |C1^ - C1| <= sqrt(K max(js(1 + eps, 1), js(1 - min(eps, 1), 1))), K = sum_d f^O(d) <= 1, js
  the Jensen-Shannon summand; it is reached.
* Theorem D.2 ([000] Eq. 22, [001] Thm A.12, Eq. 35) states |eps_p^ - eps_p| <= 3/2 times the
  bound of Theorem D.1, with D.1's assumption and C2 known in advance (from the text before it).
  With C2 known, |eps_p^ - eps_p| = 2 |C1^ - C1|, so D.1 alone would give the factor 2, not 3/2;
  D.2 holds for eps < 1 anyway because D.1 is loose (D.2 is at least 3.4 times the sharp
  bound), and is undefined for eps >= 1. privleak's bound is twice its corrected D.1.
* No error bound is given for xi^. privleak gives one from simultaneous intervals for every
  f(d | w_m).

A count of zero gives log 0: xi^ is then inf, the plug-in value (no smoothing, which would bias
every estimate to hide one), and the interval says how large xi can be. C1^ stays finite.
All epsilons use natural logarithms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Union

import numpy as np

from privleak import _arrays, validation
from privleak.channels import _js_generator, as_prior, mbp_xi
from privleak.relations import mbp_from_ldp

Criterion = Union[str, Callable[[np.ndarray, float], Any]]
MAX_RUNS = 2**53
"""The most runs (``batch_size * trials``, or ``n_terms`` of a Chernoff sum) the estimators take:
counts up to it are exact in float64."""


# --- counting recoveries ([000] C.1) -----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RecoveryCounts:
    """How often the attack recovered each data sample: ``successes[m, d]`` of ``trials`` runs on release m.

    ``batch_size`` is S of [000] C.1, the number of samples one run reconstructs: the batch size
    when each run reconstructs a whole batch (each sample is then recovered at most once a run),
    1 when each run outputs one guess. The runs on one release must be independent given the
    release (fresh attack randomness each run) for the confidence intervals to hold.

    Raises ValueError naming the field for a shape other than (M, n) with M, n >= 1, counts that
    are negative, not integers or above ``trials``, or a release whose counts add up to more than
    ``batch_size * trials`` (more recoveries than the runs reconstruct samples), or
    ``batch_size * trials`` above 2**53 (:data:`MAX_RUNS`).
    """

    successes: np.ndarray
    trials: int
    batch_size: int

    def __post_init__(self) -> None:
        trials = validation.integer(self.trials, "trials", low=1)
        batch_size = validation.integer(self.batch_size, "batch_size", low=1)
        values = _as_numpy(self.successes, "successes")
        if values.ndim != 2 or 0 in values.shape:
            raise ValueError(f"successes must have shape (n_releases >= 1, n_samples >= 1), got {values.shape}")
        if values.dtype.kind not in "iuf" or (values.dtype.kind == "f" and not (values == np.round(values)).all()):
            raise ValueError("successes must hold whole numbers of recoveries")
        if batch_size * trials > MAX_RUNS:
            raise ValueError(f"batch_size * trials must be at most 2**53 = {MAX_RUNS}, where the frequencies "
                             f"M_d^m / (S T) are exact in float64; got {batch_size} * {trials}")
        if (values < 0).any() or (values > trials).any():
            raise ValueError(f"successes must lie in [0, trials = {trials}]")
        values = values.astype(np.int64)
        # A row of n counts up to 2**53 each can pass int64's range: Python's ints add those.
        release_totals = values.sum(axis=1, dtype=np.int64 if values.shape[1] * trials < 2**63 else object)
        if (release_totals > batch_size * trials).any():
            raise ValueError(f"a release has more recoveries than batch_size * trials = {batch_size * trials}: "
                             "batch_size must be the number of samples one attack run reconstructs")
        values.flags.writeable = False
        object.__setattr__(self, "successes", values)
        object.__setattr__(self, "trials", trials)
        object.__setattr__(self, "batch_size", batch_size)

    @property
    def n_releases(self) -> int:
        """M, the number of released models."""
        return self.successes.shape[0]

    @property
    def n_samples(self) -> int:
        """n, the number of data samples whose recovery is counted."""
        return self.successes.shape[1]

    @property
    def posteriors(self) -> np.ndarray:
        """f^(d | w_m) = M_d^m / (S T) ([000] C.1), shape (M, n)."""
        return self.successes / (self.batch_size * self.trials)

    @property
    def belief(self) -> np.ndarray:
        """f^O(d) = (1/M) sum_m f^(d | w_m), the attacker's average belief after a release ([000] Eq. 17)."""
        return self.posteriors.mean(axis=0)


def count_recoveries(scores: Any, criterion: Criterion, threshold: float, *, batch_size: int | None = None
                     ) -> RecoveryCounts:
    """Count the attack runs that recover each data sample ([000] C.1: M_d^m).

    ``scores[m, t, d]`` scores run t on release m against data sample d (an MSE, a PSNR, an SSIM,
    a 0/1 match, ...). Run t recovers d when ``criterion`` says so:

    - ``"above"``: score > threshold (the paper's Omega > t; SSIM, PSNR),
    - ``"below"``: score < threshold (MSE, a distance),
    - a function ``criterion(scores, threshold)`` returning a boolean array of the scores' shape.

    ``batch_size`` (S) defaults to the number of samples: every run reconstructs the whole batch.
    Raises ValueError naming the argument for scores that are not a 3-D array with no empty axis,
    NaN scores (decide first whether a diverged run failed), a non-finite threshold, an unknown
    criterion or one that returns the wrong shape or dtype.
    """
    values = _real_array(scores, "scores")
    if values.ndim != 3 or 0 in values.shape:
        raise ValueError(f"scores must have shape (n_releases, trials, n_samples), none 0, got {values.shape}")
    if np.isnan(values).any():
        raise ValueError("scores has NaN entries: map failed attack runs to a score that fails the criterion")
    threshold = validation.real(threshold, "threshold")
    if callable(criterion):
        recovered = np.asarray(criterion(values, threshold))
        if recovered.shape != values.shape or recovered.dtype != np.bool_:
            raise ValueError(f"criterion must return a boolean array of shape {values.shape}, "
                             f"got {recovered.dtype} of shape {recovered.shape}")
    elif isinstance(criterion, str) and criterion in ("above", "below"):
        recovered = values > threshold if criterion == "above" else values < threshold
    else:
        raise ValueError(f"criterion must be 'above', 'below' or a function, got {criterion!r}")
    _, trials, n_samples = values.shape
    return RecoveryCounts(recovered.sum(axis=1), trials, n_samples if batch_size is None else batch_size)


# --- Lemma C.1, corrected: Chernoff bounds for a count -------------------------------------------


def chernoff_relative_error(expected_successes: float, confidence: float) -> float:
    """The relative error eps of a count's mean: P(|X - mu| > eps mu) <= 1 - confidence ([000] Lemma C.1).

    X is a sum of independent [0, 1] variables with mean mu = ``expected_successes``. For an
    estimate f^(d | w) from T runs on one release, mu = S T f(d | w); for f^O(d) over M releases
    drawn independently, X = sum_m M_d^m / T and mu = M S f^O(d), whatever T is. With
    L = log(2 / (1 - confidence)):

        eps = (L + sqrt(L^2 + 8 L mu)) / (2 mu)

    from the upper tail P(X >= (1 + eps) mu) <= exp(-eps^2 mu / (2 + eps)), for every eps > 0;
    the lower tail exp(-eps^2 mu / 2) is smaller. Lemma C.1 states
    1 - 2 exp(-eps^2 T k1 / 3), i.e. eps = sqrt(3 L / (T k1)): true for eps <= 1.8170 (where
    (1 + eps) ln(1 + eps) - eps >= eps^2 / 3; for eps <= 1 larger than the eps here), false for
    some T, k1 beyond (e.g. T = 10^6, k1 = 7.65e-5, eps = 2.07: 1.06 times the promised failure
    probability; T = 100, k1 = 0.001, eps = 18: promised 4.1e-5, exact 4.6e-3), and with T in
    place of M for f^O. Returns inf for mu = 0.
    """
    mu = validation.non_negative(expected_successes, "expected_successes")
    log_term = _tail_log(1.0 - validation.confidence_level(confidence, "confidence"))
    if mu == 0.0:
        return math.inf
    per_success = log_term / mu  # the formula over mu: no overflow for a huge mu
    return (per_success + math.sqrt(per_success * (per_success + 8.0))) / 2.0


def chernoff_interval(successes: Any, n_terms: int, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Confidence interval for the average mean p of ``n_terms`` independent [0, 1] variables from their sum.

    Inverts the two Chernoff tails of :func:`chernoff_relative_error`, each given half of
    1 - confidence: the p whose tails both accept the observed sum X form [lo, hi], with
    L = log(2 / (1 - confidence)) and N = ``n_terms``,

        N lo = 2 X (X - L) / (2 X + L + sqrt(L^2 + 8 L X))   (0 when X <= L),
        N hi = ((sqrt(2 L) + sqrt(2 L + 4 X)) / 2)^2         (at most N).

    For T runs on one release, X = M_d^m and p = S f(d | w_m); for f^O over M releases,
    X = sum_m M_d^m / T and p = S f^O(d). Elementwise over array-like ``successes``; each interval
    holds with probability >= ``confidence`` on its own.
    """
    totals = _real_array(successes, "successes")
    if not (np.isfinite(totals).all() and (totals >= 0).all()):
        raise ValueError("successes must be finite and >= 0")
    n_terms = validation.integer(n_terms, "n_terms", low=1, high=MAX_RUNS)
    if (totals > n_terms).any():
        raise ValueError(f"successes must be at most n_terms = {n_terms}")
    return _mean_interval(totals, n_terms, 1.0 - validation.confidence_level(confidence, "confidence"))


# --- Maximum Bayesian Privacy ([000] App. C) -----------------------------------------------------


@dataclass(frozen=True, eq=False)
class MBPEstimate:
    """xi^ with its confidence interval (see :func:`estimate_mbp`)."""

    xi: float
    """max_{m, d} |log(f^(d | w_m) / f_D(d))| ([000] Eq. 10, 12); inf if some count is 0."""
    log_ratios: np.ndarray
    """log(f^(d | w_m) / f_D(d)), shape (M, n); -inf where a sample was never recovered."""
    worst: tuple[int, int]
    """(m, d) where xi^ is attained."""
    interval: tuple[float, float]
    """Holds the MBP over the released models with probability >= ``confidence``."""
    confidence: float

    def contains(self, xi: float) -> bool:
        """Whether a mechanism's exact MBP (e.g. :func:`implied_mbp`) is consistent with this estimate."""
        return self.interval[0] <= xi <= self.interval[1]

    def exceeds(self, bound: float) -> bool:
        """Whether the measured leakage refutes an MBP upper bound (e.g. :func:`implied_mbp_bound`)."""
        return self.interval[0] > bound


def estimate_mbp(counts: RecoveryCounts, prior: Any = None, *, confidence: float = 0.95) -> MBPEstimate:
    """Estimate Maximum Bayesian Privacy xi from recovery counts ([000] App. C, [001] Eq. 23-26, App. E-F).

        xi^ = max_{m, d} |log(f^(d | w_m) / f_D(d))|,   f^(d | w_m) = M_d^m / (S T).

    ``prior`` is f_D, the attacker's prior over the n samples (default uniform), which must give
    every sample positive mass. The papers take the single release w* that leaks most
    (Assumption D.1, Eq. 12); without knowing it, the maximum over the released models is Eq. 10
    restricted to them, and equals Eq. 12 when w* is among them (pass the counts of one release to
    get Eq. 12 for it).

    The interval holds xi_released = max_{m, d} |log(f(d | w_m) / f_D(d))| with probability
    >= ``confidence`` given the releases: every f(d | w_m) lies in its :func:`chernoff_interval`
    (T terms) at once, each at failure probability (1 - confidence) / (M n). It is [0, inf) at
    worst; its upper end is inf when some count is 0 (the data cannot exclude a posterior of 0).

    xi^ is biased upward, being the largest of M n noisy cells: with many releases of similar
    leakage it picks the luckiest (synthetic test: 300 releases of 3 values, T = 200, xi^ = 1.92
    for xi = 1.30, inside the interval [0.67, 5.95]). Read it with its interval, and grow T with M.
    """
    counts = _check_counts(counts)
    prior_mass = _check_sample_prior(prior, counts.n_samples)
    confidence = validation.confidence_level(confidence, "confidence")
    return _estimate_mbp(counts, prior_mass, 1.0 - confidence, confidence)


def _estimate_mbp(counts: RecoveryCounts, prior_mass: np.ndarray, failure: float, confidence: float
                  ) -> MBPEstimate:
    """:func:`estimate_mbp` at failure probability ``failure`` (not rounded through a confidence)."""
    with np.errstate(divide="ignore"):
        log_ratios = np.log(counts.posteriors) - np.log(prior_mass)
    worst = np.unravel_index(int(np.argmax(np.abs(log_ratios))), log_ratios.shape)
    low, high = _mean_interval(counts.successes.astype(np.float64), counts.trials, failure / counts.successes.size)
    with np.errstate(divide="ignore"):
        log_low = np.log(low / counts.batch_size) - np.log(prior_mass)
        log_high = np.log(high / counts.batch_size) - np.log(prior_mass)
    # |log ratio| over [log_low, log_high] ranges from 0 (if the interval holds 0) to its larger end.
    smallest = np.where((log_low <= 0) & (log_high >= 0), 0.0, np.minimum(np.abs(log_low), np.abs(log_high)))
    largest = np.maximum(np.abs(log_low), np.abs(log_high))
    return MBPEstimate(xi=float(np.abs(log_ratios[worst])), log_ratios=log_ratios,
                       worst=(int(worst[0]), int(worst[1])),
                       interval=(float(smallest.max()), float(largest.max())), confidence=confidence)


def implied_mbp(channel: Any, prior: Any) -> float:
    """The MBP xi of a discrete mechanism, :func:`privleak.channels.mbp_xi`, as the estimators see it.

    xi^ converges to it when the attack draws its guess from the Bayes posterior under ``prior``
    (``batch_size`` 1, success = the guess is the sample) and every observation with p(y) > 0 is
    among the releases. Compare with :meth:`MBPEstimate.contains`.
    """
    return mbp_xi(channel, prior)


def implied_mbp_bound(ldp_epsilon: float, prior: Any = None) -> float:
    """An upper bound on MBP from an LDP epsilon, :func:`privleak.relations.mbp_from_ldp`.

    eps-LDP gives xi <= log(pi_min + (1 - pi_min) e^eps) <= eps ([000] Thm 5.3 states xi <= eps
    for a uniform prior; the sharper form holds for every prior). For VMF noise on the sphere
    eps = 2 kappa (:mod:`privleak.accounting`); the Gaussian mechanism has no finite LDP epsilon
    (its posterior ratios are unbounded), so its bound is inf. Compare with :meth:`MBPEstimate.exceeds`.
    """
    return mbp_from_ldp(ldp_epsilon, prior)


# --- Average Bayesian Privacy ([000] App. D) -----------------------------------------------------


@dataclass(frozen=True, eq=False)
class ABPEstimate:
    """C1^, C2^ and eps_p^ with confidence intervals that hold together (see :func:`estimate_abp`)."""

    c1: float
    """sqrt(JS(f^O || f^B)) ([000] D.1)."""
    c1_interval: tuple[float, float]
    c2: float
    """(e^(2 xi) - 1) / 2 ([000] D.2), from xi^ or as given."""
    c2_interval: tuple[float, float]
    belief: np.ndarray
    """f^O(d) ([000] Eq. 17)."""
    confidence: float

    def epsilon_p(self, tv_distance: float) -> float:
        """eps_p^ = 2 C1^ - C2^ TV(P^O || P^D) ([000] App. D, from Zhang et al. 2023d).

        ``tv_distance`` is the total variation distance between the distributions of the
        unprotected and the protected release, in [0, 1].
        """
        return _difference(2.0 * self.c1, self.c2, validation.probability(tv_distance, "tv_distance"))

    def epsilon_p_interval(self, tv_distance: float) -> tuple[float, float]:
        """Holds 2 C1 - C2 TV with probability >= ``confidence`` (Thm D.2: see :func:`epsilon_p_error_bound`)."""
        tv = validation.probability(tv_distance, "tv_distance")
        return (_difference(2.0 * self.c1_interval[0], self.c2_interval[1], tv),
                _difference(2.0 * self.c1_interval[1], self.c2_interval[0], tv))


def estimate_abp(counts: RecoveryCounts, prior: Any = None, *, releases: str = "drawn", c2: float | None = None,
                 confidence: float = 0.95) -> ABPEstimate:
    """Estimate the ABP terms C1 and C2 from recovery counts ([000] App. D, [001] App. G-I).

        C1^^2 = 1/2 sum_d k1^ log(k1^ / m) + 1/2 sum_d k2 log(k2 / m),  m = (k1^ + k2) / 2,
        k1^ = f^O(d) (Eq. 17),  k2 = f^B(d) = f_D(d) = ``prior`` (default uniform),
        C2^ = (e^(2 xi^) - 1) / 2 (Eq. 20), xi^ from :func:`estimate_mbp`, unless ``c2`` is given
        (the papers assume C2 known in advance for Thm D.2).

    The k1 are not renormalised: sum_d f^O(d) < 1 when some runs recover nothing, as in the
    paper's formula (JS of non-negative measures is still >= 0).

    ``releases`` says what c1_interval is about:

    - ``"drawn"``: the releases are independent draws from the release distribution P, and the
      interval holds C1 for f^O(d) = E_{w ~ P} f(d | w). It shrinks with M, not with T: each
      release contributes one [0, 1] term M_d^m / T to the Chernoff sum.
    - ``"given"``: the interval holds C1 for the average of f(d | w_m) over these releases (all
      M T runs are Chernoff terms). Use it when the releases are fixed: a deterministic release, or
      every possible release listed in proportion to its probability.

    All intervals hold together with probability >= ``confidence``: each k1(d) lies in its
    :func:`chernoff_interval` (failure (1 - confidence) / n each, halved when C2 is estimated),
    c1_interval is the exact range of sqrt(JS) over that box (JS is convex and separable in k1),
    and c2_interval maps the interval of xi over the released models (the other half). This is
    tighter than Thm D.1, which bounds the error for a common relative error (:func:`c1_error_bound`).
    """
    counts = _check_counts(counts)
    prior_mass = _check_sample_prior(prior, counts.n_samples)
    failure = 1.0 - validation.confidence_level(confidence, "confidence")
    if releases == "drawn":
        totals, n_terms = counts.successes.sum(axis=0, dtype=np.float64) / counts.trials, counts.n_releases
    elif releases == "given":
        totals, n_terms = counts.successes.sum(axis=0, dtype=np.float64), counts.n_releases * counts.trials
    else:
        raise ValueError(f"releases must be 'drawn' or 'given', got {releases!r}")
    if c2 is None:
        failure /= 2.0
        mbp = _estimate_mbp(counts, prior_mass, failure, 1.0 - failure)
        c2, c2_interval = _c2_from_xi(mbp.xi), (_c2_from_xi(mbp.interval[0]), _c2_from_xi(mbp.interval[1]))
    else:
        c2 = validation.non_negative(c2, "c2", allow_inf=True)
        c2_interval = (c2, c2)
    low, high = _mean_interval(totals, n_terms, failure / counts.n_samples)
    low, high = low / counts.batch_size, high / counts.batch_size
    nearest = np.clip(prior_mass, low, high)  # js(., prior) is smallest at the prior
    smallest = _js_terms(nearest, prior_mass).sum()
    largest = np.maximum(_js_terms(low, prior_mass), _js_terms(high, prior_mass)).sum()
    belief = counts.belief
    return ABPEstimate(c1=_sqrt(_js_terms(belief, prior_mass).sum()),
                       c1_interval=(_sqrt(smallest), _sqrt(largest)),
                       c2=c2, c2_interval=c2_interval, belief=belief, confidence=confidence)


def c1_error_bound(relative_error: float, belief_mass: float = 1.0) -> float:
    """Largest |C1^ - C1| when every |k1^(d) - k1(d)| <= eps k1(d) ([000] Thm D.1, corrected).

        |C1^ - C1| <= sqrt(K max(js(1 + eps, 1), js(1 - min(eps, 1), 1))),  K = sum_d k1(d),

    js(a, b) = (a log(2a / (a + b)) + b log(2b / (a + b))) / 2. Why: sqrt(JS) is a metric on
    non-negative measures (Endres and Schindelin 2003), so |C1^ - C1| <= sqrt(JS(k1^ || k1)), and
    JS(k1^ || k1) = sum_d k1(d) js(k1^(d) / k1(d), 1) with js(., 1) convex. Reached for K = 1 by
    k2 = k1 and k1^ = (1 +- eps) k1; for K < 1 k2, a prior, cannot equal k1, and the bound holds
    but is not always reached. ``belief_mass`` K is 1 for a posterior-sampling attack, below 1
    otherwise.
    Thm D.1 states sqrt((1 + eps) log((1 + eps) / (1 - eps)) / 2 + (eps + max(log(1 + eps),
    log(1 / (1 - eps)))) / 2): true for eps < 1 but at least 4.5 times larger, growing like
    4 / sqrt(eps) as eps -> 0 (0.46 instead of 0.036 at eps = 0.1), and undefined for eps >= 1,
    where this bound stays finite.
    """
    epsilon = validation.non_negative(relative_error, "relative_error", allow_inf=True)
    mass = validation.non_negative(belief_mass, "belief_mass", allow_inf=True)
    if math.isinf(epsilon) or math.isinf(mass):
        return math.inf if mass > 0 and epsilon > 0 else 0.0
    return math.sqrt(mass) * max(_root_js_against_one(epsilon), _root_js_against_one(-min(epsilon, 1.0)))


def epsilon_p_error_bound(relative_error: float, belief_mass: float = 1.0) -> float:
    """Largest |eps_p^ - eps_p| when every |k1^(d) - k1(d)| <= eps k1(d) and C2 is known ([000] Thm D.2).

    With C2 known, as the papers assume, eps_p^ - eps_p = 2 (C1^ - C1), so the bound is
    2 :func:`c1_error_bound`. Thm D.2 ([000] Eq. 22, [001] Thm A.12, Eq. 35) states 3/2 times the
    bound of Thm D.1 instead: true for eps < 1 (at least 3.4 times this bound, because D.1 is
    loose), undefined for eps >= 1.
    """
    return 2.0 * c1_error_bound(relative_error, belief_mass)


# --- internals -----------------------------------------------------------------------------------


def _mean_interval(totals: np.ndarray, n_terms: int, failure: float) -> tuple[np.ndarray, np.ndarray]:
    """The interval of :func:`chernoff_interval` for failure probability ``failure``, unchecked."""
    # Both ends are homogeneous of degree 1 in (X, L): computed on (X / N, L / N), nothing overflows.
    mean, log_term = totals / n_terms, _tail_log(failure) / n_terms
    # 2X(X - L) / (...) is (2X + L - sqrt(L^2 + 8LX)) / 2 without the cancellation.
    low = 2.0 * mean * (mean - log_term) / (2.0 * mean + log_term + np.sqrt(log_term * (log_term + 8.0 * mean)))
    high = ((math.sqrt(2.0 * log_term) + np.sqrt(2.0 * log_term + 4.0 * mean)) / 2.0) ** 2
    return np.maximum(low, 0.0), np.minimum(high, 1.0)


def _js_terms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """js(a, b) = (a log(2a / (a + b)) + b log(2b / (a + b))) / 2 elementwise (0 log 0 = 0), natural log,
    for b > 0: b phi(a / b), phi the JS generator in its form without cancellation near a = b
    (the two relative entropies' cancel to 1e-17, 1e-8 after C1's square root)."""
    return b * _js_generator(a / b)


def _root_js_against_one(x: float) -> float:
    """sqrt(js(1 + x, 1)) for x >= -1, to float64 precision. Its logs of ratios that round to
    1 +- 1e-16 lose everything as x -> 0 (the plain form gave bounds of 0, or 2e4 times too
    large, below eps = 1e-8), so: below |x| = 1e-3, |x| times the root of its Taylor series over
    x^2, 1/8 - x/16 + 7 x^2/192 - 3 x^3/128 + 31 x^4/1920 (next term 3 x^5/256: 1e-16 relative
    there; no x^2 to underflow); above, ((1 + x) log1p(u) - log1p(x / 2)) / 2 with u = x / (2 + x)
    (log1p(x / 2) = -log1p(-u), which would fail once u rounds to 1, x >= 2**54), whose
    cancellation costs 1e-16 / |x| relative."""
    if abs(x) < 1e-3:
        return abs(x) * math.sqrt(1 / 8 + x * (-1 / 16 + x * (7 / 192 + x * (-3 / 128 + x * 31 / 1920))))
    if x == -1.0:
        return math.sqrt(math.log(2.0) / 2.0)  # 0 log 0 = 0
    u = x / (2.0 + x)
    return _sqrt(((1.0 + x) * math.log1p(u) - math.log1p(x / 2.0)) / 2.0)


def _c2_from_xi(xi: float) -> float:
    """(e^(2 xi) - 1) / 2, inf where it overflows."""
    return math.inf if xi > 354.0 else math.expm1(2.0 * xi) / 2.0


def _difference(first: float, c2: float, tv: float) -> float:
    """first - c2 * tv, with 0 * inf = 0 (no distance, no penalty)."""
    return first if tv == 0.0 else first - c2 * tv


def _sqrt(value: float) -> float:
    return math.sqrt(max(float(value), 0.0))  # rounding can leave a JS of -1e-17


def _tail_log(failure: float) -> float:
    """L = log(2 / failure): each Chernoff tail gets half the failure probability."""
    return math.log(2.0 / failure)


def _as_numpy(values: Any, name: str) -> np.ndarray:
    if _arrays.is_tensor(values):
        return values.detach().cpu().numpy()
    try:
        return np.asarray(values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be an array: {error}") from None


def _real_array(values: Any, name: str) -> np.ndarray:
    """``values`` as a float64 numpy array; strings, objects and complex numbers are refused."""
    array = _as_numpy(values, name)
    if array.dtype.kind not in "biuf":
        raise validation.ArgumentTypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
    return array.astype(np.float64)


def _check_counts(counts: Any) -> RecoveryCounts:
    if not isinstance(counts, RecoveryCounts):
        raise TypeError(f"counts must be a RecoveryCounts (see count_recoveries), got {type(counts).__name__}")
    return counts


def _check_sample_prior(prior: Any, n_samples: int) -> np.ndarray:
    if prior is None:
        return np.full(n_samples, 1.0 / n_samples)
    masses = as_prior(_as_numpy(prior, "prior"), n_samples, name="prior")
    if (masses == 0).any():
        raise ValueError("prior must give every data sample positive mass (log f_D(d) appears in xi)")
    return masses
