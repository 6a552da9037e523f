"""Issue 16, array layer and metrics: every door refuses bad input with an error naming the argument.

Each row is a call, the exception it must raise and a pattern the message must match (the
argument's name first). Wrong types raise privleak.validation.ArgumentTypeError, which is both a
TypeError and a ValueError; values out of range raise ValueError; sizes that cannot fit in memory
raise AllocationTooLarge (a MemoryError and a ValueError) before anything is allocated.
"""
import math

import numpy as np
import privleak
import pytest
import torch
from privleak import _arrays
from privleak import bayesian_privacy as bp
from privleak import capacity as cap
from privleak import channels as ch
from privleak import relations as rel
from privleak.validation import ArgumentTypeError

C = np.array([[0.5, 0.5], [0.25, 0.75]])
P = np.array([0.5, 0.5])
COUNTS = bp.RecoveryCounts(np.array([[1, 2], [3, 0]]), trials=4, batch_size=2)


def unaligned(shape, dtype=np.float64):
    """A view of ``shape`` at byte offset 1 of a fresh buffer: every element straddles an alignment boundary."""
    itemsize = np.dtype(dtype).itemsize
    n = math.prod(shape)
    return np.zeros(itemsize * n + itemsize, dtype=np.uint8)[1:itemsize * n + 1].view(dtype).reshape(shape)


def stride_zero_rows(rows, cols=1):
    return np.lib.stride_tricks.as_strided(np.zeros(cols), shape=(rows, cols), strides=(0, 8))


CASES = [
    # --- top level: privleak.set_num_threads ---------------------------------------------------
    ("threads None", lambda: privleak.set_num_threads(None), TypeError, "^threads must be an int"),
    ("threads str", lambda: privleak.set_num_threads("1"), TypeError, "^threads must be an int"),
    ("threads bool", lambda: privleak.set_num_threads(True), TypeError, "^threads must be an int"),
    ("threads nan", lambda: privleak.set_num_threads(math.nan), TypeError, "^threads must be an int"),
    ("threads 0", lambda: privleak.set_num_threads(0), ValueError, "^threads must be >= 1"),
    ("threads -1", lambda: privleak.set_num_threads(-1), ValueError, "^threads must be >= 1"),
    ("threads 2^70", lambda: privleak.set_num_threads(2**70), ValueError, "^threads must be <="),
    # --- column_stats ---------------------------------------------------------------------------
    ("matrix None", lambda: privleak.column_stats(None), TypeError, "^matrix must be a numpy array"),
    ("matrix str", lambda: privleak.column_stats("1"), TypeError, "^matrix must be a numpy array"),
    ("matrix bool", lambda: privleak.column_stats(True), TypeError, "^matrix must have dtype"),
    ("matrix int", lambda: privleak.column_stats(np.ones((2, 2), dtype=np.int64)), TypeError,
     "^matrix must have dtype"),
    ("matrix 1-D", lambda: privleak.column_stats(np.ones(3)), ValueError, "^matrix must be 2-D"),
    ("matrix empty", lambda: privleak.column_stats(np.ones((0, 3))), ValueError, "^matrix must have at least one row"),
    ("matrix unaligned", lambda: privleak.column_stats(unaligned((3, 4))), ValueError, "^matrix is not aligned"),
    ("matrix unaligned f32", lambda: privleak.column_stats(unaligned((3, 4), np.float32)), ValueError,
     "^matrix is not aligned"),
    ("matrix sparse", lambda: privleak.column_stats(torch.eye(3, dtype=torch.float64).to_sparse()), TypeError,
     "^matrix has layout torch.sparse_coo"),
    ("matrix meta", lambda: privleak.column_stats(torch.ones(3, 3, device="meta")), TypeError,
     "^matrix is on device meta"),
    ("row_weights None entry", lambda: privleak.column_stats(np.ones((2, 2)), [None, 1.0]), TypeError,
     "^row_weights must hold real numbers"),
    ("row_weights str", lambda: privleak.column_stats(np.ones((2, 2)), ["1", "1"]), TypeError,
     "^row_weights must hold real numbers"),
    ("row_weights nan", lambda: privleak.column_stats(np.ones((2, 2)), [math.nan, 1.0]), ValueError,
     "^row_weights must be finite"),
    ("row_weights inf", lambda: privleak.column_stats(np.ones((2, 2)), np.array([1.0, -math.inf])), ValueError,
     "^row_weights must be finite"),
    ("row_weights shape", lambda: privleak.column_stats(np.ones((2, 2)), np.ones(3)), ValueError,
     r"^row_weights must have shape \(2,\)"),
    ("stats None", lambda: privleak.column_stats(np.ones((2, 2)), stats=None), TypeError, "^stats must be"),
    ("stats unknown", lambda: privleak.column_stats(np.ones((2, 2)), stats=["median"]), ValueError, "^stats must be"),
    # --- nearest --------------------------------------------------------------------------------
    ("queries None", lambda: privleak.nearest(None, np.zeros((1, 2)), "l1"), TypeError, "^queries must be a numpy"),
    ("inputs empty", lambda: privleak.nearest(np.zeros((1, 2)), np.zeros((0, 2)), "l1"), ValueError,
     "^inputs must have at least one row"),
    ("inputs nan", lambda: privleak.nearest(np.zeros((1, 2)), np.array([[math.nan, 0.0]]), "l1"), ValueError,
     "^inputs must be finite"),
    ("queries inf", lambda: privleak.nearest(np.array([[math.inf, 0.0]]), np.zeros((1, 2)), "l1"), ValueError,
     "^queries must be finite"),
    ("inputs dtype", lambda: privleak.nearest(np.zeros((1, 2)), np.zeros((1, 2), dtype=np.float32), "l1"), TypeError,
     "^inputs has dtype float32"),
    ("inputs shape", lambda: privleak.nearest(np.zeros((1, 2)), np.zeros((1, 3)), "l1"), ValueError,
     "^queries and inputs must have the same number of columns"),
    ("queries unaligned", lambda: privleak.nearest(unaligned((2, 3)), np.zeros((2, 3)), "squared_l2"), ValueError,
     "^queries is not aligned"),
    ("inputs sparse csr", lambda: privleak.nearest(torch.zeros(1, 2, dtype=torch.float64),
                                                   torch.eye(2, dtype=torch.float64).to_sparse_csr(), "l1"),
     TypeError, "^inputs has layout torch.sparse_csr"),
    ("metric None", lambda: privleak.nearest(np.zeros((1, 2)), np.zeros((1, 2)), None), ValueError, "^metric must be"),
    ("metric unknown", lambda: privleak.nearest(np.zeros((1, 2)), np.zeros((1, 2)), "l2"), ValueError,
     "^metric must be"),
    ("tensor_cores int", lambda: privleak.nearest(np.zeros((1, 2)), np.zeros((1, 2)), "l1", tensor_cores=1), TypeError,
     "^tensor_cores must be True or False"),
    ("inputs 2^42 stride-0 rows", lambda: privleak.nearest(np.zeros((1, 1)), stride_zero_rows(2**42), "squared_l2"),
     MemoryError, "^nearest needs"),
    # --- capacity -------------------------------------------------------------------------------
    ("dim str", lambda: cap.gaussian_ball_log_capacity("3", 1.0, 1.0), ArgumentTypeError, "^dim must be an int"),
    ("dim 2.5", lambda: cap.gaussian_ball_log_capacity(2.5, 1.0, 1.0), ValueError, "^dim must be a whole number"),
    ("dim nan", lambda: cap.gaussian_ball_log_capacity(math.nan, 1.0, 1.0), ValueError, "^dim must be a whole number"),
    ("dim bool", lambda: cap.gaussian_ball_log_capacity(True, 1.0, 1.0), ArgumentTypeError, "^dim must be an int"),
    ("dim 2^70", lambda: cap.gaussian_ball_log_capacity(2**70, 1.0, 1.0), ValueError, "^dim must be <="),
    ("radius None", lambda: cap.gaussian_ball_log_capacity(3, None, 1.0), ArgumentTypeError, "^radius must be a real"),
    ("noise_std bool", lambda: cap.gaussian_ball_log_capacity(3, 1.0, True), ArgumentTypeError, "^noise_std must be"),
    ("noise_std inf", lambda: cap.gaussian_ball_log_capacity(3, 1.0, math.inf), ValueError,
     "^noise_std must be finite"),
    ("method None", lambda: cap.gaussian_ball_log_capacity(3, 1.0, 1.0, method=None), ValueError, "^method must be"),
    ("radii[1] str", lambda: cap.gaussian_product_of_balls_log_capacity([1, 2], [1.0, "2"], 1.0), ArgumentTypeError,
     r"^radii\[1\] must be a real"),
    ("kappa str", lambda: cap.vmf_log_capacity(3, "1"), ArgumentTypeError, "^kappa must be a real"),
    ("dpsgd tiny noise", lambda: cap.dpsgd_gaussian(10, 1.0, 1e-300, 2**60), ValueError,
     "^noise_multiplier: the noise std"),
    ("dpsgd huge noise", lambda: cap.dpsgd_gaussian(10, 1e300, 1e300, 1), ValueError,
     "^noise_multiplier: the noise std"),
    ("batch_size 2^70", lambda: cap.dpsgd_gaussian(10, 1.0, 1.0, 2**70), ValueError, "^batch_size must be <="),
    ("per-layer noise", lambda: cap.dpsgd_gaussian_per_layer([2, 2], [1e300, 1e300], 1e300, 1), ValueError,
     "^noise_multiplier: the noise std"),
    ("Laplace scale str", lambda: cap.LaplaceNoise("1"), ArgumentTypeError, "^scale must be a real"),
    ("estimate seed str", lambda: cap.estimate(cap.GaussianNoise(1.0), np.zeros((2, 2)), 10, seed="1"),
     ArgumentTypeError, "^seed must be an int"),
    ("estimate seed bool", lambda: cap.estimate(cap.GaussianNoise(1.0), np.zeros((2, 2)), 10, seed=True),
     ArgumentTypeError, "^seed must be an int"),
    ("estimate seed -1", lambda: cap.estimate(cap.GaussianNoise(1.0), np.zeros((2, 2)), 10, seed=-1), ValueError,
     "^seed must be >= 0"),
    ("estimate confidence str", lambda: cap.estimate(cap.GaussianNoise(1.0), np.zeros((2, 2)), 10, confidence="0.9"),
     ArgumentTypeError, "^confidence must be a real"),
    ("estimate inputs nan", lambda: cap.estimate(cap.GaussianNoise(1.0), np.array([[math.nan, 0.0]]), 10), ValueError,
     "^inputs must be finite"),
    # --- relations ------------------------------------------------------------------------------
    ("ldp_epsilon str", lambda: rel.mbp_from_ldp("1"), ArgumentTypeError, "^ldp_epsilon must be a real"),
    ("ldp_epsilon bool", lambda: rel.mbp_from_ldp(True), ArgumentTypeError, "^ldp_epsilon must be a real"),
    ("ldp_epsilon None", lambda: rel.lip_from_ldp(None), ArgumentTypeError, "^ldp_epsilon must be a real"),
    ("ldp_epsilon nan", lambda: rel.lip_from_ldp(math.nan), ValueError, "^ldp_epsilon must be a number"),
    ("ldp_epsilon -1", lambda: rel.lip_from_ldp(-1), ValueError, "^ldp_epsilon must be >= 0"),
    ("eps_upper str", lambda: rel.ldp_from_lip("1", 1.0), ArgumentTypeError, "^eps_upper must be a real"),
    ("eps_lower None", lambda: rel.mi_from_lip(1.0, None), ArgumentTypeError, "^eps_lower must be a real"),
    ("mbp_xi str", lambda: rel.ldp_from_mbp("0.5"), ArgumentTypeError, "^mbp_xi must be a real"),
    ("prior_mismatch bool", lambda: rel.abp_from_mbp(1.0, True), ArgumentTypeError, "^prior_mismatch must be a real"),
    ("beta str", lambda: rel.pac_robustness_failure_probability(1.0, "0.1"), ArgumentTypeError, "^beta must be a real"),
    ("beta nan", lambda: rel.pac_robustness_failure_probability(1.0, math.nan), ValueError, "^beta must be finite"),
    ("beta None with bad xi", lambda: rel.pac_robustness_failure_probability(-1.0, None), ArgumentTypeError,
     "^beta must be a real"),
    ("prior nan", lambda: rel.lip_from_ldp(1.0, np.array([math.nan, 1.0])), ValueError, "^prior has non-finite"),
    # --- channels -------------------------------------------------------------------------------
    ("distance nan", lambda: ch.within_distance_gain(3, math.nan), ValueError, "^distance must be a number"),
    ("distance -1", lambda: ch.within_distance_gain(3, -1), ValueError, "^distance must be >= 0"),
    ("distance str", lambda: ch.within_distance_gain(3, "1"), ArgumentTypeError, "^distance must be a real"),
    ("distance None", lambda: ch.within_distance_gain(3, None), ArgumentTypeError, "^distance must be a real"),
    ("n_secrets None", lambda: ch.within_distance_gain(None, 1), ArgumentTypeError, "^n_secrets must be an int"),
    ("n_secrets bool", lambda: ch.within_distance_gain(True, 1), ArgumentTypeError, "^n_secrets must be an int"),
    ("n_secrets 0", lambda: ch.within_distance_gain(0, 1), ValueError, "^n_secrets must be >= 1"),
    ("n_secrets 2^70", lambda: ch.within_distance_gain(2**70, 1), MemoryError,
     "^gain_matrix: a 1180591620717411303424"),
    ("n_actions float", lambda: ch.gain_matrix(lambda w, x: w == x, 2.0, 2), ArgumentTypeError,
     "^n_actions must be an int"),
    ("n_outputs str", lambda: ch.deterministic_channel(np.array([0, 1]), "2"), ArgumentTypeError,
     "^n_outputs must be an int"),
    ("n_outputs 0", lambda: ch.deterministic_channel(np.array([0, 1]), 0), ValueError, "^n_outputs must be >= 1"),
    ("n_outputs 2^70", lambda: ch.deterministic_channel(np.array([0, 1]), 2**70), MemoryError,
     "^deterministic_channel"),
    ("gain_function wrong shape", lambda: ch.gain_matrix(lambda w, x: np.ones(3), 2, 2), ValueError,
     r"^gain_function must return real numbers broadcastable to \(2, 2\)"),
    ("gain_function strings", lambda: ch.gain_matrix(lambda w, x: np.full((2, 2), "a"), 2, 2), ValueError,
     "^gain_function must return real numbers"),
    ("gain callable wrong shape", lambda: ch.prior_g_vulnerability(P, lambda w, x: np.ones(3)), ValueError,
     "^gain_function must return"),
    ("channel nan", lambda: ch.bayes_capacity(np.array([[math.nan, 1.0]])), ValueError, "^channel has a non-finite"),
    ("channel empty", lambda: ch.bayes_capacity(np.zeros((0, 2))), ValueError, "^channel must be a 2-D array"),
    ("channel str", lambda: ch.bayes_capacity(np.array([["1"]])), TypeError, "^channel must have dtype"),
    ("prior list", lambda: ch.prior_bayes_vulnerability([0.5, 0.5]), TypeError, "^prior must be a numpy array"),
    ("prior str dtype", lambda: ch.prior_bayes_vulnerability(np.array(["1"])), TypeError,
     "^prior must have a real dtype"),
    ("gain nan", lambda: ch.prior_g_vulnerability(P, np.array([[math.nan, 1.0]])), ValueError, "^gain has non-finite"),
    # --- bayesian_privacy -----------------------------------------------------------------------
    ("expected_successes inf", lambda: bp.chernoff_relative_error(math.inf, 0.9), ValueError,
     "^expected_successes must be finite"),
    ("expected_successes str", lambda: bp.chernoff_relative_error("1", 0.9), ArgumentTypeError,
     "^expected_successes must be a real"),
    ("confidence 1", lambda: bp.chernoff_relative_error(1.0, 1.0), ValueError, "^confidence must be < 1"),
    ("confidence bool", lambda: bp.chernoff_relative_error(1.0, True), ArgumentTypeError, "^confidence must be a real"),
    ("successes str", lambda: bp.chernoff_interval(np.array(["a"]), 4, 0.9), ArgumentTypeError,
     "^successes must hold real numbers"),
    ("successes complex", lambda: bp.chernoff_interval(np.array([1j]), 4, 0.9), ArgumentTypeError,
     "^successes must hold real numbers"),
    ("successes nan", lambda: bp.chernoff_interval([math.nan], 4, 0.9), ValueError, "^successes must be finite"),
    ("n_terms float", lambda: bp.chernoff_interval([1], 4.0, 0.9), ArgumentTypeError, "^n_terms must be an int"),
    ("scores str", lambda: bp.count_recoveries(np.full((1, 2, 2), "a"), "above", 0.5), ArgumentTypeError,
     "^scores must hold real numbers"),
    ("scores complex", lambda: bp.count_recoveries(np.full((1, 2, 2), 1j), "above", 0.5), ArgumentTypeError,
     "^scores must hold real numbers"),
    ("threshold str", lambda: bp.count_recoveries(np.zeros((1, 2, 2)), "above", "0.5"), ArgumentTypeError,
     "^threshold must be a real"),
    ("threshold nan", lambda: bp.count_recoveries(np.zeros((1, 2, 2)), "above", math.nan), ValueError,
     "^threshold must be finite"),
    ("trials str", lambda: bp.RecoveryCounts(np.array([[1, 2]]), "4", 2), ArgumentTypeError, "^trials must be an int"),
    ("batch_size float", lambda: bp.RecoveryCounts(np.array([[1, 2]]), 4, 2.0), ArgumentTypeError,
     "^batch_size must be an int"),
    ("c2 nan", lambda: bp.estimate_abp(COUNTS, c2=math.nan), ValueError, "^c2 must be a number"),
    ("tv_distance str", lambda: bp.estimate_abp(COUNTS).epsilon_p("0.5"), ArgumentTypeError,
     "^tv_distance must be a real"),
    ("relative_error None", lambda: bp.c1_error_bound(None), ArgumentTypeError, "^relative_error must be a real"),
    ("ldp_epsilon str (implied_mbp_bound)", lambda: bp.implied_mbp_bound("1"), ArgumentTypeError,
     "^ldp_epsilon must be a real"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's beta warning for sparse CSR
@pytest.mark.parametrize("call, error, match", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_refused_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_argument_type_errors_are_value_errors_too():
    with pytest.raises(ValueError):
        rel.mbp_from_ldp("1")
    with pytest.raises(TypeError):
        rel.mbp_from_ldp("1")


def test_allocation_errors_are_memory_and_value_errors():
    assert issubclass(_arrays.AllocationTooLarge, MemoryError) and issubclass(_arrays.AllocationTooLarge, ValueError)
