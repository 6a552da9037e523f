"""The ghost-norm kernels (privleak.dpsgd.ghost_norm) against float64 torch references: the two
T x T Gram matrices, and the per-sample gradient sum_t g_t a_t^T formed outright."""
import math

import numpy as np
import privleak
import pytest
import torch
from conftest import requires_cuda
from privleak import _backend
from privleak.dpsgd.conv_grads import conv_weight_grads_reference
from privleak.dpsgd.ghost_norm import (
    LOST,
    MAX_PIXELS,
    VOUCHED,
    GhostNormInputs,
    conv_ghost_norm_squared,
    conv_ghost_norm_squared_reference,
    conv_patches_reference,
    embedding_ghost_norm_squared,
    embedding_ghost_norm_squared_reference,
    ghost_norm_squared,
    ghost_norm_squared_reference,
    ghost_norms,
)
from privleak.dpsgd.ghost_norm import conv_ghost_norms as conv_ghost_norms_by_group

HALF = (torch.bfloat16, torch.float16)
CHUNK = 128  # coordinates per float32 chain (csrc/common/ghost_norm.h)


def draw(batch, length, width, dtype=torch.float32, seed=0):
    """Rows of varied scale, so that no single row dominates every sample."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, width, generator=gen, dtype=torch.float64)
    return (x * torch.rand(batch, length, 1, generator=gen, dtype=torch.float64) * 3).to(dtype)


def error_bound(a, g):
    """The module docstring's bound, ((min(d, 128) + min(p, 128)) u + (T + T / 64 + 67) 2^-53)
    (sum_t |a_t| |g_t|)^2 with u = 2^-24 (2^-53 for float64), with room for second-order terms and
    the float64 reference's own rounding."""
    d, p, length = a.shape[-1], g.shape[-1], math.prod(a.shape[1:-1])
    unit = 2.0**-53 if a.dtype == torch.float64 else 2.0**-24
    scale = (a.double().norm(dim=-1) * g.double().norm(dim=-1)).flatten(1).sum(1) ** 2
    return ((min(d, CHUNK) + min(p, CHUNK) + 2) * unit + (length + length / 64 + 67) * 2.0**-53 + 2.0**-45) * scale


def test_float64_error_at_long_t_is_within_the_documented_bound_against_exact_arithmetic():
    """At T = 16000, d = p = 1, float64: the sums over the T^2 products carry most of the error
    (26 x 2^-53 of the result, past the chains' term of 2 x 2^-53 alone); the documented bound,
    checked here against the exact value (Fractions, no reference's rounding), covers it."""
    from fractions import Fraction

    gen = torch.Generator().manual_seed(16000)
    a, g = (torch.rand(1, 16000, 1, dtype=torch.float64, generator=gen) + 0.5 for _ in range(2))
    exact = float(sum(Fraction(x) * Fraction(y) for x, y in zip(a.flatten().tolist(), g.flatten().tolist())) ** 2)
    error = abs(float(ghost_norm_squared(a, g)[0]) - exact)
    documented = ((1 + 1) * 2.0**-53 + (16000 + 16000 / 64 + 67) * 2.0**-53) * exact  # all inputs > 0: scale = exact
    assert 2 * 2.0**-53 * exact < error <= documented


def per_sample_gradient_norm(a, g):
    """|sum_t g_t a_t^T|_F^2 from the per-sample weight gradient itself, in float64."""
    return torch.einsum("btp,btd->bpd", g.double(), a.double()).square().sum(dim=(1, 2))


def assert_within_bound(a, g):
    got = ghost_norm_squared(a, g)
    assert got.dtype == torch.float64 and got.shape == (a.shape[0],)
    want = ghost_norm_squared_reference(a, g)
    bound = error_bound(a, g)
    assert torch.all((got - want).abs() <= bound), ((got - want).abs() / bound).max()
    assert torch.all(got >= 0)
    return got


# T = 1, d = 1, p = 1, tile edges (rows: panels of 8 and 16, blocks of two, CUDA tiles of 64),
# chunk edges (127, 128, 129, 257 coordinates) and long T.
SHAPES = [(1, 1, 1, 1), (3, 1, 5, 7), (2, 17, 1, 1), (4, 1, 300, 200), (2, 15, 127, 129), (2, 16, 128, 128),
          (3, 33, 129, 3), (2, 47, 16, 257), (1, 65, 257, 255), (2, 100, 70, 50), (1, 129, 64, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_equals_the_float64_gram_formula_within_the_documented_bound(shape):
    batch, length, d, p = shape
    a, g = draw(batch, length, d, seed=1), draw(batch, length, p, seed=2)
    got = assert_within_bound(a, g)
    # The same number from the per-sample gradient itself, a formula that shares nothing with the Gram form.
    torch.testing.assert_close(got, per_sample_gradient_norm(a, g), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("shape", [(2, 1100, 3, 4), (1, 1030, 130, 129)])
def test_long_sequences(shape):
    batch, length, d, p = shape
    assert_within_bound(draw(batch, length, d, seed=3), draw(batch, length, p, seed=4))


def test_random_shapes():
    rng = np.random.default_rng(5)
    for i in range(12):
        batch, length = int(rng.integers(1, 5)), int(rng.integers(1, 90))
        d, p = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        assert_within_bound(draw(batch, length, d, seed=10 + i), draw(batch, length, p, seed=30 + i))


@pytest.mark.parametrize("dtype", HALF + (torch.float64,))
@pytest.mark.parametrize("shape", [(3, 40, 200, 70), (2, 1, 9, 300), (1, 70, 129, 1)])
def test_half_and_double_inputs(dtype, shape):
    # The reference reads the same half values (widened exactly to float64).
    batch, length, d, p = shape
    assert_within_bound(draw(batch, length, d, dtype, seed=6), draw(batch, length, p, dtype, seed=7))


def test_the_bound_holds_where_the_exact_norm_is_zero():
    # a_t the same for all t and g_t alternating in sign: sum_t g_t a_t^T = 0 exactly, while the
    # terms (a_t . a_s)(g_t . g_s) are large. Rounding may not make the result negative.
    a = draw(1, 1, 300, seed=8).expand(4, 64, 300)
    g = draw(4, 1, 200, seed=9) * torch.tensor([1.0, -1.0]).repeat(32).reshape(1, 64, 1)
    assert_within_bound(a, g)


def cancelling(scale, dtype=torch.float32):
    """Three samples of two positions with one input a each (|a| about 200: a repeated token) whose
    output gradients scale v and -(scale + 1) v nearly cancel: G = -v a^T, while the kernel's error
    is relative to (sum_t |a_t| |g_t|)^2, about (2 scale)^2 |v|^2 |a|^2."""
    gen = torch.Generator().manual_seed(int(math.log10(scale)))
    a = (torch.randn(3, 1, 24, generator=gen, dtype=torch.float64) * 40).expand(3, 2, 24)
    v = torch.randn(3, 1, 16, generator=gen, dtype=torch.float64)
    g = torch.cat([scale * v, -(scale + 1) * v], 1)
    return a.to(dtype).contiguous(), g.to(dtype)


@pytest.mark.parametrize("may_sync", [True, False], ids=["computed-again", "raised-only"])
def test_norms_for_clipping_are_never_under_the_exact_ones_where_the_gradient_cancels(may_sync):
    """The kernel's norm of a cancelling gradient came out far under the exact one (the sample then
    clipped less than its clip norm needs); for clipping, each norm is raised by the rounding
    bound where that passes 2^-7 of it, and computed again from float64 inputs past 2^-4 (where
    the rows may be read on the host): never under the exact norm by more than 2^-7, and over it
    by at most 2^-4 where computed again. Against the per-sample gradient formed in float64."""
    under = []
    for scale in (1e1, 1e2, 1e3, 1e4, 1e5):
        a, g = cancelling(scale)
        exact = per_sample_gradient_norm(a, g)
        kernel = ghost_norms([GhostNormInputs(a, g)])[0]
        clipping = ghost_norms([GhostNormInputs(a, g)], clipping=True, may_sync=may_sync)[0]
        under.append(float((kernel / exact).min()))
        assert torch.all(clipping >= exact * (1 - VOUCHED))
        if may_sync:
            assert torch.all(clipping <= exact * (1 + LOST))
    assert min(under) < 0.5  # the kernel's own norm lost to cancellation


def test_norms_for_clipping_are_the_kernel_s_where_nothing_cancels():
    for shape in SHAPES:
        a, g = draw(*shape[:3], seed=5), draw(shape[0], shape[1], shape[3], seed=6)
        assert torch.equal(ghost_norms([GhostNormInputs(a, g)], clipping=True)[0],
                           ghost_norms([GhostNormInputs(a, g)])[0])


def test_conv_norms_for_clipping_are_never_under_the_exact_ones_where_the_gradient_cancels():
    """A blank image of large pixels under a kernel inside it (every patch the same) and output
    gradients alternating in sign over its positions, plus a small part: the weight gradient is
    the small part's, while the kernel's error is relative to the alternating part's. Two groups."""
    args = dict(kernel_size=3, stride=1, padding=0, dilation=1, groups=2)
    under = []
    for scale in (1e1, 1e2, 1e3, 1e4):
        gen = torch.Generator().manual_seed(int(math.log10(scale)))
        x = (torch.randn(1, 8, 1, 1, generator=gen) * 50).expand(3, 8, 6, 6).contiguous()
        signs = torch.tensor([1.0, -1.0]).repeat(8).reshape(1, 1, 4, 4)
        g = scale * torch.randn(3, 4, 1, 1, generator=gen) * signs + torch.randn(3, 4, 4, 4, generator=gen)
        exact = conv_weight_grads_reference(x.double(), g.double(), **args).square().flatten(1).sum(1)
        kernel = conv_ghost_norm_squared(x, g, **args)
        clipping = conv_ghost_norms_by_group(x, g, [3, 3], [1, 1], [0, 0], [1, 1], 2, clipping=True)
        under.append(float((kernel / exact).min()))
        assert torch.all(clipping >= exact * (1 - VOUCHED))
        assert torch.all(clipping <= exact * (1 + LOST))
    assert min(under) < 1 - VOUCHED  # the kernel's own: 4% under


def test_conv_norms_for_clipping_bound_the_chains_over_the_channels():
    """The pixel Gram's float32 chains run over the channels, not the image's width: pixels
    alternating between (1, 2^-12, ...) (whose squared norm's chain drops every 2^-24 term, 127
    times) and (1, 0, ...) under output gradients alternating +-1 plus a small common part. A bound
    read with the width (1) for the chains' length came out 65 times too small, and a sample was
    released at 1.32 times its clip norm (a reviewer's construction); with the channels', never
    under the exact norm by more than 2^-7."""
    sign = torch.tensor([1.0, -1.0] * 4)
    wide, narrow = torch.full((128,), 2.0**-12), torch.zeros(128)
    wide[0] = narrow[0] = 1.0
    x = torch.stack([wide if s > 0 else narrow for s in sign], 1).reshape(1, 128, 8, 1)
    under = []
    for part in (0.001, 0.002, 0.003, 0.004, 0.006):
        g = torch.stack([sign, torch.full_like(sign, part)]).reshape(1, 2, 8, 1)
        exact = conv_weight_grads_reference(x.double(), g.double(), kernel_size=1).square().sum()
        under.append(float(conv_ghost_norm_squared(x, g, 1) / exact))
        clipping = conv_ghost_norms_by_group(x, g, [1, 1], [1, 1], [0, 0], [1, 1], 1, clipping=True)
        assert clipping >= exact * (1 - VOUCHED)
    assert min(under) < 1 - VOUCHED  # the kernel's own


def test_b_zero_t_zero_and_d_zero():
    assert ghost_norm_squared(torch.empty(0, 5, 3), torch.empty(0, 5, 2)).shape == (0,)
    zeros = torch.zeros(2, dtype=torch.float64)
    assert torch.equal(ghost_norm_squared(torch.empty(2, 0, 3), torch.empty(2, 0, 4)), zeros)
    assert torch.equal(ghost_norm_squared(torch.empty(2, 3, 0), torch.randn(2, 3, 4)), zeros)
    empty = embedding_ghost_norm_squared(torch.empty(0, 4, dtype=torch.int64), torch.empty(0, 4, 3))
    assert empty.shape == (0,) and empty.dtype == torch.float64


def test_layouts_and_mixed_dtypes():
    a, g = draw(3, 6, 20, seed=11), draw(3, 6, 9, seed=12)
    want = ghost_norm_squared(a, g)
    # Non-contiguous views give the bits of contiguous copies.
    a_view = a.transpose(1, 2).contiguous().transpose(1, 2)
    g_view = torch.cat([g, g], dim=2)[:, :, :9]
    assert not a_view.is_contiguous() and not g_view.is_contiguous()
    assert torch.equal(ghost_norm_squared(a_view, g_view), want)
    # (B, d) is T = 1; (B, T1, T2, d) lays the positions end to end.
    assert torch.equal(ghost_norm_squared(a[:, 0], g[:, 0]), ghost_norm_squared(a[:, :1], g[:, :1]))
    assert torch.equal(ghost_norm_squared(a.reshape(3, 2, 3, 20), g.reshape(3, 2, 3, 9)), want)
    # Two dtypes: both widened to the wider, exactly.
    a16 = a.to(torch.bfloat16)
    assert torch.equal(ghost_norm_squared(a16, g), ghost_norm_squared(a16.float(), g))


def test_one_call_for_many_layers_gives_each_layer_s_bits():
    # Layers of other lengths, widths and dtypes (the workspace is the longest layer's) in one call.
    layers = [(draw(3, 9, 20, seed=60), draw(3, 9, 7, seed=61)), (draw(3, 1, 5, seed=62), draw(3, 1, 300, seed=63)),
              (draw(3, 130, 16, torch.bfloat16, seed=64), draw(3, 130, 4, torch.bfloat16, seed=65)),
              (draw(3, 2, 3, torch.float64, seed=66), draw(3, 2, 9, torch.float64, seed=67))]
    got = torch.ops.privleak.ghost_norm([a for a, _ in layers], [g for _, g in layers])
    assert got.shape == (4, 3) and got.dtype == torch.float64
    for row, (a, g) in zip(got, layers):
        assert row.numpy().tobytes() == ghost_norm_squared(a, g).numpy().tobytes()
        torch.testing.assert_close(row, per_sample_gradient_norm(a, g), rtol=1e-5, atol=0.0)
    empty = torch.ops.privleak.ghost_norm([torch.empty(0, 2, 3), torch.empty(0, 4, 1)],
                                          [torch.empty(0, 2, 5), torch.empty(0, 4, 2)])
    assert empty.shape == (2, 0)


@pytest.mark.parametrize("shape", [(5, 70, 150, 140), (33, 3, 4096, 4096)])  # long samples; short ones packed
def test_threads_do_not_change_the_bits(threads, shape):
    batch, length, d, p = shape
    a, g = draw(batch, length, d, seed=13), draw(batch, length, p, seed=14)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(ghost_norm_squared(a, g))
    assert all(torch.equal(r, results[0]) for r in results)


CPU_PATHS = ["default", "avx2", "avx512"]
CPU_BEST = _backend.core.build_info()["cpu_best_capability"]


def core_ghost_norm(a, g, capability=None):
    out = torch.empty(a.shape[0], dtype=torch.float64)
    _backend.core.ghost_norm([str(a.dtype).removeprefix("torch.")], [a.data_ptr()], [g.data_ptr()], a.shape[0],
                             [a.shape[1]], [a.shape[2]], [g.shape[2]], out.data_ptr(), capability)
    return out


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 9, 15, 17), (2, 33, 129, 130), (1, 70, 300, 40), (3, 48, 8, 257)])
def test_simd_paths_give_the_portable_bits(shape, dtype, path):
    if CPU_PATHS.index(path) > CPU_PATHS.index(CPU_BEST):
        pytest.skip(f"this CPU has no {path} (its best path is {CPU_BEST})")
    batch, length, d, p = shape
    a, g = draw(batch, length, d, dtype, seed=15), draw(batch, length, p, dtype, seed=16)
    assert core_ghost_norm(a, g, path).numpy().tobytes() == core_ghost_norm(a, g, "default").numpy().tobytes()


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 9])
def test_short_samples_packed_into_a_panel_give_each_sample_s_own_bits(length, path):
    """Samples of at most half a panel's rows (8 or 16) share one: their cross terms are computed
    and left out, so each sample's norm has the bits of a call with that sample alone, for batches
    that fill the last panel or not."""
    if CPU_PATHS.index(path) > CPU_PATHS.index(CPU_BEST):
        pytest.skip(f"this CPU has no {path} (its best path is {CPU_BEST})")
    a, g = draw(19, length, 40, seed=23), draw(19, length, 150, seed=24)
    alone = b"".join(core_ghost_norm(a[i:i + 1], g[i:i + 1], path).numpy().tobytes() for i in range(19))
    for batch in (2, 5, 16, 19):
        want = alone[:8 * batch]
        assert core_ghost_norm(a[:batch], g[:batch], path).numpy().tobytes() == want
    assert_within_bound(a, g)


def test_an_unknown_path_or_one_the_cpu_lacks_is_refused():
    a = torch.ones(1, 2, 3)
    with pytest.raises(ValueError, match="capability must be 'default', 'avx2' or 'avx512'"):
        core_ghost_norm(a, a, "sse9")
    if CPU_BEST != "avx512":
        with pytest.raises(ValueError, match="cannot run the avx512 path"):
            core_ghost_norm(a, a, "avx512")


def test_non_finite_inputs():
    a, g = draw(4, 20, 30, seed=17), draw(4, 20, 10, seed=18)
    a[1, 3, 5] = math.nan
    g[2, 7, 1] = math.inf
    got = ghost_norm_squared(a, g)
    assert math.isnan(got[1]) and got[2] == math.inf
    keep = [0, 3]
    torch.testing.assert_close(got[keep], ghost_norm_squared(a[keep], g[keep]), rtol=0, atol=0)
    # Finite inputs whose float32 Gram entries overflow give +inf, never NaN, also against zero
    # output gradients (inf * 0) and with signs that would make inf - inf.
    big = torch.full((3, 4, 8), 1e20)
    big[:, 1] *= -1
    zeros_and_normal = torch.stack([torch.zeros(4, 5), torch.randn(4, 5), -torch.ones(4, 5)])
    out = ghost_norm_squared(big, zeros_and_normal)
    assert torch.all(out == math.inf)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    eg = torch.randn(2, 3, 4)
    eg[0, 1, 2] = math.nan
    e_out = embedding_ghost_norm_squared(ids, eg)
    assert math.isnan(e_out[0]) and math.isfinite(e_out[1])


# ------------------------------------------------------------------------------------ Embedding


def draw_ids(batch, length, vocab, seed):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def embedding_gradient_norm(ids, g):
    """|G|_F^2 of the per-sample Embedding weight gradient G[v] = sum_{t: id_t = v} g_t, formed outright."""
    out = []
    for sample_ids, sample_g in zip(ids, g.double()):
        _, group = torch.unique(sample_ids, return_inverse=True)
        rows = torch.zeros(len(sample_ids), g.shape[-1], dtype=torch.float64).index_add_(0, group, sample_g)
        out.append(rows.square().sum())
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
@pytest.mark.parametrize("shape, vocab", [((3, 1, 5), 10), ((4, 50, 33), 7), ((2, 64, 1), 3), ((3, 40, 100), 1000),
                                          ((2, 2000, 70), 50), ((2, 17, 300), 1)])
def test_embedding_equals_the_references(shape, vocab, dtype):
    batch, length, p = shape
    ids, g = draw_ids(batch, length, vocab, seed=19), draw(batch, length, p, dtype, seed=20)
    got = embedding_ghost_norm_squared(ids, g)
    scale = (g.double().norm(dim=-1).sum(1)) ** 2
    for want in (embedding_ghost_norm_squared_reference(ids, g), embedding_gradient_norm(ids, g)):
        assert torch.all((got - want).abs() <= 1e-12 * scale)


def test_embedding_ids_of_any_integer_dtype_and_range():
    g = draw(3, 30, 8, seed=21)
    ids = draw_ids(3, 30, 5, seed=22)
    want = embedding_ghost_norm_squared(ids, g)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(embedding_ghost_norm_squared(ids.to(dtype), g), want)
    # Only equality counts: ids far outside any vocabulary, negative ones included.
    assert torch.equal(embedding_ghost_norm_squared(ids * (2**40) - 7, g), want)
    # Non-contiguous ids and output gradients.
    assert torch.equal(embedding_ghost_norm_squared(ids.t().contiguous().t(), torch.cat([g, g], 2)[:, :, :8]), want)


def test_embedding_threads_do_not_change_the_bits(threads):
    g, ids = draw(6, 300, 40, seed=23), draw_ids(6, 300, 20, seed=24)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(embedding_ghost_norm_squared(ids, g))
    assert all(torch.equal(r, results[0]) for r in results)


# --------------------------------------------------------------------------------- ops and errors


def test_gradients_are_not_needed_for_norms():
    a = draw(2, 3, 4, seed=28).requires_grad_()
    g = draw(2, 3, 5, seed=29)
    got = ghost_norm_squared(a, g)
    assert not got.requires_grad
    assert torch.equal(got, ghost_norm_squared(a.detach(), g))


def test_bad_input_names_the_argument():
    a, g = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    with pytest.raises(TypeError, match="activations must be a torch tensor"):
        ghost_norm_squared(a.tolist(), g)
    with pytest.raises(TypeError, match="activations must have dtype"):
        ghost_norm_squared(a.long(), g)
    with pytest.raises(TypeError, match="output_grads must have dtype"):
        ghost_norm_squared(a, g.to(torch.complex64))
    with pytest.raises(ValueError, match=r"output_grads must be \(B, T, p\)"):
        ghost_norm_squared(a, torch.randn(5))
    with pytest.raises(ValueError, match="activations has shape .* and output_grads"):
        ghost_norm_squared(torch.randn(3, 3, 4), g)
    with pytest.raises(ValueError, match="activations has shape .* and output_grads"):
        ghost_norm_squared(torch.randn(2, 4, 4), g)
    with pytest.raises(ValueError, match="activations has shape .* and output_grads"):
        ghost_norm_squared(torch.randn(2), torch.randn(2, 5))
    with pytest.raises(TypeError, match="activations has layout"):
        ghost_norm_squared(a.to_sparse(), g)
    with pytest.raises(TypeError, match="activations is on device meta"):
        ghost_norm_squared(a.to("meta"), g)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match="ids must have dtype"):
        embedding_ghost_norm_squared(ids.float(), g)
    with pytest.raises(TypeError, match="ids must have dtype"):
        embedding_ghost_norm_squared(ids.bool(), g)
    with pytest.raises(TypeError, match="ids must be a torch tensor"):
        embedding_ghost_norm_squared([[0, 1, 2], [0, 1, 2]], g)
    with pytest.raises(ValueError, match="ids has shape"):
        embedding_ghost_norm_squared(torch.zeros(2, 4, dtype=torch.int64), g)
    with pytest.raises(TypeError, match="output_grads must have dtype"):
        embedding_ghost_norm_squared(ids, g.long())
    # The ops themselves refuse what their kernels cannot read.
    # dtypes, shapes (a 0-d first one too), no layer, list lengths, batches
    for activations, output_grads in [([a], [g.double()]), ([a[0]], [g[0]]), ([a[0, 0, 0]], [g]), ([], []),
                                      ([a, a], [g]), ([a, a[:1]], [g, g[:1]])]:
        with pytest.raises(ValueError, match="privleak::ghost_norm takes"):
            torch.ops.privleak.ghost_norm(activations, output_grads)
    with pytest.raises(ValueError, match="one dtype, activations, output_grads, length, d and p per layer"):
        _backend.core.ghost_norm(["float32"], [a.data_ptr()], [], 2, [3], [4], [5], 0)
    with pytest.raises(ValueError, match="privleak::embedding_ghost_norm takes"):
        torch.ops.privleak.embedding_ghost_norm(ids.int(), g)


# -------------------------------------------------------------------------------- Convolutions

# (input shape, outputs, kernel_size, stride, padding, dilation, groups): Conv2d and Conv1d; tile
# edges (pixels and positions past 8, 16 and 64), a channel count past a chunk, strides, dilations,
# asymmetric kernels and padding past the kernel's reach, groups, one pixel.
CONVS = [((2, 3, 8, 8), 4, 3, 1, 1, 1, 1), ((3, 4, 9, 7), 6, 3, 2, 1, 1, 2),
         ((2, 6, 10, 11), 4, (3, 2), (2, 1), (1, 0), (2, 3), 2), ((2, 5, 20), 3, 3, 1, 1, 1, 1),
         ((1, 130, 5, 5), 7, 3, 1, 2, 2, 1), ((2, 1, 1, 1), 1, 1, 1, 0, 1, 1), ((2, 8, 17, 17), 16, 3, 1, 1, 1, 1),
         ((1, 2, 4, 4), 3, 2, 1, 3, 1, 1), ((2, 4, 3, 70), 129, (1, 5), 1, (0, 2), 1, 1),
         ((1, 9, 33), 2, 4, 3, 0, 2, 1), ((2, 16, 6, 6), 32, 3, 1, 1, 1, 16)]


def draw_conv(case, dtype=torch.float32, seed=0):
    """Inputs and output gradients of the convolution ``case``, of varied scale per sample."""
    shape, outputs, kernel, stride, padding, dilation, groups = case
    conv = (torch.nn.Conv1d if len(shape) == 3 else torch.nn.Conv2d)(shape[1], outputs, kernel, stride, padding,
                                                                      dilation, groups)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    g = torch.randn(conv(x.float()).shape, generator=gen, dtype=torch.float64)
    scale = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen, dtype=torch.float64) * 3
    return (x * scale).to(dtype), g.to(dtype), dict(kernel_size=kernel, stride=stride, padding=padding,
                                                     dilation=dilation, groups=groups)


def conv_error_bound(x, g, args):
    """:func:`error_bound` for the patches a_t of each group: d is the group's channels, not its
    patch length (conv_ghost_norm_squared's docstring)."""
    scale = sum((a.norm(dim=-1) * g_t.norm(dim=-1)).sum(1) ** 2 for a, g_t in conv_patches_reference(x, g, **args))
    channels, outputs = x.shape[1] // args["groups"], g.shape[1] // args["groups"]
    unit = 2.0**-53 if x.dtype == torch.float64 else 2.0**-24
    return ((min(channels, CHUNK) + min(outputs, CHUNK) + 2) * unit + 2.0**-45) * scale


def assert_conv_within_bound(x, g, args):
    got = conv_ghost_norm_squared(x, g, **args)
    assert got.dtype == torch.float64 and got.shape == (x.shape[0],)
    want = conv_ghost_norm_squared_reference(x, g, **args)
    bound = conv_error_bound(x, g, args)
    assert torch.all((got - want).abs() <= bound), ((got - want).abs() / bound).max()
    assert torch.all(got >= 0)
    return got


@pytest.mark.parametrize("case", CONVS)
def test_conv_equals_the_patch_formula_and_the_per_sample_gradient(case):
    x, g, args = draw_conv(case, seed=41)
    got = assert_conv_within_bound(x, g, args)
    # The per-sample gradients from torch's convolution backward, one sample at a time.
    grads = conv_weight_grads_reference(x, g, **args)
    torch.testing.assert_close(got, grads.square().flatten(1).sum(1), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("dtype", HALF + (torch.float64,))
@pytest.mark.parametrize("case", [CONVS[1], CONVS[4], CONVS[8]])
def test_conv_half_and_double_inputs(dtype, case):
    assert_conv_within_bound(*draw_conv(case, dtype, seed=42))


def test_conv_bound_holds_where_the_exact_norm_is_zero():
    # Every pixel the same and the output gradients alternating in sign over an even number of
    # positions whose patches lie inside the input: the per-sample gradient is exactly 0.
    x = torch.randn(1, 20, 1, 1).expand(3, 20, 6, 6).contiguous()
    g = torch.randn(3, 5, 1, 1) * torch.tensor([1.0, -1.0]).repeat(8).reshape(1, 1, 4, 4)
    got = assert_conv_within_bound(x, g, dict(kernel_size=3, stride=1, padding=0, dilation=1, groups=1))
    assert torch.all(got < 1e-6 * (x.norm() * g.norm()) ** 2)


def test_conv_empty_batch_and_layouts():
    x, g, args = draw_conv(CONVS[2], seed=43)
    assert conv_ghost_norm_squared(x[:0], g[:0], **args).shape == (0,)
    # Non-contiguous views and two dtypes: the bits of contiguous copies in the wider dtype.
    want = conv_ghost_norm_squared(x, g, **args)
    x_view = x.transpose(2, 3).contiguous().transpose(2, 3)
    assert not x_view.is_contiguous()
    assert torch.equal(conv_ghost_norm_squared(x_view, g, **args), want)
    x16 = x.to(torch.bfloat16)
    assert torch.equal(conv_ghost_norm_squared(x16, g, **args), conv_ghost_norm_squared(x16.float(), g, **args))


@pytest.mark.parametrize("groups", [2, 3, 16])
def test_conv_groups_add_in_a_fixed_tree(groups):
    # A grouped convolution's norm is its groups' norms (each its own ungrouped convolution) added
    # pairwise, (0 + 1) + (2 + 3), ...: a fixed order, so that CPU and CUDA (whose sums over a dim
    # add in different orders) agree.
    x, g, args = draw_conv(((16, 2 * groups, 5, 5), 3 * groups, 3, 1, 1, 1, groups), seed=47)
    level = [conv_ghost_norm_squared(x_j, g_j, **{**args, "groups": 1})
             for x_j, g_j in zip(x.chunk(groups, 1), g.chunk(groups, 1))]
    while len(level) > 1:
        level = [sum(level[j:j + 2]) for j in range(0, len(level), 2)]
    assert torch.equal(conv_ghost_norm_squared(x, g, **args), level[0])


def test_conv_threads_do_not_change_the_bits(threads):
    x, g, args = draw_conv(((9, 12, 10, 10), 20, 3, 1, 1, 1, 1), seed=44)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(conv_ghost_norm_squared(x, g, **args))
    assert all(torch.equal(r, results[0]) for r in results)


def core_conv_ghost_norm(x, g, args, capability=None):
    """The core kernel on a 2-d convolution without groups."""
    out = torch.empty(x.shape[0], dtype=torch.float64)
    pair = [[v, v] if isinstance(v, int) else list(v)
            for v in (args["kernel_size"], args["stride"], args["padding"], args["dilation"])]
    geometry = [*x.shape, *g.shape[1:], *[v for values in pair for v in values]]
    _backend.core.conv_ghost_norm(str(x.dtype).removeprefix("torch."), x.data_ptr(), g.data_ptr(), geometry,
                                  out.data_ptr(), capability)
    return out


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [CONVS[0], CONVS[4], CONVS[6], CONVS[8], ((2, 140, 9, 9), 20, 3, 2, 1, 1, 1)])
def test_conv_simd_paths_give_the_portable_bits(case, dtype, path):
    if CPU_PATHS.index(path) > CPU_PATHS.index(CPU_BEST):
        pytest.skip(f"this CPU has no {path} (its best path is {CPU_BEST})")
    x, g, args = draw_conv(case, dtype, seed=45)
    assert x.ndim == 4 and args["groups"] == 1  # what the core kernel takes
    assert (core_conv_ghost_norm(x, g, args, path).numpy().tobytes()
            == core_conv_ghost_norm(x, g, args, "default").numpy().tobytes())


def test_conv_non_finite_inputs():
    x, g, args = draw_conv(CONVS[0], seed=46)
    x, g = x.repeat(2, 1, 1, 1), g.repeat(2, 1, 1, 1)  # 4 samples
    x[1, 2, 3, 4] = math.nan
    g[2, 1, 0, 0] = math.inf
    x[3] = 1e20  # finite, but its float32 Gram entries overflow
    got = conv_ghost_norm_squared(x, g, **args)
    assert math.isnan(got[1]) and got[2] == math.inf and got[3] == math.inf and math.isfinite(got[0])


def test_conv_bad_input_names_the_argument():
    x, g, args = draw_conv(CONVS[0], seed=47)
    with pytest.raises(TypeError, match="inputs must be a torch tensor"):
        conv_ghost_norm_squared(x.tolist(), g, **args)
    with pytest.raises(TypeError, match="output_grads must have dtype"):
        conv_ghost_norm_squared(x, g.long(), **args)
    with pytest.raises(ValueError, match="output_grads has spatial size"):
        conv_ghost_norm_squared(x, g[:, :, :3], **args)
    with pytest.raises(ValueError, match="kernel_size must be"):
        conv_ghost_norm_squared(x, g, **{**args, "kernel_size": (3, 3, 3)})
    with pytest.raises(ValueError, match="groups=3 must divide"):
        conv_ghost_norm_squared(x, g, **{**args, "groups": 3})
    big = torch.zeros(1, 1, 1, MAX_PIXELS + 1)
    with pytest.raises(ValueError, match="pixels a channel"):
        conv_ghost_norm_squared(big, torch.zeros(1, 1, 1, MAX_PIXELS + 1), 1)
    with pytest.raises(ValueError, match="privleak::conv_ghost_norm takes"):
        torch.ops.privleak.conv_ghost_norm(x, g.double(), [3, 3], [1, 1], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="conv_ghost_norm: the output gradient's size"):
        core_conv_ghost_norm(x, g[:, :, :3].contiguous(), args)


# ------------------------------------------------------------------------------------------ CUDA


CUDA_CASES = [(1, 1, 1, 1), (3, 33, 129, 3), (2, 65, 257, 255), (2, 130, 64, 300), (1, 1100, 9, 5)]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
@pytest.mark.parametrize("shape", CUDA_CASES)
def test_cuda_gives_the_cpu_bits(shape, dtype):
    batch, length, d, p = shape
    a, g = draw(batch, length, d, dtype, seed=31), draw(batch, length, p, dtype, seed=32)
    cpu = ghost_norm_squared(a, g)
    gpu = ghost_norm_squared(a.cuda(), g.cuda())
    assert gpu.device.type == "cuda" and cpu.numpy().tobytes() == gpu.cpu().numpy().tobytes()
    ids = draw_ids(batch, length, max(2, length // 3), seed=33)
    cpu = embedding_ghost_norm_squared(ids, g)
    gpu = embedding_ghost_norm_squared(ids.cuda(), g.cuda())
    assert cpu.numpy().tobytes() == gpu.cpu().numpy().tobytes()


@requires_cuda
def test_cuda_many_layers_in_one_call_give_the_cpu_bits():
    # A call's layers share launches in groups of one dtype, at most 32 layers and 16 MiB of scratch
    # (csrc/cuda/ghost_norm.cu): 36 float32 layers (a group of 32, one of 4), some of no positions,
    # six alternating between bfloat16 and float64 (a group each), then eight long ones whose scratch
    # (2.3 MB each) splits their group by bytes.
    small = [(130, 20, 7), (1, 5, 300), (9, 16, 4), (0, 3, 2), (64, 8, 8), (65, 2, 9)]
    shapes = [(*shape, torch.float32) for shape in small * 6] + [
        (*shape, dtype) for shape, dtype in zip(small, [torch.bfloat16, torch.float64] * 3)] + [
        (2048, 3, 2, torch.float32)] * 8
    layers = [(draw(4, n, d, dtype, seed=100 + 2 * k), draw(4, n, p, dtype, seed=101 + 2 * k))
              for k, (n, d, p, dtype) in enumerate(shapes)]
    cpu = torch.ops.privleak.ghost_norm([a for a, _ in layers], [g for _, g in layers])
    gpu = torch.ops.privleak.ghost_norm([a.cuda() for a, _ in layers], [g.cuda() for _, g in layers])
    assert gpu.device.type == "cuda" and cpu.numpy().tobytes() == gpu.cpu().numpy().tobytes()
    for row, (a, g) in zip(gpu.cpu(), layers):  # and each layer's are its call's alone
        assert row.numpy().tobytes() == ghost_norm_squared(a.cuda(), g.cuda()).cpu().numpy().tobytes()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
@pytest.mark.parametrize("case", CONVS + [((3, 7, 20, 20), 9, 3, 1, 1, 1, 1), ((2, 3, 130), 5, 5, 1, 2, 1, 1)])
def test_cuda_conv_gives_the_cpu_bits(case, dtype):
    x, g, args = draw_conv(case, dtype, seed=48)
    cpu = conv_ghost_norm_squared(x, g, **args)
    gpu = conv_ghost_norm_squared(x.cuda(), g.cuda(), **args)
    assert gpu.device.type == "cuda" and cpu.numpy().tobytes() == gpu.cpu().numpy().tobytes()


@requires_cuda
def test_cuda_non_finite_and_empty_inputs_match_the_cpu():
    a, g = draw(4, 20, 30, seed=34), draw(4, 20, 10, seed=35)
    a[1, 3, 5], g[2, 7, 1] = math.nan, math.inf
    a[3] = 1e20
    cpu, gpu = ghost_norm_squared(a, g), ghost_norm_squared(a.cuda(), g.cuda()).cpu()
    assert torch.equal(cpu.isnan(), gpu.isnan()) and torch.equal(cpu[~cpu.isnan()], gpu[~gpu.isnan()])
    assert ghost_norm_squared(torch.empty(0, 3, 2).cuda(), torch.empty(0, 3, 2).cuda()).shape == (0,)
    assert torch.equal(ghost_norm_squared(torch.empty(2, 0, 2).cuda(), torch.empty(2, 0, 3).cuda()).cpu(),
                       torch.zeros(2, dtype=torch.float64))
    assert torch.equal(embedding_ghost_norm_squared(torch.empty(2, 0, dtype=torch.int64).cuda(),
                                                    torch.empty(2, 0, 3).cuda()).cpu(),
                       torch.zeros(2, dtype=torch.float64))


def test_info_reports_the_kernels_run():
    # The CPU path the kernel takes is the one privleak reports.
    a, g = draw(2, 20, 30, seed=39), draw(2, 20, 10, seed=40)
    assert torch.equal(core_ghost_norm(a, g), core_ghost_norm(a, g, privleak.info()["cpu_capability"]))
