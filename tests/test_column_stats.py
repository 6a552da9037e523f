"""privleak.column_stats against the numpy reference (privleak.reference.column_stats)."""
import numpy as np
import privleak
import pytest
import torch
from conftest import requires_cuda
from privleak import reference

SHAPES = [(1, 1), (1, 700), (700, 1), (3, 5), (257, 513), (1000, 1030), (5000, 3), (4096, 4096)]


def assert_matches_reference(stats, matrix, row_weights=None):
    stats = type(stats)(*(s.cpu() if isinstance(s, torch.Tensor) else s for s in stats))
    want_max, want_argmax, want_min, want_sum = reference.column_stats(matrix, row_weights)
    np.testing.assert_array_equal(np.asarray(stats.max), want_max)
    np.testing.assert_array_equal(np.asarray(stats.argmax), want_argmax)
    np.testing.assert_array_equal(np.asarray(stats.min), want_min)
    # Both sum in float64; only the order of additions differs (numpy sums pairwise).
    np.testing.assert_allclose(np.asarray(stats.sum), want_sum, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_matrices_match_numpy(shape, dtype):
    rng = np.random.default_rng(hash(shape) % 2**32)
    matrix = rng.standard_normal(shape).astype(dtype)
    stats = privleak.column_stats(matrix)
    assert stats.max.dtype == dtype and stats.min.dtype == dtype
    assert stats.argmax.dtype == np.int64 and stats.sum.dtype == np.float64
    assert_matches_reference(stats, matrix)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 9), (300, 40), (2000, 600)])
def test_row_weights_give_stats_of_the_weighted_matrix(shape, dtype):
    rng = np.random.default_rng(1)
    matrix = rng.random(shape).astype(dtype)
    weights = rng.dirichlet(np.ones(shape[0]))  # float64: converted to the matrix's dtype
    assert_matches_reference(privleak.column_stats(matrix, weights), matrix, weights)


def test_all_equal_columns_give_the_lowest_argmax():
    matrix = np.full((1000, 17), 0.25)
    stats = privleak.column_stats(matrix)
    np.testing.assert_array_equal(stats.argmax, np.zeros(17))
    np.testing.assert_array_equal(stats.max, stats.min)


def test_ties_across_row_chunks_keep_the_first_row():
    # 5000 rows span several chunks: the same maximum in several chunks must keep the earliest.
    matrix = np.zeros((5000, 4))
    matrix[[100, 2600, 4999], :] = 1.0
    matrix[[4000, 4500], 3] = 2.0
    np.testing.assert_array_equal(privleak.column_stats(matrix).argmax, [100, 100, 100, 4000])


def test_large_float32_values_are_summed_without_overflow():
    matrix = np.full((4096, 3), 3.0e38, dtype=np.float32)
    matrix[7, 1] = np.finfo(np.float32).max
    stats = privleak.column_stats(matrix)
    with np.errstate(over="ignore"):
        assert np.isinf(matrix.sum(axis=0)).all()  # what a float32 accumulator would return
    np.testing.assert_allclose(stats.sum, matrix.astype(np.float64).sum(axis=0), rtol=1e-12)
    assert stats.argmax[1] == 7 and stats.max[1] == np.finfo(np.float32).max


def test_nan_and_inf_follow_numpy():
    matrix = np.array([[1.0, np.inf, 0.0], [np.nan, 2.0, -np.inf], [np.nan, np.nan, 1.0]])
    assert_matches_reference(privleak.column_stats(matrix), matrix)


def test_row_stride_views_are_read_in_place():
    rng = np.random.default_rng(2)
    big = rng.random((3000, 900))
    for view in (big[::3, 17:811], big[::-2, 5:6], big[1200:1201, :]):
        assert_matches_reference(privleak.column_stats(view), np.ascontiguousarray(view))


def test_zero_columns_give_empty_results():
    stats = privleak.column_stats(np.empty((4, 0)))
    assert all(len(s) == 0 for s in stats)


@pytest.mark.parametrize("shape", [(300_000, 5), (600, 9000)])  # one column block; several (>= 2^20: parallel)
def test_result_bits_do_not_depend_on_thread_count(shape, threads):
    matrix = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(privleak.column_stats(matrix))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a.tobytes() == b.tobytes()


def test_torch_cpu_tensors_give_torch_results():
    matrix = torch.rand(513, 77, dtype=torch.float64)
    weights = torch.rand(513, dtype=torch.float32)
    stats = privleak.column_stats(matrix, weights)
    assert isinstance(stats.max, torch.Tensor) and stats.argmax.dtype == torch.int64
    assert_matches_reference(stats, matrix.numpy(), weights.numpy())


@pytest.mark.parametrize(
    "matrix, error, words",
    [
        (np.ones((3, 3), dtype=np.int64), TypeError, "matrix must have dtype float32 or float64, got int64"),
        (np.ones((3, 3), dtype=np.float16), TypeError, "float16"),
        (np.ones(3), ValueError, "matrix must be 2-D"),
        (np.ones((2, 3, 4)), ValueError, "matrix must be 2-D"),
        (np.ones((4, 3), order="F"), ValueError, "matrix must have contiguous rows"),
        (np.ones((0, 3)), ValueError, "at least one row"),
        (np.ones((3, 3), dtype=">f8"), TypeError, "byte order"),
        ("not an array", TypeError, "matrix must be a numpy array or a torch tensor"),
        (torch.ones(3, 3, device="meta"), ValueError, "device meta"),
    ],
)
def test_bad_matrices_are_rejected_with_the_argument_named(matrix, error, words):
    with pytest.raises(error, match=words):
        privleak.column_stats(matrix)


def test_bad_row_weights_are_rejected():
    with pytest.raises(ValueError, match=r"row_weights must have shape \(3,\)"):
        privleak.column_stats(np.ones((3, 2)), np.ones(4))
    with pytest.raises(TypeError, match="row_weights is a torch tensor"):
        privleak.column_stats(np.ones((3, 2)), torch.ones(3))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (700, 1), (257, 513), (5000, 3), (4096, 4096)])
def test_cuda_matches_cpu_bit_for_bit(shape, dtype):
    matrix = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(4))
    weights = torch.rand(shape[0], dtype=dtype)
    for w in (None, weights):
        cpu = privleak.column_stats(matrix, w)
        gpu = privleak.column_stats(matrix.cuda(), None if w is None else w.cuda())
        assert gpu.max.is_cuda
        for a, b in zip(cpu, gpu):
            assert torch.equal(a, b.cpu())


@requires_cuda
def test_cuda_reads_row_stride_views():
    big = torch.rand(3000, 900, device="cuda", dtype=torch.float64)
    view = big[::3, 17:811]
    assert_matches_reference(privleak.column_stats(view), view.contiguous().cpu().numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "stats", [("max",), ("argmax",), ("min",), ("sum",), ("max", "min"), ("min", "sum"), ("argmax", "sum")]
)
def test_subsets_of_statistics_match_the_full_pass(stats, dtype, threads):
    matrix = np.random.default_rng(5).random((4000, 300)).astype(dtype)  # >= 2^20 elements: parallel
    weights = np.random.default_rng(6).random(4000)
    for n in (1, 2):  # one column block: the column-block schedule, then the row-chunk one
        threads(n)
        for w in (None, weights):
            full = privleak.column_stats(matrix, w)
            part = privleak.column_stats(matrix, w, stats=stats)
            for name in ("max", "argmax", "min", "sum"):
                got = getattr(part, name)
                if name in stats or (name == "max" and "argmax" in stats):
                    assert got.tobytes() == getattr(full, name).tobytes()
                else:
                    assert got is None


@pytest.mark.parametrize("stats", [(), ("mean",), ["max", "median"]])
def test_unknown_statistics_are_rejected(stats):
    with pytest.raises(ValueError, match="stats must be a non-empty subset"):
        privleak.column_stats(np.ones((2, 2)), stats=stats)


@pytest.mark.parametrize("weights, error, words", [
    ([None, 1.0, 1.0], TypeError, "row_weights must hold real numbers"),
    (["1", "1", "1"], TypeError, "row_weights must hold real numbers"),
    (np.array([1.0, np.nan, 1.0]), ValueError, "row_weights must be finite"),
    (np.array([1.0, np.inf, 1.0]), ValueError, "row_weights must be finite"),
    (torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64), ValueError, "row_weights must be finite"),
    (np.array([1 + 1j, 1, 1]), TypeError, "row_weights must hold real numbers"),
])
def test_non_numeric_or_non_finite_row_weights_are_rejected(weights, error, words):
    matrix = torch.ones(3, 2, dtype=torch.float64) if isinstance(weights, torch.Tensor) else np.ones((3, 2))
    with pytest.raises(error, match=words):
        privleak.column_stats(matrix, weights)


def test_unaligned_matrix_is_rejected_not_read():
    matrix = np.zeros(8 * 12 + 8, dtype=np.uint8)[1:8 * 12 + 1].view(np.float64).reshape(3, 4)
    with pytest.raises(ValueError, match="matrix is not aligned"):
        privleak.column_stats(matrix)
    assert privleak.column_stats(np.array(matrix)).max.shape == (4,)


def test_outputs_larger_than_memory_are_refused_before_allocating(monkeypatch):
    from privleak import _arrays

    monkeypatch.setattr(_arrays, "_cpu_available_bytes", lambda: 10_000)
    monkeypatch.setattr(_arrays, "_UNCHECKED_BYTES", 0)
    privleak.column_stats(np.ones((2, 10)), stats="max")
    with pytest.raises(MemoryError, match=r"column_stats needs \d+ bytes"):
        privleak.column_stats(np.ones((2, 1000)))


@pytest.mark.parametrize("stats", [None, 3, ["max", None]])
def test_bad_stats_are_named(stats):
    with pytest.raises((TypeError, ValueError), match="stats must be a non-empty subset"):
        privleak.column_stats(np.ones((2, 2)), stats=stats)
