"""Bad inputs to the von Mises-Fisher functions and the Bessel functions behind them: each raises
the documented exception with a message naming the argument (issue 16: inputs checked at every
door). ArgumentTypeError (privleak.validation) is both a TypeError and a ValueError."""
import math

import numpy as np
import pytest
import torch
from privleak import mechanisms as M
from privleak import special


def unit(p, dtype=torch.float64):
    mu = torch.arange(1, p + 1, dtype=torch.float64)
    return (mu / mu.norm()).to(dtype)


E1 = torch.tensor([1.0, 0.0], dtype=torch.float64)

CASES = [
    # vmf_sample: kappa
    ("kappa zero", lambda: M.vmf_sample(unit(5), 0.0), ValueError, "kappa"),
    ("kappa negative", lambda: M.vmf_sample(unit(5), -1.0), ValueError, "kappa"),
    ("kappa inf", lambda: M.vmf_sample(unit(5), math.inf), ValueError, "kappa"),
    ("kappa nan", lambda: M.vmf_sample(unit(5), math.nan), ValueError, "kappa"),
    ("kappa str", lambda: M.vmf_sample(unit(5), "1"), TypeError, "kappa"),
    ("kappa bool", lambda: M.vmf_sample(unit(5), True), TypeError, "kappa"),
    # vmf_sample: mu
    ("mu p = 1", lambda: M.vmf_sample(torch.ones(1), 1.0), ValueError, "mu"),
    ("mu zero", lambda: M.vmf_sample(torch.zeros(4), 1.0), ValueError, "mu"),
    ("mu nan", lambda: M.vmf_sample(torch.tensor([1.0, math.nan]), 1.0), ValueError, "mu"),
    ("mu inf", lambda: M.vmf_sample(torch.tensor([1.0, math.inf]), 1.0), ValueError, "mu"),
    ("mu 2-D", lambda: M.vmf_sample(torch.ones(2, 2), 1.0), ValueError, "mu"),
    ("mu int", lambda: M.vmf_sample(torch.ones(3, dtype=torch.int64), 1.0), TypeError, "mu"),
    ("mu list", lambda: M.vmf_sample([1.0, 0.0], 1.0), TypeError, "mu"),
    # vmf_sample: n
    ("n negative", lambda: M.vmf_sample(unit(5), 1.0, -1), ValueError, "n"),
    ("n float", lambda: M.vmf_sample(unit(5), 1.0, 1.5), TypeError, "n"),
    ("n bool", lambda: M.vmf_sample(unit(5), 1.0, True), TypeError, "n"),
    # vmf_sample: the counter space
    ("offset negative", lambda: M.vmf_sample(unit(5), 1.0, 1, key=1, offset=-1), ValueError, "offset"),
    ("offset 2^63", lambda: M.vmf_sample(unit(5), 1.0, 1, key=1, offset=2**63), ValueError, "offset"),
    ("offset + n > 2^63", lambda: M.vmf_sample(unit(5), 1.0, 3, key=1, offset=2**63 - 2), ValueError, "offset"),
    ("secure generator", lambda: M.vmf_sample(unit(5), 1.0, generator=M.SecureNoiseGenerator()), ValueError,
     "secure"),
    # vmf_log_density
    ("y inside the sphere", lambda: M.vmf_log_density(torch.tensor([0.5, 0.0], dtype=torch.float64), E1, 1.0),
     ValueError, "y"),
    ("y outside the sphere", lambda: M.vmf_log_density(torch.tensor([3.0, 4.0], dtype=torch.float64), E1, 1.0),
     ValueError, "y"),
    ("y zero", lambda: M.vmf_log_density(torch.zeros(2, dtype=torch.float64), E1, 1.0), ValueError, "y"),
    ("y huge", lambda: M.vmf_log_density(torch.tensor([1e300, 0.0], dtype=torch.float64), E1, 1.0), ValueError, "y"),
    ("y nan", lambda: M.vmf_log_density(torch.tensor([math.nan, 0.0], dtype=torch.float64), E1, 1.0), ValueError,
     "y"),
    ("y inf", lambda: M.vmf_log_density(torch.tensor([math.inf, 0.0], dtype=torch.float64), E1, 1.0), ValueError,
     "y"),
    ("y float32 a few eps off", lambda: M.vmf_log_density(torch.tensor([1.0 + 1e-4, 0.0]), E1, 1.0), ValueError, "y"),
    ("y wrong p", lambda: M.vmf_log_density(torch.ones(3, dtype=torch.float64), E1, 1.0), ValueError, "y"),
    ("y list", lambda: M.vmf_log_density([1.0, 0.0], E1, 1.0), TypeError, "y"),
    ("mu zero (density)", lambda: M.vmf_log_density(E1, torch.zeros(2, dtype=torch.float64), 1.0), ValueError, "mu"),
    ("mu nan (density)", lambda: M.vmf_log_density(E1, torch.tensor([math.nan, 1.0]), 1.0), ValueError, "mu"),
    ("mu p = 1 (density)", lambda: M.vmf_log_density(torch.ones(1), torch.ones(1), 1.0), ValueError, "mu"),
    ("kappa zero (density)", lambda: M.vmf_log_density(E1, E1, 0.0), ValueError, "kappa"),
    ("kappa inf (density)", lambda: M.vmf_log_density(E1, E1, math.inf), ValueError, "kappa"),
    ("kappa nan (density)", lambda: M.vmf_log_density(E1, E1, math.nan), ValueError, "kappa"),
    ("kappa str (density)", lambda: M.vmf_log_density(E1, E1, "2"), TypeError, "kappa"),
    # special
    ("nu negative", lambda: special.log_bessel_iv(-1.0, 1.0), ValueError, "nu"),
    ("nu nan", lambda: special.log_bessel_iv(math.nan, 1.0), ValueError, "nu"),
    ("x negative", lambda: special.log_bessel_iv(1.0, -1.0), ValueError, "x"),
    ("x inf", lambda: special.log_bessel_ive(1.0, math.inf), ValueError, "x"),
    ("x nan (ratio)", lambda: special.bessel_iv_ratio(1.0, math.nan), ValueError, "x"),
    ("p = 1", lambda: special.vmf_log_normaliser(1, 1.0), ValueError, "p"),
    ("p fractional", lambda: special.vmf_log_scaled_normaliser(2.5, 1.0), ValueError, "p"),
    ("kappa zero (normaliser)", lambda: special.vmf_log_scaled_normaliser(3, 0.0), ValueError, "kappa"),
    ("kappa inf (normaliser)", lambda: special.vmf_log_normaliser(3, math.inf), ValueError, "kappa"),
    ("kappa array with a nan", lambda: special.vmf_mean_resultant_length(3, np.array([1.0, math.nan])), ValueError,
     "kappa"),
]


@pytest.mark.parametrize("call, error, name", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_refused_with_the_argument_named(call, error, name):
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()


def test_kernels_refuse_what_the_python_layer_refuses():
    from privleak import _backend

    for kappa in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="kappa"):
            _backend.core.vmf_sample("float64", 0, 3, kappa, 1, 0, 0, 0)
