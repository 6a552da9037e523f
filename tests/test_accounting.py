"""Accounting, every value against an independent computation: the Gaussian RDP against Opacus's
RDP analysis (separate code), the Gaussian PLD against Balle and Wang's exact curve (q = 1) and
Opacus's PRV accountant (q < 1), the fixed-size path at q = 1 against the add/remove RDP at
sigma / 2, the VMF accounting against the subsampled randomised-response pair enumerated outcome
by outcome, and one Gaussian release against mpmath quadrature of the hockey-stick divergence."""
import itertools
import math
import warnings

import mpmath
import numpy as np
import pytest
import torch
from dp_accounting import dp_event, pld
from opacus.accountants import PRVAccountant
from opacus.accountants.analysis import rdp as opacus_rdp
from privleak import accounting
from privleak import mechanisms as M
from scipy.optimize import brentq
from scipy.stats import norm

# dp-accounting's default RDP orders, written out: Opacus evaluates the RDP on the same grid, so the
# two agree up to the series truncation of the fractional orders, not up to the grid.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]


INTEGER_ORDERS = [a for a in ORDERS if float(a).is_integer()]


def opacus_rdp_epsilon(sigma, q, steps, delta, orders=ORDERS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        curve = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
        return float(opacus_rdp.get_privacy_spent(orders=orders, rdp=curve, delta=delta)[0])


@pytest.mark.parametrize("sigma, q, steps", [(1.3, 0.02, 500), (4.0, 0.01, 10_000), (1.0, 0.05, 1000), (1.1, 1.0, 10)])
def test_gaussian_rdp_is_opacus_rdp_analysis(sigma, q, steps):
    # At integer orders both libraries sum the same finite binomial expansion (exact). At fractional
    # orders dp-accounting 0.6.0 sums |binom(alpha, i)| (gammaln drops the sign), an upper bound: at
    # alpha = 1.1, q = 0.05, sigma = 1 it gives 0.00292 where Opacus and mpmath quadrature of
    # E[(mu / mu0)^alpha] give 0.0021571. So privleak's RDP epsilon lies between Opacus's on the full grid
    # and Opacus's on the integer orders alone, and equals Opacus's where the optimum order is an integer.
    got = accounting.gaussian_epsilon(sigma, steps, 1e-5, sampling_rate=q, accountant="rdp")
    full, integer = opacus_rdp_epsilon(sigma, q, steps, 1e-5), opacus_rdp_epsilon(sigma, q, steps, 1e-5, INTEGER_ORDERS)
    assert full * (1 - 1e-6) <= got <= integer * (1 + 1e-9)
    if full == pytest.approx(integer, rel=1e-12):  # optimum at an integer order: (4.0, 0.01), (1.1, 1.0)
        assert got == pytest.approx(full, rel=1e-9)
    # measured: the (1.3, 0.02) and (1.0, 0.05) runs are 2.7e-8 and 3.1e-3 above Opacus's full grid


def test_fractional_order_rdp_against_quadrature():
    # The reference for the comment above: RDP at alpha = 1.1 by mpmath quadrature equals Opacus's value.
    mpmath.mp.dps = 30
    q, alpha = mpmath.mpf("0.05"), mpmath.mpf("1.1")
    mixture = lambda z: (1 - q) * mpmath.npdf(z, 0, 1) + q * mpmath.npdf(z, 1, 1)  # noqa: E731
    moment = mpmath.quad(lambda z: mpmath.npdf(z, 0, 1) * (mixture(z) / mpmath.npdf(z, 0, 1)) ** alpha,
                         [-mpmath.inf, 0, 1, mpmath.inf])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_opacus = opacus_rdp.compute_rdp(q=0.05, noise_multiplier=1.0, steps=1, orders=[1.1])[0]
    assert float(mpmath.log(moment) / (alpha - 1)) == pytest.approx(by_opacus, rel=1e-8)


def prv_bracket(sigma, q, steps, delta, eps_error=0.01):
    """Opacus's PRV accountant (Gopi, Lee and Wutschitz 2021): certified lower bound, estimate, upper bound."""
    accountant = PRVAccountant()
    accountant.history = [(sigma, q, steps)]
    return accountant._get_dprv(eps_error=eps_error, delta_error=1e-9).compute_epsilon(delta, 1e-9, eps_error)


@pytest.mark.parametrize("sigma, q, steps", [(1.3, 0.02, 500), (0.8, 0.1, 100), (1.0, 0.05, 1000)])
def test_gaussian_pld_is_opacus_prv(sigma, q, steps):
    low, estimate, high = prv_bracket(sigma, q, steps, 1e-5)
    got = accounting.gaussian_epsilon(sigma, steps, 1e-5, sampling_rate=q)
    # PRV's certified bracket is +-0.01; its estimate and dp-accounting's PLD (discretised at 1e-4,
    # pessimistically) measured within 3e-7 relative here.
    assert low <= got <= high
    assert got == pytest.approx(estimate, rel=1e-4)


def test_abadi_et_al_mnist_setting():
    # Abadi et al. (CCS 2016, Sec. 3.1): q = 0.01, sigma = 4, T = 10^4, delta = 1e-5 gives eps ~ 1.26 by their
    # moments accountant. RDP: Opacus's RDP analysis on the same orders gives 1.0355. PLD: Opacus's PRV
    # accountant gives [0.9369, 0.9569], estimate 0.94687; the PLD measured 0.94700 (1.3e-4 above: the
    # pessimistic discretisation, 1e-4 per step, composed 10^4 times).
    rdp_eps = accounting.gaussian_epsilon(4.0, 10_000, 1e-5, sampling_rate=0.01, accountant="rdp")
    pld_eps = accounting.gaussian_epsilon(4.0, 10_000, 1e-5, sampling_rate=0.01, accountant="pld")
    assert rdp_eps == pytest.approx(opacus_rdp_epsilon(4.0, 0.01, 10_000, 1e-5), rel=1e-6)
    low, estimate, high = prv_bracket(4.0, 0.01, 10_000, 1e-5)
    assert low <= pld_eps <= high and pld_eps == pytest.approx(estimate, rel=5e-4)
    assert pld_eps < rdp_eps < 1.26


def balle_wang_epsilon(sigma, delta):
    """Exact epsilon(delta) of one Gaussian release with std sigma over the sensitivity, by brentq on
    delta(eps) = Phi(-eps sigma + 1/(2 sigma)) - e^eps Phi(-eps sigma - 1/(2 sigma)) (Balle and Wang 2018)."""
    def excess(eps):
        return norm.cdf(-eps * sigma + 0.5 / sigma) - math.exp(eps) * norm.cdf(-eps * sigma - 0.5 / sigma) - delta
    return brentq(excess, 0.0, 200.0, xtol=1e-14, rtol=1e-14)


@pytest.mark.parametrize("sigma, steps", [(1.0, 1), (2.0, 10), (4.0, 1000), (20.0, 10_000), (0.9, 3)])
def test_gaussian_pld_full_batch_is_one_gaussian_of_sigma_over_root_steps(sigma, steps):
    # q = 1: T Gaussian releases of std sigma compose exactly to one of std sigma / sqrt(T).
    got = accounting.gaussian_epsilon(sigma, steps, 1e-5)
    assert got == pytest.approx(balle_wang_epsilon(sigma / math.sqrt(steps), 1e-5), rel=1e-9)
    # and delta(got) of the composed pair, integrated by mpmath, is the delta asked for
    assert _hockey_stick(sigma / math.sqrt(steps), got) == pytest.approx(1e-5, rel=1e-8)
    # RDP is an upper bound (Opacus, independent): never below the exact value
    assert got <= opacus_rdp_epsilon(sigma, 1.0, steps, 1e-5)


@pytest.mark.parametrize("sigma, steps", [(1.1, 10), (2.0, 100), (0.7, 1)])
def test_fixed_size_full_batch_is_add_remove_at_half_sigma(sigma, steps):
    # q = 1 without replacement takes every example; replacing one moves the clipped sum by 2 c, so the
    # replace-one epsilon is the add/remove epsilon at sensitivity 2, that is at noise multiplier sigma / 2.
    got = accounting.gaussian_epsilon(sigma, steps, 1e-5, sampling_rate=1.0, sampling="fixed", dataset_size=64,
                                      accountant="rdp")
    assert got == pytest.approx(opacus_rdp_epsilon(sigma / 2, 1.0, steps, 1e-5), rel=1e-9)
    # the RDP of a Gaussian at sensitivity 2 is alpha * 4 / (2 sigma^2): converted by hand, same orders
    alphas = np.array(ORDERS)
    curve = steps * alphas * 2.0 / sigma ** 2
    by_hand = np.min(curve + np.log1p(-1 / alphas) - np.log(1e-5 * alphas) / (alphas - 1))
    assert got == pytest.approx(by_hand, rel=1e-9)


def test_fixed_size_subsampled_lies_between_poisson_and_full_batch():
    # q < 1 has no second implementation at hand; it must at least be above add/remove Poisson sampling at
    # sigma (replace-one is at least as strong a neighbour as add/remove up to the factor 2) and below q = 1.
    fixed = accounting.gaussian_epsilon(1.0, 100, 1e-5, sampling_rate=0.01, sampling="fixed", dataset_size=10_000,
                                        accountant="rdp")
    full = accounting.gaussian_epsilon(1.0, 100, 1e-5, sampling_rate=1.0, sampling="fixed", dataset_size=10_000,
                                       accountant="rdp")
    assert opacus_rdp_epsilon(1.0, 0.01, 100, 1e-5) < fixed < full



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


# ----------------------------------------------------------------------------- VMF


def subsampled_pair(kappa, q):
    """The Poisson-subsampled randomised-response pair at eps = 2 kappa, as mpmath numbers: outcome
    probabilities of P' = q P + (1 - q) Q and Q, P = (p, 1 - p), Q = (1 - p, p), p = e^eps / (1 + e^eps)."""
    mpmath.mp.dps = 60
    eps = 2 * mpmath.mpf(kappa)
    p, not_p = 1 / (1 + mpmath.exp(-eps)), 1 / (1 + mpmath.exp(eps))  # no cancellation at any eps
    big_p, big_q = (p, not_p), (not_p, p)
    return tuple(q * a + (1 - q) * b for a, b in zip(big_p, big_q)), big_q


@pytest.mark.parametrize("kappa, q", [(0.05, 0.01), (0.5, 0.3), (2.0, 0.05), (400.0, 0.01), (3.0, 1.0)])
def test_vmf_one_step_is_the_worst_loss_of_the_subsampled_pair(kappa, q):
    # delta = 0: the largest |log P'(y) / Q(y)| over outcomes and both directions, by mpmath at 60 digits.
    first, second = subsampled_pair(kappa, q)
    worst = max(abs(mpmath.log(a / b)) for a, b in zip(first, second))
    assert accounting.vmf_privacy(kappa, 1, sampling_rate=q).epsilon == pytest.approx(float(worst), rel=1e-13)
    # and T steps at delta = 0: pure losses add, the worst sequence repeats the worst outcome
    assert accounting.vmf_privacy(kappa, 7, sampling_rate=q).epsilon == pytest.approx(7 * float(worst), rel=1e-13)


def brute_force_epsilon(kappa, q, steps, delta):
    """Enumerate all 2^T outcome sequences of the T-fold subsampled pair; the hockey-stick divergence in
    both directions; bisection for the least eps with both <= delta. No binomial, no logs tricks."""
    first, second = subsampled_pair(kappa, q)
    sequences = list(itertools.product((0, 1), repeat=steps))
    p = [mpmath.fprod(first[y] for y in seq) for seq in sequences]
    r = [mpmath.fprod(second[y] for y in seq) for seq in sequences]

    def delta_of(eps):
        e = mpmath.exp(eps)
        return max(mpmath.fsum(max(0, a - e * b) for a, b in zip(p, r)),
                   mpmath.fsum(max(0, b - e * a) for a, b in zip(p, r)))

    lo, hi = mpmath.mpf(0), mpmath.mpf(steps) * max(abs(mpmath.log(a / b)) for a, b in zip(first, second))
    if delta_of(lo) <= delta:
        return 0.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return float(hi)


@pytest.mark.parametrize("kappa, q, steps, delta", [
    (0.25, 1.0, 8, 1e-5), (2.0, 0.05, 10, 1e-5), (0.5, 0.3, 10, 1e-3), (3.0, 1.0, 5, 1e-5),
    (400.0, 0.01, 6, 1e-5), (0.05, 0.5, 9, 0.2)])
def test_vmf_run_epsilon_is_the_brute_force_composition_of_the_subsampled_pair(kappa, q, steps, delta):
    got = accounting.vmf_privacy(kappa, steps, delta, sampling_rate=q).epsilon
    assert got == pytest.approx(brute_force_epsilon(kappa, q, steps, delta), rel=1e-9, abs=1e-10)


def binomial_epsilon(kappa, q, steps, delta):
    """The same pair for T too large to enumerate: all T + 1 counts k of first outcomes, no window, in
    mpmath, bisection."""
    first, second = subsampled_pair(kappa, q)
    log_c = [mpmath.loggamma(steps + 1) - mpmath.loggamma(k + 1) - mpmath.loggamma(steps - k + 1)
             for k in range(steps + 1)]
    p = [mpmath.exp(c + k * mpmath.log(first[0]) + (steps - k) * mpmath.log(first[1])) for k, c in enumerate(log_c)]
    r = [mpmath.exp(c + k * mpmath.log(second[0]) + (steps - k) * mpmath.log(second[1])) for k, c in enumerate(log_c)]

    def delta_of(eps):
        e = mpmath.exp(eps)
        return max(mpmath.fsum(max(0, a - e * b) for a, b in zip(p, r)),
                   mpmath.fsum(max(0, b - e * a) for a, b in zip(p, r)))

    lo, hi = mpmath.mpf(0), mpmath.mpf(steps) * max(abs(mpmath.log(a / b)) for a, b in zip(first, second))
    for _ in range(70):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return float(hi)


@pytest.mark.parametrize("kappa, q, steps", [(0.05, 0.01, 1000), (5.0, 0.01, 200), (0.25, 1.0, 300), (5e4, 0.004, 400)])
def test_vmf_run_epsilon_for_long_runs_and_large_kappa(kappa, q, steps):
    got = accounting.vmf_privacy(kappa, steps, 1e-5, sampling_rate=q).epsilon
    assert got == pytest.approx(binomial_epsilon(kappa, q, steps, 1e-5), rel=1e-9, abs=1e-10)


def test_vmf_accounting_is_tighter_than_composing_the_amplified_epsilon_as_pure_dp():
    # The former accounting (amplified epsilon composed as randomised response) is a valid but loose
    # bound: kappa = 5, q = 0.01, T = 200 gave 1080 where the exact composition (brute force above) is 52.
    amplified = math.log(1 + 0.01 * math.expm1(10.0))
    assert accounting.vmf_privacy(5.0, 200, 1e-5, sampling_rate=0.01).epsilon < 0.05 * 200 * amplified


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
    # so much noise that delta alone covers it: delta(0) = 2 Phi(1/(2 sigma)) - 1 < 0.5
    assert 2 * norm.cdf(0.5 / 1e3) - 1 < 0.5
    assert accounting.analytic_gaussian_epsilon(1e3, 0.5) == 0.0


@pytest.mark.parametrize("kappa", [17.0, 19.0, 50.0, 1e4])
def test_vmf_without_subsampling_composes_at_large_kappa(kappa):
    # q = 1 is T-fold randomised response at eps = 2 kappa; delta falls on its last outcome (all
    # T first outcomes), so eps_T = T eps + log(1 - delta / p^T), p = e^eps / (1 + e^eps), computed
    # here in mpmath. 1 - (1 - e^-eps) used to round to 0 above eps = 37 (a math domain error).
    steps, delta = 10, 1e-5
    with mpmath.workdps(50):
        eps = mpmath.mpf(2 * kappa)
        p = mpmath.exp(eps) / (1 + mpmath.exp(eps))
        expected = float(steps * eps + mpmath.log(1 - delta / p**steps))
    got = accounting.vmf_privacy(kappa, steps, delta).epsilon
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_pld_accountant_takes_a_delta_below_its_default_tail_mass():
    """The composition's truncated tail counts as infinite loss: at dp-accounting's default tail
    of 1e-15, every delta <= 1e-15 gave epsilon = inf. Now finite, above the epsilon of a delta
    where the FFT's round-off is far below it (1e-12), and within RDP's bound (10 steps, q = 0.01,
    sigma = 1). Not in order between 1e-15 and 1e-16: the round-off is of their order there, and
    their epsilons came out 3.52 and 3.25 on an Intel CPU, in order on an AMD one."""
    deltas = (1e-12, 1e-15, 1e-16)
    eps = [accounting.gaussian_epsilon(1.0, 10, delta, sampling_rate=0.01) for delta in deltas]
    rdp = [accounting.gaussian_epsilon(1.0, 10, delta, sampling_rate=0.01, accountant="rdp") for delta in deltas]
    assert all(math.isfinite(e) for e in eps) and eps[0] * 1.2 < min(eps[1:])  # 2.40 against 3.2-3.5
    assert all(e <= bound for e, bound in zip(eps, rdp))


def test_fixed_size_sampling_of_a_fractional_batch_is_refused():
    """Batches of q N examples: a q N that is not a whole number was accounted as the even integer it
    rounds to (q N = 2.5 as batches of 2, a review: epsilon 14.4 where batches of 3 give 19.5)."""
    with pytest.raises(ValueError, match=r"fixed-size sampling draws batches of sampling_rate \* dataset_size "
                                         r"examples, a whole number: got 0.025 \* 100 = 2.5"):
        accounting.gaussian_epsilon(1.0, 100, 1e-5, sampling_rate=0.025, sampling="fixed", dataset_size=100,
                                    accountant="rdp")
    three = accounting.gaussian_epsilon(1.0, 100, 1e-5, sampling_rate=0.03, sampling="fixed", dataset_size=100,
                                        accountant="rdp")  # 0.03 * 100 = 3.0000000000000004 is 3
    assert three > accounting.gaussian_epsilon(1.0, 100, 1e-5, sampling_rate=0.02, sampling="fixed",
                                               dataset_size=100, accountant="rdp")
