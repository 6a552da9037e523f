"""Accounting: the Gaussian wrapper against dp-accounting and a published value, the VMF
accounting against the density ratio and an exact composition computed by brute force."""
import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event, pld, rdp
from scipy.special import comb

from privleak import accounting
from privleak import mechanisms as M


@pytest.mark.parametrize("accountant, engine", [("pld", pld.PLDAccountant), ("rdp", rdp.RdpAccountant)])
def test_gaussian_epsilon_is_dp_accountings(accountant, engine):
    acc = engine()
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.3)), 500))
    assert accounting.gaussian_epsilon(1.3, 500, 1e-5, sampling_rate=0.02, accountant=accountant) == acc.get_epsilon(1e-5)


def test_abadi_et_al_mnist_setting():
    # Abadi et al. (CCS 2016, Sec. 3.1): q = 0.01, sigma = 4, T = 10^4, delta = 1e-5 gives eps ~ 1.26 by
    # their moments accountant, an upper bound; RDP is tighter and PLD tighter still.
    rdp_eps = accounting.gaussian_epsilon(4.0, 10_000, 1e-5, sampling_rate=0.01, accountant="rdp")
    pld_eps = accounting.gaussian_epsilon(4.0, 10_000, 1e-5, sampling_rate=0.01, accountant="pld")
    assert 0.9 < pld_eps <= rdp_eps <= 1.26


def test_gaussian_epsilon_grows_with_steps_and_falls_with_noise():
    eps = [accounting.gaussian_epsilon(s, t, 1e-5, sampling_rate=0.01) for s, t in ((1.0, 100), (1.0, 1000), (2.0, 1000))]
    assert eps[0] < eps[1] and eps[2] < eps[1]
    fixed = accounting.gaussian_epsilon(1.0, 100, 1e-5, sampling_rate=0.01, sampling="fixed", dataset_size=10_000,
                                        accountant="rdp")
    assert math.isfinite(fixed) and fixed > 0


def test_vmf_step_epsilon_is_the_worst_density_ratio():
    p, kappa = 50, 3.0
    g = torch.Generator().manual_seed(0)
    mu, other = (torch.nn.functional.normalize(torch.randn(2, p, dtype=torch.float64, generator=g), dim=1))
    worst = (mu - other) / (mu - other).norm()  # the y attaining the bound
    ys = torch.cat([M.vmf_sample(mu, kappa, 2000, key=1), worst[None]])
    log_ratio = M.vmf_log_density(ys, mu, kappa) - M.vmf_log_density(ys, other, kappa)
    bound = kappa * float((mu - other).norm())
    assert float(log_ratio.max()) <= bound + 1e-9 and abs(float(log_ratio[-1]) - bound) < 1e-9
    privacy = accounting.vmf_privacy(kappa)
    assert privacy.metric_epsilon == kappa and privacy.step_epsilon == 2 * kappa == privacy.epsilon


def exact_pure_dp_composition(epsilon: float, steps: int, delta: float) -> float:
    """Smallest eps_T with delta(eps_T) <= delta for T-fold composition of an eps-DP step, from the
    dominating pair (randomized response) by summing the hockey-stick divergence over outcomes:
    k unlikely outcomes have probability P_k and privacy loss (T - 2k) eps. In logs, so that any
    eps works."""
    log_p = -math.log1p(math.exp(-epsilon))  # log(e^eps / (1 + e^eps))
    ks = np.arange(steps + 1)
    log_pk = np.log(comb(steps, ks)) + (steps - ks) * log_p + ks * (log_p - epsilon)
    losses = (steps - 2 * ks) * epsilon

    def delta_of(eps_total):  # sum_k P_k (1 - e^(eps_T - loss_k))_+
        return float(np.sum(np.exp(log_pk) * -np.expm1(np.minimum(eps_total - losses, 0.0))))

    lo, hi = 0.0, steps * epsilon
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("kappa, steps, q", [(0.25, 20, 1.0), (0.05, 200, 1.0), (2.0, 50, 0.05)])
def test_vmf_run_epsilon_is_the_optimal_composition(kappa, steps, q):
    got = accounting.vmf_privacy(kappa, steps, 1e-5, sampling_rate=q)
    amplified = math.log1p(q * math.expm1(2 * kappa))
    want = exact_pure_dp_composition(amplified, steps, 1e-5)
    assert got.epsilon == pytest.approx(want, rel=2e-3)  # dp-accounting discretises the loss at 1e-4
    assert got.epsilon <= steps * amplified


@pytest.mark.parametrize("kappa, steps, q", [(3.0, 5, 1.0), (400.0, 50, 0.01), (5e4, 1000, 0.004)])
def test_vmf_run_epsilon_is_exact_where_delta_falls_on_the_last_step(kappa, steps, q):
    # Large kappa, as in training (e^(2 kappa) overflows beyond kappa ~ 355): the closed form.
    got = accounting.vmf_privacy(kappa, steps, 1e-5, sampling_rate=q).epsilon
    amplified = 2 * kappa + math.log(q + (1 - q) * math.exp(-2 * kappa))
    want = exact_pure_dp_composition(amplified, steps, 1e-5)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-9)
    assert want < steps * amplified


def test_vmf_epsilon_without_delta_is_basic_composition_and_survives_large_kappa():
    assert accounting.vmf_privacy(1.5, 10).epsilon == pytest.approx(30.0)
    large = accounting.vmf_privacy(5000.0, 3, sampling_rate=0.01)
    assert large.epsilon == pytest.approx(3 * (10_000 + math.log(0.01)), rel=1e-12)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: accounting.gaussian_epsilon(0.0, 10, 1e-5), "noise_multiplier must be finite and > 0"),
        (lambda: accounting.gaussian_epsilon(1.0, 0, 1e-5), "steps must be an int >= 1"),
        (lambda: accounting.gaussian_epsilon(1.0, 10, 1.5), "delta must be in"),
        (lambda: accounting.gaussian_epsilon(1.0, 10, 1e-5, sampling_rate=2.0), "sampling_rate must be <= 1"),
        (lambda: accounting.gaussian_epsilon(1.0, 10, 1e-5, sampling="fixed"), "accountant='rdp'"),
        (lambda: accounting.gaussian_epsilon(1.0, 10, 1e-5, sampling="fixed", accountant="rdp"), "dataset_size"),
        (lambda: accounting.vmf_privacy(-1.0), "kappa must be finite and > 0"),
    ],
)
def test_bad_arguments_are_rejected(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ----------------------------------------------------------------------------- one Gaussian release


def _hockey_stick(sigma: float, epsilon: float) -> float:
    """delta(eps) = integral of max(0, p(y) - e^eps q(y)) for p = N(1, sigma^2), q = N(0, sigma^2), by
    mpmath quadrature at 50 digits: independent of the closed form under test."""
    import mpmath

    mpmath.mp.dps = 50
    s, e = mpmath.mpf(sigma), mpmath.mpf(epsilon)
    # p > e^eps q exactly where y > 1/2 + eps sigma^2.
    edge = mpmath.mpf(1) / 2 + e * s ** 2

    def density(y, mean):
        return mpmath.exp(-(y - mean) ** 2 / (2 * s ** 2)) / (s * mpmath.sqrt(2 * mpmath.pi))

    value = mpmath.quad(lambda y: density(y, 1) - mpmath.exp(e) * density(y, 0), [edge, edge + 40 * s, mpmath.inf])
    return float(value)


@pytest.mark.parametrize("epsilon", [0.5, 3.0, 173.0, 1e4, 1e6])
def test_analytic_gaussian_calibration_meets_the_hockey_stick_divergence(epsilon):
    sigma = accounting.analytic_gaussian_noise_multiplier(epsilon, 1e-5)
    assert _hockey_stick(sigma, epsilon) == pytest.approx(1e-5, rel=1e-8)
    assert accounting.analytic_gaussian_epsilon(sigma, 1e-5) == pytest.approx(epsilon, rel=1e-9)


@pytest.mark.parametrize("sigma", [0.7, 1.5, 4.0])
def test_analytic_gaussian_epsilon_agrees_with_dp_accountings_pld(sigma):
    engine = pld.PLDAccountant()
    engine.compose(dp_event.GaussianDpEvent(sigma))
    # dp-accounting discretises the loss (pessimistically), so it sits a hair above the exact curve.
    exact = accounting.analytic_gaussian_epsilon(sigma, 1e-5)
    assert exact <= engine.get_epsilon(1e-5) <= exact * (1 + 1e-3)


def test_analytic_gaussian_edge_cases():
    assert accounting.analytic_gaussian_epsilon(1.0, 0.0) == math.inf
    assert accounting.analytic_gaussian_epsilon(1e3, 0.5) == 0.0  # so much noise that delta alone covers it
    with pytest.raises(ValueError, match="noise_multiplier"):
        accounting.analytic_gaussian_epsilon(0.0, 1e-5)
    with pytest.raises(ValueError, match="delta must be > 0"):
        accounting.analytic_gaussian_noise_multiplier(1.0, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        accounting.analytic_gaussian_noise_multiplier(-1.0, 1e-5)
