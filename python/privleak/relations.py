"""Implications between privacy notions, as functions that return the implied bound.

Each function checks the conditions of its implication and returns the best bound that follows
from its arguments: the true one. Where a paper states a different bound, the docstring gives
the paper's statement and says why it differs; ``tests/test_relations.py`` checks every bound
against brute force over random channels and priors and reaches it with a worked example where
it is tight. Papers: [000] Zhang, Fei, Chen, Jin (LDP / ABP / MBP), [001] Zhang, Chen (priors
epsilon-close to uniform, PAC robustness), [003] lecture notes (LIP, LDP, DP, MI), [004] Biswas et
al. (Bayes capacity). Metrics are in :mod:`privleak.channels`; all epsilons are natural-log.

Notation: a channel C has r[x, y] = P(x|y) / P(x) = C[x, y] / p(y) under a prior pi. Column y of
r has pi-mean 1 and row x of r has p-mean 1. LIP (eps_U, eps_L) means e^-eps_L <= r <= e^eps_U
on the support of pi; MBP xi is LIP (xi, xi); LDP eps bounds C[x, y] / C[x', y] = r[x, y] / r[x', y]
by e^eps. Several sharp bounds below are the largest value of an average E[phi(T)] over a ratio T
confined to [L, U] with mean 1; for convex phi that maximum puts all mass on L and U.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from privleak import validation
from privleak.channels import (
    _capacity_over_rows,
    _js_generator,
    as_channel,
    as_gain,
    as_mapping,
    as_prior,
    bayes_capacity,
)


def lip_from_ldp(ldp_epsilon: float, prior: Any = None) -> tuple[float, float]:
    """LDP -> LIP: the largest (eps_U, eps_L) of an eps-LDP channel ([003], implication (1)).

    With pi_min the smallest non-zero prior mass:

        eps_U <= -log(pi_min + (1 - pi_min) e^-eps),   eps_L <= log(pi_min + (1 - pi_min) e^eps).

    Why: r[x, y] = C[x, y] / sum_x' pi[x'] C[x', y] and every C[x', y] lies within e^+-eps of
    C[x, y], worst when x is the least likely secret. Each bound is reached by a two-observation
    channel (tests). The notes state eps-LDP => eps-LIP, true for every prior and the limit of
    these bounds as pi_min -> 0, which is what ``prior=None`` returns; for any actual prior both
    are smaller. eps_U stays finite even for eps = inf: a posterior is at most 1, so r <= 1/pi_min.
    """
    epsilon = validation.epsilon(ldp_epsilon, "ldp_epsilon")
    if prior is None:
        return epsilon, epsilon
    smallest = _smallest_masses(as_prior(prior), 1)[0]
    if smallest == 1.0:  # a single possible secret: the posterior equals the prior
        return 0.0, 0.0
    upper = -float(np.logaddexp(math.log(smallest), math.log1p(-smallest) - epsilon))
    lower = float(np.logaddexp(math.log(smallest), math.log1p(-smallest) + epsilon))
    return upper, lower


def mbp_from_ldp(ldp_epsilon: float, prior: Any = None) -> float:
    """LDP -> MBP: xi <= log(pi_min + (1 - pi_min) e^eps) <= eps ([000] Thm 5.3, [001] Thm IV.4).

    MBP xi is max(eps_U, eps_L) of :func:`lip_from_ldp`, and the eps_L bound is the larger.
    Papers: eps-LDP => eps-MBP for a uniform prior (Thm 5.3), (eps + eps_c)-MBP for a prior with
    |log pi[x] / pi[x']| <= eps_c (Thm IV.4). Both hold but are loose: the true bound is below eps
    for *every* prior, so the + eps_c of Thm IV.4 is never needed. r[x, y] divides a likelihood by
    a pi-average of likelihoods within e^+-eps of it, whatever pi is; the proof of Lemma A.5
    instead bounds the posterior by e^(eps + eps_c) / |D| and reads 1/|D| as pi[x]. For the
    uniform prior on n secrets it is log((1 + (n - 1) e^eps) / n), e.g. log((1 + e) / 2) = 0.62
    for n = 2, eps = 1 instead of 1. Reached by a two-observation channel (tests);
    ``prior=None`` returns the supremum eps.
    """
    return max(lip_from_ldp(ldp_epsilon, prior))


def ldp_from_lip(eps_upper: float, eps_lower: float, prior: Any = None) -> float:
    """LIP -> LDP: the largest LDP epsilon of a channel that is (eps_U, eps_L)-LIP under ``prior``.

    The lecture notes' bound eps_U + eps_L ([003], "Relations") holds for every prior and is what
    ``prior=None`` returns, but it is reached only as the two smallest prior masses go to 0. For a
    known prior (full support: LIP says nothing about secrets of probability 0), a column of r has
    pi-mean 1, so x and x' cannot both sit at the extremes. With U = e^eps_U, L = e^-eps_L, the
    largest r[x, y] / r[x', y] for masses p = pi[x], q = pi[x'] is

        min(U, (1 - (1 - p) L) / p) / L          if (1 - q) U + q L >= 1  (x' can sit at L),
        U q / (1 - (1 - q) U)                    otherwise               (x can sit at U),

    largest for the two least likely secrets (either order). Reached by a two-observation channel
    (tests). E.g. the uniform prior on 2 secrets with eps_U = eps_L = 1 gives log(2e - 1) = 1.49,
    not 2.

    The second form is ill-conditioned where its denominator 1 - (1 - q) U is small (q L small: a
    large eps_L): an error delta in eps_U moves the result by 1 + (1 - q) U / (1 - (1 - q) U)
    times delta. The result is exact for the epsilons given; for epsilons measured from a channel
    (rounded, or estimated) add their error bound first, or the result can fall below that
    channel's own LDP epsilon (seen once in 3000 random channels: 2e-3 nats, from inputs
    rounded to float64).
    """
    upper = validation.epsilon(eps_upper, "eps_upper")
    lower = validation.epsilon(eps_lower, "eps_lower")
    if prior is None:
        return upper + lower
    masses = as_prior(prior)
    if (masses == 0).any():
        raise ValueError("prior must give every secret positive probability: LIP/MBP do not constrain the rows of "
                         "impossible secrets, so no LDP bound follows for them")
    if masses.size == 1:
        return 0.0
    if _exp(-lower) == 0.0:  # a possible secret may be ruled out while another is not
        return math.inf
    p, q = _smallest_masses(masses, 2)
    return math.log(max(_largest_likelihood_ratio(p, q, upper, lower), _largest_likelihood_ratio(q, p, upper, lower)))


def ldp_from_mbp(mbp_xi: float, prior: Any = None) -> float:
    """MBP -> LDP: xi-MBP implies at most 2 xi-LDP ([000] Thm 5.3, [001] Thm IV.4); MBP xi is LIP (xi, xi).

    Papers: xi-MBP => 2 xi-LDP for a uniform prior (Thm 5.3) and (2 xi + eps_c)-LDP for a prior
    eps_c-close to uniform (Thm IV.4). The truth: 2 xi for *every* full-support prior, because
    C[x, y] / C[x', y] = r[x, y] / r[x', y] exactly, whatever the prior (the proof of Lemma A.6
    inserts a factor e^+-eps_c that is not there), so the + eps_c is never needed; and for a
    known prior the sharp value of :func:`ldp_from_lip`. For the uniform prior on n secrets it is
    xi + log(min(e^xi, n - (n - 1) e^-xi)): 2 xi exactly when n >= e^xi + 1, smaller otherwise
    (log(2 e^xi - 1) for n = 2).
    """
    xi = validation.epsilon(mbp_xi, "mbp_xi")
    return ldp_from_lip(xi, xi, prior)


def mi_from_lip(eps_upper: float, eps_lower: float) -> float:
    """LIP -> MI: the largest I(X; Y) in nats of an (eps_U, eps_L)-LIP channel ([003], implication (2)).

    I = sum_y p(y) sum_x pi[x] r log r, and each column of r has pi-mean 1 within [L, U]
    (L = e^-eps_L, U = e^eps_U); t log t is convex, so the maximum puts mass
    lam = (1 - L) / (U - L) on U and the rest on L:

        I <= lam U eps_U - (1 - lam) L eps_L.

    The notes state eps-LIP => I <= eps, true (I is an average of log r <= eps_U) but loose:
    for eps_U = eps_L = eps the bound is eps tanh(eps / 2), e.g. 0.46 instead of 1 at eps = 1.
    Reached when lam = 1/k: k equally likely secrets, k observations, C[x, y] = U/k if x == y
    else L/k (tests); for other lam it is the supremum.
    """
    upper = validation.epsilon(eps_upper, "eps_upper")
    lower = validation.epsilon(eps_lower, "eps_lower")
    return _two_point_maximum(lambda t: t * math.log(t) if t > 0 else 0.0, lambda log_t: log_t, upper, lower)


def abp_from_mbp(mbp_xi: float, prior_mismatch: float = 0.0) -> float:
    """MBP -> ABP: the largest epsilon_{p,a} of a xi-MBP channel ([000] Thm 5.4, [001] Thm IV.6).

    ``mbp_xi`` is MBP under the true prior pi; the attacker's prior q (F^B) satisfies
    |log q / pi| <= ``prior_mismatch`` = eps (:func:`privleak.channels.prior_mismatch`) and the
    attacker updates q by Bayes' rule (:func:`privleak.channels.abp_epsilons`). Papers:

        epsilon_{p,a} <= sqrt((xi + eps) (e^(xi + eps) - 1) / 2),

    true but loose, and above sqrt(ln 2), the largest possible value, once xi + eps > 0.92. The
    truth: with t = F^A_x / q, JS(F^A_x || q) = sum_d q[d] phi(t[d]) for the convex
    phi(t) = (t log(2t / (1 + t)) + log(2 / (1 + t))) / 2, and t has q-mean 1. Writing
    t[d] = sum_y p(y) r[x, y] r[d, y] s(y) with r in [e^-xi, e^xi] of p-mean 1 and
    s = p_pi / p_q in [e^-m, e^m], m = min(eps, xi), gives
    t in [e^-m (2L - L^2), e^m (U + L - UL)] (L = e^-xi, U = e^xi: the extreme values of the
    mean of a product of two such ratios), and JS is at most phi's two-point maximum over that
    interval. For eps = 0 this is reached (two secrets with pi = (1/(1 + e^xi), e^xi/(1 + e^xi)),
    tests): at xi = 1 it is 0.21 where the paper gives 0.93. For eps > 0 it stays a valid bound,
    below the paper's, but is not shown to be reached.
    """
    xi = validation.epsilon(mbp_xi, "mbp_xi")
    mismatch = min(validation.epsilon(prior_mismatch, "prior_mismatch"), xi)
    if math.isinf(xi):
        return math.sqrt(math.log(2.0))
    # log(U + L - UL) and -log(2L - L^2), written so that no exponential overflows.
    log_highest = xi + math.log1p(-math.exp(-xi) * -math.expm1(-xi))
    log_lowest = xi - math.log1p(-math.expm1(-xi))
    divergence = _two_point_maximum(_js_generator, _js_generator_over_ratio,
                                    log_highest + mismatch, log_lowest + mismatch)
    return math.sqrt(max(divergence, 0.0))


def pac_robustness_failure_probability(mbp_xi: float, beta: float, prior: Any = None) -> float:
    """PAC robustness of an (xi, beta, alpha)-MBP mechanism: the gamma of [001] Thm IV.7.

    If M is xi-MBP and misses the accuracy region (||M(d) - mu|| > alpha) with probability at most
    beta on the data d, then on any other d' it misses with probability at most

        gamma = min(e^eta beta, 1 - e^-eta (1 - beta)),   eta = ldp_from_mbp(xi, prior),

    the sharp pair of inequalities eta-LDP gives for one event and its complement. The paper's
    gamma = (1 + 4 xi) beta, claimed for 0 <= xi <= 1, relies on e^(2 xi) <= 1 + 2 xi + 4 xi^2 <=
    1 + 4 xi, which fails for xi > 0.6282 (the root of e^(2 xi) = 1 + 4 xi; of its two steps, the
    second fails for every xi > 1/2 and the first past xi = 0.8966): at xi = 1 a mechanism reaches
    7.39 beta > 5 beta (tests). Its main text also quotes a confidence 1 - beta / gamma and a
    radius log(1/gamma) / (2 n xi) that the theorem does not contain.
    """
    beta = validation.probability(beta, "beta")
    eta = ldp_from_mbp(mbp_xi, prior)
    if math.isinf(eta):
        return 1.0
    grown = beta * _exp(eta) if beta > 0 else 0.0
    return min(grown, 1.0 - _exp(-eta) * (1.0 - beta))


def g_leakage_bound(channel: Any, gain: Any) -> float:
    """Bayes capacity bounds the multiplicative g-leakage: L_g(pi, C) <= C_Bayes(C) ([004] Sec. III).

    Holds for every prior (with V_g(pi) > 0) and every *non-negative* gain, and is reached by the
    identity gain with the uniform prior. Raises ValueError for a gain with a negative entry: then
    the bound fails (tests: a 2 x 2 example leaks 5 times where the capacity is 2).
    """
    capacity = bayes_capacity(channel)  # checks the channel, so its shape is known below
    if (as_gain(gain, channel.shape[0]) < 0).any():
        raise ValueError("gain has negative entries: Bayes capacity bounds the g-leakage of non-negative gains only")
    return capacity


def capacity_after_deterministic_preprocessing(mapping: Any, channel: Any) -> float:
    """C_Bayes of x -> channel[mapping[x]]: sum_y max_{x' in image(mapping)} channel[x', y] ([004] Lemma II.1).

    The lemma states C_Bayes(F . D) = C_Bayes(D) for every deterministic F. Its proof assumes
    channels have no all-zero column, i.e. F is onto the rows of D; without that, rows of D
    outside F's image drop out and the capacity can fall (e.g. to 1 for a constant function).
    True in general: C_Bayes(F . D) <= C_Bayes(D) for any pre-processing F, deterministic or not,
    with equality for a deterministic F exactly when every column's maximum of D is attained on
    F's image (always when F is onto). Copies nothing: the image rows are selected by 0/1 weights.
    """
    matrix = as_channel(channel)
    in_image = np.zeros(matrix.shape[0], dtype=bool)
    in_image[as_mapping(mapping, matrix.shape[0])] = True
    return _capacity_over_rows(matrix, in_image)


# --- internals -------------------------------------------------------------------------------


def _exp(x: float) -> float:
    """e^x, inf where it overflows."""
    return math.inf if x > 709.0 else math.exp(x)


def _smallest_masses(masses: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` smallest positive entries, ascending."""
    return np.sort(masses[masses > 0])[:count]


def _largest_likelihood_ratio(p: float, q: float, eps_upper: float, eps_lower: float) -> float:
    """max r[x, y] / r[x', y] over columns of pi-mean 1 within [e^-eps_L, e^eps_U], pi[x] = p, pi[x'] = q.

    The other secrets fill the rest of the mean; the ratio is a linear-fractional objective, so
    it is largest at a vertex: r[x'] = L if that leaves room, else r[x] = U.
    """
    upper, lower = _exp(eps_upper), _exp(-eps_lower)
    if (1.0 - q) * upper + q * lower >= 1.0:
        return min(upper, (1.0 - (1.0 - p) * lower) / p) / lower
    return upper * q / (1.0 - (1.0 - q) * upper)


def _two_point_maximum(phi: Callable[[float], float], phi_over_ratio: Callable[[float], float],
                       eps_upper: float, eps_lower: float) -> float:
    """max E[phi(T)] over T in [e^-eps_lower, e^eps_upper] with E[T] = 1, phi convex, phi(1) = 0.

    The maximum puts mass lam = (1 - L) / (U - L) on U and 1 - lam on L. ``phi_over_ratio(log U)``
    = phi(U) / U keeps lam phi(U) = (1 - L) / (1 - L/U) * phi(U) / U finite for huge or infinite U.
    """
    if eps_upper == 0.0 or eps_lower == 0.0:  # then T = 1
        return 0.0
    lower = math.exp(-eps_lower)
    spread = -math.expm1(-(eps_upper + eps_lower))  # 1 - L / U
    return (1.0 - lower) / spread * phi_over_ratio(eps_upper) + -math.expm1(-eps_upper) / spread * phi(lower)


def _js_generator_over_ratio(log_t: float) -> float:
    """_js_generator(t) / t for t = e^log_t, stable up to t = inf (where it tends to ln(2) / 2)."""
    if math.isinf(log_t):
        return 0.5 * math.log(2.0)
    inverse = math.exp(-log_t)
    return 0.5 * (math.log(2.0) - math.log1p(inverse) + inverse * (math.log(2.0) - log_t - math.log1p(inverse)))
