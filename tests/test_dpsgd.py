"""Fused per-sample clipping against the float64 torch reference (privleak.reference)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import requires_cuda
from privleak import dpsgd, reference
from privleak import mechanisms as M

SHAPES = [[(5, 3), (7,), (2, 4, 6)], [(1,)], [(3000,), (1030, 7)], [(5000,)]]


def per_sample(shapes, batch, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # Varied norms, so that some samples are clipped and some are not.
    return [(torch.randn(batch, *s, generator=g) * torch.rand(batch, *([1] * len(s)), generator=g) * 3)
            .to(dtype).to(device) for s in shapes]


def split_noise(grads, std, key, offset=0):
    """The noise the kernel adds: the float Gaussian stream over the concatenated tensors."""
    z = M.gaussian_noise(sum(g[0].numel() for g in grads), key=key, offset=offset)
    parts, start = [], 0
    for g in grads:
        parts.append(std * z[start:start + g[0].numel()].double())
        start += g[0].numel()
    return parts


def assert_close(got, want, rtol=1e-5):
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-12)


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("noise_std", [0.0, 0.7])
def test_fused_clipping_matches_the_reference(shapes, per_layer, noise_std):
    grads = per_sample(shapes, batch=33)
    got = dpsgd.clip_and_accumulate(grads, 1.5, per_layer=per_layer, noise_std=noise_std, key=3, offset=11,
                                    batch_size=40.0)
    noise = split_noise(grads, noise_std, key=3, offset=11) if noise_std else None
    assert_close(got.grads, reference.clip_and_accumulate(grads, [1.5], per_layer, noise, 40.0))


def test_per_layer_clip_norms_apply_tensor_by_tensor():
    grads = per_sample(SHAPES[0], batch=20)
    got = dpsgd.clip_and_accumulate(grads, [0.5, 2.0, 1.0], per_layer=True)
    assert_close(got.grads, reference.clip_and_accumulate(grads, [0.5, 2.0, 1.0], True))
    norms = torch.stack([g.double().reshape(20, -1).norm(dim=1) for g in grads], dim=1)
    torch.testing.assert_close(got.norms, norms)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_accumulated_in_float32(dtype):
    grads = per_sample(SHAPES[2], batch=16, dtype=dtype)
    got = dpsgd.clip_and_accumulate(grads, 1.0)
    assert_close(got.grads, reference.clip_and_accumulate(grads, [1.0], False), rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_subnormals_extremes_and_non_finite_values_convert_exactly(dtype):
    info = torch.finfo(dtype)
    grads = torch.zeros(4, 64, dtype=dtype)
    grads[0] = torch.arange(1, 65, dtype=torch.float64) * info.smallest_normal / 128  # subnormals (fp16: k 2^-24)
    big = min(info.max, 1e19)  # bf16's max would overflow the float32 squares (a sample beyond 1.8e19 is dropped)
    grads[1, :3] = torch.tensor([big, -big, info.smallest_normal])
    grads[2, 5], grads[3, 9] = float("nan"), -float("inf")
    got = dpsgd.clip_and_accumulate([grads], 1e6, non_finite="drop", batch_size=1.0)
    assert got.dropped.tolist() == [False, False, True, True]
    want_norms = grads[:2].double().norm(dim=1)
    # atol: squares below 1.2e-38 underflow in float32, which hides bf16 subnormals (~1e-39) from the norm.
    torch.testing.assert_close(got.norms[:2], want_norms, rtol=1e-6, atol=1e-18)
    assert_close(got.grads, reference.clip_and_accumulate([grads[:2]], [1e6], False, None, 1.0))
    # Past 1.8e19 (only bf16 gets there) the square overflows and the sample counts as non-finite.
    grads[1, 0] = 2e19 if dtype == torch.bfloat16 else info.max
    assert dpsgd.clip_and_accumulate([grads], 1e6, non_finite="drop").dropped.tolist()[1] == (dtype == torch.bfloat16)


def test_fp16_gradients_give_the_same_bits_on_the_portable_path():
    # This interpreter widens fp16 with F16C where the CPU has it; a second one runs the portable
    # conversion (PRIVLEAK_CPU_CAPABILITY=default). Rows of 3000 elements leave a tail after the
    # 8-wide conversions, and B = 7 leaves samples outside the sets of four.
    code = (
        "import sys, torch, privleak\n"
        "from privleak import dpsgd\n"
        "assert privleak.info()['cpu_capability'] == 'default'\n"
        "g = torch.Generator().manual_seed(5)\n"
        "grads = [torch.randn(7, 3000, generator=g).half(), torch.randn(7, 13, 5, generator=g).half()]\n"
        "out = dpsgd.clip_and_accumulate(grads, 20.0, noise_std=0.5, key=4)\n"
        "sys.stdout.write(b''.join(t.numpy().tobytes() for t in out.grads + [out.norms]).hex())\n"
    )
    env = dict(os.environ, PRIVLEAK_CPU_CAPABILITY="default")
    portable = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(7, 3000, generator=g).half(), torch.randn(7, 13, 5, generator=g).half()]
    here = dpsgd.clip_and_accumulate(grads, 20.0, noise_std=0.5, key=4)
    assert bytes.fromhex(portable) == b"".join(t.numpy().tobytes() for t in here.grads + [here.norms])
    noise = split_noise(grads, 0.5, key=4)
    assert_close(here.grads, reference.clip_and_accumulate(grads, [20.0], False, noise, 7), rtol=1e-4)


def test_non_finite_samples_raise_or_are_dropped():
    grads = per_sample(SHAPES[0], batch=10)
    grads[1][3, 2] = float("nan")
    grads[2][7, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"samples \[3, 7\] are not finite"):
        dpsgd.clip_and_accumulate(grads, 1.0)
    got = dpsgd.clip_and_accumulate(grads, 1.0, non_finite="drop", batch_size=10)
    assert got.dropped.tolist() == [i in (3, 7) for i in range(10)]
    kept = [g[[i for i in range(10) if i not in (3, 7)]] for g in grads]
    assert_close(got.grads, reference.clip_and_accumulate(kept, [1.0], False, None, 10))
    assert all(torch.isfinite(g).all() for g in got.grads)


@pytest.mark.parametrize("per_layer", [False, True])
def test_samples_in_cache_sized_groups_match_the_reference(per_layer, threads):
    """Rows of 300 kB go through the CPU kernel in groups (12, 12, 6 of a batch of 30); a dropped
    sample in the first and in the last group must not disturb the others."""
    batch = 30
    grads = per_sample([(50_000,), (25, 1000)], batch=batch)
    grads[0][1, 5] = float("nan")
    grads[1][29, 3, 3] = float("inf")
    kept = [g[[i for i in range(batch) if i not in (1, 29)]] for g in grads]
    noise = split_noise(grads, 0.2, key=4)
    results = []
    for n in (1, 2):
        threads(n)
        results.append(dpsgd.clip_and_accumulate(grads, 2.0, per_layer=per_layer, noise_std=0.2, key=4,
                                                 batch_size=28, non_finite="drop"))
        assert results[-1].dropped.tolist() == [i in (1, 29) for i in range(batch)]
        assert_close(results[-1].grads, reference.clip_and_accumulate(kept, [2.0], per_layer, noise, 28))
    assert all(torch.equal(a, b) for a, b in zip(results[0].grads, results[1].grads))


def test_zero_gradients_are_left_alone():
    grads = [torch.zeros(4, 10)]
    got = dpsgd.clip_and_accumulate(grads, 1.0)
    assert torch.equal(got.grads[0], torch.zeros(10))


def test_empty_parameter_tensors_give_empty_sums():
    got = dpsgd.clip_and_accumulate([torch.zeros(4, 0), torch.ones(4, 3, 0)], 1.0, noise_std=1.0, key=1)
    assert [tuple(g.shape) for g in got.grads] == [(0,), (3, 0)]
    assert torch.equal(got.norms, torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("count", [1, 5, 50])
def test_flat_norms_add_the_tensors_squares_left_to_right(count):
    # The flat norm is sqrt(s_0 + s_1 + ... + s_{T-1}) over the kernel's per-tensor squares, added
    # left to right in float64 (the order of the clip factors), the same bits on every device and
    # for any split of the batch. Squares spanning 2^-60 .. 2^60 make the order show in the bits.
    g = torch.Generator().manual_seed(count)
    grads = [torch.randn(16, 1 + t % 3, generator=g) * 2.0 ** torch.randint(-30, 30, (16, 1), generator=g)
             for t in range(count)]
    got = dpsgd.clip_and_accumulate(grads, 1.0)
    squares = torch.ops.privleak.clip_accumulate(grads, torch.ones(1, dtype=torch.float64), False, 0.0, [0, 0], 0,
                                                 1.0)[-2].numpy()
    total = squares[:, 0].copy()
    for t in range(1, count):
        total = total + squares[:, t]
    assert got.norms.dtype == torch.float64
    np.testing.assert_array_equal(got.norms.numpy(), np.sqrt(total))
    pieces = [dpsgd.clip_and_accumulate([x[rows] for x in grads], 1.0).norms for rows in (slice(0, 3), slice(3, 16))]
    assert torch.equal(torch.cat(pieces), got.norms)
    per_layer = dpsgd.clip_and_accumulate(grads, 1.0, per_layer=True).norms
    np.testing.assert_array_equal(per_layer.numpy(), np.sqrt(squares))


def test_bits_do_not_depend_on_thread_count(threads):
    grads = per_sample(SHAPES[2], batch=64)
    results = []
    for n in (1, 2):
        threads(n)
        results.append(dpsgd.clip_and_accumulate(grads, 1.0, noise_std=0.3, key=5))
    for a, b in zip(results[0].grads, results[1].grads):
        assert torch.equal(a, b)
    assert torch.equal(results[0].norms, results[1].norms)


def test_noise_comes_from_the_generator_stream():
    grads = per_sample(SHAPES[0], batch=4)
    g1, g2 = M.NoiseGenerator(9), M.NoiseGenerator(9)
    a = dpsgd.clip_and_accumulate(grads, 1.0, noise_std=1.0, generator=g1)
    b = dpsgd.clip_and_accumulate(grads, 1.0, noise_std=1.0, key=9, offset=0)
    assert all(torch.equal(x, y) for x, y in zip(a.grads, b.grads))
    assert g1.offset == sum(g[0].numel() for g in grads) and g2.offset == 0


def test_secure_noise_is_added_to_the_sum_on_its_grid():
    grads = per_sample(SHAPES[3], batch=8)
    clean = dpsgd.clip_and_accumulate(grads, 1.0, batch_size=8.0).grads[0].double()
    noisy = dpsgd.clip_and_accumulate(grads, 1.0, noise_std=0.5, generator=M.SecureNoiseGenerator(),
                                      batch_size=8.0).grads[0].double()
    steps = noisy * 8 * 2.0**21  # the sum plus its noise lies on the grid 2^(frexp(0.5) - 21)
    assert torch.equal(steps, steps.round())
    noise = ((noisy - clean) * 8).numpy()
    # 5000 discrete Gaussian draws of variance 0.5^2 (to 2^-19): (n - 1) s^2 / sigma^2 is chi-square
    # with n - 1 degrees of freedom and the mean normal with sd sigma / sqrt(n). Each check fails
    # falsely with probability 1e-6 (the noise is fresh OS entropy every run).
    n, sigma, alpha = len(noise), 0.5, 1e-6
    assert abs(noise.mean()) < scipy.stats.norm.isf(alpha / 2) * sigma / math.sqrt(n)
    chi2 = (n - 1) * noise.var(ddof=1) / sigma**2
    assert scipy.stats.chi2.ppf(alpha / 2, n - 1) < chi2 < scipy.stats.chi2.isf(alpha / 2, n - 1)


def test_an_empty_batch_releases_the_noise_alone():
    # Poisson sampling draws empty batches; Alg. 1 releases N(0, std^2 I) / L for them, the noise a
    # batch of dropped samples gets from the kernel.
    empty = [torch.empty(0, *s) for s in SHAPES[0]]
    dropped = [torch.full((3, *s), float("nan")) for s in SHAPES[0]]
    for std in (0.0, 0.7):
        got = dpsgd.clip_and_accumulate(empty, 1.0, noise_std=std, key=9, offset=5, batch_size=3.3)
        want = dpsgd.clip_and_accumulate(dropped, 1.0, noise_std=std, key=9, offset=5, batch_size=3.3,
                                         non_finite="drop")
        assert all(torch.equal(a, b) for a, b in zip(got.grads, want.grads))
        assert got.norms.shape == (0,) and got.dropped.shape == (0,)
    per_layer = dpsgd.clip_and_accumulate(empty, [1.0, 2.0, 3.0], per_layer=True, batch_size=2)
    assert per_layer.norms.shape == (0, 3) and all(torch.equal(g, torch.zeros(g.shape)) for g in per_layer.grads)


def test_clip_norm_and_batch_size_take_any_real_number():
    grads = per_sample(SHAPES[0], batch=4)
    want = dpsgd.clip_and_accumulate(grads, 0.5, batch_size=3.0).grads
    got = dpsgd.clip_and_accumulate(grads, np.float32(0.5), batch_size=np.int64(3)).grads
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda g: dpsgd.clip_and_accumulate(g, 0.0), ValueError, "clip_norm must be > 0"),
        (lambda g: dpsgd.clip_and_accumulate(g, [1.0, 2.0]), ValueError, "clip_norm must be one number"),
        (lambda g: dpsgd.clip_and_accumulate(g, 1.0, non_finite="ignore"), ValueError, "non_finite must be"),
        (lambda g: dpsgd.clip_and_accumulate(g, 1.0, batch_size=0), ValueError, "batch_size must be"),
        (lambda g: dpsgd.clip_and_accumulate(g, 1.0, batch_size="2"), TypeError, "batch_size must be a real number"),
        (lambda g: dpsgd.clip_and_accumulate(g, 1.0, batch_size=1e-310), ValueError,
         "batch_size = 1e-310 is out of range"),
        (lambda g: dpsgd.clip_and_accumulate(g, 1.0, noise_std=-1.0), ValueError, "noise_std must be >= 0"),
        (lambda g: dpsgd.clip_and_accumulate([g[0].double()], 1.0), TypeError, "must have dtype"),
        (lambda g: dpsgd.clip_and_accumulate([g[0].transpose(1, 2)], 1.0), ValueError, "must be contiguous"),
        (lambda g: dpsgd.clip_and_accumulate([g[0], g[1][:2]], 1.0), ValueError, "has batch 2"),
        (lambda g: dpsgd.clip_and_accumulate(g[0], 1.0), TypeError, "non-empty sequence"),
        (lambda g: dpsgd.clip_and_accumulate([], 1.0), TypeError, "non-empty sequence"),
    ],
)
def test_bad_arguments_are_rejected(call, error, words):
    with pytest.raises(error, match=words):
        call(per_sample(SHAPES[0], batch=4))


# The CUDA comparison's cases. Its CPU half runs on every machine (test_cuda_cases_are_valid_on_the_cpu),
# so an argument the CPU refuses shows up without a GPU. The last two shape lists fill a whole
# launch group of the CUDA kernel (48 tensors) with empty tensors, which must launch nothing.
CUDA_SHAPES = {"mixed": SHAPES[2], "empty_group": [(0,)] * 48 + [(3, 0), (5,)], "all_empty": [(0,), (2, 0)] * 25}
CUDA_CASES = [pytest.param(shapes, per_layer, dtype, batch, id=f"{shapes}-{per_layer}-{str(dtype)[6:]}-{batch}")
              for shapes in CUDA_SHAPES for per_layer in (False, True)
              for dtype in (torch.float32, torch.bfloat16, torch.float16) for batch in (64, 0)]


def cuda_case(shapes, per_layer, dtype, batch):
    """(per-sample gradients on the CPU, clip_and_accumulate's other arguments) for one case."""
    grads = per_sample(CUDA_SHAPES[shapes], batch=batch, dtype=dtype)
    # An empty batch needs batch_size (its default, B, is 0); a full one keeps the default.
    kwargs = dict(per_layer=per_layer, noise_std=0.4, key=2, batch_size=3.3 if batch == 0 else None)
    return grads, kwargs


@pytest.mark.parametrize("shapes, per_layer, dtype, batch", CUDA_CASES)
def test_cuda_cases_are_valid_on_the_cpu(shapes, per_layer, dtype, batch):
    grads, kwargs = cuda_case(shapes, per_layer, dtype, batch)
    got = dpsgd.clip_and_accumulate(grads, 1.0, **kwargs)
    assert [g.shape for g in got.grads] == [g.shape[1:] for g in grads]
    assert got.norms.shape == ((batch, len(grads)) if per_layer else (batch,))
    if batch and "empty" in shapes:  # the empty tensors add nothing to the norms
        nonempty = [g for g in grads if g[0].numel()]
        want = [torch.zeros(batch, dtype=torch.float64)] if not nonempty else \
            [g.double().reshape(batch, -1).norm(dim=1) for g in nonempty]
        want = torch.stack(want, dim=1).norm(dim=1)
        torch.testing.assert_close(got.norms if not per_layer else got.norms.norm(dim=1), want)


@requires_cuda
@pytest.mark.parametrize("shapes, per_layer, dtype, batch", CUDA_CASES)
def test_cuda_matches_cpu(shapes, per_layer, dtype, batch):
    grads, kwargs = cuda_case(shapes, per_layer, dtype, batch)
    cpu = dpsgd.clip_and_accumulate(grads, 1.0, **kwargs)
    gpu = dpsgd.clip_and_accumulate([g.cuda() for g in grads], 1.0, **kwargs)
    assert torch.equal(cpu.norms, gpu.norms.cpu())
    for a, b in zip(cpu.grads, gpu.grads):
        assert torch.equal(a, b.cpu())


def _factors_reference(sums: np.ndarray, clip_norms, per_layer: bool, norm_type: int) -> np.ndarray:
    """min(1, c / |g|) sample by sample in Python floats: the sums added left to right, the
    correctly rounded square root, 0 for a sample with a non-finite sum."""
    out = np.zeros(sums.shape, dtype=np.float32)
    for i, row in enumerate(sums.tolist()):
        if not all(math.isfinite(s) for s in row):
            continue
        total = 0.0
        for s in row:
            total += s
        for t, s in enumerate(row):
            value = s if per_layer else total
            norm = math.sqrt(value) if norm_type == 2 else value
            c = clip_norms[t if per_layer else 0]
            out[i, t] = np.float32(c / norm) if norm > c else 1.0
    return out


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("norm_type", [1, 2])
def test_clip_factors_follow_the_clip_rule(per_layer, norm_type):
    rng = np.random.default_rng(3)
    sums = rng.exponential(2.0, size=(50, 4)) * rng.choice([0.0, 1e-3, 1.0, 1e3], size=(50, 4))
    sums[3, 1], sums[7, 0], sums[9, 3] = np.nan, np.inf, 0.0
    clip_norms = [0.5, 1.0, 2.0, 0.25] if per_layer else [1.5]
    got = dpsgd.clip_factors(torch.from_numpy(sums), clip_norms, per_layer=per_layer, norm_type=norm_type)
    assert got.dtype == torch.float32 and got.shape == (50, 4)
    np.testing.assert_array_equal(got.numpy(), _factors_reference(sums, clip_norms, per_layer, norm_type))
    assert (got[3] == 0).all() and (got[7] == 0).all()  # non-finite: dropped


def test_clip_factors_are_those_of_the_fused_kernel():
    """The factors applied to the per-sample gradients give clip_and_accumulate's sum."""
    grads = per_sample(SHAPES[2], batch=9)
    for per_layer in (False, True):
        fused = dpsgd.clip_and_accumulate(grads, 0.7, per_layer=per_layer, batch_size=1.0)
        sums = fused.norms.square() if per_layer else \
            torch.stack([g.double().reshape(9, -1).square().sum(1) for g in grads], 1)
        factors = dpsgd.clip_factors(sums, 0.7, per_layer=per_layer)
        for t, (g, out) in enumerate(zip(grads, fused.grads)):
            want = torch.einsum("b,b...->...", factors[:, t].double(), g.double())
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "sums, kwargs, error, words",
    [
        (torch.ones(4, 2), {}, TypeError, "norm_sums must have dtype float64"),
        (torch.ones(4, dtype=torch.float64), {}, ValueError, r"norm_sums must be \(B, T\)"),
        (torch.ones(4, 0, dtype=torch.float64), {}, ValueError, "T >= 1"),
        ([[1.0, 2.0]], {}, TypeError, "norm_sums must be a torch tensor"),
        (torch.ones(4, 2, dtype=torch.float64), {"norm_type": 3}, ValueError, "norm_type must be 1"),
        (torch.ones(4, 2, dtype=torch.float64), {"per_layer": True, "clip_norm": [1.0, 2.0, 3.0]}, ValueError,
         "clip_norm must be one number"),
        (torch.ones(4, 2, dtype=torch.float64), {"clip_norm": -1.0}, ValueError, "clip_norm must be > 0"),
    ],
)
def test_clip_factors_refuse_bad_input(sums, kwargs, error, words):
    kwargs = {"clip_norm": 1.0, **kwargs}
    with pytest.raises(error, match=words):
        dpsgd.clip_factors(sums, kwargs.pop("clip_norm"), **kwargs)


@requires_cuda
def test_clip_factors_on_cuda_match_the_cpu():
    sums = torch.from_numpy(np.random.default_rng(4).exponential(2.0, size=(300, 5)))
    sums[5, 2] = np.nan
    for per_layer in (False, True):
        cpu = dpsgd.clip_factors(sums, 1.2, per_layer=per_layer)
        assert torch.equal(dpsgd.clip_factors(sums.cuda(), 1.2, per_layer=per_layer).cpu(), cpu)


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("norm_type", [2, 1])
def test_norm_sums_given_for_tensors_read_elsewhere_count_in_the_factors(per_layer, norm_type):
    # Book-keeping hands the kernel some tensors' per-sample gradients and the norm sums of the
    # others (ghost norms): the factors and sums are those of the kernel over all of them.
    grads = per_sample([(5, 3), (7,), (2, 4, 6), (300,)], batch=9, seed=3)
    grads[1][4] = float("nan")  # a dropped sample: factor 0, left out of every sum
    clip_norms = torch.tensor([0.5, 1.0, 2.0, 0.7] if per_layer else [0.9], dtype=torch.float64)
    *whole, whole_sums, whole_factors = torch.ops.privleak.clip_accumulate(grads, clip_norms, per_layer, 0.0, [0, 0],
                                                                           0, 1.0, norm_type)
    read = [grads[0], grads[2]]
    order = [0, 2, 1, 3]  # the kernel's columns: the tensors it reads, then the others
    given = whole_sums[:, [1, 3]]
    *outs, sums, factors = torch.ops.privleak.clip_accumulate(read, clip_norms[order] if per_layer else clip_norms,
                                                              per_layer, 0.0, [0, 0], 0, 1.0, norm_type, given)
    torch.testing.assert_close(sums, whole_sums[:, order], rtol=0, atol=0, equal_nan=True)
    if per_layer:  # flat clipping adds the columns in another order: equal up to rounding
        assert torch.equal(factors, whole_factors[:, order])
    # Independent reference: float64 norms and factors by the formula, float64 weighted sums.
    per_tensor = torch.stack([g.double().flatten(1).abs().pow(norm_type).sum(1) for g in grads], 1)
    norm = per_tensor if per_layer else per_tensor.sum(1, keepdim=True)
    norm = norm.sqrt() if norm_type == 2 else norm
    want = torch.where(norm > clip_norms, clip_norms / norm, torch.ones_like(norm)).expand(-1, 4)
    want = torch.where(torch.isfinite(per_tensor).all(1, keepdim=True), want, torch.zeros_like(want))
    np.testing.assert_allclose(factors.numpy(), want[:, order].numpy(), rtol=1e-6)
    assert factors[4].eq(0).all() and torch.isfinite(factors).all()
    for got, g, column in zip(outs, read, (0, 1)):
        kept = torch.nan_to_num(g.double()) * want[:, order][:, column].view(-1, *[1] * (g.ndim - 1))
        np.testing.assert_allclose(got.numpy(), kept.sum(0).numpy(), rtol=1e-5, atol=1e-6)
        assert torch.equal(got, whole[[0, 2][column]])


@requires_cuda
@pytest.mark.parametrize("per_layer", [False, True])
def test_cuda_norm_sums_given_match_the_cpu_bits(per_layer):
    grads = per_sample([(5, 3), (2, 4, 6), (3000,)], batch=9, seed=5)
    given = torch.rand(9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(6)) * 20
    clip_norms = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.5] if per_layer else [0.9], dtype=torch.float64)
    cpu = torch.ops.privleak.clip_accumulate(grads, clip_norms, per_layer, 0.0, [0, 0], 0, 1.0, 2, given)
    gpu = torch.ops.privleak.clip_accumulate([g.cuda() for g in grads], clip_norms.cuda(), per_layer, 0.0, [0, 0], 0,
                                             1.0, 2, given.cuda())
    assert len(cpu) == len(gpu) == 5
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


class _LSTMRegressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


@requires_cuda
def test_per_sample_gradients_of_an_lstm_on_cuda_match_the_cpu():
    """torch.func cannot vmap cuDNN's LSTM (pytorch#105982): on CUDA the materialised path runs
    it on torch's native kernels, giving the CPU's per-sample gradients, and leaves cuDNN on."""
    torch.manual_seed(0)
    model = _LSTMRegressor()
    x, y = torch.randn(5, 7, 3), torch.randn(5, 1)

    def loss(out, target):
        return (out - target).pow(2).sum()

    want = dpsgd.per_sample_gradients(model, loss, x, y)
    got = dpsgd.per_sample_gradients(model.cuda(), loss, x.cuda(), y.cuda())
    assert torch.backends.cudnn.enabled
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-5)


def test_per_sample_gradients_draw_each_samples_dropout_mask():
    """y = w . dropout(x) with a squared loss: sample i's gradient of w is 2 (y_i - t_i) m_i x_i /
    (1 - p) for its own dropout mask m_i, so each coordinate is 0 or the undropped value, about a
    fraction p of them 0, the masks differing between samples."""
    torch.manual_seed(0)
    p, batch, width = 0.5, 64, 32
    model = torch.nn.Sequential(torch.nn.Dropout(p), torch.nn.Linear(width, 1, bias=False))
    x, t = torch.randn(batch, width) + 3.0, torch.randn(batch, 1)
    (grads,) = dpsgd.per_sample_gradients(model, lambda out, y: (out - y).square().sum(), x, t)
    kept = grads[:, 0] != 0
    y = (model[1].weight.detach() * kept * x / (1 - p)).sum(1, keepdim=True)  # each sample's own forward
    torch.testing.assert_close(grads[:, 0], torch.where(kept, 2 * (y - t) * x / (1 - p), 0.0))
    fraction = 1 - kept.double().mean().item()  # binomial(2048, 0.5): sd 0.011
    assert abs(fraction - p) < 0.06
    assert len({tuple(row.tolist()) for row in kept}) > batch // 2


def _raw_clip(grads=None, clip_norms=None, per_layer=False, noise_std=0.0, key=(0, 0), scale=1.0, norm_type=2,
              other_sums=None):
    grads = [torch.randn(4, 3), torch.randn(4, 5)] if grads is None else grads
    clip_norms = torch.ones(1, dtype=torch.float64) if clip_norms is None else clip_norms
    return torch.ops.privleak.clip_accumulate(grads, clip_norms, per_layer, noise_std, list(key), 0, scale, norm_type,
                                              other_sums)


@pytest.mark.parametrize("kwargs", [
    # the kernel read past the end of the smaller tensor: the process died (SIGSEGV)
    dict(grads=[torch.randn(4096, 64), torch.randn(1, 64)]),
    dict(grads=[]),
    dict(grads=[torch.tensor(1.0)]),
    dict(grads=[torch.randn(5, 4).t()]),  # non-contiguous: the kernel read the storage, not the view
    dict(grads=[torch.randn(4, 3), torch.randn(4, 3, dtype=torch.bfloat16)]),  # read as float32: inf
    dict(grads=[torch.randn(4, 3, dtype=torch.float64)]),
    dict(clip_norms=torch.ones(1)),  # float32 norms: every factor 0
    dict(clip_norms=torch.ones(1, dtype=torch.float64), per_layer=True),  # one norm for two tensors: read past it
    dict(clip_norms=torch.ones(3, dtype=torch.float64)),
    dict(key=(1,)),
    dict(noise_std=float("nan")),
    dict(noise_std=-1.0),
    dict(scale=float("inf")),
    dict(other_sums=torch.ones(3, 1, dtype=torch.float64)),
    dict(other_sums=torch.ones(4, 1)),
], ids=lambda kwargs: ",".join(kwargs))
def test_the_raw_clip_op_refuses_what_its_kernel_cannot_read(kwargs):
    """torch.ops.privleak.clip_accumulate itself (book-keeping calls it directly) refuses input its
    kernel would read out of bounds or as other numbers: a clear error, never a crash or a silent
    result."""
    with pytest.raises(ValueError, match="privleak::clip_accumulate takes a non-empty list of contiguous"):
        _raw_clip(**kwargs)
    assert len(_raw_clip()) == 4  # the same call with good input runs
