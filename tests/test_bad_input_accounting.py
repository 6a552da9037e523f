"""Every public function of privleak.accounting with bad values: the exception type and a message
naming the argument; numpy scalars (np.float32, np.int64) accepted as numbers; huge steps refused
before anything is allocated."""
import math

import numpy as np
import pytest
from privleak import accounting
from privleak.validation import ArgumentTypeError

GOOD = {
    "gaussian_epsilon": dict(noise_multiplier=1.0, steps=10, delta=1e-5, sampling_rate=0.1),
    "analytic_gaussian_epsilon": dict(noise_multiplier=1.0, delta=1e-5),
    "analytic_gaussian_noise_multiplier": dict(epsilon=1.0, delta=1e-5),
    "vmf_privacy": dict(kappa=1.0, steps=10, delta=1e-5, sampling_rate=0.1),
}
TYPE_BAD = [None, "1", True, [1.0]]
REAL_BAD = [math.nan, math.inf, -math.inf]
CASES = []
for function, good in GOOD.items():
    for name in good:
        for value in TYPE_BAD:
            CASES.append((function, name, value, ArgumentTypeError))
        for value in REAL_BAD + [-1, 0]:
            if name == "delta" and value == 0:
                continue  # delta = 0 is allowed (pure DP / infinite epsilon), except below
            CASES.append((function, name, value, ValueError))
        if name in ("steps",):
            CASES += [(function, name, 2.0, ArgumentTypeError), (function, name, np.float32(3), ArgumentTypeError)]
        if name in ("delta", "sampling_rate"):
            CASES += [(function, name, 1.5, ValueError), (function, name, 2 ** 70, ValueError)]
        if name == "delta":
            CASES.append((function, name, 1.0, ValueError))
CASES.append(("analytic_gaussian_noise_multiplier", "delta", 0.0, ValueError))


@pytest.mark.parametrize("function, name, value, error", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]!r}" for c in CASES])
def test_bad_value_is_refused_naming_the_argument(function, name, value, error):
    with pytest.raises(error, match=name):
        getattr(accounting, function)(**{**GOOD[function], name: value})


def test_argument_type_error_is_both():
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)


@pytest.mark.parametrize("function", list(GOOD))
def test_numpy_scalars_are_accepted_as_numbers(function):
    good = GOOD[function]
    numpy_args = {k: (np.int64(v) if isinstance(v, int) else np.float32(v)) for k, v in good.items()}
    got, want = getattr(accounting, function)(**numpy_args), getattr(accounting, function)(**good)
    got, want = (got.epsilon, want.epsilon) if function == "vmf_privacy" else (got, want)
    assert got == pytest.approx(want, rel=1e-6)  # float32 rounding of 0.1 and 1e-5


@pytest.mark.parametrize("kwargs, words", [
    (dict(sampling="fixed"), "accountant='rdp'"),
    (dict(sampling="fixed", accountant="rdp"), "dataset_size"),
    (dict(sampling="fixed", accountant="rdp", dataset_size=0), "dataset_size"),
    (dict(sampling="fixed", accountant="rdp", dataset_size=10.0), "dataset_size"),
    (dict(sampling="fixed", accountant="rdp", dataset_size=True), "dataset_size"),
    (dict(sampling="uniform"), "sampling"),
    (dict(sampling=None), "sampling"),
    (dict(accountant="moments"), "accountant"),
    (dict(accountant=1), "accountant"),
])
def test_gaussian_epsilon_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        accounting.gaussian_epsilon(1.0, 10, 1e-5, **kwargs)


@pytest.mark.parametrize("call", [
    lambda: accounting.gaussian_epsilon(1.0, 2 ** 40, 1e-5, sampling_rate=0.01),
    lambda: accounting.gaussian_epsilon(0.5, 10 ** 9, 1e-5, sampling_rate=0.9),
    lambda: accounting.vmf_privacy(0.05, 2 ** 40, 1e-5, sampling_rate=0.01),
    lambda: accounting.vmf_privacy(1.0, 2 ** 70, 1e-5, sampling_rate=0.5),
], ids=["pld-2^40", "pld-1e9-q0.9", "vmf-2^40", "vmf-2^70"])
def test_huge_steps_are_refused_before_allocating(call):
    with pytest.raises(ValueError, match="steps"):
        call()


@pytest.mark.parametrize("kwargs", [{}, dict(sampling_rate=0.01, accountant="rdp"),
                                    dict(sampling_rate=0.1, sampling="fixed", dataset_size=100, accountant="rdp")])
def test_a_vanishing_noise_multiplier_is_refused_naming_it(kwargs):
    """A subnormal sigma divided by zero inside the closed form and dp-accounting's RDP."""
    with pytest.raises(ValueError, match="noise_multiplier = 5e-324 is too small to account"):
        accounting.gaussian_epsilon(5e-324, 10, 1e-5, **kwargs)
    assert math.isfinite(accounting.gaussian_epsilon(1e-100, 10, 1e-5, **kwargs))


def test_a_small_noise_multiplier_is_refused_by_the_pld_accountant_before_allocating():
    """dp-accounting's one-step PLD at sigma = 1e-3 asked for 38 GiB (MemoryError here, a real
    allocation on a larger machine)."""
    with pytest.raises(ValueError, match="noise_multiplier = 0.001 is too small for the PLD accountant.*rdp"):
        accounting.gaussian_epsilon(1e-3, 10, 1e-5, sampling_rate=0.01)


def test_huge_steps_where_a_closed_form_exists():
    # q = 1 PLD: one Gaussian at sigma / 2^20; RDP: linear in T; VMF with delta = 0: T log(1 + q (e^eps - 1)).
    # Balle and Wang at sigma' << 1: eps ~ 1 / (2 sigma'^2) to leading order, here 2^39.
    assert accounting.gaussian_epsilon(1.0, 2 ** 40, 1e-5) == pytest.approx(2 ** 39, rel=1e-2)
    assert math.isfinite(accounting.gaussian_epsilon(1.0, 2 ** 40, 1e-5, sampling_rate=0.01, accountant="rdp"))
    assert accounting.vmf_privacy(1.0, 2 ** 70, sampling_rate=0.5).epsilon == \
        pytest.approx(2 ** 70 * math.log(1 + 0.5 * math.expm1(2.0)), rel=1e-12)
