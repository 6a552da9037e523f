"""Secure mode: ChaCha20 against RFC 8439 and the cryptography package, the exact discrete
samplers against their probability mass functions, and the grid that defeats low-bit attacks."""
import math
import struct

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import requires_cuda
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from privleak import _backend
from privleak import mechanisms as M


def test_chacha20_matches_rfc8439_section_2_3_2():
    key = list(struct.unpack("<8I", bytes(range(32))))
    nonce = list(struct.unpack("<3I", bytes.fromhex("000000090000004a00000000")))
    want = [0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3, 0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
            0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9, 0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2]
    assert _backend.core.chacha20_block(key, 1, nonce) == want


@pytest.mark.parametrize("seed", range(5))
def test_chacha20_matches_the_cryptography_keystream(seed):
    rng = np.random.default_rng(seed)
    key_bytes, nonce_bytes = rng.bytes(32), rng.bytes(12)
    counter = int(rng.integers(0, 2**32 - 4))
    # cryptography's ChaCha20 takes a 16-byte nonce: the 32-bit block counter, then the RFC nonce.
    encryptor = Cipher(algorithms.ChaCha20(key_bytes, struct.pack("<I", counter) + nonce_bytes), mode=None).encryptor()
    keystream = encryptor.update(bytes(64 * 3))
    key, nonce = list(struct.unpack("<8I", key_bytes)), list(struct.unpack("<3I", nonce_bytes))
    ours = b"".join(struct.pack("<16I", *_backend.core.chacha20_block(key, counter + i, nonce)) for i in range(3))
    assert ours == keystream


# Secure draws use fresh OS entropy on every run, so each statistical check below states how often
# it fails by chance: ALPHA per check.
ALPHA = 1e-6


def assert_mean_and_variance(z, variance, kurtosis):
    """The sample mean and variance of n iid draws against the true ones, each check two-sided at
    false-failure probability ALPHA: the mean is normal with sd sqrt(variance / n); for Gaussian
    draws (kurtosis 3) (n - 1) s^2 / variance is chi-square(n - 1); otherwise s^2 is taken as normal
    with sd variance sqrt((kurtosis - 1) / n) (the CLT; n is in the hundreds of thousands).
    The discretised scale (rounded up by at most 2^-19) is far inside these bounds."""
    z = np.asarray(z, dtype=np.float64)
    n, quantile = len(z), scipy.stats.norm.isf(ALPHA / 2)
    assert abs(z.mean()) < quantile * math.sqrt(variance / n)
    s2 = z.var(ddof=1)
    if kurtosis == 3.0:
        chi2 = (n - 1) * s2 / variance
        assert scipy.stats.chi2.ppf(ALPHA / 2, n - 1) < chi2 < scipy.stats.chi2.isf(ALPHA / 2, n - 1)
    else:
        assert abs(s2 / variance - 1) < quantile * math.sqrt((kurtosis - 1) / n)


def integer_draws(distribution, scale, n, key=(1, 2, 3, 4, 5, 6, 7, 8)):
    """Raw discrete samples: grid 2^0, nothing added."""
    out = np.empty(n)
    _backend.core.apply_secure_noise(distribution, "float64", [out.ctypes.data], [n], list(key), 0, scale, 0, False)
    return out.astype(np.int64)


def chi_square_pvalue(samples, log_weight, support):
    """Pearson's test of the samples against pmf proportional to exp(log_weight(y)) on |y| <= support,
    pooling the tails beyond the central bins with an expected count of at least 5."""
    ys = np.arange(-support, support + 1)
    pmf = np.exp(log_weight(ys) - log_weight(ys).max())
    pmf /= pmf.sum()
    expected = pmf * len(samples)
    keep = expected >= 5
    lo, hi = ys[keep].min(), ys[keep].max()
    bins = np.arange(lo, hi + 1)
    observed = np.array([(samples < lo).sum()] + [(samples == y).sum() for y in bins] + [(samples > hi).sum()])
    expected = np.concatenate([[expected[ys < lo].sum()], expected[(ys >= lo) & (ys <= hi)], [expected[ys > hi].sum()]])
    return scipy.stats.chisquare(observed, expected).pvalue


# The pmf tests use fixed keys (the bits never change); the p-value bound 1e-3 is what a fresh key
# would fail with probability 1e-3, and what a wrong pmf fails with certainty at 200,000 draws.
@pytest.mark.parametrize("sigma2", [1, 3, 50])
def test_discrete_gaussian_has_the_exact_pmf(sigma2):
    samples = integer_draws("gaussian", sigma2, 200_000)
    support = int(40 * math.sqrt(sigma2)) + 10
    assert chi_square_pvalue(samples, lambda y: -(y.astype(float) ** 2) / (2 * sigma2), support) > 1e-3


@pytest.mark.parametrize("t", [1, 4])
def test_discrete_laplace_has_the_exact_pmf(t):
    samples = integer_draws("laplace", t, 200_000, key=(9, 9, 9, 9, 1, 2, 3, 4))
    assert chi_square_pvalue(samples, lambda y: -np.abs(y).astype(float) / t, 60 * t) > 1e-3


@pytest.mark.parametrize("distribution", ["gaussian", "laplace"])
def test_secure_noise_lies_on_the_grid_and_has_the_requested_scale(distribution):
    scale = 0.37
    fn = M.gaussian_noise if distribution == "gaussian" else M.laplace_noise
    z = fn(200_000, scale, generator=M.SecureNoiseGenerator(), dtype=torch.float64).numpy()
    units = z / 2.0 ** M._grid(scale)
    np.testing.assert_array_equal(units, np.round(units))
    std = scale if distribution == "gaussian" else math.sqrt(2) * scale
    assert_mean_and_variance(z, std**2, kurtosis=3.0 if distribution == "gaussian" else 6.0)


def test_adding_secure_noise_rounds_the_input_to_the_grid_first():
    x = torch.randn(10_000, dtype=torch.float64) * 3
    y = M.add_gaussian_noise(x, 0.5, generator=M.SecureNoiseGenerator())
    g = 2.0 ** M._grid(0.5)
    noise_units = y.numpy() / g - np.floor(x.numpy() / g + 0.5)
    np.testing.assert_array_equal(noise_units, np.round(noise_units))
    assert_mean_and_variance(noise_units * g, 0.5**2, kurtosis=3.0)


def test_the_discrete_scale_is_rounded_up():
    for scale in (1e-9, 0.3, 1.0, 7.77e5):
        sigma2_units, k = M._discrete_parameters("gaussian", scale)
        assert sigma2_units * 4.0**k >= scale**2 and sigma2_units * 4.0**k < scale**2 * (1 + 2**-19)
        t_units, k = M._discrete_parameters("laplace", scale)
        assert scale <= t_units * 2.0**k < scale * (1 + 2**-19)


def worst_pair_on_the_grid(g, n, sensitivity, norm):
    """Neighbours a, b of ``n`` values at distance ``sensitivity`` (in L``norm``) that rounding to
    the grid g (round half up, as the kernel: floor(x / g + 1/2)) moves apart the most: the
    difference spread evenly over the values (aligned with the rounding's), every value of a just
    under a half step, so that each of b's rounds up one step more; returns their distance on the
    grid, by numpy."""
    half = (np.arange(n) + 0.5) * g
    a = np.nextafter(half, -np.inf)
    b = a + sensitivity / n ** (1 / norm)
    assert np.linalg.norm(b - a, norm) <= sensitivity * (1 + 1e-9)
    rounded = [np.floor(v / g + 0.5) * g for v in (a, b)]
    return np.linalg.norm(rounded[1] - rounded[0], norm)


@pytest.mark.parametrize("distribution, sigma, n", [("gaussian", 10.0, 10**6), ("gaussian", 1.0, 10**5),
                                                    ("gaussian", 0.5, 3), ("laplace", 1.0, 10**4),
                                                    ("laplace", 4.0, 2000), ("laplace", 1.0, 10**6)])
def test_the_secure_scale_covers_the_sensitivity_that_rounding_to_the_grid_adds(distribution, sigma, n):
    """Rounding to the grid g moves each of n values by less than g / 2, so neighbours' values on
    the grid can be up to Delta + g sqrt(n) (L2) or Delta + g n (L1) apart (a review: 1.0071 C at
    n = 10^6 for the Gaussian, 1.91 C_1 for Laplace, the epsilon reported for C). secure_scale's
    scale s' keeps the worst pair's distance on its grid over s' within Delta / s (the zCDP rho
    Delta^2 / (2 s^2), Laplace's epsilon Delta / b), where s itself does not."""
    sensitivity = 0.3
    scale = sigma * sensitivity
    norm = 2 if distribution == "gaussian" else 1
    raised = M.secure_scale(distribution, scale, sensitivity, n)
    apart = worst_pair_on_the_grid(2.0 ** M._grid(raised), n, sensitivity, norm)
    assert apart / raised <= sensitivity / scale
    assert worst_pair_on_the_grid(2.0 ** M._grid(scale), n, sensitivity, norm) / scale > sensitivity / scale
    assert raised < scale * (1 + 2.0**-19 * sigma * (math.sqrt(n) if norm == 2 else n)) + 1e-300


@pytest.mark.parametrize("distribution, sigma, n", [("laplace", 1.0, 2**21), ("gaussian", 2048.0, 2**20)])
def test_secure_noise_where_no_scale_covers_its_grid_is_refused(distribution, sigma, n):
    """The grid grows with the scale: past s n^(1/2 or 1) / Delta = 2^21 no scale covers its
    rounding; under it one does (3 s at half of it: a review found the first form of the refusal,
    at half of it, refused Laplace on 10^6 values, where 2 s covers it)."""
    norm = "L2" if distribution == "gaussian" else "L1"
    with pytest.raises(ValueError, match=f"secure {distribution} noise of scale {sigma} on {n} values of {norm} "
                                         "sensitivity 1.0: rounding them"):
        M.secure_scale(distribution, sigma, 1.0, n)
    fewer = n // 4 if distribution == "gaussian" else n // 2
    raised = M.secure_scale(distribution, sigma, 1.0, fewer)
    spread = math.sqrt(fewer) if distribution == "gaussian" else fewer
    assert sigma < raised <= 4 * sigma and raised >= sigma * (1 + 2.0 ** M._grid(raised) * spread)


@pytest.mark.parametrize("path", ["noise", "release", "laplace"])
def test_dp_sgd_draws_secure_noise_at_the_scale_that_covers_the_grid(path):
    """The Gaussian mechanism's secure noise on 10^6 values at sigma 10, added to a clipped
    average (book-keeping's path) or to the clipped sum in the fused clipping op (the materialised
    path): its std is the raised one (1.0076 sigma C), 9 of its standard errors above sigma C,
    which the grid's rounding would have left uncovered. Laplace's on 2 10^5 values at multiplier
    1 (per layer, C_1 the sum of the layers'): its scale raised 1.2 times, 35 standard errors."""
    from privleak.dpsgd.gaussian import Gaussian
    from privleak.dpsgd.laplace import Laplace
    from privleak.dpsgd.mechanism import Clipping

    generator = M.SecureNoiseGenerator()
    if path == "laplace":
        n, raised = 2 * 10**5, M.secure_scale("laplace", 2.0, 2.0, 2 * 10**5)
        assert raised > 2.0 * 1.15
        released = Laplace(1.0).noise([torch.zeros(n // 2), torch.zeros(n // 2)], Clipping((0.5, 1.5), True), 1.0,
                                      generator)
        assert_mean_and_variance(torch.cat(released).double().numpy(), 2 * raised**2, kurtosis=6.0)
        return
    n, raised = 10**6, M.secure_scale("gaussian", 10.0, 1.0, 10**6)
    assert raised > 10.07
    mechanism, clipping = Gaussian(10.0), Clipping((1.0,), False)
    if path == "noise":
        released = mechanism.noise([torch.zeros(n)], clipping, 1.0, generator)[0]
    else:
        released = mechanism.release([torch.zeros(1, n)], clipping, 1.0, generator, "raise")[0]
    assert_mean_and_variance(released.double().numpy(), raised**2, kurtosis=3.0)


def test_secure_generators_take_no_seed_and_never_repeat():
    with pytest.raises(TypeError):
        M.SecureNoiseGenerator(5)
    g = M.SecureNoiseGenerator()
    a, b = M.gaussian_noise(64, generator=g), M.gaussian_noise(64, generator=g)
    c = M.gaussian_noise(64, generator=M.SecureNoiseGenerator())
    assert not torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_secure_noise_on_low_precision_tensors_is_finite(dtype):
    x = (torch.randn(5000) * 100).to(dtype)
    y = M.add_laplace_noise_(x.clone(), 1.0, generator=M.SecureNoiseGenerator())
    assert torch.isfinite(y).all() and y.dtype == dtype


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda g: M.gaussian_noise(3, 0.0, generator=g), "secure noise needs a scale > 0"),
        (lambda g: M.add_gaussian_noise(torch.tensor([1.0, float("nan")]), 1.0, generator=g), "x must be finite"),
        (lambda g: M.add_gaussian_noise(torch.tensor([1e30], dtype=torch.float64), 1e-9, generator=g), "too large"),
        (lambda g: M.vmf_sample(torch.ones(3), 1.0, generator=g), "no secure mode"),
    ],
)
def test_bad_secure_arguments_are_rejected(call, words):
    with pytest.raises(ValueError, match=words):
        call(M.SecureNoiseGenerator())


def test_secure_op_passes_opcheck():
    key = list(range(8))
    torch.library.opcheck(torch.ops.privleak.add_noise.default,
                          (torch.randn(6, 2, requires_grad=True), "discrete_gaussian", 2.0**40, key, 5, -21))


@requires_cuda
@pytest.mark.parametrize("distribution", ["discrete_gaussian", "discrete_laplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_secure_noise_is_bit_identical_to_cpu(distribution, dtype):
    key, grid = [7, 1, 2, 3, 4, 5, 6, 7], -20
    args = ([100_003], distribution, float(2**41), key, 11, grid, dtype)
    cpu = torch.ops.privleak.noise(*args, torch.device("cpu"))
    assert torch.equal(cpu, torch.ops.privleak.noise(*args, torch.device("cuda")).cpu())


# ------------------------------------------------------------------------- never the same stream twice


def test_secure_generators_cannot_be_copied_or_pickled():
    import copy
    import pickle

    g = M.SecureNoiseGenerator()
    for duplicate in (copy.copy, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        with pytest.raises(TypeError, match="SecureNoiseGenerator cannot be copied or pickled"):
            duplicate(g)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy({"optimizer state": [g]})  # also inside a container


def _draw_in_a_forked_child(g, draw):
    """Fork, draw in the child and send the bytes back through a pipe; the parent's next draw."""
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read)
            os.write(write, draw(g).numpy().tobytes())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return b"".join(chunks), draw(g).numpy().tobytes()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
@pytest.mark.parametrize("path", ["noise", "clip_and_accumulate"])
def test_a_forked_child_gets_a_new_key(path):
    from privleak import dpsgd

    if path == "noise":
        def draw(g):
            return M.gaussian_noise(256, 1.0, generator=g, dtype=torch.float64)
    else:
        grads = [torch.zeros(2, 256)]

        def draw(g):
            return dpsgd.clip_and_accumulate(grads, 1.0, noise_std=1.0, generator=g).grads[0]
    g = M.SecureNoiseGenerator()
    draw(g)  # the parent has drawn before the fork
    child, parent = _draw_in_a_forked_child(g, draw)
    assert len(child) == len(parent) == 256 * (8 if path == "noise" else 4)
    child_values = np.frombuffer(child, dtype=np.float64 if path == "noise" else np.float32)
    parent_values = np.frombuffer(parent, dtype=child_values.dtype)
    # A reused key gives the parent's 256 values. Secure noise is discrete (a grid of about 1e-6 of
    # its scale), so two independent draws share a value now and then: 0.018 expected of 256 x 256
    # pairs, at least 4 shared with probability about 1e-9.
    assert np.isin(child_values, parent_values).sum() < 4


def test_the_pid_check_rekeys_where_the_fork_hook_did_not_run():
    g = M.SecureNoiseGenerator()
    key = list(g._key_words)
    g._pid = -1  # as if inherited through a fork that bypassed os.fork's hooks
    M.gaussian_noise(4, generator=g)
    assert g._key_words != key and g._pid == __import__("os").getpid() and g._offset == 4
