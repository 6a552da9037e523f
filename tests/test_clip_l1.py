"""Fused per-sample clipping in the L1 norm (Laplace DP-SGD: clip_and_accumulate(norm_type=1))
against a float64 torch reference."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from privleak import mechanisms as M
from privleak.dpsgd.clip import clip_and_accumulate
from test_dpsgd import CUDA_CASES, SHAPES, assert_close, per_sample
from test_dpsgd import cuda_case as l2_cuda_case


def l1_reference(grads, clip_norms, per_layer, noise=None, batch_size=None):
    """(sum_b clip_c(g_b) + noise) / L in float64, clip_c(g) = g min(1, c / |g|_1)."""
    flat = [g.double().reshape(g.shape[0], -1) for g in grads]
    if per_layer:
        norms = torch.stack([torch.linalg.vector_norm(g, ord=1, dim=1) for g in flat], dim=1)
    else:
        norms = torch.linalg.vector_norm(torch.cat(flat, dim=1), ord=1, dim=1, keepdim=True)
    c = torch.tensor(clip_norms, dtype=torch.float64)
    factors = torch.where(norms > c, c / norms, torch.ones_like(norms)).expand(-1, len(grads))
    scale = grads[0].shape[0] if batch_size is None else batch_size
    outs = []
    for t, g in enumerate(flat):
        total = (factors[:, t:t + 1] * g).sum(dim=0)
        if noise is not None:
            total = total + noise[t]
        outs.append((total / scale).reshape(grads[t].shape[1:]))
    return outs


def l1_norms(grads, per_layer):
    norms = torch.stack([torch.linalg.vector_norm(g.double().reshape(g.shape[0], -1), ord=1, dim=1) for g in grads],
                        dim=1)
    return norms if per_layer else norms.sum(dim=1)


def split_noise(grads, std, key, offset=0):
    """The noise the kernel adds: the float Gaussian stream over the concatenated tensors (flat)."""
    sizes = [math.prod(g.shape[1:]) for g in grads]
    z = M.gaussian_noise(sum(sizes), key=key, offset=offset)
    return [std * part.double() for part in z.split(sizes)]


def clip_for(grads, per_layer):
    """Clip norms near the samples' median L1 norms (about 1.2 per element): some samples clipped, some not."""
    sizes = [float(math.prod(g.shape[1:])) for g in grads]
    return sizes if per_layer else [sum(sizes)]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("noise_std", [0.0, 0.7])
def test_l1_clipping_matches_the_reference(shapes, per_layer, noise_std):
    grads = per_sample(shapes, batch=33)
    clip = clip_for(grads, per_layer)
    got = clip_and_accumulate(grads, clip, per_layer=per_layer, noise_std=noise_std, key=3, offset=11,
                              batch_size=40.0, norm_type=1)
    noise = split_noise(grads, noise_std, key=3, offset=11) if noise_std else None
    want = l1_reference(grads, clip, per_layer, noise, 40.0)
    assert_close(got.grads, want)
    torch.testing.assert_close(got.norms, l1_norms(grads, per_layer), rtol=1e-6, atol=0)
    assert not got.dropped.any()


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("per_layer", [False, True])
def test_l1_clips_some_samples_and_not_others(shapes, per_layer):
    # The case above tests clipping only where the clip norm falls among the samples' norms.
    grads = per_sample(shapes, batch=33)
    norms, clip = l1_norms(grads, per_layer), torch.tensor(clip_for(grads, per_layer), dtype=torch.float64)
    assert (norms > clip).any() and (norms < clip).any()


def test_l1_per_layer_clip_norms_apply_tensor_by_tensor():
    grads = per_sample(SHAPES[0], batch=20)
    got = clip_and_accumulate(grads, [0.5, 20.0, 5.0], per_layer=True, norm_type=1)
    assert_close(got.grads, l1_reference(grads, [0.5, 20.0, 5.0], True))
    assert got.norms.shape == (20, 3)
    torch.testing.assert_close(got.norms, l1_norms(grads, True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_layer", [False, True])
def test_l1_half_precision_gradients_are_accumulated_in_float32(dtype, per_layer):
    grads = per_sample(SHAPES[2], batch=16, dtype=dtype)
    clip = clip_for(grads, per_layer)
    got = clip_and_accumulate(grads, clip, per_layer=per_layer, noise_std=0.3, key=8, norm_type=1)
    noise = split_noise(grads, 0.3, key=8)
    assert_close(got.grads, l1_reference(grads, clip, per_layer, noise), rtol=1e-4)
    torch.testing.assert_close(got.norms, l1_norms(grads, per_layer), rtol=1e-6, atol=0)


@pytest.mark.parametrize("per_layer", [False, True])
def test_l1_a_batch_of_one(per_layer):
    grads = per_sample(SHAPES[0], batch=1)
    got = clip_and_accumulate(grads, 2.0, per_layer=per_layer, norm_type=1)
    assert_close(got.grads, l1_reference(grads, [2.0] * (3 if per_layer else 1), per_layer))
    assert got.norms.shape == ((1, 3) if per_layer else (1,))
    torch.testing.assert_close(got.norms, l1_norms(grads, per_layer), rtol=1e-6, atol=0)
    # The release has L1 norm min(|g|_1, c) (to float32 rounding), per tensor or in all.
    released = torch.stack([g.double().abs().sum() for g in got.grads])
    released = released if per_layer else released.sum(dim=0, keepdim=True)
    assert (got.norms > 2.0).any()
    torch.testing.assert_close(released, got.norms.reshape(-1).clamp(max=2.0), rtol=1e-6, atol=0)


def test_l1_a_sample_exactly_at_the_clip_norm_is_left_alone():
    # |g|_1 = 1 exactly (dyadic elements sum exactly): the factor is 1, not c / |g|_1 rounded.
    at = torch.tensor([[0.25, -0.5], [0.125, 0.125]])
    above = torch.tensor([[0.5, -0.5], [0.5, 0.5]])  # |g|_1 = 2: halved
    grads = [torch.stack([at[0], above[0]]), torch.stack([at[1], above[1]])]
    got = clip_and_accumulate(grads, 1.0, batch_size=1.0, norm_type=1)
    assert got.norms.tolist() == [1.0, 2.0]
    assert got.grads[0].tolist() == [0.25 + 0.25, -0.5 - 0.25]
    assert got.grads[1].tolist() == [0.125 + 0.25, 0.125 + 0.25]
    # Per layer, tensor 0 of sample 0 is at its clip norm 0.75, tensor 1 at 0.25.
    per_layer = clip_and_accumulate(grads, [0.75, 0.25], per_layer=True, batch_size=1.0, norm_type=1)
    assert per_layer.norms.tolist() == [[0.75, 0.25], [1.0, 1.0]]
    assert per_layer.grads[0].tolist() == [0.25 + 0.375, -0.5 - 0.375]
    assert per_layer.grads[1].tolist() == [0.125 + 0.125, 0.125 + 0.125]


def test_l1_differs_from_l2_and_l2_stays_the_default():
    grads = per_sample(SHAPES[0], batch=8)
    default = clip_and_accumulate(grads, 1.0, noise_std=0.5, key=2)
    l2 = clip_and_accumulate(grads, 1.0, noise_std=0.5, key=2, norm_type=2)
    l1 = clip_and_accumulate(grads, 1.0, noise_std=0.5, key=2, norm_type=1)
    assert all(torch.equal(a, b) for a, b in zip(default.grads, l2.grads)) and torch.equal(default.norms, l2.norms)
    assert not torch.equal(l1.norms, l2.norms) and not torch.equal(l1.grads[0], l2.grads[0])
    assert (l1.norms >= l2.norms).all()  # |g|_1 >= |g|_2


def test_l1_norms_are_the_kernel_sums_added_left_to_right():
    # No square root: flat norms are the per-tensor L1 norms the kernel returns, added left to
    # right in float64; per-layer norms are those sums themselves.
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(16, 1 + t % 3, generator=g) * 2.0 ** torch.randint(-30, 30, (16, 1), generator=g)
             for t in range(7)]
    sums = torch.ops.privleak.clip_accumulate(grads, torch.ones(1, dtype=torch.float64), False, 0.0, [0, 0], 0, 1.0,
                                              1)[-2].numpy()
    total = sums[:, 0].copy()
    for t in range(1, 7):
        total = total + sums[:, t]
    np.testing.assert_array_equal(clip_and_accumulate(grads, 1.0, norm_type=1).norms.numpy(), total)
    np.testing.assert_array_equal(clip_and_accumulate(grads, 1.0, per_layer=True, norm_type=1).norms.numpy(), sums)
    torch.testing.assert_close(torch.from_numpy(sums), l1_norms(grads, True), rtol=1e-6, atol=0)


def test_l1_non_finite_samples_raise_or_are_dropped():
    grads = per_sample(SHAPES[0], batch=10)
    grads[1][3, 2] = float("nan")
    grads[2][7, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"samples \[3, 7\] are not finite"):
        clip_and_accumulate(grads, 1.0, norm_type=1)
    got = clip_and_accumulate(grads, 1.0, non_finite="drop", batch_size=10, norm_type=1)
    assert got.dropped.tolist() == [i in (3, 7) for i in range(10)]
    kept = [g[[i for i in range(10) if i not in (3, 7)]] for g in grads]
    assert_close(got.grads, l1_reference(kept, [1.0], False, None, 10))
    assert all(torch.isfinite(g).all() for g in got.grads)


def test_l1_an_overflowing_lane_sum_counts_as_non_finite():
    # Elements 0 and 16 share a float32 lane: 3e38 + 3e38 overflows it. In different lanes they
    # add in float64 and the sample is kept (and clipped).
    grads = torch.zeros(3, 64, dtype=torch.bfloat16)
    grads[0, 0] = grads[0, 16] = 3e38
    grads[1, 0] = grads[1, 1] = 3e38
    grads[2, 5] = 1.0
    got = clip_and_accumulate([grads], 1e30, non_finite="drop", batch_size=1.0, norm_type=1)
    assert got.dropped.tolist() == [True, False, False]
    assert got.grads[0][:2].tolist() == pytest.approx([5e29, 5e29], rel=1e-6) and float(got.grads[0][5]) == 1.0


@pytest.mark.parametrize("per_layer", [False, True])
def test_l1_samples_in_cache_sized_groups_match_the_reference(per_layer, threads):
    """Rows of 300 kB go through the CPU kernel in groups; dropped samples in the first and the
    last group must not disturb the others, and the thread count must not change the bits."""
    batch = 30
    grads = per_sample([(50_000,), (25, 1000)], batch=batch)
    grads[0][1, 5] = float("nan")
    grads[1][29, 3, 3] = float("inf")
    kept = [g[[i for i in range(batch) if i not in (1, 29)]] for g in grads]
    noise = split_noise(grads, 0.2, key=4)
    clip = [30_000.0, 20_000.0] if per_layer else [50_000.0]
    results = []
    for n in (1, 2):
        threads(n)
        results.append(clip_and_accumulate(grads, clip, per_layer=per_layer, noise_std=0.2, key=4, batch_size=28,
                                           non_finite="drop", norm_type=1))
        assert results[-1].dropped.tolist() == [i in (1, 29) for i in range(batch)]
        assert_close(results[-1].grads, l1_reference(kept, clip, per_layer, noise, 28))
    assert all(torch.equal(a, b) for a, b in zip(results[0].grads, results[1].grads))
    np.testing.assert_array_equal(results[0].norms.numpy(), results[1].norms.numpy())  # NaN, inf included


@pytest.mark.parametrize("per_layer", [False, True])
def test_l1_an_empty_batch_releases_the_noise_alone(per_layer):
    empty = [torch.empty(0, *s) for s in SHAPES[0]]
    dropped = [torch.full((3, *s), float("nan")) for s in SHAPES[0]]
    for std in (0.0, 0.7):
        got = clip_and_accumulate(empty, 1.0, per_layer=per_layer, noise_std=std, key=9, offset=5, batch_size=3.3,
                                  norm_type=1)
        want = clip_and_accumulate(dropped, 1.0, per_layer=per_layer, noise_std=std, key=9, offset=5,
                                   batch_size=3.3, non_finite="drop", norm_type=1)
        l2 = clip_and_accumulate(empty, 1.0, per_layer=per_layer, noise_std=std, key=9, offset=5, batch_size=3.3)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got.grads, want.grads, l2.grads))
        assert got.norms.shape == ((0, 3) if per_layer else (0,)) and got.dropped.shape == (0,)
        if std:
            noise = split_noise(empty, std, key=9, offset=5)
            assert_close(got.grads, [n.reshape(g.shape[1:]) / 3.3 for n, g in zip(noise, empty)])


def test_l1_bits_do_not_depend_on_the_cpu_capability_tier():
    # The tier (PRIVLEAK_CPU_CAPABILITY, read once per process) picks fp16's widening; every
    # tier must give the same bits, for each dtype, flat and per layer. B = 7 leaves samples
    # outside the sets of four, rows of 3000 a tail after the 8- and 16-wide loops.
    code = (
        "import sys, torch, privleak\n"
        "from privleak.dpsgd.clip import clip_and_accumulate\n"
        "out = [privleak.info()['cpu_capability'].encode()]\n"
        "for dtype in (torch.float32, torch.bfloat16, torch.float16):\n"
        "    g = torch.Generator().manual_seed(5)\n"
        "    grads = [torch.randn(7, 3000, generator=g).to(dtype), torch.randn(7, 13, 5, generator=g).to(dtype)]\n"
        "    for per_layer in (False, True):\n"
        "        r = clip_and_accumulate(grads, 500.0, per_layer=per_layer, noise_std=0.5, key=4, norm_type=1)\n"
        "        out += [t.numpy().tobytes() for t in r.grads + [r.norms]]\n"
        "sys.stdout.write(b'|'.join(x.hex().encode() for x in out).decode())\n"
    )
    results = {}
    for tier in ("default", "avx2", "avx512"):
        env = dict(os.environ, PRIVLEAK_CPU_CAPABILITY=tier)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        ran, *bits = run.stdout.split("|")
        results[bytes.fromhex(ran).decode()] = bits
    assert "default" in results  # the portable tier runs on every CPU
    first = next(iter(results.values()))
    assert all(bits == first for bits in results.values()), sorted(results)


@pytest.mark.parametrize(
    "norm_type, error, words",
    [
        (3, ValueError, "norm_type must be 1 .* or 2"),
        (0, ValueError, "norm_type must be 1 .* or 2"),
        (float("inf"), TypeError, "norm_type must be an int"),
        (1.0, TypeError, "norm_type must be an int"),
        ("1", TypeError, "norm_type must be an int"),
        (True, TypeError, "norm_type must be an int"),
        (None, TypeError, "norm_type must be an int"),
    ],
)
def test_bad_norm_types_are_rejected(norm_type, error, words):
    with pytest.raises(error, match=words):
        clip_and_accumulate(per_sample(SHAPES[0], batch=4), 1.0, norm_type=norm_type)


def test_numpy_integer_norm_types_are_accepted():
    grads = per_sample(SHAPES[0], batch=4)
    a = clip_and_accumulate(grads, 1.0, norm_type=np.int64(1))
    b = clip_and_accumulate(grads, 1.0, norm_type=1)
    assert all(torch.equal(x, y) for x, y in zip(a.grads, b.grads))


def test_the_kernel_refuses_other_norm_types():
    with pytest.raises(ValueError, match="norm_type must be 1 or 2, got 3"):
        torch.ops.privleak.clip_accumulate(per_sample(SHAPES[0], batch=2), torch.ones(1, dtype=torch.float64),
                                           False, 0.0, [0, 0], 0, 1.0, 3)


# The CUDA comparison's cases are those of test_dpsgd's L2 comparison, in the L1 norm. Their CPU
# half runs on every machine (test_l1_cuda_cases_are_valid_on_the_cpu).
def cuda_case(shapes, per_layer, dtype, batch):
    """(per-sample gradients on the CPU, clip_and_accumulate's other arguments) for one case."""
    grads, kwargs = l2_cuda_case(shapes, per_layer, dtype, batch)
    return grads, {**kwargs, "norm_type": 1}


@pytest.mark.parametrize("shapes, per_layer, dtype, batch", CUDA_CASES)
def test_l1_cuda_cases_are_valid_on_the_cpu(shapes, per_layer, dtype, batch):
    grads, kwargs = cuda_case(shapes, per_layer, dtype, batch)
    got = clip_and_accumulate(grads, 100.0, **kwargs)
    assert [g.shape for g in got.grads] == [g.shape[1:] for g in grads]
    assert got.norms.shape == ((batch, len(grads)) if per_layer else (batch,))
    if batch:
        torch.testing.assert_close(got.norms, l1_norms(grads, per_layer), rtol=1e-6, atol=0)


@requires_cuda
@pytest.mark.parametrize("shapes, per_layer, dtype, batch", CUDA_CASES)
def test_l1_cuda_matches_cpu(shapes, per_layer, dtype, batch):
    grads, kwargs = cuda_case(shapes, per_layer, dtype, batch)
    cpu = clip_and_accumulate(grads, 100.0, **kwargs)
    gpu = clip_and_accumulate([g.cuda() for g in grads], 100.0, **kwargs)
    assert torch.equal(cpu.norms, gpu.norms.cpu()) and torch.equal(cpu.dropped, gpu.dropped.cpu())
    for a, b in zip(cpu.grads, gpu.grads):
        assert torch.equal(a, b.cpu())


@requires_cuda
def test_l1_cuda_drops_non_finite_samples_as_the_cpu_does():
    grads = per_sample(SHAPES[0], batch=10)
    grads[1][3, 2] = float("nan")
    grads[2][7, 0, 0, 0] = float("inf")
    kwargs = dict(non_finite="drop", noise_std=0.3, key=6, norm_type=1)
    cpu = clip_and_accumulate(grads, 5.0, **kwargs)
    gpu = clip_and_accumulate([g.cuda() for g in grads], 5.0, **kwargs)
    assert gpu.dropped.cpu().tolist() == [i in (3, 7) for i in range(10)]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.grads, gpu.grads))
