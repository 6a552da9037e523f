"""Differential-privacy accounting for DP-SGD runs, Gaussian (Alg. 1) and von Mises-Fisher (Alg. 2).

Gaussian runs are accounted by Google's ``dp-accounting`` library (privacy loss distributions
and Renyi DP), which is made for exactly this. The VMF mechanism has no accountant there, so its
accounting is privleak's own, built from three facts:

* **Per step.** VMF(mu, kappa) has density C exp(kappa mu.y) on the unit sphere, so for two means
  f(y | mu) / f(y | mu') = exp(kappa (mu - mu').y) <= exp(kappa |mu - mu'|_2): kappa-metric DP in
  the Euclidean distance of the means, and, as unit means are at most 2 apart, 2 kappa-DP (pure,
  local). Both bounds are attained (y along mu - mu'). In Alg. 2 the mean is the normalised
  clipped average, which one example can turn anywhere, so 2 kappa is the per-step epsilon.
* **Subsampling and composition.** Any eps-DP pair of output distributions is a post-processing
  of randomised response at eps, so a Poisson-subsampled (rate q) step is dominated by the
  subsampled randomised-response pair, and T steps by its T-fold product, a binomial over the
  outcomes: privleak computes that pair's exact epsilon(delta) (``_subsampled_pure_dp_composition``),
  with no overflow at any kappa. One step with delta = 0 is log(1 + q (e^eps - 1)) (Balle, Barthe
  and Gaboardi, NeurIPS 2018); with delta = 0, T times that. Before, privleak composed that
  amplified epsilon as if it were randomised response, a valid bound up to 20 times too loose
  (kappa = 5, q = 0.01, T = 200: 1080 where the truth is 52).

One Gaussian release on its own (what a reconstruction attack sees in one leaked update) has the
exact curve of Balle and Wang's analytic Gaussian mechanism, which privleak evaluates in closed
form: calibrating it through dp-accounting's PLD takes 64 s at epsilon = 173 and 445 s at 1000,
where the closed form takes milliseconds and agrees with it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from scipy.optimize import brentq
from scipy.special import gammaln, log_ndtr, logsumexp

from privleak import validation

if TYPE_CHECKING:
    from dp_accounting.pld import privacy_loss_distribution

#: dp-accounting's PLD accountant composes T steps by one FFT whose length its Chernoff tail bound
#: fixes. A composition that would need more points than this (about 0.5 GiB per complex array) is
#: refused with a ValueError naming ``steps`` before anything is allocated; RDP has no such limit.
MAX_PLD_POINTS = 2 ** 25
#: Below this noise multiplier epsilon passes 1e200 and the accountants' arithmetic overflows (Balle and
#: Wang's closed form failed at 1e-154, dp-accounting's RDP divided by zero at 1e-200).
MIN_NOISE_MULTIPLIER = 1e-100
#: The VMF composition sums the binomial outcomes of the T-fold subsampled pair that carry any of
#: the mass that matters (within e^-60 of delta); more outcomes than this are refused (``steps``).
MAX_VMF_OUTCOMES = 2 ** 24

_PLD_DISCRETIZATION = 1e-4  # dp-accounting's PLDAccountant default
_PLD_TAIL_MASS = 1e-15  # dp-accounting's self_compose default


def _composed_pld_points(loss: "privacy_loss_distribution.PrivacyLossDistribution", steps: int,
                         tail: float = _PLD_TAIL_MASS) -> int:
    """Length of the FFT that ``loss.self_compose(steps)`` would allocate, by dp-accounting's own
    Chernoff bound on the truncated support; without access to the probabilities, the untruncated
    length (an upper bound)."""
    from dp_accounting.pld import common as pld_common

    points = 0
    for pmf in (loss._pmf_remove, loss._pmf_add):  # pylint: disable=protected-access
        probs = getattr(pmf, "_probs", None)
        if probs is None:
            points = max(points, (pmf.size - 1) * steps + 1)
            continue
        low, high = pld_common.compute_self_convolve_bounds(probs, steps, tail)
        points = max(points, high - low + 1, len(probs))
    return points


def gaussian_epsilon(noise_multiplier: float, steps: int, delta: float, *, sampling_rate: float = 1.0,
                     sampling: str = "poisson", dataset_size: int | None = None, accountant: str = "pld") -> float:
    """epsilon(delta) of T steps of DP-SGD with Gaussian noise (Alg. 1).

    Args:
        noise_multiplier: sigma, the noise std over the clip norm.
        steps: T.
        delta: the target delta.
        sampling_rate: q = L / N for Poisson sampling (1 = the full batch every step).
        sampling: "poisson" (add/remove neighbours; PLD or RDP) or "fixed", a sample of
            q N examples without replacement (replace-one neighbours, under which one example moves
            the clipped sum by 2 c: the noise multiplier over that sensitivity is sigma / 2; RDP only,
            as dp-accounting has it).
        dataset_size: N, needed for ``sampling="fixed"``.
        accountant: "pld" (tight) or "rdp".

    With q = 1 and ``accountant="pld"`` the T releases compose exactly to one Gaussian release with
    noise sigma / sqrt(T), whose curve is Balle and Wang's closed form
    (:func:`analytic_gaussian_epsilon`): exact, where dp-accounting's discretised PLD is a hair
    pessimistic and needs memory growing like T / sigma^2 (34 s and 2.6 GB at sigma = 1, T = 1000).
    With q < 1, dp-accounting's PLD; a composition that would need more than ``MAX_PLD_POINTS``
    points is refused (ValueError naming ``steps``; use ``accountant="rdp"``), as is a sigma whose
    one step alone would (below about 1e-3 at the default discretisation: naming
    ``noise_multiplier``). The composition truncates a tail of min(1e-15, delta / 1000), counted
    as infinite loss (dp-accounting's default 1e-15 made every delta <= 1e-15 give inf). Below a
    delta of about 1e-13 the composition's float64 FFT round-off is of delta's order, and the
    epsilon wanders with the tail and the CPU's FFT kernels (10 steps, q = 0.01, sigma = 1: within
    1e-3 over tails of delta / 100 to delta / 1e5 at 1e-13, within 1% at 1e-14, 3.20-3.52 at
    1e-15 on one Intel CPU): take RDP's bound there. RDP takes any T. A sigma below
    ``MIN_NOISE_MULTIPLIER`` (1e-100) is refused.
    """
    sigma = validation.positive(noise_multiplier, "noise_multiplier")
    if sigma < MIN_NOISE_MULTIPLIER:
        raise ValueError(f"noise_multiplier = {sigma!r} is too small to account: below {MIN_NOISE_MULTIPLIER:g} "
                         "epsilon passes 1e200 and the accountants' arithmetic overflows")
    steps = validation.integer(steps, "steps", low=1)
    delta = validation.probability(delta, "delta", open_high=True)
    q = validation.probability(sampling_rate, "sampling_rate", open_low=True)
    accountant = validation.choice(accountant, "accountant", ("pld", "rdp"))
    sampling = validation.choice(sampling, "sampling", ("poisson", "fixed"))
    # dp-accounting here, not at the module's top: its import (scipy.signal and more) takes 1.4 s, and
    # privleak's CLI imports this module to build its parser (`privleak --help`: 3.8-4.2 -> 3.2-3.7 s)
    from dp_accounting import dp_event, privacy_accountant, rdp
    from dp_accounting.pld import privacy_loss_distribution

    step = dp_event.GaussianDpEvent(sigma)
    if sampling == "poisson":
        if accountant == "rdp":
            engine = rdp.RdpAccountant()
            engine.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, step) if q < 1 else step,
                                                        steps))
            return float(engine.get_epsilon(delta))
        if q == 1.0:
            return _analytic_gaussian_epsilon(sigma / math.sqrt(steps), delta)
        # One step's losses span about 1 / (2 sigma^2) + 10 / sigma either way, at the discretisation's
        # spacing: dp-accounting allocates them all (38 GiB at sigma = 1e-3) before any check of ours.
        one_step = (1.0 / sigma**2 + 20.0 / sigma) / _PLD_DISCRETIZATION
        if one_step > MAX_PLD_POINTS:
            raise ValueError(f"noise_multiplier = {sigma:g} is too small for the PLD accountant: one step's privacy "
                             f"loss distribution would need about {one_step:.3g} points (limit {MAX_PLD_POINTS}); "
                             "use accountant='rdp'")
        # The tail the composition truncates counts as infinite loss, i.e. adds to delta: it is kept
        # to a thousandth of delta (dp-accounting's default 1e-15 alone made any delta <= 1e-15 inf)
        tail = _PLD_TAIL_MASS if delta == 0 else min(_PLD_TAIL_MASS, delta * 1e-3)
        loss = privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=sigma, sampling_prob=q, value_discretization_interval=_PLD_DISCRETIZATION)
        points = _composed_pld_points(loss, steps, tail)
        if points > MAX_PLD_POINTS:
            raise ValueError(f"steps = {steps} is too many for the PLD accountant at noise_multiplier = {sigma:g}, "
                             f"sampling_rate = {q:g}: its composition would need {points:.3g} points (limit "
                             f"{MAX_PLD_POINTS}); use accountant='rdp'")
        return float(loss.self_compose(steps, tail).get_epsilon_for_delta(delta))
    if accountant != "rdp":
        raise ValueError("fixed-size sampling is accounted with accountant='rdp' (dp-accounting's PLD lacks it)")
    if dataset_size is None:
        raise ValueError("fixed-size sampling needs dataset_size, an int >= 1, got None")
    n = validation.integer(dataset_size, "dataset_size", low=1)
    # dp-accounting's noise multiplier is the noise std over the sensitivity under its neighbouring
    # relation: replacing one example moves the clipped sum by up to 2 c, so it is sigma / 2.
    # (privleak passed sigma before, and reported at q = 1 the add/remove epsilon at sigma.)
    batch = round(q * n)
    if batch < 1 or not math.isclose(q * n, batch, rel_tol=1e-9):
        raise ValueError(f"fixed-size sampling draws batches of sampling_rate * dataset_size examples, a whole number: "
                         f"got {q!r} * {n} = {q * n!r}")
    event = dp_event.SampledWithoutReplacementDpEvent(n, batch, dp_event.GaussianDpEvent(sigma / 2))
    engine = rdp.RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)
    engine.compose(dp_event.SelfComposedDpEvent(event, steps))
    return float(engine.get_epsilon(delta))


def _log_gaussian_delta(epsilon: float, noise_multiplier: float) -> float:
    """log delta(eps) of one Gaussian release with std sigma times the sensitivity (Balle and Wang,
    ICML 2018, Thm 8): delta = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma),
    in logs because both terms underflow long before their difference matters."""
    sigma = noise_multiplier
    log_first = float(log_ndtr(0.5 / sigma - epsilon * sigma))
    log_second = epsilon + float(log_ndtr(-0.5 / sigma - epsilon * sigma))
    if log_second >= log_first:
        return -math.inf
    return log_first + math.log1p(-math.exp(log_second - log_first))


def _analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    if delta == 0.0:
        return math.inf
    log_delta = math.log(delta)
    if _log_gaussian_delta(0.0, sigma) <= log_delta:
        return 0.0
    upper = 1.0
    while _log_gaussian_delta(upper, sigma) > log_delta:
        upper *= 2.0
    return brentq(lambda eps: _log_gaussian_delta(eps, sigma) - log_delta, 0.0, upper, xtol=1e-12, rtol=1e-12)


def analytic_gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """epsilon(delta) of a single Gaussian release N(f(x), (sigma Delta)^2 I), Delta the L2
    sensitivity of f: the least eps with delta(eps) <= delta on Balle and Wang's exact curve.

    For the epsilon of one leaked update as local DP, where any two clipped gradients may be
    neighbours, the sensitivity is the diameter 2c of the clipping ball: pass noise_multiplier / 2.
    """
    sigma = validation.positive(noise_multiplier, "noise_multiplier")
    return _analytic_gaussian_epsilon(sigma, validation.probability(delta, "delta", open_high=True))


def analytic_gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """The sigma at which one Gaussian release is exactly (epsilon, delta)-DP (the inverse of
    :func:`analytic_gaussian_epsilon`)."""
    epsilon = validation.positive(epsilon, "epsilon")
    delta = validation.probability(delta, "delta", open_high=True)
    if delta == 0.0:
        raise ValueError("delta must be > 0: no Gaussian noise gives pure DP")
    log_delta = math.log(delta)

    def excess(log_sigma: float) -> float:
        return _log_gaussian_delta(epsilon, math.exp(log_sigma)) - log_delta

    low, high = -1.0, 1.0
    while excess(low) < 0:
        low *= 2.0
    while excess(high) > 0:
        high *= 2.0
    return math.exp(brentq(excess, low, high, xtol=1e-13, rtol=1e-13))


def _amplified_by_poisson_sampling(epsilon: float, q: float) -> float:
    """log(1 + q (e^eps - 1)), written as eps + log(q + (1 - q) e^-eps) where e^eps would overflow."""
    if epsilon <= 1.0:
        return math.log1p(q * math.expm1(epsilon))
    return epsilon + math.log(q + (1.0 - q) * math.exp(-epsilon))


class VMFPrivacy(NamedTuple):
    """Privacy of a VMF DP-SGD run (module docstring)."""

    metric_epsilon: float  #: per step, per unit of Euclidean distance between the means: kappa
    step_epsilon: float  #: per step, pure (local) DP: 2 kappa
    epsilon: float  #: over the run, with subsampling and composition, at ``delta``
    delta: float


def vmf_privacy(kappa: float, steps: int = 1, delta: float = 0.0, *, sampling_rate: float = 1.0) -> VMFPrivacy:
    """Metric-DP and pure-DP epsilon of the VMF mechanism per step, and epsilon(delta) over a run
    of ``steps`` Poisson-subsampled steps (rate ``sampling_rate``): the exact epsilon of the
    T-fold Poisson-subsampled randomised-response pair (:func:`_subsampled_pure_dp_composition`)."""
    kappa = validation.positive(kappa, "kappa")
    steps = validation.integer(steps, "steps", low=1)
    delta = validation.probability(delta, "delta", open_high=True)
    q = validation.probability(sampling_rate, "sampling_rate", open_low=True)
    step = 2.0 * kappa
    return VMFPrivacy(kappa, step, _subsampled_pure_dp_composition(step, q, steps, delta), delta)


def _log_unamplified_loss(epsilon: float, q: float) -> float:
    """log(1 - q (1 - e^-eps)) = log((1 - q) + q e^-eps), the privacy loss of the subsampled pair's
    second outcome: log1p where the argument is small, else a log-sum of the two terms (1 - q
    (1 - e^-eps) cancels once it is below 1/2, and rounds to 0 for q = 1 and eps > 37)."""
    shrink = q * -math.expm1(-epsilon)
    if shrink <= 0.5:
        return math.log1p(-shrink)
    if q == 1.0:
        return -epsilon
    first, second = math.log1p(-q), math.log(q) - epsilon
    top = max(first, second)
    return top + math.log1p(math.exp(min(first, second) - top))


def _softplus(x: float) -> float:
    """log(1 + e^x) without overflow."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def _subsampled_pure_dp_composition(epsilon: float, q: float, steps: int, delta: float) -> float:
    """The least eps_T such that T Poisson-subsampled (rate q) eps-DP steps are (eps_T, delta)-DP,
    for every eps-DP base mechanism: exact.

    Any eps-DP pair of output distributions is a post-processing of randomised response
    P = (p, 1 - p), Q = (1 - p, p), p = e^eps / (1 + e^eps) (Kairouz, Oh and Viswanath 2015), so
    the Poisson-subsampled step is dominated by the pair (P' = q P + (1 - q) Q, Q) when the example
    is removed and (Q, P') when it is added (Zhu, Dong and Wang, AISTATS 2022), attained by
    randomised response itself. T steps: k first outcomes out of T, binomial, with privacy loss
    k l0 + (T - k) l1, l0 = log(1 + q (e^eps - 1)) (the amplified step epsilon of Balle, Barthe and
    Gaboardi 2018) and l1 = log(1 - q (1 - e^-eps)); delta(eps_T) is the larger hockey-stick
    divergence of the two directions, summed over k in logs (any kappa) and solved for eps_T.

    This is tighter than composing the amplified step epsilon l0 as a pure-DP mechanism (what
    privleak did before): that treats the subsampled step as if it were randomised response at
    l0, whose loss -l0 on the second outcome is far below l1; at kappa = 2, q = 0.05, T = 50,
    delta = 1e-5 it gave 62.5 where the truth is 14.3. With q = 1 the two agree.
    Only outcomes k whose probability lies within e^-60 of delta are summed (the rest add less than
    T e^-60 delta); more than ``MAX_VMF_OUTCOMES`` of them is refused (ValueError naming steps).
    """
    amplified = _amplified_by_poisson_sampling(epsilon, q)
    if delta == 0.0:  # the largest loss, in either direction: T l0 >= -T l1
        return steps * amplified
    log_q0 = -_softplus(epsilon)  # Q: first outcome 1 / (1 + e^eps)
    log_q1 = -_softplus(-epsilon)
    log_p0 = amplified + log_q0  # P' first outcome (1 + q (e^eps - 1)) / (1 + e^eps)
    loss1 = _log_unamplified_loss(epsilon, q)  # <= 0; -epsilon when q = 1
    log_p1 = loss1 + log_q1
    floor = math.log(delta) - 60.0

    def log_binomial(k, log_a: float, log_b: float):
        return gammaln(steps + 1.0) - gammaln(k + 1.0) - gammaln(steps - k + 1.0) + k * log_a + (steps - k) * log_b

    def window(log_a: float, log_b: float) -> tuple[int, int]:
        """The k with log Binomial(k; T, a) >= floor: an interval around the mode (log-concave)."""
        mode = min(steps, max(0, math.floor((steps + 1) * math.exp(log_a))))
        if log_binomial(mode, log_a, log_b) < floor:
            return mode, mode - 1  # empty
        low, high = 0, mode  # log pmf rises on [0, mode]: the first k above the floor
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if log_binomial(mid, log_a, log_b) < floor else (low, mid)
        first = low
        low, high = mode, steps  # falls on [mode, T]: the last k above the floor
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (low, mid - 1) if log_binomial(mid, log_a, log_b) < floor else (mid, high)
        return first, low

    spans = [window(log_p0, log_p1), window(log_q0, log_q1)]
    first, last = min(s[0] for s in spans), max(s[1] for s in spans)
    if last - first + 1 > MAX_VMF_OUTCOMES:
        raise ValueError(f"steps = {steps} is too many for the VMF composition at kappa = {epsilon / 2:g}, "
                         f"sampling_rate = {q:g}, delta = {delta:g}: {last - first + 1} binomial outcomes to sum "
                         f"(limit {MAX_VMF_OUTCOMES})")
    ks = np.arange(first, last + 1, dtype=np.float64)
    log_p = log_binomial(ks, log_p0, log_p1)
    log_q = log_binomial(ks, log_q0, log_q1)
    losses = ks * amplified + (steps - ks) * loss1  # log P'(k) / Q(k)

    def log_delta(eps_total: float) -> float:
        # remove: sum over loss > eps of P'(k) (1 - e^(eps - loss)); add: over -loss > eps of Q(k) (1 - e^(eps + loss))
        terms = []
        for log_mass, loss in ((log_p, losses), (log_q, -losses)):
            above = loss > eps_total
            if np.any(above):
                terms.append(logsumexp(log_mass[above] + np.log(-np.expm1(eps_total - loss[above]))))
        return max(terms) if terms else -math.inf

    target = math.log(delta)
    if log_delta(0.0) <= target:
        return 0.0
    upper = steps * amplified  # no loss exceeds it: delta 0
    return float(brentq(lambda e: max(log_delta(e), -1e300) - target, 0.0, upper, xtol=1e-12, rtol=1e-13))
