"""privleak.relations: every bound holds on random channels and priors, and is reached where tight.

"Holds" is checked against metrics computed by plain loops (tests/discrete_channels.py); "reached"
by worked examples built from the definitions (and, for LIP -> LDP, from a linear program solved by
scipy), measured by the same loops. The papers' own statements are checked too: where they are
false, an example shows it.
"""
import itertools
import math

import discrete_channels as ref
import mpmath
import numpy as np
import pytest
from discrete_channels import channels, channels_with_prior, gains, priors
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from privleak import channels as ch
from privleak import relations as rel
from scipy.optimize import linprog

FAST = settings(deadline=None, max_examples=100)
SLOW = settings(deadline=None, max_examples=40)
TOL = 1e-9
EPSILONS = st.floats(0.05, 3.0)


def prior_closeness(prior):
    """eps_c with |log pi[x] / pi[x']| <= eps_c: how far a full-support prior is from uniform."""
    return math.log(max(prior) / min(prior))


def witness_channel(ratios, prior):
    """Two observations; the first has a small p(y0) = t and posterior ratios P(x|y0) / P(x) = ratios.

    The second takes the remaining mass, so its ratios are within about t of 1 and all the
    extremes sit in the first column. Needs ratios of pi-mean 1.
    """
    ratios = np.asarray(ratios, dtype=float)
    assert abs(prior @ ratios - 1) < 1e-12
    first = 1e-3 / ratios.max() * ratios  # t = 1e-3 / max(ratios)
    return np.column_stack([first, 1 - first])


def largest_column_ratio(prior, eps_upper, eps_lower):
    """max r[i] / r[j] over columns r with pi-mean 1 and e^-eps_lower <= r <= e^eps_upper, by LP.

    Charnes-Cooper: z = r / r[j], s = 1 / r[j]; maximise z[i] subject to z[j] = 1, L s <= z <= U s,
    pi . z = s. Returns the ratio and the maximising column r.
    """
    n, upper, lower = len(prior), math.exp(eps_upper), math.exp(-eps_lower)
    best_ratio, best_column = 1.0, np.ones(n)
    for i, j in itertools.permutations(range(n), 2):
        objective = np.zeros(n + 1)
        objective[i] = -1.0
        bounds_ub = np.vstack([np.hstack([np.eye(n), -upper * np.ones((n, 1))]),
                               np.hstack([-np.eye(n), lower * np.ones((n, 1))])])
        equalities = np.vstack([np.append(prior, -1.0), np.eye(1, n + 1, j)])
        result = linprog(objective, A_ub=bounds_ub, b_ub=np.zeros(2 * n), A_eq=equalities, b_eq=[0.0, 1.0],
                         bounds=[(0, None)] * (n + 1), method="highs")
        assert result.status == 0
        if -result.fun > best_ratio:
            best_ratio, best_column = -result.fun, result.x[:n] / result.x[n]
    return best_ratio, best_column


# --- LDP -> LIP / MBP ([003] (1), [000] Thm 5.3, [001] Thm IV.4) ------------------------------


@FAST
@given(channels_with_prior())
def test_ldp_implies_lip_and_mbp(case):
    channel, prior = case
    ldp = ref.ldp_epsilon(channel)
    upper, lower = ref.lip_epsilons(channel, prior)
    bound_upper, bound_lower = rel.lip_from_ldp(ldp, prior)
    assert upper <= bound_upper + TOL and lower <= bound_lower + TOL
    assert max(upper, lower) <= rel.mbp_from_ldp(ldp, prior) + TOL
    # The papers' eps-LDP => eps-MBP (uniform prior) and => (eps + eps_c)-MBP hold, for every prior.
    assert rel.mbp_from_ldp(ldp, prior) <= ldp + TOL
    assert rel.lip_from_ldp(ldp) == (ldp, ldp)


@FAST
@given(st.integers(1, 6).flatmap(lambda n: priors(n, full_support=True)), EPSILONS)
def test_ldp_to_lip_bounds_are_reached(prior, epsilon):
    bound_upper, bound_lower = rel.lip_from_ldp(epsilon, prior)
    least_likely = np.argmin(prior)
    # Upper: the least likely secret alone makes the first observation e^eps times likelier.
    boost = np.ones(len(prior))
    boost[least_likely] = math.exp(epsilon)
    upper_case = witness_channel(boost / (prior @ boost), prior)
    assert ref.ldp_epsilon(upper_case) <= epsilon + TOL
    assert ref.lip_epsilons(upper_case, prior)[0] == pytest.approx(bound_upper, rel=1e-9, abs=1e-12)
    # Lower: every other secret makes it e^eps times likelier.
    damp = np.full(len(prior), math.exp(epsilon))
    damp[least_likely] = 1.0
    lower_case = witness_channel(damp / (prior @ damp), prior)
    assert ref.ldp_epsilon(lower_case) <= epsilon + TOL
    assert ref.lip_epsilons(lower_case, prior)[1] == pytest.approx(bound_lower, rel=1e-9, abs=1e-12)


def test_ldp_to_mbp_for_the_uniform_prior_is_below_the_papers_bound():
    for n in (2, 10, 1000):
        assert rel.mbp_from_ldp(1.0, np.full(n, 1 / n)) == pytest.approx(math.log((1 + (n - 1) * math.e) / n))
    assert rel.mbp_from_ldp(1.0, np.full(2, 0.5)) == pytest.approx(0.6201, abs=1e-4)
    assert rel.lip_from_ldp(math.inf, np.array([0.25, 0.75])) == (pytest.approx(math.log(4)), math.inf)


# --- LIP / MBP -> LDP ([003], [000] Thm 5.3, [001] Thm IV.4) ----------------------------------


@FAST
@given(channels_with_prior(full_support=True))
def test_lip_and_mbp_imply_ldp(case):
    channel, prior = case
    ldp = ref.ldp_epsilon(channel)
    upper, lower = ref.lip_epsilons(channel, prior)
    assert ldp <= rel.ldp_from_lip(upper, lower, prior) + TOL
    assert rel.ldp_from_lip(upper, lower, prior) <= upper + lower + TOL  # the lecture notes' bound
    xi = max(upper, lower)
    assert ldp <= rel.ldp_from_mbp(xi, prior) + TOL
    # [000] Thm 5.3 (uniform) says 2 xi, [001] Thm IV.4 says 2 xi + eps_c: 2 xi holds for every prior.
    assert rel.ldp_from_mbp(xi, prior) <= 2 * xi + TOL <= 2 * xi + prior_closeness(prior) + TOL


@SLOW
@given(st.integers(2, 5).flatmap(lambda n: priors(n, full_support=True)), EPSILONS, EPSILONS)
def test_lip_to_ldp_bound_is_the_linear_programs_optimum_and_is_reached(prior, eps_upper, eps_lower):
    optimum, column = largest_column_ratio(prior, eps_upper, eps_lower)
    bound = rel.ldp_from_lip(eps_upper, eps_lower, prior)
    assert bound == pytest.approx(math.log(optimum), rel=1e-6, abs=1e-9)
    reached = witness_channel(column, prior)
    upper, lower = ref.lip_epsilons(reached, prior)
    assert upper <= eps_upper + 1e-7 and lower <= eps_lower + 1e-7
    assert ref.ldp_epsilon(reached) == pytest.approx(bound, rel=1e-6, abs=1e-9)


def test_mbp_to_ldp_for_the_uniform_prior():
    xi = 1.0
    # Two secrets cannot both sit at the extremes: log(2 e^xi - 1) < 2 xi.
    assert rel.ldp_from_mbp(xi, np.full(2, 0.5)) == pytest.approx(math.log(2 * math.e - 1))
    # From n >= e^xi + 1 secrets on, the papers' 2 xi is reached.
    assert rel.ldp_from_mbp(xi, np.full(3, 1 / 3)) < 2 * xi
    assert rel.ldp_from_mbp(xi, np.full(4, 1 / 4)) == pytest.approx(2 * xi)
    with pytest.raises(ValueError, match="prior must give every secret positive probability"):
        rel.ldp_from_mbp(xi, np.array([0.5, 0.5, 0.0]))


# --- LIP -> MI ([003] (2)) --------------------------------------------------------------------


@FAST
@given(channels_with_prior())
def test_lip_implies_mutual_information_bound(case):
    channel, prior = case
    upper, lower = ref.lip_epsilons(channel, prior)
    information = ref.mutual_information(channel, prior)
    assert information <= rel.mi_from_lip(upper, lower) + TOL
    assert rel.mi_from_lip(upper, lower) <= upper + TOL  # the notes' eps-LIP => eps-MI


@pytest.mark.parametrize("secrets", [2, 3, 5])
@pytest.mark.parametrize("lower_ratio", [0.05, 0.5, 0.9])
def test_lip_to_mi_bound_is_reached(secrets, lower_ratio):
    # r = U on the diagonal and L elsewhere, with mass lam = 1/k on U: the two-point maximiser.
    upper_ratio = secrets - (secrets - 1) * lower_ratio
    channel = (np.full((secrets, secrets), lower_ratio) + np.eye(secrets) * (upper_ratio - lower_ratio)) / secrets
    prior = np.full(secrets, 1 / secrets)
    upper, lower = ref.lip_epsilons(channel, prior)
    assert (upper, lower) == (pytest.approx(math.log(upper_ratio)), pytest.approx(-math.log(lower_ratio)))
    assert ref.mutual_information(channel, prior) == pytest.approx(rel.mi_from_lip(upper, lower), rel=1e-12)


def test_symmetric_lip_to_mi_bound_is_eps_tanh_half_eps():
    for epsilon in (0.1, 1.0, 5.0):
        assert rel.mi_from_lip(epsilon, epsilon) == pytest.approx(epsilon * math.tanh(epsilon / 2))
    assert rel.mi_from_lip(1.0, math.inf) == pytest.approx(1.0)
    assert rel.mi_from_lip(math.inf, 1.0) == math.inf


# --- MBP -> ABP ([000] Thm 5.4, [001] Thm IV.6) -----------------------------------------------


def paper_abp_bound(xi, mismatch):
    return math.sqrt((xi + mismatch) * math.expm1(xi + mismatch) / 2)


@FAST
@given(channels_with_prior(full_support=True), st.data())
def test_mbp_implies_abp(case, data):
    channel, true_prior = case
    attacker_prior = data.draw(st.one_of(st.just(true_prior), priors(channel.shape[0], full_support=True)))
    xi = max(ref.lip_epsilons(channel, true_prior))
    mismatch = max(abs(math.log(q / p)) for p, q in zip(true_prior, attacker_prior))
    bound = rel.abp_from_mbp(xi, mismatch)
    assert max(ref.abp_epsilons(channel, attacker_prior)) <= bound + 1e-7
    assert bound <= paper_abp_bound(xi, mismatch) + TOL
    assert bound <= math.sqrt(math.log(2)) + TOL


@pytest.mark.parametrize("t", [1 - 2**-52, 1 - 1e-12, 1 - 1e-8, 0.999, 0.5, 1 / 3, 0.3, 1e-5, 0.0, 1 + 1e-10, 2.9, 3.1])
def test_js_generator_is_accurate_near_one(t):
    # Its two logs cancel to O((t - 1)^2) near 1; hypothesis found a channel with xi = 2.2e-16
    # whose bound came out at 5e-9 from that rounding.
    mpmath.mp.dps = 50
    x = mpmath.mpf(t)
    want = (x * mpmath.log(2 * x / (1 + x)) if t > 0 else 0) / 2 + mpmath.log(2 / (1 + x)) / 2
    assert rel._js_generator(t) == pytest.approx(float(want), rel=1e-14, abs=0)
    assert rel.abp_from_mbp(2**-52, 2**-52) <= paper_abp_bound(2**-52, 2**-52)


@pytest.mark.parametrize("xi", [0.05, 0.5, 1.0, 2.0, 6.0])
def test_abp_bound_is_reached_without_prior_mismatch(xi):
    # Secret 0 (mass 1/(1 + e^xi)) and observation 0 are each other's extremes of r.
    upper, lower = math.exp(xi), math.exp(-xi)
    lam = 1 / (1 + upper)
    middle = 1 + lower - lower**2  # r[1, 1], fixed by the row and column means
    channel = np.array([[upper * lam, lower * (1 - lam)], [lower * lam, middle * (1 - lam)]])
    prior = np.array([lam, 1 - lam])
    assert max(ref.lip_epsilons(channel, prior)) == pytest.approx(xi)
    assert ref.abp_epsilons(channel, prior)[0] == pytest.approx(rel.abp_from_mbp(xi), rel=1e-9)


def test_papers_abp_bound_is_loose_and_passes_the_largest_possible_value():
    assert rel.abp_from_mbp(1.0) == pytest.approx(0.2114, abs=1e-4)
    assert paper_abp_bound(1.0, 0.0) == pytest.approx(0.9269, abs=1e-4)
    assert paper_abp_bound(1.0, 0.0) > math.sqrt(math.log(2))  # no JS divergence exceeds ln 2
    assert rel.abp_from_mbp(math.inf) == pytest.approx(math.sqrt(math.log(2)))
    assert rel.abp_from_mbp(0.0, 5.0) == 0.0  # posterior = prior whatever the attacker believed


# --- PAC robustness ([001] Thm IV.7) ----------------------------------------------------------


@FAST
@given(channels_with_prior(full_support=True, max_cols=5))
def test_mbp_mechanisms_are_pac_robust(case):
    channel, prior = case
    xi = max(ref.lip_epsilons(channel, prior))
    for mask in range(1, 2 ** channel.shape[1]):
        event = [y for y in range(channel.shape[1]) if mask >> y & 1]  # "misses the accuracy region"
        probabilities = np.minimum(channel[:, event].sum(axis=1), 1.0)
        for beta, other in itertools.product(probabilities, probabilities):
            assert other <= rel.pac_robustness_failure_probability(xi, beta, prior) + 1e-9


def test_pac_robustness_bound_is_reached_and_the_papers_gamma_fails():
    xi, prior = 1.0, np.full(4, 0.25)
    _, column = largest_column_ratio(prior, xi, xi)  # r spans e^-xi .. e^xi: 2 xi-LDP
    channel = witness_channel(column, prior)
    assert max(ref.lip_epsilons(channel, prior)) == pytest.approx(xi)
    beta, failure = channel[:, 0].min(), channel[:, 0].max()
    assert failure == pytest.approx(rel.pac_robustness_failure_probability(xi, beta, prior), rel=1e-6)
    assert failure == pytest.approx(math.exp(2 * xi) * beta, rel=1e-6)
    assert failure > (1 + 4 * xi) * beta  # [001] Thm IV.7's gamma, claimed for 0 <= xi <= 1
    # Its proof's steps: e^(2 xi) <= 1 + 4 xi only up to xi = 0.6282, 1 + 2 xi + 4 xi^2 up to 0.897.
    assert math.exp(2 * 0.628) < 1 + 4 * 0.628 and math.exp(2 * 0.6283) > 1 + 4 * 0.6283
    assert math.exp(2 * 0.9) > 1 + 2 * 0.9 + 4 * 0.9**2
    # The complementary event: 1 - e^-2xi (1 - beta) is the sharper bound for large beta.
    assert rel.pac_robustness_failure_probability(xi, 0.9, prior) == pytest.approx(1 - math.exp(-2) * 0.1)


# --- Bayes capacity and g-leakage ([004] Sec. III) --------------------------------------------


@FAST
@given(channels_with_prior(), st.data())
def test_bayes_capacity_bounds_g_leakage_of_non_negative_gains(case, data):
    channel, prior = case
    n = channel.shape[0]
    gain = data.draw(gains(n, low=0.0, high=1.0))
    prior_vulnerability = max(sum(prior[x] * g[x] for x in range(n)) for g in gain)
    assume(prior_vulnerability > 1e-6)
    leakage = ref.g_vulnerability(channel, prior, gain) / prior_vulnerability
    assert leakage <= rel.g_leakage_bound(channel, gain) * (1 + 1e-9)


@FAST
@given(channels())
def test_g_leakage_bound_is_reached_by_the_identity_gain_and_uniform_prior(channel):
    n = channel.shape[0]
    leakage = ref.g_vulnerability(channel, np.full(n, 1 / n), np.eye(n)) * n
    assert rel.g_leakage_bound(channel, np.eye(n)) == pytest.approx(leakage, rel=1e-12)


def test_g_leakage_bound_fails_for_negative_gains():
    channel, prior, gain = np.eye(2), np.array([0.6, 0.4]), np.array([[1.0, -1.0], [-1.0, 1.0]])
    prior_vulnerability = max(0.6 - 0.4, 0.4 - 0.6)
    assert ref.g_vulnerability(channel, prior, gain) / prior_vulnerability == pytest.approx(5.0)  # > capacity 2
    with pytest.raises(ValueError, match="gain has negative entries"):
        rel.g_leakage_bound(channel, gain)


# --- pre-processing ([004] Lemma II.1) --------------------------------------------------------


@FAST
@given(channels(), st.data())
def test_deterministic_preprocessing_can_only_lower_capacity(channel, data):
    n = channel.shape[0]
    mapping = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6)))
    after = rel.capacity_after_deterministic_preprocessing(mapping, channel)
    assert after == pytest.approx(ref.bayes_capacity(channel[mapping]), rel=1e-12)
    assert after <= ref.bayes_capacity(channel) + TOL
    onto = np.concatenate([mapping, np.arange(n)])  # onto the rows of the channel: Lemma II.1's equality
    assert rel.capacity_after_deterministic_preprocessing(onto, channel) == pytest.approx(ref.bayes_capacity(channel))


@FAST
@given(channels(), st.data())
def test_any_preprocessing_can_only_lower_capacity(channel, data):
    before = data.draw(channels(cols=channel.shape[0]))
    assert ref.bayes_capacity(ch.cascade(before, channel)) <= ref.bayes_capacity(channel) + TOL


def test_lemma_ii1_fails_for_a_function_that_is_not_onto():
    # The lemma claims C_Bayes(F . D) = C_Bayes(D) for every deterministic F.
    constant = np.zeros(3, dtype=np.int64)
    assert rel.capacity_after_deterministic_preprocessing(constant, np.eye(3)) == 1.0
    assert ch.bayes_capacity(ch.cascade(ch.deterministic_channel(constant, 3), np.eye(3))) == 1.0
    assert ch.bayes_capacity(np.eye(3)) == 3.0


# --- DP does not imply MI privacy ([003], "Counterexample") -----------------------------------


def test_dp_does_not_imply_mutual_information_privacy():
    # Seven people each hold a bit; the mechanism reports every bit through randomized response.
    # Neighbouring data sets (one bit apart) stay within e^eps: eps-DP. But the output reveals
    # all seven bits a little, and I(S; Y) grows with the number of people past eps.
    people, epsilon = 7, 2.0
    keep = math.exp(epsilon) / (1 + math.exp(epsilon))
    secrets = list(itertools.product([0, 1], repeat=people))
    channel = np.array([[math.prod(keep if s == o else 1 - keep for s, o in zip(secret, output)) for output in secrets]
                        for secret in secrets])
    neighbours = [(a, b) for a in range(len(secrets)) for b in range(len(secrets))
                  if sum(x != y for x, y in zip(secrets[a], secrets[b])) == 1]
    dp_epsilon = max(math.log(channel[a, y] / channel[b, y]) for a, b in neighbours for y in range(len(secrets)))
    assert dp_epsilon == pytest.approx(epsilon)
    uniform = np.full(len(secrets), 1 / len(secrets))
    information = ref.mutual_information(channel, uniform)
    assert information > epsilon  # so eps-DP does not give I(S; Y) <= eps
    assert ch.mutual_information_nats(channel, uniform) == pytest.approx(information, rel=1e-9)
    # LDP, which compares every pair of data sets, does bound it (via LIP).
    ldp = ch.ldp_epsilon(channel)
    assert ldp == pytest.approx(people * epsilon)
    assert information <= rel.mi_from_lip(*rel.lip_from_ldp(ldp, uniform))


# --- argument checks --------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: rel.mbp_from_ldp(-1.0), "ldp_epsilon must be >= 0"),
    (lambda: rel.ldp_from_lip(1.0, math.nan), "eps_lower must be a number"),
    (lambda: rel.abp_from_mbp(1.0, -0.5), "prior_mismatch must be"),
    (lambda: rel.pac_robustness_failure_probability(1.0, 1.5), "beta must be <= 1"),
    (lambda: rel.lip_from_ldp(1.0, np.array([0.5, 0.6])), "prior sums to"),
])
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
