"""privleak.nearest against the numpy brute-force reference (privleak.reference.nearest).

The reference forms the full float64 matrix of <x, y>, ||x - y||^2 (by direct differences) or
||x - y||_1. The kernels choose winners by scores in the data's dtype (for squared L2 the
expanded form), so a winner may differ from the reference's only between inputs whose values
are within the scores' rounding error; the returned value must be the chosen input's exact value.
"""
import numpy as np
import privleak
import pytest
import torch
from conftest import requires_cuda
from privleak import _backend, reference
from privleak.reductions import NEAREST_METRICS

# (n_queries, n_inputs, p): single rows and columns, sizes off the kernels' tiles (16 or 8
# queries x 6 inputs with AVX2, 32 or 16 x 12 with AVX-512) and blocks (120 inputs, 256 or 128
# coordinates), several input blocks.
SHAPES = [(1, 1, 1), (1, 7, 1), (5, 1, 3), (17, 121, 2), (37, 500, 64), (9, 250, 257), (40, 130, 300), (600, 61, 20)]


def direct_values(queries, chosen, metric):
    """<x, y>, ||x - y||^2 or ||x - y||_1 of each query and its chosen input, in float64."""
    y, x = queries.astype(np.float64), chosen.astype(np.float64)
    if metric == "inner_product":
        return (y * x).sum(axis=1)
    return ((y - x) ** 2).sum(axis=1) if metric == "squared_l2" else np.abs(y - x).sum(axis=1)


def score_error_bound(queries, inputs, metric):
    """A bound, generous by a factor of a few, on the rounding error of the kernels' scores."""
    eps = np.finfo(queries.dtype).eps
    p = queries.shape[1]
    y, x = queries.astype(np.float64), inputs.astype(np.float64)
    if metric == "inner_product":
        scale = np.linalg.norm(y, axis=1).max() * np.linalg.norm(x, axis=1).max()
    elif metric == "squared_l2":
        c = x.mean(axis=0)
        scale = (np.linalg.norm(y - c, axis=1).max() + np.linalg.norm(x - c, axis=1).max()) ** 2
    else:
        scale = np.abs(y).sum(axis=1).max() + np.abs(x).sum(axis=1).max()
    return 4 * p * eps * scale


def assert_matches_reference(result, queries, inputs, metric):
    value, index = np.asarray(result.value), np.asarray(result.index)
    assert value.dtype == np.float64 and index.dtype == np.int64
    assert ((0 <= index) & (index < len(inputs))).all()
    exact = direct_values(queries, inputs[index], metric)
    np.testing.assert_allclose(value, exact, rtol=1e-12, atol=1e-12)
    want_value, want_index = reference.nearest(queries, inputs, metric)
    tolerance = score_error_bound(queries, inputs, metric)
    differs = index != want_index
    # A different winner is allowed only as a near-tie with the reference's.
    np.testing.assert_allclose(value[differs], want_value[differs], rtol=0, atol=tolerance)
    assert differs.mean() <= 0.01


@pytest.mark.parametrize("metric", NEAREST_METRICS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_points_match_numpy(shape, dtype, metric):
    n_queries, n_inputs, p = shape
    rng = np.random.default_rng(n_queries * 1000 + n_inputs + p)
    queries = rng.standard_normal((n_queries, p)).astype(dtype)
    inputs = rng.standard_normal((n_inputs, p)).astype(dtype)
    assert_matches_reference(privleak.nearest(queries, inputs, metric), queries, inputs, metric)


@pytest.mark.parametrize("metric", NEAREST_METRICS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_duplicated_inputs_go_to_the_lowest_index(dtype, metric):
    # Every input appears twice, at j and at 2n - 1 - j: the copies have bit-identical scores,
    # across input blocks and ranges, and the earlier copy must win.
    rng = np.random.default_rng(1)
    inputs = rng.standard_normal((1000, 24)).astype(dtype)
    queries = rng.standard_normal((40, 24)).astype(dtype)
    once = privleak.nearest(queries, inputs, metric)
    twice = privleak.nearest(queries, np.concatenate([inputs, inputs[::-1]]), metric)
    np.testing.assert_array_equal(twice.index, once.index)
    np.testing.assert_array_equal(twice.value, once.value)


@pytest.mark.parametrize("metric", NEAREST_METRICS)
def test_exact_ties_between_distinct_inputs_go_to_the_lowest_index(metric):
    # Dyadic coordinates and a centre of 0: every score is exact, so these ties are exact.
    inputs = np.array([[0.0, -1.0], [1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    queries = np.array([[0.0, 0.0], [0.5, 0.5], [-0.25, -0.25], [3.0, 3.0]], dtype=np.float32)
    # Under every metric: all four inputs tie for the first query, (1, 0) and (0, 1) for the
    # second and fourth, (0, -1) and (-1, 0) for the third.
    np.testing.assert_array_equal(privleak.nearest(queries, inputs, metric).index, [0, 1, 0, 1])


def test_points_far_from_the_origin_keep_their_nearest_neighbours():
    # float32 points near (1000, ..., 1000): uncentred, ||x||^2 - 2 <x, y> would carry errors of
    # about p eps ||x||^2 = 16 * 6e-8 * 1.6e7 = 15, as large as the nearest distances; centring at
    # the inputs' mean brings them down to about 1e-5.
    rng = np.random.default_rng(2)
    inputs = (1000.0 + rng.standard_normal((300, 16))).astype(np.float32)
    queries = (1000.0 + rng.standard_normal((50, 16))).astype(np.float32)
    result = privleak.nearest(queries, inputs, "squared_l2")
    np.testing.assert_array_equal(result.index, reference.nearest(queries, inputs, "squared_l2")[1])


def test_a_query_equal_to_an_input_finds_it_at_distance_zero():
    rng = np.random.default_rng(3)
    inputs = rng.standard_normal((500, 33)).astype(np.float32)
    result = privleak.nearest(inputs[::7], inputs, "squared_l2")
    np.testing.assert_array_equal(result.index, np.arange(0, 500, 7))
    np.testing.assert_array_equal(result.value, 0.0)


@pytest.mark.parametrize("metric", NEAREST_METRICS)
@pytest.mark.parametrize("shape", [(700, 2000, 40), (3, 5000, 300)])  # many query blocks; input ranges
def test_result_bits_do_not_depend_on_thread_count(shape, metric, threads):
    n_queries, n_inputs, p = shape
    rng = np.random.default_rng(4)
    queries = rng.standard_normal((n_queries, p)).astype(np.float32)
    inputs = rng.standard_normal((n_inputs, p)).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(privleak.nearest(queries, inputs, metric))
    for other in results[1:]:
        assert other.index.tobytes() == results[0].index.tobytes()
        assert other.value.tobytes() == results[0].value.tobytes()


def call_core(queries, inputs, metric, capability=None):
    """The CPU kernel on `capability`'s path (None: the one chosen at load time), rows read with
    the arrays' row strides."""
    value, index = np.empty(len(queries)), np.empty(len(queries), dtype=np.int64)
    center = inputs.mean(axis=0).astype(inputs.dtype)
    itemsize = queries.dtype.itemsize
    _backend.core.nearest(metric, queries.dtype.name, queries.ctypes.data, len(queries), queries.strides[0] // itemsize,
                          inputs.ctypes.data, len(inputs), inputs.strides[0] // itemsize, queries.shape[1],
                          center.ctypes.data, value.ctypes.data, index.ctypes.data, capability)
    return value, index


CPU_PATHS = ["default", "avx2", "avx512"]
CPU_BEST = _backend.core.build_info()["cpu_best_capability"]


def skip_unless_cpu_runs(path):
    if CPU_PATHS.index(path) > CPU_PATHS.index(CPU_BEST):
        pytest.skip(f"this CPU has no {path} (its best path is {CPU_BEST})")


# (n_queries, n_inputs, p) off every tile edge: query tiles of 16 or 32 float32 (8 or 16 float64)
# and input tiles of 6 or 12; input blocks of 120; coordinate blocks of 128 or 256 float32 (128
# float64) coordinates; one query block (inputs packed by each thread) and several (packed once).
PATH_SHAPES = [(1, 1, 1), (33, 131, 1), (47, 250, 3), (37, 251, 64), (17, 13, 129), (600, 130, 300),
               (65, 121, 1000), (1100, 37, 64)]


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("data", ["normal", "small integers"])
@pytest.mark.parametrize("metric", NEAREST_METRICS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", PATH_SHAPES)
def test_simd_paths_give_the_portable_kernels_bits(shape, dtype, metric, data, path):
    # The portable kernel is common/nearest.h written out; the AVX2 and AVX-512 kernels (other
    # tile shapes, the same operations per pair) must match it exactly: values and indices. Small
    # integers make many exact ties, which must go to the same (lowest) index on every path. The
    # rows are read through strides wider than p.
    skip_unless_cpu_runs(path)
    n_queries, n_inputs, p = shape
    rng = np.random.default_rng(n_queries + n_inputs + p)
    def draw(n):
        return rng.standard_normal((n, p + 5)) if data == "normal" else rng.integers(-2, 3, (n, p + 5))

    queries, inputs = draw(n_queries).astype(dtype)[:, 2:p + 2], draw(n_inputs).astype(dtype)[:, 3:p + 3]
    portable = call_core(queries, inputs, metric, "default")
    simd = call_core(queries, inputs, metric, path)
    assert simd[0].tobytes() == portable[0].tobytes() and simd[1].tobytes() == portable[1].tobytes()


@pytest.mark.parametrize("metric", NEAREST_METRICS)
def test_every_path_sends_duplicated_inputs_to_the_lowest_index(metric):
    # Copies of each input at j and 2n - 1 - j, across tiles, blocks and ranges of every path.
    rng = np.random.default_rng(11)
    inputs = rng.standard_normal((500, 40)).astype(np.float32)
    queries = rng.standard_normal((70, 40)).astype(np.float32)
    twice = np.concatenate([inputs, inputs[::-1]])
    want = call_core(queries, inputs, metric, "default")
    for path in CPU_PATHS[:CPU_PATHS.index(CPU_BEST) + 1]:
        got = call_core(queries, twice, metric, path)
        assert got[1].tobytes() == want[1].tobytes() and got[0].tobytes() == want[0].tobytes(), path


def test_the_load_time_path_is_the_reported_one():
    rng = np.random.default_rng(12)
    queries, inputs = rng.standard_normal((40, 70)), rng.standard_normal((300, 70))
    chosen, named = call_core(queries, inputs, "inner_product"), call_core(
        queries, inputs, "inner_product", privleak.info()["cpu_capability"])
    assert chosen[1].tobytes() == named[1].tobytes() and chosen[0].tobytes() == named[0].tobytes()


def test_a_path_the_cpu_lacks_or_an_unknown_one_is_refused():
    x = np.ones((3, 4))
    with pytest.raises(ValueError, match="capability must be 'default', 'avx2' or 'avx512'"):
        call_core(x, x, "l1", "sse2")
    if CPU_BEST != "avx512":
        with pytest.raises(ValueError, match="this CPU cannot run the avx512 path"):
            call_core(x, x, "l1", "avx512")


AVX2_TIER = ["avx2", "fma", "f16c"]
AVX512_TIER = AVX2_TIER + ["avx512f", "avx512bw", "avx512dq", "avx512vl"]


@pytest.mark.parametrize(
    "features, requested, chosen",
    [
        ([], None, "default"),
        ([], "avx512", "default"),  # a request above what the CPU has gets the best it has
        (["avx2", "fma"], None, "default"),  # AVX2 without F16C
        (AVX2_TIER, None, "avx2"),
        (AVX2_TIER, "avx512", "avx2"),
        (AVX2_TIER, "default", "default"),
        (AVX2_TIER + ["avx512f"], None, "avx2"),  # AVX-512 F alone (Xeon Phi) is not the avx512 tier
        (AVX2_TIER + ["avx512f", "avx512bw", "avx512dq"], "avx512", "avx2"),  # no VL
        (["avx512f", "avx512bw", "avx512dq", "avx512vl"], None, "default"),  # no AVX2 tier under it
        (AVX512_TIER, None, "avx512"),
        (AVX512_TIER, "native", "avx512"),
        (AVX512_TIER, "avx512", "avx512"),
        (AVX512_TIER, "avx2", "avx2"),
        (AVX512_TIER, "default", "default"),
        (AVX512_TIER, "AVX2", "avx512"),  # names are exact; unrecognised ones request nothing
    ],
)
def test_the_load_time_choice_never_exceeds_the_cpu(features, requested, chosen):
    assert _backend.core.choose_cpu_capability(features, requested) == chosen


def test_the_choice_for_this_cpu_is_the_reported_one():
    assert CPU_PATHS.index(privleak.info()["cpu_capability"]) <= CPU_PATHS.index(CPU_BEST)
    with pytest.raises(ValueError, match="unknown CPU feature 'sse9'"):
        _backend.core.choose_cpu_capability(["sse9"])


def test_row_stride_views_are_read_in_place():
    rng = np.random.default_rng(6)
    big = rng.standard_normal((400, 90))
    for queries, inputs in ((big[::3, 5:40], big[1::2, 50:85]), (big[::-2, :7], big[7:8, 60:67])):
        for metric in NEAREST_METRICS:
            assert_matches_reference(privleak.nearest(queries, inputs, metric), np.ascontiguousarray(queries),
                                     np.ascontiguousarray(inputs), metric)


def test_no_queries_give_empty_results():
    result = privleak.nearest(np.empty((0, 3)), np.ones((4, 3)), "l1")
    assert result.value.shape == (0,) and result.index.shape == (0,)


def test_torch_cpu_tensors_give_torch_results():
    queries = torch.randn(30, 12, generator=torch.Generator().manual_seed(7))
    inputs = torch.randn(90, 12, generator=torch.Generator().manual_seed(8))
    result = privleak.nearest(queries, inputs, "squared_l2")
    assert isinstance(result.value, torch.Tensor) and result.index.dtype == torch.int64
    assert_matches_reference(result, queries.numpy(), inputs.numpy(), "squared_l2")


GOOD = np.ones((3, 4))


@pytest.mark.parametrize(
    "queries, inputs, metric, kwargs, error, words",
    [
        (GOOD, GOOD, "cosine", {}, ValueError, "metric must be one of"),
        (np.ones((3, 4), dtype=np.int64), GOOD, "l1", {}, TypeError, "queries must have dtype float32 or float64"),
        (GOOD, GOOD.astype(np.float32), "l1", {}, TypeError, "inputs has dtype float32 but queries has dtype float64"),
        (GOOD, np.ones((3, 5)), "l1", {}, ValueError, "same number of columns"),
        (np.ones((3, 0)), np.ones((3, 0)), "l1", {}, ValueError, "at least one column"),
        (GOOD, np.ones((0, 4)), "l1", {}, ValueError, "inputs must have at least one row"),
        (np.ones(4), GOOD, "l1", {}, ValueError, "queries must be 2-D"),
        (GOOD, np.ones((4, 3)).T, "l1", {}, ValueError, "inputs must have contiguous rows"),
        (GOOD, np.array([[1.0, np.nan, 0, 0]]), "l1", {}, ValueError, "inputs must be finite"),
        (np.array([[np.inf, 0, 0, 0]]), GOOD, "squared_l2", {}, ValueError, "queries must be finite"),
        (np.full((1, 4), 1e30, dtype=np.float32), np.ones((2, 4), dtype=np.float32), "inner_product", {},
         ValueError, "would overflow float32"),
        (GOOD, GOOD, "l1", {"tensor_cores": True}, ValueError, "tensor_cores=True needs CUDA float32"),
        (GOOD, GOOD, "l1", {"tensor_cores": 1}, TypeError, "tensor_cores must be True or False"),
        ("points", GOOD, "l1", {}, TypeError, "queries must be a numpy array or a torch tensor"),
        (GOOD, torch.ones(3, 4, device="meta"), "l1", {}, ValueError, "inputs is on device meta"),
    ],
)
def test_bad_arguments_are_rejected_with_the_argument_named(queries, inputs, metric, kwargs, error, words):
    with pytest.raises(error, match=words):
        privleak.nearest(queries, inputs, metric, **kwargs)


@requires_cuda
@pytest.mark.parametrize("metric", NEAREST_METRICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 500, 64), (9, 250, 257), (600, 61, 20), (3, 5000, 40)])
def test_cuda_matches_cpu_bit_for_bit(shape, dtype, metric):
    n_queries, n_inputs, p = shape
    generator = torch.Generator().manual_seed(9)
    queries = torch.randn(n_queries, p, dtype=dtype, generator=generator)
    inputs = torch.randn(n_inputs, p, dtype=dtype, generator=generator)
    cpu = privleak.nearest(queries, inputs, metric)
    gpu = privleak.nearest(queries.cuda(), inputs.cuda(), metric)
    assert gpu.value.is_cuda
    assert torch.equal(cpu.index, gpu.index.cpu()) and torch.equal(cpu.value, gpu.value.cpu())


@requires_cuda
@pytest.mark.parametrize("metric", ["inner_product", "squared_l2"])
def test_cuda_tensor_cores_find_the_winners_up_to_tf32_rounding(metric):
    generator = torch.Generator().manual_seed(10)
    queries = torch.randn(300, 96, generator=generator)
    inputs = torch.randn(2000, 96, generator=generator)
    result = privleak.nearest(queries.cuda(), inputs.cuda(), metric, tensor_cores=True)
    value, index = result.value.cpu().numpy(), result.index.cpu().numpy()
    np.testing.assert_allclose(value, direct_values(queries.numpy(), inputs.numpy()[index], metric), rtol=1e-12)
    want_value, want_index = reference.nearest(queries.numpy(), inputs.numpy(), metric)
    # TF32 keeps 11 significant bits: scores are off by about 2^-11 ||x|| ||y|| (x, y centred).
    tolerance = 4 * 2.0**-11 * 96 * 4
    np.testing.assert_allclose(value, want_value, rtol=0, atol=tolerance)
    assert (index == want_index).mean() > 0.9


@requires_cuda
def test_cuda_tensor_cores_need_float32_and_a_product():
    x = torch.ones(4, 3, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="tensor_cores=True needs CUDA float32"):
        privleak.nearest(x, x, "inner_product", tensor_cores=True)
    with pytest.raises(ValueError, match="tensor_cores=True needs CUDA float32"):
        privleak.nearest(x.float(), x.float(), "l1", tensor_cores=True)


def test_stride_zero_inputs_whose_norms_exceed_memory_are_refused_before_any_pass(monkeypatch):
    # (2^31 + 3) x 1 rows of one stored value: the squared-L2 norms alone would take 16 GiB.
    from privleak import _arrays

    monkeypatch.setattr(_arrays, "_cpu_available_bytes", lambda: 1 << 30)
    inputs = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(2**31 + 3, 1), strides=(0, 8))
    with pytest.raises(MemoryError, match=r"nearest needs 1[0-9]{10} bytes"):
        privleak.nearest(np.zeros((1, 1)), inputs, "squared_l2")


def test_absurd_stride_zero_inputs_are_refused_on_any_machine():
    inputs = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(2**42, 1), strides=(0, 8))
    with pytest.raises(ValueError, match="nearest needs"):
        privleak.nearest(np.zeros((1, 1)), inputs, "squared_l2")


def test_unaligned_queries_are_rejected():
    queries = np.zeros(8 * 6 + 8, dtype=np.uint8)[1:8 * 6 + 1].view(np.float64).reshape(2, 3)
    with pytest.raises(ValueError, match="queries is not aligned"):
        privleak.nearest(queries, np.zeros((2, 3)), "l1")
