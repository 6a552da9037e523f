"""Differential-privacy accounting for DP-SGD runs, Gaussian (Alg. 1) and von Mises-Fisher (Alg. 2).

Gaussian runs are accounted by Google's ``dp-accounting`` library (privacy loss distributions
and Renyi DP), which is made for exactly this. The VMF mechanism has no accountant there, so its
accounting is privleak's own, built from three facts:

* **Per step.** VMF(mu, kappa) has density C exp(kappa mu.y) on the unit sphere, so for two means
  f(y | mu) / f(y | mu') = exp(kappa (mu - mu').y) <= exp(kappa |mu - mu'|_2): kappa-metric DP in
  the Euclidean distance of the means, and, as unit means are at most 2 apart, 2 kappa-DP (pure,
  local). Both bounds are attained (y along mu - mu'). In Alg. 2 the mean is the normalised
  clipped average, which one example can turn anywhere, so 2 kappa is the per-step epsilon.
* **Subsampling.** Poisson sampling with rate q amplifies an eps-DP step to
  log(1 + q (e^eps - 1))-DP (Balle, Barthe and Gaboardi, NeurIPS 2018, add/remove neighbours);
  a fixed-size batch of m out of n, drawn without replacement, to the same with q = m / n under
  replace-one neighbours (same paper).
* **Composition.** T steps are composed with the privacy loss distribution that dominates any
  pure-DP mechanism (dp-accounting's ``from_privacy_parameters``), which is the optimal
  composition for pure DP (Kairouz, Oh and Viswanath, ICML 2015); with delta = 0 it is T eps.
  Where delta falls on its last step (large eps: every kappa above about 1 at small T), the
  composition has a closed form (``_pure_dp_composition``), which privleak uses: it is exact, and
  the PLD would overflow there.

One Gaussian release on its own (what a reconstruction attack sees in one leaked update) has the
exact curve of Balle and Wang's analytic Gaussian mechanism, which privleak evaluates in closed
form: calibrating it through dp-accounting's PLD takes 64 s at epsilon = 173 and 445 s at 1000,
where the closed form takes milliseconds and agrees with it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from scipy.optimize import brentq
from scipy.special import log_ndtr

from dp_accounting import dp_event, pld, privacy_accountant, rdp
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution


def _check_positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return steps


def _check_delta(delta) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    return float(delta)


def gaussian_epsilon(noise_multiplier: float, steps: int, delta: float, *, sampling_rate: float = 1.0,
                     sampling: str = "poisson", dataset_size: int | None = None, accountant: str = "pld") -> float:
    """epsilon(delta) of T steps of DP-SGD with Gaussian noise (Alg. 1), by dp-accounting.

    Args:
        noise_multiplier: sigma, the noise std over the clip norm.
        steps: T.
        delta: the target delta.
        sampling_rate: q = L / N for Poisson sampling (1 = the full batch every step).
        sampling: "poisson" (add/remove neighbours; PLD or RDP) or "fixed", a sample of
            q N examples without replacement (replace-one neighbours; RDP only, as dp-accounting has it).
        dataset_size: N, needed for ``sampling="fixed"``.
        accountant: "pld" (tight) or "rdp".
    """
    sigma = _check_positive(noise_multiplier, "noise_multiplier")
    steps, delta = _check_steps(steps), _check_delta(delta)
    q = _check_positive(sampling_rate, "sampling_rate")
    if q > 1:
        raise ValueError(f"sampling_rate must be <= 1, got {q}")
    if accountant not in ("pld", "rdp"):
        raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
    step = dp_event.GaussianDpEvent(sigma)
    if sampling == "poisson":
        event = dp_event.PoissonSampledDpEvent(q, step) if q < 1 else step
        engine = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    elif sampling == "fixed":
        if accountant != "rdp":
            raise ValueError("fixed-size sampling is accounted with accountant='rdp' (dp-accounting's PLD lacks it)")
        if not isinstance(dataset_size, int) or dataset_size < 1:
            raise ValueError(f"fixed-size sampling needs dataset_size, an int >= 1, got {dataset_size!r}")
        event = dp_event.SampledWithoutReplacementDpEvent(dataset_size, max(1, round(q * dataset_size)), step)
        engine = rdp.RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)
    else:
        raise ValueError(f"sampling must be 'poisson' or 'fixed', got {sampling!r}")
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


def analytic_gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """epsilon(delta) of a single Gaussian release N(f(x), (sigma Delta)^2 I), Delta the L2
    sensitivity of f: the least eps with delta(eps) <= delta on Balle and Wang's exact curve.

    For the epsilon of one leaked update as local DP, where any two clipped gradients may be
    neighbours, the sensitivity is the diameter 2c of the clipping ball: pass noise_multiplier / 2.
    """
    sigma = _check_positive(noise_multiplier, "noise_multiplier")
    delta = _check_delta(delta)
    if delta == 0.0:
        return math.inf
    log_delta = math.log(delta)
    if _log_gaussian_delta(0.0, sigma) <= log_delta:
        return 0.0
    upper = 1.0
    while _log_gaussian_delta(upper, sigma) > log_delta:
        upper *= 2.0
    return brentq(lambda eps: _log_gaussian_delta(eps, sigma) - log_delta, 0.0, upper, xtol=1e-12, rtol=1e-12)


def analytic_gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """The sigma at which one Gaussian release is exactly (epsilon, delta)-DP (the inverse of
    :func:`analytic_gaussian_epsilon`)."""
    epsilon = _check_positive(epsilon, "epsilon")
    delta = _check_delta(delta)
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
    """Metric-DP and pure-DP epsilon of the VMF mechanism per step, and epsilon(delta) over a run."""
    kappa = _check_positive(kappa, "kappa")
    steps, delta = _check_steps(steps), _check_delta(delta)
    q = _check_positive(sampling_rate, "sampling_rate")
    if q > 1:
        raise ValueError(f"sampling_rate must be <= 1, got {q}")
    step = 2.0 * kappa
    amplified = _amplified_by_poisson_sampling(step, q)
    return VMFPrivacy(kappa, step, _pure_dp_composition(amplified, steps, delta), delta)


def _pure_dp_composition(epsilon: float, steps: int, delta: float) -> float:
    """The least eps_T with T eps-DP steps (eps_T, delta)-DP: the optimal composition.

    Its dominating pair is T-fold randomized response: with p = e^eps / (1 + e^eps), k unlikely
    outcomes out of T have privacy loss (T - 2k) eps. On ((T - 2) eps, T eps] only k = 0 lies
    above, so delta(eps_T) = p^T (1 - e^(eps_T - T eps)) there, and eps_T = T eps + log(1 - delta / p^T)
    when that falls in the interval: exact, and the case of every large eps, where dp-accounting's
    PLD would overflow e^eps (kappa above about 355) or take minutes. Otherwise dp-accounting
    composes the pure-DP privacy loss distribution.
    """
    if delta == 0.0:
        return steps * epsilon
    likely_all = math.exp(-steps * math.log1p(math.exp(-epsilon)))  # p^T
    if delta < likely_all:
        closed = steps * epsilon + math.log1p(-delta / likely_all)
        if closed > (steps - 2) * epsilon:
            return closed
    loss = privacy_loss_distribution.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(epsilon, 0.0))
    return min(steps * epsilon, float(loss.self_compose(steps).get_epsilon_for_delta(delta)))
