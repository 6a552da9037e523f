"""Von Mises-Fisher sampling against the exact moments, scipy's sampler, and its own invariants."""
import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from privleak import mechanisms as M
from conftest import requires_cuda


def mean_resultant_length(p: int, kappa: float) -> float:
    """A_p(kappa) = I_{p/2}(kappa) / I_{p/2-1}(kappa), independently of privleak: scipy's ive for
    small orders, else the backward recurrence r_nu = 1 / (2 nu / kappa + r_{nu+1}) (stable, and
    contracting fast when 2 nu / kappa is not small, which holds wherever it is used here)."""
    nu = p / 2
    if p <= 1000:
        return float(scipy.special.ive(nu, kappa) / scipy.special.ive(nu - 1, kappa))
    r = 0.0
    for k in range(4000, -1, -1):
        r = 1.0 / (2 * (nu + k) / kappa + r)
    return r


def unit(p, seed=0, dtype=torch.float64):
    mu = torch.randn(p, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return (mu / mu.norm()).to(dtype)


@pytest.mark.parametrize(
    "p, kappa, n",
    [(2, 1.0, 4000), (3, 1e-6, 4000), (3, 0.5, 4000), (3, 50.0, 4000), (3, 1e9, 4000), (100, 10.0, 4000),
     (100, 1000.0, 4000), (13_700, 1000.0, 1000), (13_700, 1e5, 1000), (10**6, 1e6, 20)],
)
def test_mean_cosine_is_the_mean_resultant_length(p, kappa, n):
    mu = unit(p)
    y = M.vmf_sample(mu, kappa, n, key=p)
    w = (y @ mu).numpy()
    a = mean_resultant_length(p, kappa)
    var = max(1 - a * a - (p - 1) * a / kappa, 0.0)  # Var(mu.y) = A_p'(kappa)
    assert abs(w.mean() - a) <= 5 * np.sqrt(var / n) + 1e-12
    assert abs(w.var() - var) <= 0.25 * var + 1e-12  # a loose check that the spread is right too


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("p, kappa", [(2, 3.0), (50, 1e-6), (1000, 1e9), (10**7, 1e6)])
def test_samples_are_unit_vectors_without_nan(p, kappa, dtype, tolerance):
    n = 1 if p == 10**7 else 200
    y = M.vmf_sample(unit(p, dtype=dtype), kappa, n, key=1)
    assert y.shape == (n, p) and y.dtype == dtype and torch.isfinite(y).all()
    assert (y.double().norm(dim=1) - 1).abs().max() < tolerance


@pytest.mark.parametrize("p, kappa", [(3, 2.0), (5, 20.0), (10, 0.3)])
def test_two_sample_tests_agree_with_scipy(p, kappa):
    mu = unit(p)
    ours = M.vmf_sample(mu, kappa, 3000, key=5).numpy()
    theirs = scipy.stats.vonmises_fisher(mu.numpy(), kappa).rvs(3000, random_state=np.random.default_rng(5))
    # The cosine to mu, and the coordinate along a fixed direction orthogonal to mu.
    other = np.random.default_rng(1).standard_normal(p)
    other -= (other @ mu.numpy()) * mu.numpy()
    other /= np.linalg.norm(other)
    for direction in (mu.numpy(), other):
        assert scipy.stats.ks_2samp(ours @ direction, theirs @ direction).pvalue > 1e-3


def test_mean_is_normalised_before_sampling():
    mu = unit(20)  # normalising 7.5 mu changes its last bits, hence the tolerance
    torch.testing.assert_close(M.vmf_sample(7.5 * mu, 4.0, 50, key=3), M.vmf_sample(mu, 4.0, 50, key=3),
                               rtol=0, atol=1e-13)


def test_bits_do_not_depend_on_threads_or_on_how_a_draw_is_split(threads):
    mu = unit(3000, dtype=torch.float32)
    whole = M.vmf_sample(mu, 100.0, 9, key=12)
    threads(1)
    assert torch.equal(whole, M.vmf_sample(mu, 100.0, 9, key=12))
    threads(2)
    generator = M.NoiseGenerator(12)
    parts = [M.vmf_sample(mu, 100.0, n, generator=generator) for n in (4, 1, 4)]
    assert torch.equal(whole, torch.cat(parts))


def test_vmf_op_passes_opcheck():
    torch.library.opcheck(torch.ops.privleak.vmf_sample.default, (unit(10), 5.0, 4, [3, 0], 0))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: M.vmf_sample(unit(5), 0.0), ValueError, "kappa must be > 0"),
        (lambda: M.vmf_sample(unit(5), -1.0), ValueError, "kappa must be finite and >= 0"),
        (lambda: M.vmf_sample(unit(5), float("inf")), ValueError, "kappa must be finite"),
        (lambda: M.vmf_sample(torch.ones(1), 1.0), ValueError, "p >= 2"),
        (lambda: M.vmf_sample(torch.zeros(4), 1.0), ValueError, "mu must be finite and non-zero"),
        (lambda: M.vmf_sample(torch.tensor([1.0, float("nan")]), 1.0), ValueError, "mu must be finite"),
        (lambda: M.vmf_sample(torch.ones(2, 2), 1.0), ValueError, "mu must be 1-D"),
        (lambda: M.vmf_sample(torch.ones(3, dtype=torch.int64), 1.0), TypeError, "mu must have dtype"),
        (lambda: M.vmf_sample(unit(5), 1.0, -1), ValueError, "n must be a non-negative int"),
    ],
)
def test_bad_arguments_are_rejected(call, error, words):
    with pytest.raises(error, match=words):
        call()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p, kappa, n", [(2, 1.0, 1000), (3, 1e9, 1000), (13_700, 1000.0, 100), (10**6, 1e5, 2)])
def test_cuda_samples_are_bit_identical_to_cpu(p, kappa, n, dtype):
    mu = unit(p, dtype=dtype)
    assert torch.equal(M.vmf_sample(mu, kappa, n, key=8), M.vmf_sample(mu.cuda(), kappa, n, key=8).cpu())


@pytest.mark.parametrize("p, kappa", [(2, 0.7), (3, 25.0), (10, 4.0)])
def test_log_density_matches_scipy(p, kappa):
    mu = unit(p)
    y = M.vmf_sample(mu, kappa, 50, key=2)
    want = scipy.stats.vonmises_fisher(mu.numpy(), kappa).logpdf(y.numpy())
    np.testing.assert_allclose(M.vmf_log_density(y, mu, kappa).numpy(), want, rtol=1e-12, atol=1e-12)


def test_log_density_integrates_to_one_on_the_sphere():
    # On S^2 with mu = e3: integral over theta of f(cos theta) * 2 pi sin theta.
    import scipy.integrate

    mu = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)

    def integrand(theta):
        y = torch.tensor([[np.sin(theta), 0.0, np.cos(theta)]], dtype=torch.float64)
        return float(torch.exp(M.vmf_log_density(y, mu, 40.0))) * 2 * np.pi * np.sin(theta)

    total, _ = scipy.integrate.quad(integrand, 0, np.pi, epsabs=1e-13, points=[0.05, 0.3])
    assert abs(total - 1) < 1e-10


def test_log_density_is_finite_in_a_million_dimensions():
    p, kappa = 10**6, 1e5
    mu = unit(p)
    y = M.vmf_sample(mu, kappa, 2, key=1)
    log_f = M.vmf_log_density(y, mu, kappa)
    assert torch.isfinite(log_f).all()
    # Two samples' log densities differ by kappa times the difference of their cosines.
    w = y @ mu
    assert abs(float(log_f[0] - log_f[1]) - kappa * float(w[0] - w[1])) < 1e-6 * kappa
