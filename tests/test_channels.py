"""privleak.channels against plain-loop computations of each definition (tests/discrete_channels.py)."""
import math
import tracemalloc

import discrete_channels as ref
import numpy as np
import pytest
import torch
from conftest import requires_cuda
from discrete_channels import channels, channels_with_prior, gains, priors
from hypothesis import given, settings
from hypothesis import strategies as st
from privleak import channels as ch

FAST = settings(deadline=None, max_examples=100)


@pytest.fixture(autouse=True)
def one_kernel_thread(threads):
    """These tests check formulas on channels of a few entries, calling the kernel thousands of
    times; a parallel region per call costs more than the work, and on an oversubscribed 2-core
    machine each one can stall for a scheduler tick (a 5x slower run). Thread-count independence
    of the kernel is tested in test_column_stats.py."""
    threads(1)


def close(a, b, rel=1e-9):
    return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@FAST
@given(channels_with_prior())
def test_bayes_vulnerability_and_leakage(case):
    channel, prior = case
    posterior = ref.g_vulnerability(channel, prior, np.eye(channel.shape[0]))
    assert close(ch.prior_bayes_vulnerability(prior), max(prior))
    assert close(ch.posterior_bayes_vulnerability(channel, prior), posterior)
    assert close(ch.multiplicative_bayes_leakage(channel, prior), posterior / max(prior))
    assert close(ch.additive_bayes_leakage(channel, prior) + max(prior), posterior)
    assert close(ch.min_entropy_leakage_bits(channel, prior), math.log2(posterior / max(prior)))


@FAST
@given(channels_with_prior())
def test_bayes_capacity_and_sibson_mutual_information(case):
    channel, prior = case
    capacity = ref.bayes_capacity(channel)
    assert close(ch.bayes_capacity(channel), capacity)
    assert close(ch.sibson_mi_infinity_bits(channel), math.log2(capacity))
    # Sibson's I_infinity sees only the prior's support.
    support = [x for x in range(len(prior)) if prior[x] > 0]
    assert close(ch.sibson_mi_infinity_bits(channel, prior), math.log2(ref.bayes_capacity(channel[support])))
    # The capacity is the multiplicative Bayes leakage under the uniform prior ([004] Sec. II-C).
    uniform = np.full(channel.shape[0], 1.0 / channel.shape[0])
    assert close(ch.multiplicative_bayes_leakage(channel, uniform), capacity)


@FAST
@given(channels_with_prior(), st.data())
def test_g_vulnerability_and_leakage_with_a_gain_matrix(case, data):
    channel, prior = case
    n = channel.shape[0]
    gain = data.draw(gains(n))
    prior_vulnerability = max(sum(prior[x] * g[x] for x in range(n)) for g in gain)
    posterior = ref.g_vulnerability(channel, prior, gain)
    assert close(ch.prior_g_vulnerability(prior, gain), prior_vulnerability)
    assert close(ch.posterior_g_vulnerability(channel, prior, gain), posterior)
    assert close(ch.additive_g_leakage(channel, prior, gain), posterior - prior_vulnerability, rel=1e-7)
    if prior_vulnerability > 1e-6:
        assert close(ch.multiplicative_g_leakage(channel, prior, gain), posterior / prior_vulnerability, rel=1e-7)


@FAST
@given(channels_with_prior(), st.integers(0, 3))
def test_g_vulnerability_with_a_gain_function(case, distance):
    channel, prior = case
    n = channel.shape[0]
    within = [[1.0 if abs(w - x) <= distance else 0.0 for x in range(n)] for w in range(n)]
    assert close(ch.posterior_g_vulnerability(channel, prior, ch.within_distance_gain(n, distance)),
                 ref.g_vulnerability(channel, prior, within))
    # A callable gain is evaluated on (action, secret) index pairs, with the secrets as actions.
    assert close(ch.posterior_g_vulnerability(channel, prior, lambda w, x: np.abs(w - x) <= distance),
                 ref.g_vulnerability(channel, prior, within))
    # Distance 0 is the identity gain: g-vulnerability is Bayes vulnerability.
    assert close(ch.multiplicative_g_leakage(channel, prior, ch.within_distance_gain(n, 0)),
                 ch.multiplicative_bayes_leakage(channel, prior))


def test_gain_matrix_with_other_actions():
    # Actions are pairs of guesses {2a, 2a + 1}: a "guess in two tries" attacker.
    gain = ch.gain_matrix(lambda w, x: (x // 2) == w, n_actions=2, n_secrets=4)
    np.testing.assert_array_equal(gain, [[1, 1, 0, 0], [0, 0, 1, 1]])
    assert ch.prior_g_vulnerability(np.array([0.1, 0.2, 0.3, 0.4]), gain) == pytest.approx(0.7)


@FAST
@given(channels_with_prior())
def test_shannon_mutual_information(case):
    channel, prior = case
    assert close(ch.mutual_information_nats(channel, prior), ref.mutual_information(channel, prior), rel=1e-7)


@FAST
@given(channels())
def test_ldp_epsilon(channel):
    assert close(ch.ldp_epsilon(channel), ref.ldp_epsilon(channel))


def test_ldp_epsilon_over_sets_of_observations_equals_single_observations():
    # Def. 5.1 of [000] quantifies over sets S; brute force over all of them.
    rng = np.random.default_rng(0)
    for _ in range(20):
        channel = rng.dirichlet(np.full(4, 0.7), size=3)
        worst = max(math.log(channel[a][list(s)].sum() / channel[b][list(s)].sum())
                    for a in range(3) for b in range(3)
                    for s in [[y for y in range(4) if mask >> y & 1] for mask in range(1, 16)])
        assert close(ch.ldp_epsilon(channel), worst)


def test_ldp_epsilon_zeros():
    assert ch.ldp_epsilon(np.array([[0.5, 0.5], [1.0, 0.0]])) == math.inf  # zero and non-zero in a column
    all_zero_column = np.array([[0.5, 0.0, 0.5], [0.25, 0.0, 0.75]])
    assert ch.ldp_epsilon(all_zero_column) == pytest.approx(math.log(2))
    assert ch.ldp_epsilon(np.array([[0.1, 0.9]])) == 0.0  # one secret
    assert ch.ldp_epsilon(np.ones((3, 1))) == 0.0  # one observation


@FAST
@given(channels_with_prior())
def test_lip_epsilons_and_mbp(case):
    channel, prior = case
    want_upper, want_lower = ref.lip_epsilons(channel, prior)
    upper, lower = ch.lip_epsilons(channel, prior)
    assert close(upper, want_upper, rel=1e-7) and close(lower, want_lower, rel=1e-7)
    assert ch.mbp_xi(channel, prior) == max(upper, lower)


@FAST
@given(channels_with_prior(full_support=True), st.data())
def test_abp_epsilons(case, data):
    channel, true_prior = case
    attacker_prior = data.draw(st.one_of(st.just(true_prior), priors(channel.shape[0], full_support=True)))
    want = ref.abp_epsilons(channel, attacker_prior)
    got = ch.abp_epsilons(channel, attacker_prior)
    assert all(close(g, w, rel=1e-7) or abs(g - w) < 1e-7 for g, w in zip(got, want))
    assert ch.abp_epsilon(channel, attacker_prior) == max(got)


def test_abp_needs_an_attacker_who_can_explain_every_observation():
    channel = np.array([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="attacker_prior"):
        ch.abp_epsilons(channel, np.array([1.0, 0.0]))


def test_prior_mismatch():
    assert ch.prior_mismatch(np.array([0.5, 0.5, 0.0]), np.array([0.25, 0.75, 0.0])) == pytest.approx(math.log(2))
    assert ch.prior_mismatch(np.array([0.5, 0.5]), np.array([1.0, 0.0])) == math.inf


@FAST
@given(channels(), st.data())
def test_cascade_and_parallel_composition(first, data):
    n, m = first.shape
    second = data.draw(channels(rows=m, max_cols=4))
    beside = data.draw(channels(rows=n, max_cols=4))
    a, b, c = ref.rows(first), ref.rows(second), ref.rows(beside)
    want_cascade = [[sum(a[x][y] * b[y][z] for y in range(m)) for z in range(len(b[0]))] for x in range(n)]
    np.testing.assert_allclose(ch.cascade(first, second), want_cascade, rtol=1e-12, atol=1e-15)
    want_parallel = [[a[x][y] * c[x][z] for y in range(m) for z in range(len(c[0]))] for x in range(n)]
    np.testing.assert_allclose(ch.parallel_composition(first, beside), want_parallel, rtol=1e-12, atol=1e-15)


@FAST
@given(channels(), st.data())
def test_deterministic_preprocessing_is_a_cascade(channel, data):
    mapping = np.array(data.draw(st.lists(st.integers(0, channel.shape[0] - 1), min_size=1, max_size=6)))
    function = ch.deterministic_channel(mapping, channel.shape[0])
    assert [[int(v) for v in row] for row in function] == [[int(y == f) for y in range(len(channel))] for f in mapping]
    np.testing.assert_allclose(ch.deterministic_preprocessing(mapping, channel), ch.cascade(function, channel),
                               rtol=1e-15)


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (1, 1)])
def test_single_row_and_single_column_channels(shape):
    channel = np.random.default_rng(7).dirichlet(np.ones(shape[1]), size=shape[0])
    prior = np.full(shape[0], 1 / shape[0])
    assert close(ch.bayes_capacity(channel), ref.bayes_capacity(channel))
    assert ch.ldp_epsilon(channel) == pytest.approx(0.0, abs=1e-12)
    assert ref.ldp_epsilon(channel) == pytest.approx(0.0, abs=1e-12)
    assert ch.lip_epsilons(channel, prior) == pytest.approx(ref.lip_epsilons(channel, prior), abs=1e-12)
    assert ch.mutual_information_nats(channel, prior) == pytest.approx(0.0, abs=1e-12)
    assert ch.abp_epsilon(channel, prior) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("secrets", [2, 6])
def test_a_channel_that_leaks_nothing_has_an_abp_of_zero_to_rounding(secrets):
    """Identical rows of 1000 observations: the posterior is the prior, JS 0. The two relative
    entropies of the mixture cancelled to 1e-16, an ABP of 1e-8 after the square root."""
    row = np.random.default_rng(0).random(1000)
    channel = np.tile(row / row.sum(), (secrets, 1))
    assert ch.abp_epsilon(channel, np.full(secrets, 1 / secrets)) < 1e-12


@FAST
@given(channels(dtype=np.float32), st.data())
def test_float32_channels_match_loops_on_their_values(channel, data):
    prior = data.draw(priors(channel.shape[0]))
    assert close(ch.bayes_capacity(channel), ref.bayes_capacity(channel), rel=1e-6)
    identity = np.eye(len(prior))
    want = ref.g_vulnerability(channel, prior, identity)
    assert close(ch.posterior_bayes_vulnerability(channel, prior), want, rel=1e-6)
    assert close(ch.ldp_epsilon(channel), ref.ldp_epsilon(channel), rel=1e-6)


# --- dtypes, devices, large inputs ------------------------------------------------------------


def every_metric(channel, prior):
    return [
        ch.bayes_capacity(channel), ch.posterior_bayes_vulnerability(channel, prior),
        ch.sibson_mi_infinity_bits(channel, prior), ch.ldp_epsilon(channel), *ch.lip_epsilons(channel, prior),
        ch.mutual_information_nats(channel, prior), ch.abp_epsilon(channel, prior),
        ch.posterior_g_vulnerability(channel, prior, ch.within_distance_gain(channel.shape[0], 1)),
    ]


def random_case(rows=40, cols=70, seed=3):
    rng = np.random.default_rng(seed)
    channel = rng.dirichlet(np.ones(cols), size=rows)
    prior = rng.dirichlet(np.ones(rows))
    prior[::7] = 0.0
    return channel, prior / prior.sum()


def test_float32_channels_match_float64():
    channel, prior = random_case()
    np.testing.assert_allclose(every_metric(channel.astype(np.float32), prior), every_metric(channel, prior), rtol=2e-5)


def test_torch_cpu_tensors_match_numpy():
    channel, prior = random_case()
    np.testing.assert_allclose(every_metric(torch.from_numpy(channel), torch.from_numpy(prior)),
                               every_metric(channel, prior), rtol=1e-12)


@requires_cuda
def test_torch_cuda_tensors_match_numpy():
    channel, prior = random_case()
    np.testing.assert_allclose(every_metric(torch.from_numpy(channel).cuda(), torch.from_numpy(prior).cuda()),
                               every_metric(channel, prior), rtol=1e-12)


def test_large_float32_channel_is_not_copied():
    rng = np.random.default_rng(0)
    channel = rng.random((4000, 5000), dtype=np.float32)
    channel /= channel.sum(axis=1, keepdims=True)
    prior = np.full(4000, 1 / 4000)
    tracemalloc.start()
    try:
        for metric in (ch.bayes_capacity, ch.ldp_epsilon):
            metric(channel)
        for metric in (ch.posterior_bayes_vulnerability, ch.lip_epsilons, ch.mutual_information_nats):
            metric(channel, prior)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < channel.nbytes / 2  # no float64 copy (2x) nor float32 copy (1x) of the matrix


# --- bad input -------------------------------------------------------------------------------

GOOD = np.array([[0.5, 0.5], [0.25, 0.75]])


@pytest.mark.parametrize("channel, message", [
    (np.array([[0.5, np.nan], [0.25, 0.75]]), "channel has a non-finite entry nan at row 0"),
    (np.array([[0.5, 0.5], [np.inf, 0.75]]), "channel has a non-finite entry inf at row 1"),
    (np.array([[1.5, -0.5], [0.25, 0.75]]), "channel has a negative entry -0.5 at row 0, column 1"),
    (np.array([[0.5, 0.5], [0.25, 0.70]]), "channel row 1 sums to 0.95"),
    (np.array([[0.5, 0.5 + 1e-8]]), "channel row 0 sums to"),
    (np.array([[0.5, 0.5 + 5e-5]], dtype=np.float32), "tolerance 1e-05 for float32"),
    (np.array([0.5, 0.5]), "2-D"),
    (np.zeros((0, 3)), "at least one row"),
])
def test_bad_channels_raise_value_error_naming_the_argument(channel, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ch.bayes_capacity(channel)


def test_row_sum_tolerance_is_as_documented():
    ch.bayes_capacity(np.array([[0.5, 0.5 + 5e-6]], dtype=np.float32))
    ch.bayes_capacity(np.array([[0.5, 0.5 + 5e-10]]))
    with pytest.raises(ValueError, match="sums to"):
        ch.bayes_capacity(np.array([[0.5, 0.5 + 5e-9]]))


@pytest.mark.parametrize("prior, message", [
    (np.array([1.0]), r"prior must have shape \(2,\)"),
    (np.array([[0.5, 0.5]]), r"prior must have shape \(2,\)"),
    (np.array([0.5, np.nan]), "prior has non-finite entries"),
    (np.array([1.5, -0.5]), "prior has negative entries"),
    (np.array([0.5, 0.6]), "prior sums to 1.1"),
])
def test_bad_priors_raise_value_error(prior, message):
    with pytest.raises(ValueError, match=message):
        ch.posterior_bayes_vulnerability(GOOD, prior)


def test_non_arrays_raise_type_error():
    with pytest.raises(TypeError, match="channel must be a numpy array or a torch tensor, got list"):
        ch.bayes_capacity([[1.0]])
    with pytest.raises(TypeError, match="prior must be a numpy array"):
        ch.mutual_information_nats(GOOD, [0.5, 0.5])
    with pytest.raises(TypeError, match="channel must have dtype float32 or float64"):
        ch.bayes_capacity(np.array([["a"]]))
    with pytest.raises(TypeError, match="mapping must have an integer dtype"):
        ch.deterministic_preprocessing(np.array([0.5]), GOOD)


def test_bad_second_arguments_are_named():
    with pytest.raises(ValueError, match="second has a negative entry"):
        ch.cascade(GOOD, np.array([[1.5, -0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="first has 2 observations but second has 3 secrets"):
        ch.cascade(GOOD, np.full((3, 1), 1.0))
    with pytest.raises(ValueError, match=r"gain must have shape \(n_actions >= 1, 2\)"):
        ch.prior_g_vulnerability(np.array([0.5, 0.5]), np.ones((2, 3)))
    with pytest.raises(ValueError, match="mapping has values outside"):
        ch.deterministic_preprocessing(np.array([0, 2]), GOOD)


def test_integer_channels_and_transposed_views_are_accepted():
    assert ch.bayes_capacity(np.eye(3, dtype=np.int64)) == 3.0
    assert ch.ldp_epsilon(np.array([[0.5, 0.25], [0.5, 0.75]]).T) == pytest.approx(math.log(2))


def test_unaligned_channels_are_copied_not_refused():
    # A float64 view at byte offset 1 (e.g. read from a packed file): the kernels refuse it, the
    # metrics take an aligned copy.
    buffer = np.zeros(8 * 4 + 8, dtype=np.uint8)
    matrix = buffer[1:33].view(np.float64).reshape(2, 2)
    matrix[...] = [[0.5, 0.5], [0.25, 0.75]]
    assert not matrix.flags.aligned
    assert ch.bayes_capacity(matrix) == pytest.approx(1.25)
    tensor = torch.frombuffer(bytearray(buffer.tobytes()), dtype=torch.float64, offset=1, count=4).reshape(2, 2)
    assert ch.bayes_capacity(tensor) == pytest.approx(1.25)
