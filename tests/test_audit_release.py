"""Issue 20, multi-run auditing of one mechanism release (privleak.audit.release) and its CLI.

Soundness: audits of mechanisms whose epsilon is known exceed it in at most the allowed share of
runs (a binomial check with margin). Power: the audit of a Gaussian release reaches >= 0.7 of
epsilon for epsilon in [1, 8]; Laplace and VMF (pure DP) get closer. VMF: privleak's accounting
(2 kappa per step) is never contradicted. Clopper-Pearson and the bound's formula are checked
against independent computations (scipy.stats.binomtest, randomised response).
"""
import json
import math

import numpy as np
import pytest
from privleak import accounting, capacity, cli
from privleak.audit import (
    MECHANISMS,
    ReleaseAudit,
    audit_release,
    clopper_pearson_upper,
    epsilon_lower_bound,
    laplace_segment_log_capacity,
)
from privleak.audit import release as release_module
from scipy import integrate, stats

# ----------------------------------------------------------------------------- the statistics


@pytest.mark.parametrize("k, n", [(0, 1), (0, 10), (1, 10), (9, 10), (10, 10), (0, 5000), (17, 5000), (4999, 5000),
                                  (250, 100000)])
@pytest.mark.parametrize("confidence", [0.6, 0.95, 0.975, 0.999])
def test_clopper_pearson_matches_binomtest(k, n, confidence):
    # binomtest's two-sided exact interval at level 2c - 1 has the one-sided level-c bound as its upper end.
    reference = stats.binomtest(k, n).proportion_ci(confidence_level=2 * confidence - 1, method="exact").high
    assert float(clopper_pearson_upper(k, n, confidence)) == pytest.approx(reference, rel=1e-9, abs=1e-15)
    if k < n:  # and by definition: P(Binomial(n, ub) <= k) = 1 - c
        assert stats.binom.cdf(k, n, float(clopper_pearson_upper(k, n, confidence))) == pytest.approx(
            1 - confidence, rel=1e-6)


def test_clopper_pearson_is_vectorised_and_checks_its_arguments():
    ks = np.arange(0, 21)
    assert np.allclose(clopper_pearson_upper(ks, 20, 0.9), [clopper_pearson_upper(int(k), 20, 0.9) for k in ks])
    for bad in (-1, 21, np.array([0.5])):
        with pytest.raises(ValueError, match="successes"):
            clopper_pearson_upper(bad, 20, 0.9)
    with pytest.raises(ValueError, match="confidence"):
        clopper_pearson_upper(1, 20, 1.0)
    with pytest.raises(ValueError, match="trials"):
        clopper_pearson_upper(0, 0, 0.9)


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 3.0, 10.0])
def test_randomised_response_rates_give_its_epsilon(epsilon):
    # Randomised response at epsilon: FPR = FNR = 1 / (1 + e^eps), the extreme eps-DP test.
    rate = 1 / (1 + math.exp(epsilon))
    assert float(epsilon_lower_bound(rate, rate)) == pytest.approx(epsilon, rel=1e-12)
    # delta > 0 lowers it: (1 - delta - rate) / rate
    assert float(epsilon_lower_bound(rate, rate, 0.01)) == pytest.approx(math.log((1 - 0.01 - rate) / rate))


def test_epsilon_lower_bound_formula():
    assert float(epsilon_lower_bound(0.1, 0.2)) == pytest.approx(math.log(8.0))  # max(log 8, log 4.5)
    assert float(epsilon_lower_bound(0.5, 0.5)) == 0.0  # a coin toss proves nothing
    assert float(epsilon_lower_bound(0.9, 0.9)) == 0.0  # negative: 0
    assert float(epsilon_lower_bound(0.3, 0.3, 0.8)) == 0.0  # numerators <= 0
    assert float(epsilon_lower_bound(0.0, 0.5)) == math.inf


# ----------------------------------------------------------------------------- soundness


def _allowed_exceedances(runs, share, tail=1e-4):
    """The smallest count k with P(Binomial(runs, share) >= k) < tail: a count this high refutes
    "the bound exceeds the truth in at most ``share`` of runs"."""
    k = int(runs * share)
    while stats.binom.sf(k - 1, runs, share) >= tail:
        k += 1
    return k


@pytest.mark.parametrize("mechanism, releases, confidence", [
    ("gaussian", 2000, 0.95), ("laplace", 1000, 0.95), ("vmf", 1000, 0.95),
    ("laplace", 1000, 0.5),  # where the audit is nearly tight, so the level is what keeps it below
])
def test_soundness_over_repeated_audits(threads, mechanism, releases, confidence):
    threads(1)  # small draws: one thread (OpenMP's start-up would cost more than the draw on a busy machine)
    runs, epsilon = 200, 1.0
    bounds = np.array([audit_release(mechanism, epsilon, releases=releases, confidence=confidence,
                                     seed=seed).lower_bound for seed in range(runs)])
    exceeded = int(np.count_nonzero(bounds > epsilon))
    assert exceeded < _allowed_exceedances(runs, 1 - confidence), (exceeded, bounds.max())
    assert bounds.mean() > 0  # the audits did find something


# ----------------------------------------------------------------------------- power


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 4.0, 8.0])
def test_gaussian_power(epsilon):
    # 10^7 releases per neighbour; measured over 8 seeds: 0.82-0.86 (epsilon 1-4), 0.72-0.80 (epsilon 8)
    result = audit_release("gaussian", epsilon, releases=10**7)
    assert 0.7 * epsilon <= result.lower_bound <= epsilon
    assert result.accountant_epsilon == pytest.approx(epsilon, rel=1e-9)


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 4.0, 8.0])
def test_laplace_power(epsilon):
    # pure DP: 0.89 (epsilon 8) to 0.99 (epsilon 1) of epsilon at the CLI's default 10^5 releases
    result = audit_release("laplace", epsilon)
    assert 0.85 * epsilon <= result.lower_bound <= epsilon


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 4.0, 8.0])
def test_vmf_reaches_a_stated_share_of_two_kappa(epsilon):
    # on S^1 at 10^5 releases: 0.91-0.95 of 2 kappa; so 2 kappa / bound <= 1 / 0.85 = 1.18
    result = audit_release("vmf", epsilon)
    two_kappa = accounting.vmf_privacy(epsilon / 2).step_epsilon
    assert result.noise == epsilon / 2 and result.accountant_epsilon == two_kappa == epsilon
    assert 0.85 * two_kappa <= result.lower_bound <= two_kappa


@pytest.mark.parametrize("dim", [2, 3, 10])
@pytest.mark.parametrize("epsilon", [0.5, 2.0, 8.0, 16.0])
def test_vmf_audit_never_contradicts_privleak_s_accounting(dim, epsilon):
    for seed in range(3):
        result = audit_release("vmf", epsilon, releases=20000, dim=dim, seed=seed)
        assert result.lower_bound <= accounting.vmf_privacy(result.noise).step_epsilon


def test_an_under_noised_mechanism_is_caught():
    # noise calibrated to epsilon 3 but claimed as epsilon 1: the audit refutes the claim
    std = accounting.analytic_gaussian_noise_multiplier(3.0, 1e-5)
    gaussian = audit_release("gaussian", 1.0, noise=std, releases=200_000)
    assert gaussian.lower_bound > 1.5 and gaussian.accountant_epsilon == pytest.approx(3.0)
    laplace = audit_release("laplace", 1.0, noise=1 / 3)
    assert laplace.lower_bound > 2.5 and laplace.accountant_epsilon == pytest.approx(3.0)
    vmf = audit_release("vmf", 1.0, noise=1.5)
    assert vmf.lower_bound > 2.5 and vmf.accountant_epsilon == 3.0


# ----------------------------------------------------------------------------- the result


def test_the_result_and_its_references():
    result = audit_release("gaussian", 2.0, delta=1e-6, releases=4000, seed=5, confidence=0.9)
    assert isinstance(result, ReleaseAudit)
    assert (result.epsilon, result.delta, result.confidence, result.releases, result.seed) == (2.0, 1e-6, 0.9, 4000, 5)
    assert result.selection_releases + result.evaluation_releases == 4000 and result.selection_releases == 1000
    assert result.fpr <= result.fpr_upper and result.fnr <= result.fnr_upper
    sigma = accounting.analytic_gaussian_noise_multiplier(2.0, 1e-6)
    assert result.noise == pytest.approx(sigma)
    # the Bayes capacity of x + N(0, sigma^2) over the segment [0, 1]: 1 + 1 / (sigma sqrt(2 pi))
    assert result.log_capacity == pytest.approx(math.log1p(1 / (sigma * math.sqrt(2 * math.pi))), rel=1e-9)
    assert json.loads(json.dumps(result.as_dict(), allow_nan=False))["lower_bound"] == result.lower_bound
    assert audit_release("gaussian", 2.0, delta=1e-6, releases=4000, seed=5, confidence=0.9) == result
    assert audit_release("gaussian", 2.0, delta=1e-6, releases=4000, seed=6, confidence=0.9) != result
    # a Gaussian audited at delta = 0 against a given noise: the accountant's epsilon is infinite
    pure = audit_release("gaussian", 2.0, delta=0.0, noise=1.0, releases=1000)
    assert pure.accountant_epsilon == math.inf and pure.as_dict()["accountant_epsilon"] is None


def test_the_draws_do_not_depend_on_the_chunk_size(monkeypatch, threads):
    threads(1)
    expected = [audit_release(m, 2.0, releases=3000, seed=1) for m in MECHANISMS]
    monkeypatch.setattr(release_module, "_CHUNK_VALUES", 71)  # not a divisor of 3000 (VMF: 35 samples of 2)
    assert [audit_release(m, 2.0, releases=3000, seed=1) for m in MECHANISMS] == expected


@pytest.mark.parametrize("sensitivity, scale", [(1.0, 1.0), (2.0, 0.25), (0.1, 3.0)])
def test_laplace_segment_capacity_against_quadrature(sensitivity, scale):
    def sup_density(y):  # the nearest point of the segment [0, sensitivity]
        return math.exp(-max(0.0, -y, y - sensitivity) / scale) / (2 * scale)

    inside = sensitivity / (2 * scale)
    tails = 2 * integrate.quad(lambda t: math.exp(-t / scale) / (2 * scale), 0, math.inf)[0]
    middle = integrate.quad(sup_density, 0, sensitivity)[0]
    assert middle == pytest.approx(inside)
    assert laplace_segment_log_capacity(sensitivity, scale) == pytest.approx(math.log(middle + tails), rel=1e-10)


def test_capacity_is_within_pure_dp():
    # an eps-DP release has Bayes capacity <= e^eps
    for epsilon in (0.5, 2.0, 8.0):
        laplace = audit_release("laplace", epsilon, releases=100)
        vmf = audit_release("vmf", epsilon, releases=100, dim=5)
        assert laplace.log_capacity <= epsilon and vmf.log_capacity <= epsilon
        assert vmf.log_capacity == capacity.vmf_log_capacity(5, epsilon / 2).log


@pytest.mark.parametrize("kwargs, named", [
    (dict(mechanism="exponential"), "mechanism"), (dict(epsilon=0.0), "epsilon"), (dict(epsilon=math.nan), "epsilon"),
    (dict(epsilon="1"), "epsilon"), (dict(delta=1.0), "delta"), (dict(delta=-0.1), "delta"),
    (dict(mechanism="gaussian", delta=0.0), "delta"), (dict(releases=1), "releases"),
    (dict(releases=10**8 + 1), "releases"), (dict(releases=2.0), "releases"), (dict(confidence=1.0), "confidence"),
    (dict(confidence=0.0), "confidence"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
    (dict(sensitivity=0.0), "sensitivity"), (dict(mechanism="gaussian", dim=3), "dim"), (dict(dim=1), "dim"),
    (dict(mechanism="vmf", sensitivity=2.0), "sensitivity"), (dict(noise=-1.0), "noise"),
    (dict(mechanism="laplace", noise=1e-320), "noise"), (dict(selection_fraction=1.0), "selection_fraction"),
])
def test_bad_arguments_name_themselves(kwargs, named):
    arguments = dict(mechanism="vmf", epsilon=1.0, releases=100)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=named):
        audit_release(arguments.pop("mechanism"), arguments.pop("epsilon"), **arguments)


# ----------------------------------------------------------------------------- the command line


def test_cli_json(capsys):
    argv = ["audit", "release", "--mechanism", "laplace", "--epsilon", "2", "--releases", "5000", "--seed", "3",
            "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    expected = audit_release("laplace", 2.0, releases=5000, seed=3)
    assert report["lower_bound"] == expected.lower_bound and report["epsilon"] == 2.0
    assert report["confidence"] == 0.95 and report["delta"] == 0.0
    assert set(report) >= {"lower_bound", "epsilon", "confidence", "delta", "releases", "fpr", "fnr", "fpr_upper",
                           "fnr_upper", "threshold", "accountant_epsilon", "log_capacity"}


def test_cli_defaults_and_text(capsys):
    assert cli.main(["audit", "release", "--mechanism", "gaussian", "--epsilon", "1", "--releases", "2000",
                     "--confidence", "0.9", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["delta"] == 1e-5 and report["releases"] == 2000 and report["seed"] == 0
    assert report["confidence"] == 0.9
    assert cli.main(["audit", "release", "--mechanism", "vmf", "--epsilon", "3", "--releases", "2000"]) == 0
    text = capsys.readouterr().out
    assert "audited lower bound" in text and "vmf mechanism on S^1" in text and "claimed epsilon      3" in text


@pytest.mark.parametrize("argv, named", [
    (["audit"], "audit_command"), (["audit", "nope"], "nope"),
    (["audit", "release", "--epsilon", "1"], "--mechanism"),
    (["audit", "release", "--mechanism", "laplace"], "--epsilon"),
    (["audit", "release", "--mechanism", "exp", "--epsilon", "1"], "--mechanism"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "0"], "--epsilon"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "inf"], "--epsilon"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--delta", "1"], "--delta"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--delta", "-1e-9"], "--delta"),
    (["audit", "release", "--mechanism", "gaussian", "--epsilon", "1", "--delta", "0"], "--delta"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--releases", "1"], "--releases"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--releases", "1e6"], "--releases"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--releases", "100000001"], "--releases"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--confidence", "1"], "--confidence"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--confidence", "nan"], "--confidence"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--seed", "-1"], "--seed"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--seed", str(2**63)], "--seed"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--json=1"], "--json"),
    (["audit", "release", "--mechanism", "laplace", "--epsilon", "1", "--dim", "3"], "--dim"),
])
def test_cli_refuses_bad_options(capsys, monkeypatch, argv, named):
    monkeypatch.setattr(release_module, "audit_release", lambda *a, **k: pytest.fail("the audit ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "error:" in error and named in error, error
