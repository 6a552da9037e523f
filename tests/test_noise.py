"""Counter-based Gaussian and Laplace noise: bits against the numpy reference, distributions
against scipy, and the torch op contract."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import HAS_CUDA, requires_cuda
from privleak import _backend, reference
from privleak import mechanisms as M

# Random123's known-answer vectors for Philox4x32-10 (tests/kat_vectors): counter, key, output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
DISTRIBUTIONS = ["gaussian", "laplace"]
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_reference_philox_matches_random123(counter, key, expected):
    np.testing.assert_array_equal(reference.philox4x32_10(np.array(counter, dtype=np.uint32), key), expected)


def draw(distribution, n, key, offset=0, dtype=torch.float32, scale=1.0):
    fn = M.gaussian_noise if distribution == "gaussian" else M.laplace_noise
    return fn(n, scale, key=key, offset=offset, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
# 4 * 2**32 - 37: the draw's blocks cross a 2^32 boundary of the counter's low word (float and double).
@pytest.mark.parametrize("offset, n", [(0, 1), (7, 100_003), (2**40 + 3, 1001), (4 * 2**32 - 37, 1001)])
def test_kernel_bits_equal_the_numpy_reference(distribution, dtype, offset, n):
    key = 0xDEADBEEF12345678
    got = draw(distribution, n, key, offset, dtype).numpy()
    want = reference.noise(distribution, n, key, offset, got.dtype)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_bits_do_not_depend_on_threads_or_on_how_a_draw_is_split(distribution, threads):
    whole = draw(distribution, 300_001, key=11)  # above the parallel threshold
    threads(1)
    assert torch.equal(whole, draw(distribution, 300_001, key=11))
    threads(2)
    pieces = [draw(distribution, n, key=11, offset=start) for start, n in ((0, 3), (3, 20_000), (20_003, 279_998))]
    assert torch.equal(whole, torch.cat(pieces))
    generator = M.NoiseGenerator(11)
    fn = M.gaussian_noise if distribution == "gaussian" else M.laplace_noise
    assert torch.equal(whole, torch.cat([fn(n, generator=generator) for n in (1, 299_999, 1)]))


CPU_PATHS = ["default", "avx2", "avx512"]
CPU_BEST = _backend.core.build_info()["cpu_best_capability"]
# (distribution, output dtype, mode, n, offset). 4 * 2**32 - 37: the blocks cross a 2^32 carry of
# the counter's low word inside a vector of blocks (float and double generation); the offsets and
# sizes are no multiples of the lanes (64 blocks a batch, 8 or 16 blocks a vector); 300_001
# elements split over threads and many batches.
PATH_CASES = [(distribution, dtype, mode, 5003, 4 * 2**32 - 37) for distribution in DISTRIBUTIONS
              for dtype in ("float32", "float64", "bfloat16", "float16") for mode in ("new", "add", "add_")]
PATH_CASES += [("gaussian", "float32", "new", 300_001, 7), ("laplace", "float64", "add_", 300_001, 2**40 + 3),
               ("gaussian", "float64", "new", 1, 3), ("laplace", "float32", "add", 3, 2**32 - 1)]
PATH_KEY, PATH_SCALE = 0xDEADBEEF12345678, 0.75
# Run in a second interpreter, under PRIVLEAK_CPU_CAPABILITY (read once, at the first use).
PATH_CODE = """
import json, sys, torch, privleak
from privleak import mechanisms as M
assert privleak.info()["cpu_capability"] == sys.argv[1], privleak.info()["cpu_capability"]
out = []
for distribution, dtype, mode, n, offset in json.loads(sys.argv[2]):
    dtype = getattr(torch, dtype)
    if mode == "new":
        fn = M.gaussian_noise if distribution == "gaussian" else M.laplace_noise
        z = fn(n, %r, key=%d, offset=offset, dtype=dtype)
    else:
        x = torch.linspace(-3, 3, n, dtype=torch.float64).to(dtype)
        fn = getattr(M, f"add_{distribution}_noise{'_' if mode == 'add_' else ''}")
        z = fn(x, %r, key=%d, offset=offset)
    out.append(z.view(torch.uint8).numpy().tobytes())
sys.stdout.write(b"".join(out).hex())
""" % (PATH_SCALE, PATH_KEY, PATH_SCALE, PATH_KEY)


def path_case_bits(distribution, dtype, mode, n, offset):
    # The numpy reference's noise in the generation type (float64 for float64, else float32),
    # scaled there, added there to the input for the add modes, and rounded once to the output.
    out = getattr(torch, dtype)
    gen = torch.float64 if out == torch.float64 else torch.float32
    z = torch.from_numpy(reference.noise(distribution, n, PATH_KEY, offset, np.dtype(str(gen).removeprefix("torch."))))
    noise = z * torch.tensor(PATH_SCALE, dtype=gen)
    if mode != "new":
        noise = torch.linspace(-3, 3, n, dtype=torch.float64).to(out).to(gen) + noise
    return noise.to(out).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("path", CPU_PATHS)
def test_portable_and_vectorised_cpu_paths_give_the_same_bits(path):
    # Each CPU path (portable loops, AVX2, AVX-512: Philox, the transform and the interleave) in
    # its own interpreter must give the numpy reference's bits, for both distributions, every
    # output dtype, new draws, out-of-place and in-place addition.
    if CPU_PATHS.index(path) > CPU_PATHS.index(CPU_BEST):
        pytest.skip(f"this CPU cannot run the {path} path (its best is {CPU_BEST})")
    env = dict(os.environ, PRIVLEAK_CPU_CAPABILITY=path)
    got = subprocess.run([sys.executable, "-c", PATH_CODE, path, json.dumps(PATH_CASES)], env=env,
                         capture_output=True, text=True, check=True).stdout
    got = bytes.fromhex(got)
    start = 0
    for case in PATH_CASES:
        want = path_case_bits(*case)
        assert got[start:start + len(want)] == want, (path, case)
        start += len(want)
    assert start == len(got)


def test_streams_are_independent_across_distributions_and_dtypes():
    g32, l32 = draw("gaussian", 10_000, 5), draw("laplace", 10_000, 5)
    g64 = draw("gaussian", 10_000, 5, dtype=torch.float64)
    # Under independence r sqrt(n) is about N(0, 1): a bound at the two-sided 1e-6 quantile (4.9 / sqrt(n)).
    # The keys are fixed, so the draws never change; the bound is what a fresh key would fail with
    # probability 1e-6, and what streams sharing elements would exceed by far.
    bound = scipy.stats.norm.isf(0.5e-6) / np.sqrt(len(g32))
    assert abs(np.corrcoef(g32, l32)[0, 1]) < bound and abs(np.corrcoef(g32, g64)[0, 1]) < bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("distribution, scipy_dist", [("gaussian", scipy.stats.norm), ("laplace", scipy.stats.laplace)])
def test_noise_follows_its_distribution(distribution, scipy_dist, dtype):
    scale = 2.5
    z = draw(distribution, 400_000, key=2024, dtype=dtype, scale=scale).double().numpy()
    assert scipy.stats.kstest(z, scipy_dist(scale=scale).cdf).pvalue > 1e-3
    n = len(z)
    var = scipy_dist(scale=scale).var()
    # Fixed keys (the bits never change), bounds at 5 standard errors of the sampling distribution:
    # the mean normal with sd sqrt(var / n), the sample variance normal with sd var sqrt((kurtosis - 1) / n),
    # a tail frequency binomial; a fresh key would fail each with probability 5.7e-7.
    assert abs(z.mean()) < 5 * np.sqrt(var / n)
    assert abs(z.var() / var - 1) < 5 * np.sqrt((scipy_dist.stats(moments="k") + 2) / n)
    # Tails: P(|Z| > 4 sd) against the exact probability, within 5 binomial standard errors.
    p = 2 * scipy_dist(scale=scale).sf(4 * np.sqrt(var))
    assert abs((np.abs(z) > 4 * np.sqrt(var)).mean() - p) < 5 * np.sqrt(p / n)


def test_gaussian_tail_reaches_past_six_sigma_in_float32():
    # A 24-bit uniform would cap |z| at 5.77; the 32-bit grid reaches 6.8 (first 2^26 elements).
    assert float(draw("gaussian", 2**26, key=1).abs().max()) > 5.8


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementary_functions_are_accurate(dtype):
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.random(100_000), np.exp(-rng.random(1000) * 30), [1.0, 0.5, 0.25]]).astype(dtype)
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(reference._log_positive(u), np.log(u.astype(np.float64)), rtol=4 * eps, atol=4 * eps)
    c, s = reference._cos_sin_two_pi(u)
    angle = 2 * np.pi * u.astype(np.float64)
    np.testing.assert_allclose(c, np.cos(angle), atol=8 * eps)
    np.testing.assert_allclose(s, np.sin(angle), atol=8 * eps)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
# float16 subnormals, normals, and noise near float16's max (9685 x 6.77 < 65504: the largest std
# float16 takes; the sums with the format's max below overflow to inf)
@pytest.mark.parametrize("scale", [1e-6, 1.0, 9000.0])
def test_half_outputs_are_the_float32_noise_rounded_to_nearest_even(half, scale):
    z32 = M.gaussian_noise(100_000, scale, key=8)
    assert torch.equal(M.gaussian_noise(100_000, scale, key=8, dtype=half), z32.to(half))
    # Non-finite entries and the format's extremes go through the same conversion (NaN must stay NaN).
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    extremes = torch.tensor([torch.finfo(half).max, torch.finfo(half).tiny, torch.finfo(half).smallest_normal / 3])
    x = torch.cat([specials, extremes, -extremes, torch.randn(100_000 - 11)]).to(half)
    want = (x.float() + z32).to(half)
    got = M.add_gaussian_noise_(x.clone(), scale, key=8)
    assert torch.equal(got.isnan(), want.isnan())  # NaN bits may differ (torch drops a bf16 NaN's sign)
    assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_adding_noise_in_and_out_of_place_agree_and_pass_the_gradient(dtype):
    x = torch.randn(64, 33, dtype=dtype, requires_grad=True)
    y = M.add_laplace_noise(x, 0.3, key=77, offset=5)
    assert torch.equal(y.detach(), x.detach() + M.laplace_noise((64, 33), 0.3, key=77, offset=5, dtype=dtype))
    assert torch.equal(M.add_laplace_noise_(x.detach().clone(), 0.3, key=77, offset=5), y.detach())
    (y * torch.arange(33, dtype=dtype)).sum().backward()
    assert torch.equal(x.grad, torch.arange(33, dtype=dtype).expand(64, 33))


def test_in_place_noise_on_a_non_contiguous_tensor_follows_row_major_order():
    base = torch.zeros(40, 30)
    view = base.t()
    M.add_gaussian_noise_(view, 1.0, key=3)
    assert torch.equal(view, M.gaussian_noise((30, 40), key=3))


@pytest.mark.parametrize("add", [M.add_gaussian_noise_, M.add_laplace_noise_, M.add_gaussian_noise,
                                 M.add_laplace_noise])
def test_a_list_of_tensors_gets_the_noise_of_their_concatenation(add):
    # One stream over the tensors laid end to end: a non-contiguous one in row-major order, an
    # empty one taking no elements, dtypes of their own; a generator advances past all of them.
    tensors = [torch.randn(3, 4), torch.randn(5, 2).t(), torch.empty(0), torch.randn(7, dtype=torch.float64)]
    noise = M.gaussian_noise if "gaussian" in add.__name__ else M.laplace_noise
    inplace = add.__name__.endswith("_")
    originals = [t.clone() for t in tensors]
    out = add(tensors if inplace else tuple(tensors), 0.5, key=11, offset=9)
    assert (out is tensors) if inplace else isinstance(out, tuple)
    start = 0
    for original, got in zip(originals, out):
        want = noise(original.shape, 0.5, key=11, offset=9 + start, dtype=original.dtype) + original
        assert torch.equal(got, want) and got.shape == original.shape
        start += original.numel()
    generator = M.NoiseGenerator(5)
    add([torch.zeros(3), torch.zeros(4)], 1.0, generator=generator)
    assert generator.offset == 7
    assert add([], 1.0, generator=generator) == [] and generator.offset == 7


def test_ops_work_under_torch_compile():
    fn = torch.compile(lambda x: M.add_gaussian_noise(x * 2, 1.0, key=5), backend="eager", fullgraph=True)
    x = torch.ones(8)
    assert torch.equal(fn(x), M.add_gaussian_noise(x * 2, 1.0, key=5))
    # A list of tensors: their checks traced too (no real address to test while tracing).
    many = torch.compile(lambda xs: M.add_laplace_noise([x * 2 for x in xs], 1.0, key=5), backend="eager",
                         fullgraph=True)
    xs = [torch.ones(3), torch.ones(2, 2)]
    assert all(torch.equal(g, w) for g, w in zip(many(xs), M.add_laplace_noise([x * 2 for x in xs], 1.0, key=5)))


def test_generator_state_round_trips():
    g = M.NoiseGenerator(123)
    M.gaussian_noise(10, generator=g)
    state = g.get_state()
    a = M.gaussian_noise(5, generator=g)
    g.set_state(state)
    assert torch.equal(a, M.gaussian_noise(5, generator=g))
    assert g.initial_seed() == 123 and g.get_state() == (123, 15)
    M.manual_seed(9)
    assert torch.equal(M.gaussian_noise(4), M.gaussian_noise(4, key=9))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: M.gaussian_noise(3, -1.0), ValueError, "std must be >= 0"),
        (lambda: M.gaussian_noise(3, float("nan")), ValueError, "std must be finite"),
        (lambda: M.laplace_noise(3, float("inf")), ValueError, "scale must be finite"),
        (lambda: M.gaussian_noise(3, "1"), TypeError, "std must be a real number"),
        (lambda: M.gaussian_noise(3, dtype=torch.int32), TypeError, "dtype must be one of"),
        (lambda: M.gaussian_noise(-3), ValueError, "size must be"),
        (lambda: M.gaussian_noise(3, key=-1), ValueError, "key must be in"),
        (lambda: M.gaussian_noise(3, key=2**64), ValueError, "key must be in"),
        (lambda: M.gaussian_noise(3, key=1, offset=-2), ValueError, "offset must satisfy"),
        (lambda: M.gaussian_noise(3, key=1, offset=2**63 - 2), ValueError, "offset must satisfy"),
        (lambda: M.gaussian_noise(3, offset=4), ValueError, "offset needs an explicit key"),
        (lambda: M.gaussian_noise(3, key=1, generator=M.NoiseGenerator(1)), ValueError, "either generator or key"),
        (lambda: M.add_gaussian_noise_(torch.ones(3, dtype=torch.int64), 1.0), TypeError, "x must have dtype"),
        (lambda: M.add_gaussian_noise(np.ones(3), 1.0), TypeError, "x must be a torch tensor"),
        (lambda: M.NoiseGenerator(1.5), TypeError, "seed must be an int"),
    ],
)
def test_bad_arguments_are_rejected_with_the_argument_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_cuda_noise_is_bit_identical_to_cpu(distribution, dtype):
    fn = M.gaussian_noise if distribution == "gaussian" else M.laplace_noise
    for offset, n in ((0, 1), (5, 1_000_003)):
        cpu = fn(n, 1.5, key=99, offset=offset, dtype=dtype)
        gpu = fn(n, 1.5, key=99, offset=offset, dtype=dtype, device="cuda")
        assert torch.equal(cpu, gpu.cpu())
    x = torch.randn(1000, 37).to(dtype)
    add = M.add_gaussian_noise_ if distribution == "gaussian" else M.add_laplace_noise_
    assert torch.equal(add(x.clone(), 0.7, key=4), add(x.cuda(), 0.7, key=4).cpu())


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("distribution", [*DISTRIBUTIONS, "discrete_gaussian", "discrete_laplace"])
def test_cuda_noise_of_many_tensors_in_one_call_is_the_cpus(distribution, dtype):
    # 151 tensors in one call: launches of 64 arrays each, odd sizes whose Philox blocks straddle
    # two tensors, empty ones, and a large one.
    sizes = [k * 37 % 11 for k in range(150)] + [100_003]
    gen = torch.Generator().manual_seed(8)
    cpu = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    gpu = [x.cuda() for x in cpu]
    secure = distribution.startswith("discrete")
    args = (distribution, 2.0**41, [7, 1, 2, 3, 4, 5, 6, 7], 5, -20) if secure else (distribution, 1.5, [99, 3], 5, 0)
    torch.ops.privleak.add_noise_many_(cpu, *args)
    torch.ops.privleak.add_noise_many_(gpu, *args)
    assert all(torch.equal(c, g.cpu()) for c, g in zip(cpu, gpu))


@requires_cuda
def test_one_call_over_tensors_on_the_cpu_and_a_gpu_gives_each_its_share_of_the_stream():
    """The op called directly with tensors on two devices: a kernel per run of one device, each on
    its own (one kernel for all had written the GPU's memory from the CPU, or faulted)."""
    gen = torch.Generator().manual_seed(3)
    cpu = [torch.randn(n, generator=gen) for n in (1001, 37, 4096)]
    mixed = [cpu[0].clone(), cpu[1].cuda(), cpu[2].clone()]
    torch.ops.privleak.add_noise_many_(cpu, "gaussian", 1.5, [99, 3], 5, 0)
    torch.ops.privleak.add_noise_many_(mixed, "gaussian", 1.5, [99, 3], 5, 0)
    assert all(torch.equal(c, m.cpu()) for c, m in zip(cpu, mixed))


# ------------------------------------------------------------------ counter space and output range


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_ranges_far_apart_in_the_counter_space_share_no_elements(distribution, dtype):
    # Element e is value e mod k of Philox block e div k (k = 4 float, 2 double), the 64-bit block
    # number in two counter words: offsets 2^32 and 2^62 apart (block numbers 2^30, 2^60 or 2^31,
    # 2^61 apart: a truncated or wrapped counter would repeat them) give other noise, each range
    # equal to the numpy reference, and the last elements of the space are reachable.
    n, key = 64, 0x0123456789ABCDEF
    offsets = [0, 2**32, 2**62, 2**62 + 2**32, 2**63 - n]
    draws = [draw(distribution, n, key, offset, dtype).numpy() for offset in offsets]
    for offset, got in zip(offsets, draws):
        assert got.tobytes() == reference.noise(distribution, n, key, offset, got.dtype).tobytes()
    for i in range(len(draws)):
        for j in range(i):
            assert not np.isin(draws[i], draws[j]).any()


def test_the_counter_space_ends_at_2_to_the_63():
    with pytest.raises(ValueError, match="offset must satisfy"):
        M.gaussian_noise(2, key=1, offset=2**63 - 1)
    g = M.NoiseGenerator(1)
    for bad in (2**63, 2**64, -1):
        with pytest.raises(ValueError, match="offset must be in"):
            g.set_state((1, bad))
    with pytest.raises(TypeError, match="offset must be an int"):
        g.set_state((1, 5.0))
    with pytest.raises(TypeError, match="state must be a"):
        g.set_state(5)
    g.set_state((1, np.int64(2**63 - 3)))  # the last valid state: a draw may not move it to 2^63
    assert g.get_state() == (1, 2**63 - 3)
    M.gaussian_noise(2, generator=g)
    assert g.get_state() == (1, 2**63 - 1)
    with pytest.raises(ValueError, match="stream is exhausted"):
        M.gaussian_noise(1, generator=g)
    assert g.get_state() == (1, 2**63 - 1)  # a refused draw leaves the state alone
    M.gaussian_noise(0, generator=g)


def test_generators_draw_disjoint_ranges_from_many_threads():
    import threading

    g = M.NoiseGenerator(4)
    out = []
    threads = [threading.Thread(target=lambda: out.extend(g.claim(1)[1] for _ in range(2000))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == list(range(8000))


def test_noise_generators_copy_and_pickle_with_their_state():
    import copy
    import pickle

    g = M.NoiseGenerator(5)
    M.gaussian_noise(3, generator=g)
    for twin in (copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        assert twin.get_state() == g.get_state()
        assert torch.equal(M.gaussian_noise(4, generator=twin), M.gaussian_noise(4, key=5, offset=3))


@pytest.mark.parametrize(
    "distribution, dtype, largest_ok",
    [
        ("gaussian", torch.float32, 3.4028235e38 / 6.7637),
        ("gaussian", torch.float64, 1.7976931348623157e308 / 8.6517),
        ("laplace", torch.float32, 3.4028235e38 / 22.181),
        ("laplace", torch.float64, 1.7976931348623157e308 / 37.430),
        ("gaussian", torch.float16, 65504 / 6.7637),
        ("gaussian", torch.bfloat16, 3.3895314e38 / 6.7637),
    ],
)
def test_scales_whose_noise_overflows_the_dtype_are_refused(distribution, dtype, largest_ok):
    # The largest unit values: sqrt(2 ln 2^33) = 6.764 and sqrt(2 ln 2^54) = 8.652 (Gaussian),
    # ln 2^32 = 22.18 and ln 2^54 = 37.43 (Laplace). Just below the limit the noise is finite;
    # above it (old code: inf in the output) the scale is refused, naming it.
    fn = M.gaussian_noise if distribution == "gaussian" else M.laplace_noise
    name = "std" if distribution == "gaussian" else "scale"
    z = fn(1000, largest_ok * 0.999, key=3, dtype=dtype)
    assert torch.isfinite(z).all()
    for too_big in (largest_ok * 1.01, float(torch.finfo(dtype).max)):
        with pytest.raises(ValueError, match=f"{name} = .* is too large for"):
            fn(1000, too_big, key=3, dtype=dtype)
        add = M.add_gaussian_noise_ if distribution == "gaussian" else M.add_laplace_noise_
        with pytest.raises(ValueError, match=f"{name} = .* is too large for"):
            add(torch.zeros(10, dtype=dtype), too_big, key=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scales_lost_in_the_generation_precision_are_refused(dtype):
    # float32 noise of std 1e-46 was silently all zeros.
    with pytest.raises(ValueError, match="std must be 0 or >= 1.18e-38"):
        M.gaussian_noise(10, 1e-46, key=1, dtype=dtype)
    assert torch.equal(M.gaussian_noise(10, 0.0, key=1, dtype=dtype), torch.zeros(10, dtype=dtype))
    assert (M.gaussian_noise(10, 1e-300, key=1, dtype=torch.float64) != 0).all()


@pytest.mark.parametrize("add", [M.add_gaussian_noise_, M.add_laplace_noise_])
def test_in_place_noise_refuses_what_torchs_in_place_ops_refuse(add):
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.add_(1)
    with pytest.raises(RuntimeError, match="x is a leaf tensor that requires grad"):
        add(leaf, 1.0, key=1)
    with pytest.raises(RuntimeError, match="view of a leaf Variable"):
        leaf[:2].add_(1)
    with pytest.raises(RuntimeError, match="x is a view of a leaf tensor that requires grad"):
        add(leaf[:2], 1.0, key=1)
    assert torch.equal(leaf, torch.ones(3))
    with torch.no_grad():  # allowed there, as torch allows leaf.add_(1)
        add(leaf, 1.0, key=1)
    assert not torch.equal(leaf, torch.ones(3))
    with torch.inference_mode():
        frozen = torch.ones(3)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        frozen.add_(1)
    with pytest.raises(RuntimeError, match="x is an inference tensor"):
        add(frozen, 1.0, key=1)
    with torch.inference_mode():
        add(frozen, 1.0, key=1)
    non_leaf = torch.ones(3, requires_grad=True) * 2  # torch allows it, and so does privleak
    add(non_leaf, 1.0, key=1)


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a GPU")
def test_cuda_without_cuda_raises_privleaks_runtime_error():
    # torch's own AssertionError ("Torch not compiled with CUDA enabled") came out before.
    g = M.NoiseGenerator(1)
    with pytest.raises(RuntimeError, match="device is cuda.*CUDA cannot run here|cannot use CUDA here"):
        M.gaussian_noise(3, generator=g, device="cuda")
    with pytest.raises(RuntimeError, match="device is cuda:0"):
        M.laplace_noise(3, key=1, device=torch.device("cuda", 0))
    assert g.offset == 0  # nothing was claimed
