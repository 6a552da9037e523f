"""Random channels and priors for hypothesis, and plain-loop computations of the channel metrics.

The loop versions follow the definitions in the papers symbol by symbol (Bayes' rule for
posteriors, sums over secrets and observations) in Python floats, sharing no code with
privleak.channels, so that the tests compare two independent computations.
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

# Entries are 0 or at least 1e-6, so that products with priors never underflow.
_ENTRY = st.one_of(st.just(0.0), st.floats(1e-6, 1.0))
_MASS = st.one_of(st.just(0.0), st.floats(1e-3, 1.0))


@st.composite
def channels(draw, max_rows: int = 6, max_cols: int = 6, rows: int | None = None, cols: int | None = None,
             dtype=np.float64) -> np.ndarray:
    """Row-stochastic matrices, dense, sparse (many exact zeros) or near-deterministic; the shape
    is drawn up to (max_rows, max_cols) unless ``rows`` or ``cols`` fixes it."""
    rows = rows or draw(st.integers(1, max_rows))
    cols = cols or draw(st.integers(1, max_cols))
    style = draw(st.sampled_from(["dense", "sparse", "near_deterministic"]))
    weights = draw(arrays(np.float64, (rows, cols), elements=st.floats(1e-6, 1.0) if style == "dense" else _ENTRY))
    if style == "near_deterministic":
        targets = draw(arrays(np.int64, rows, elements=st.integers(0, cols - 1)))
        weights = weights * 1e-9
        weights[np.arange(rows), targets] = 1.0
    empty = weights.sum(axis=1) == 0
    weights[empty, draw(st.integers(0, cols - 1))] = 1.0
    return (weights / weights.sum(axis=1, keepdims=True)).astype(dtype)


@st.composite
def priors(draw, size: int, full_support: bool = False) -> np.ndarray:
    """Distributions over ``size`` secrets: uniform, or random with (unless full_support) zeros."""
    if draw(st.booleans()):
        return np.full(size, 1.0 / size)
    masses = draw(arrays(np.float64, size, elements=st.floats(1e-3, 1.0) if full_support else _MASS))
    if masses.sum() == 0:
        masses[draw(st.integers(0, size - 1))] = 1.0
    return masses / masses.sum()


@st.composite
def gains(draw, n_secrets: int, low: float = -1.0, high: float = 2.0) -> np.ndarray:
    """Gain matrices G[w, x] with 1 to 4 actions."""
    actions = draw(st.integers(1, 4))
    return draw(arrays(np.float64, (actions, n_secrets), elements=st.floats(low, high)))


@st.composite
def channels_with_prior(draw, full_support: bool = False, **channel_options):
    channel = draw(channels(**channel_options))
    return channel, draw(priors(channel.shape[0], full_support))


def rows(channel) -> list[list[float]]:
    return [[float(v) for v in row] for row in np.asarray(channel)]


def output_distribution(channel, prior) -> list[float]:
    c = rows(channel)
    return [sum(prior[x] * c[x][y] for x in range(len(c))) for y in range(len(c[0]))]


def posterior(channel, prior, y: int) -> list[float]:
    """P(x | y) by Bayes' rule."""
    c = rows(channel)
    joint = [prior[x] * c[x][y] for x in range(len(c))]
    total = sum(joint)
    return [j / total for j in joint]


def bayes_capacity(channel) -> float:
    c = rows(channel)
    return sum(max(c[x][y] for x in range(len(c))) for y in range(len(c[0])))


def g_vulnerability(channel, prior, gain) -> float:
    """sum_y max_w sum_x pi[x] C[x, y] g[w][x]; the identity channel gives the prior vulnerability."""
    c = rows(channel)
    return sum(
        max(sum(prior[x] * c[x][y] * gain[w][x] for x in range(len(c))) for w in range(len(gain)))
        for y in range(len(c[0]))
    )


def mutual_information(channel, prior) -> float:
    c = rows(channel)
    p = output_distribution(channel, prior)
    return sum(
        prior[x] * c[x][y] * math.log(c[x][y] / p[y])
        for x in range(len(c)) for y in range(len(c[0])) if prior[x] * c[x][y] > 0
    )


def ldp_epsilon(channel) -> float:
    """max over pairs of secrets and observations of log(C[x, y] / C[x', y])."""
    c = rows(channel)
    worst = 0.0
    for y in range(len(c[0])):
        for a in c:
            for b in c:
                if a[y] > 0 and b[y] == 0:
                    return math.inf
                if a[y] > 0 and b[y] > 0:
                    worst = max(worst, math.log(a[y] / b[y]))
    return worst


def lip_epsilons(channel, prior) -> tuple[float, float]:
    """max and -min of log(P(x|y) / P(x)) over possible secrets and observations."""
    p = output_distribution(channel, prior)
    upper, lower = 0.0, 0.0
    for y in range(len(p)):
        if p[y] == 0:
            continue
        post = posterior(channel, prior, y)
        for x, mass in enumerate(prior):
            if mass == 0:
                continue
            if post[x] == 0:
                lower = math.inf
            else:
                upper = max(upper, math.log(post[x] / mass))
                lower = max(lower, -math.log(post[x] / mass))
    return upper, lower


def js_divergence(a, b) -> float:
    mixture = [(u + v) / 2 for u, v in zip(a, b)]
    return 0.5 * sum(u * math.log(u / m) for u, m in zip(a, mixture) if u > 0) + 0.5 * sum(
        v * math.log(v / m) for v, m in zip(b, mixture) if v > 0
    )


def abp_epsilons(channel, attacker_prior) -> list[float]:
    """sqrt(JS(F^A_x || q)) with F^A_x(d) = sum_y C[x, y] P_q(d | y), for each true secret x."""
    c = rows(channel)
    p = output_distribution(channel, attacker_prior)
    posteriors = {y: posterior(channel, attacker_prior, y) for y in range(len(p)) if p[y] > 0}
    result = []
    for x in range(len(c)):
        belief = [sum(c[x][y] * posteriors[y][d] for y in posteriors) for d in range(len(c))]
        result.append(math.sqrt(max(js_divergence(belief, attacker_prior), 0.0)))
    return result
