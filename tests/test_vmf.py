"""Von Mises-Fisher sampling against the exact moments, scipy's sampler, and its own invariants."""
import functools
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from conftest import requires_cuda
from privleak import mechanisms as M


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
    # The sample variance s^2 has variance var^2 (2 / (n - 1) + g2 / n), g2 the excess kurtosis of
    # mu.y; a scaled chi-square c chi2(d) with that mean and variance (d = 2 var^2 / Var(s^2);
    # d = n - 1 for normal data) gives the two-sided 1e-6 band. g2 is taken from the sample when n
    # is large (at least 0, which only widens the band); for n = 20 (p = 10^6) 1 - mu.y is close
    # to Gamma((p - 1) / 2) / kappa, whose g2 = 12 / (p - 1). (A fixed 25% band at n = 20 held by
    # the luck of the key: s^2 / var then has a standard deviation of 32%.)
    g2 = max(float(scipy.stats.kurtosis(w)), 0.0) if n >= 1000 else 12.0 / (p - 1)
    d = 2.0 / (2.0 / (n - 1) + g2 / n)
    low, high = scipy.stats.chi2.ppf([5e-7, 1 - 5e-7], d) / d
    sample_var = w.var(ddof=1)
    assert low * var - 1e-12 <= sample_var <= high * var + 1e-12


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


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "p, kappa, n, offset",
    [(2, 1.0, 1000, 0), (3, 1e9, 1000, 0), (13_700, 1000.0, 100, 0), (10**6, 1e5, 2, 0), (5, 1e200, 10, 0),
     (50, 3.0, 20, 2**62 - 7), (7, 3.0, 20, 2**32 - 10), (3, 0.5, 5, 2**63 - 5)],
)
def test_cuda_samples_are_bit_identical_to_cpu(p, kappa, n, offset, dtype):
    mu = unit(p, dtype=dtype)
    cpu = M.vmf_sample(mu, kappa, n, key=8, offset=offset)
    assert torch.equal(cpu, M.vmf_sample(mu.cuda(), kappa, n, key=8, offset=offset).cpu())


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_normalises_mu_to_the_same_bits_as_cpu(dtype):
    # Not unit: the norm and the division must give the same bits on both devices.
    mu = (3.7 * unit(100_003, seed=4, dtype=torch.float64)).to(dtype)
    assert torch.equal(M.vmf_sample(mu, 50.0, 3, key=2), M.vmf_sample(mu.cuda(), 50.0, 3, key=2).cpu())


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


# --- huge kappa: the call returns, and the sample is mu to working precision ------------------


@pytest.mark.parametrize("kappa", [1e153, 1e155, 1e200, 1e300, 1.7976931348623157e308])
@pytest.mark.parametrize("p", [2, 3, 50])
def test_huge_kappa_returns_mu(p, kappa):
    # Wood's b = m1 / (2 kappa + sqrt(4 kappa^2 + m1^2)) formed 4 kappa^2 = inf above kappa ~ 1.3e154:
    # the acceptance test became NaN and the loop never ended. Mean resultant length 1 - (p - 1) / (2 kappa)
    # means the samples equal mu up to rounding.
    mu = unit(p, seed=p)
    y = M.vmf_sample(mu, kappa, 20, key=3)
    eps = torch.finfo(torch.float64).eps
    assert torch.isfinite(y).all()
    assert (y - mu).abs().max() <= 2 * eps
    assert (y.norm(dim=1) - 1).abs().max() <= 4 * eps


@pytest.mark.parametrize("p", [2, 3, 50, 1000])
@pytest.mark.parametrize("kappa", [1e6, 1e10, 1e20])  # beyond ~1e30 y - mu rounds to 0
def test_large_kappa_has_the_right_spread(p, kappa):
    # Past the huge-kappa fix the law of 1 - mu.y is still Wood's: for kappa >> p it is
    # Gamma((p - 1) / 2) / kappa; check its mean to 5 standard errors.
    mu = unit(p, seed=1)
    y = M.vmf_sample(mu, kappa, 4000, key=11)
    # 1 - mu.y from the chord, without cancellation: |y - mu|^2 / 2.
    t = ((y - mu).norm(dim=1) ** 2 / 2 * kappa).numpy()
    shape = (p - 1) / 2
    assert abs(t.mean() - shape) <= 5 * np.sqrt(shape / len(t)) + 1e-3 * shape


# --- counter space ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_distinct_offsets_give_distinct_samples(p, dtype):
    # Before, offset 2^62 repeated offset 0 ((sample << 32) and (offset + s) * m wrapped in uint64),
    # and mu.y repeated for offsets 2^32 apart.
    mu = unit(p, dtype=dtype)
    offsets = [0, 1, 2**32, 2**32 + 1, 2**33, 2**62, 2**62 + 2**32, 2**63 - 4]
    samples = [M.vmf_sample(mu, 2.0, 3, key=9, offset=o) for o in offsets]
    cosines = [tuple((s.double() @ mu.double()).tolist()) for s in samples]
    assert len(set(cosines)) == len(offsets)
    for i in range(len(offsets)):
        for j in range(i):
            assert not torch.equal(samples[i], samples[j]), (offsets[i], offsets[j])


def test_a_sample_depends_only_on_its_own_offset():
    mu = unit(9)
    whole = M.vmf_sample(mu, 5.0, 6, key=4, offset=2**32 - 3)
    for s in range(6):
        assert torch.equal(whole[s], M.vmf_sample(mu, 5.0, 1, key=4, offset=2**32 - 3 + s)[0])


@pytest.mark.parametrize("offset, n", [(2**63 - 2, 3), (2**63, 1), (2**64, 0)])
def test_offsets_beyond_the_counter_space_are_refused(offset, n):
    with pytest.raises(ValueError, match="offset"):
        M.vmf_sample(unit(5), 1.0, n, key=1, offset=offset)
    M.vmf_sample(unit(5), 1.0, 2, key=1, offset=2**63 - 2)  # the last two samples exist


def test_the_kernel_refuses_what_the_counter_space_cannot_hold():
    from privleak import _backend

    with pytest.raises(ValueError, match="2\\^31"):
        _backend.core.vmf_sample("float64", 0, 2**31 + 2, 1.0, 1, 0, 0, 0)
    with pytest.raises(ValueError, match="offset"):
        _backend.core.vmf_sample("float64", 0, 3, 1.0, 2, 0, 2**63 - 1, 0)


# --- the norm of mu: the same bits in every order and on every device -------------------------


def test_the_norm_of_mu_does_not_depend_on_the_order_of_summation():
    from privleak import special

    x = torch.randn(100_003, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3.0
    norm = special.scaled_norm(x)[1]
    permuted = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(6))]
    assert special.scaled_norm(permuted)[1] == norm
    # ... equal to the correctly rounded norm (math.fsum of the exact squares, then one sqrt)
    scaled = special.scaled_norm(x)[0].numpy()
    squares, errors = special.two_product(scaled, scaled)
    assert norm == math.sqrt(math.fsum(np.concatenate([squares, errors]).tolist()))
    # ... and in pieces: the sample is the sample of the same mu pre-normalised by that norm.
    mu = x[:4000]
    scaled, n = special.scaled_norm(mu)
    assert torch.equal(M.vmf_sample(mu, 7.0, 4, key=1), M.vmf_sample(scaled / n, 7.0, 4, key=1))


def test_huge_and_tiny_mu_are_normalised_exactly():
    mu = unit(6)
    want = M.vmf_sample(mu, 3.0, 5, key=2)
    for factor in (2.0**1000, 2.0**-1000):
        assert torch.equal(M.vmf_sample(mu * factor, 3.0, 5, key=2), want)


# --- log density -----------------------------------------------------------------------------


def mp_log_density(y, mu, kappa):
    """log C_p(kappa) + kappa mu.y at the float64 points: the normaliser in mpmath (60 digits), and
    mu.y - 1 correctly rounded by math.fsum of the exact products (Dekker's split, checked
    against Fraction arithmetic in test_special) and -1."""
    import mpmath as mp
    from privleak import special

    hi, lo = special.two_product(np.asarray(y, dtype=np.float64), np.asarray(mu, dtype=np.float64))
    cos_minus_one = math.fsum(hi.tolist() + lo.tolist() + [-1.0])
    with mp.workdps(60):
        return mp_log_scaled_normaliser(len(mu), kappa) + mp.mpf(kappa) * cos_minus_one


@functools.lru_cache(maxsize=None)
def mp_log_scaled_normaliser(p, kappa):
    """log C_p(kappa) + kappa in mpmath."""
    import mpmath as mp

    with mp.workdps(60):
        nu, k = mp.mpf(p) / 2 - 1, mp.mpf(kappa)
        return nu * mp.log(k) - (nu + 1) * mp.log(2 * mp.pi) - mp_log_iv(nu, k) + k


def mp_log_iv(nu, k):
    import os
    import sys

    import mpmath as mp

    sys.path.insert(0, os.path.dirname(__file__))
    from test_special import mp_log_iv as reference

    if k > 1e5 and k > 100 * nu * nu:  # the large-argument series, at mpmath precision
        s, term = mp.mpf(1), mp.mpf(1)
        for j in range(1, 40):
            term = -term * (4 * nu * nu - (2 * j - 1) ** 2) / (8 * j * k)
            s += term
        return k - mp.log(2 * mp.pi * k) / 2 + mp.log(s)
    return reference(float(nu), float(k))


DENSITY_GRID = [(p, kappa) for p in (2, 3, 5, 10, 17, 101, 1000, 10**4, 10**6)
                for kappa in (1e-4, 0.3, 4.0, 30.0, 800.0, 2000.0, 1e5, 1e6)]


@pytest.mark.parametrize("p, kappa", DENSITY_GRID)
def test_log_density_is_within_a_few_ulp_of_mpmath(p, kappa):
    # Points: mu itself, samples (near the mode), a point orthogonal to mu, -mu. The error of each
    # term (kappa (mu.y - 1) and the log normaliser's own terms) is a few ulp of it, so the bound is
    # 8 ulp of the larger of the value and the scale of the normaliser's terms (|log|S^{p-1}|| and
    # nu |log(kappa / 2 pi)| ~ what cancels near the value's zero); away from that zero it is
    # 8 ulp of the value. Before, kappa mu.y + log C_p(kappa) was 40 ulp off at p = 2, kappa = 800.
    from privleak import special

    scaled, norm = special.scaled_norm(unit(p, seed=p))
    mu = (scaled / norm).numpy()  # the float64 direction vmf_sample and vmf_log_density use
    samples = M.vmf_sample(torch.from_numpy(mu), kappa, 3, key=p).numpy()
    other = np.roll(mu, 1) - (np.roll(mu, 1) @ mu) * mu
    other /= np.linalg.norm(other)
    points = np.vstack([mu, samples, other, -mu])
    got = M.vmf_log_density(torch.from_numpy(points), torch.from_numpy(mu), kappa).numpy()
    nu = p / 2 - 1
    scale = abs(float(special.log_sphere_area(p))) + nu * abs(np.log(kappa / (2 * np.pi))) + 1.0
    for value, point in zip(got, points):
        reference = float(mp_log_density(point, mu, kappa))
        error = abs(value - reference)
        assert error <= 8 * np.spacing(max(abs(reference), 1.0)) or error <= 8 * np.spacing(scale), \
            (p, kappa, value, reference, error / np.spacing(abs(reference)))


def test_log_density_at_p2_kappa800_is_within_two_ulp():
    mu = torch.tensor([0.6, 0.8], dtype=torch.float64)
    y = torch.tensor([[0.6, 0.8], [0.8, 0.6], [1.0, 0.0]], dtype=torch.float64)
    got = M.vmf_log_density(y, mu, 800.0).numpy()
    for value, point in zip(got, y.numpy()):
        reference = float(mp_log_density(point, mu.numpy(), 800.0))
        assert abs(value - reference) <= 2 * np.spacing(abs(reference))


@pytest.mark.parametrize(
    "x, mu, kappa, reference",
    [([1., 0., 0.], [1., 0., 0.], 1e-4, -2.5309242486359573), ([1., 0., 0.], [0., 0., 1.], 1e-4, -2.5310242486359575),
     ([1., 0., 0.], [1., 0., 0.], 100, 2.767293119578746), ([1., 0., 0.], [0., 0., 1.], 100, -97.23270688042125),
     ([1., 0., 0.], [np.sqrt(0.98), np.sqrt(0.02), 0.], 2000, -14.337987284534103),
     ([1., 0., 0.], [1., 0., 0.], 2000, 5.763025393132737),
     ([1., 0., 0., 0., 0.], [1., 0., 0., 0., 0.], 2000, 11.526550911307156),
     ([1., 0., 0., 0., 0.], [np.sqrt(0.98), np.sqrt(0.02), 0., 0, 0.], 2000, -8.574461766359684),
     ([1., 0., 0., 0., 0.], [np.sqrt(0.8), np.sqrt(0.2), 0., 0, 0.], 2000, -199.61906708886113)],
)
def test_scipy_log_density_references(x, mu, kappa, reference):
    # SciPy's own test values (mpmath at 50 digits, mu as given: these mu are unit to float64
    # rounding, so normalising leaves them as they are).
    got = float(M.vmf_log_density(torch.tensor(x, dtype=torch.float64), torch.tensor(mu, dtype=torch.float64), kappa))
    np.testing.assert_allclose(got, reference, rtol=1e-15)
    np.testing.assert_allclose(np.exp(got), np.exp(reference), rtol=1e-13)


@pytest.mark.parametrize("y", [[0.5, 0.0], [3.0, 4.0], [1.0, 1e-7], [0.0, 0.0]])
def test_log_density_refuses_points_off_the_sphere(y):
    with pytest.raises(ValueError, match="y must lie on the unit sphere"):
        M.vmf_log_density(torch.tensor(y, dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64), 1.0)


def test_log_density_accepts_rounded_unit_vectors():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        mu = unit(1000, seed=3)
        y = M.vmf_sample(mu, 100.0, 5, key=3).to(dtype)
        assert torch.isfinite(M.vmf_log_density(y, mu, 100.0)).all()
