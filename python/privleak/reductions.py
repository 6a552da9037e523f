"""Reductions over the rows of a matrix, the building blocks of the leakage metrics.

A channel is a row-stochastic matrix C (rows: secrets, columns: observations). Its Bayes capacity
is the sum of the column maxima, its LDP epsilon needs the column maxima and minima, and with a
prior pi the posterior vulnerability and the output distribution are the column maxima and sums
of pi_x * C[x, y] (Biswas et al., Sec. II; Zhang et al., Def. 4.2 and 5.1). :func:`column_stats`
gives all of these in one pass over the matrix, on CPU or CUDA, without copying it.

A continuous mechanism over a finite input set has a channel matrix too large to form: its
columns are outputs y in R^p. :func:`nearest` gives the column maxima of the matrix
log f(x)(y) for the Gaussian, VMF and Laplace mechanisms directly from the inputs and outputs.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple

import numpy as np

from privleak import _arrays, _backend
from privleak.validation import ArgumentTypeError, boolean, choice

# The bits of the kernels' statistics mask (csrc/common/column_stats.h, ColumnStat).
_STAT_BITS = {"max": 1, "argmax": 2, "min": 4, "sum": 8}
ALL_STATS = tuple(_STAT_BITS)


class ColumnStats(NamedTuple):
    """Per-column statistics; arrays of the input's kind (numpy or torch) and device, or None
    for a statistic that was not asked for."""

    max: Any  #: max over rows, in the input dtype
    argmax: Any  #: lowest row index that attains the max (int64)
    min: Any  #: min over rows, in the input dtype
    sum: Any  #: sum over rows, accumulated and returned in float64


def column_stats(matrix: Any, row_weights: Any = None, *, stats: Iterable[str] = ALL_STATS) -> ColumnStats:
    """Max, argmax, min and sum over the rows of each column of ``matrix``, in one pass.

    With ``row_weights`` w the statistics are those of the matrix ``w[i] * matrix[i, j]``
    (the product is taken in the matrix's dtype), e.g. the joint distribution pi_x C[x, y] of a
    prior pi and a channel C.

    Args:
        matrix: 2-D float32 or float64 numpy array or torch tensor (CPU or CUDA) with at least one
            row. Rows must be contiguous; the row stride is free, so row slices and sub-blocks of a
            larger matrix are read in place.
        row_weights: optional 1-D array of length ``matrix.shape[0]`` of finite real numbers
            (strings, None entries, NaN and infinities are refused); converted to the matrix's
            kind, dtype and device (a copy of this vector only).
        stats: which of "max", "argmax", "min", "sum" to compute (all by default). Fewer
            statistics make a faster pass: the column maxima alone (Bayes capacity) run at memory
            speed. "argmax" implies "max".

    Returns:
        :class:`ColumnStats` of arrays of length ``matrix.shape[1]``.

    The matrix must be aligned to its element size (a view at an odd byte offset raises
    ValueError: pass a copy) and dense (sparse, quantized and meta tensors raise TypeError). Outputs
    and workspace are checked against the memory still available before anything is allocated
    (:class:`privleak._arrays.AllocationTooLarge`, a MemoryError and a ValueError).

    Ties in the max go to the lowest row index. NaN propagates as in numpy: a column holding NaN
    has NaN max, min and sum, and its argmax is the first NaN. Results are deterministic and
    identical on CPU and CUDA, for any thread count.
    """
    try:
        wanted = set([stats] if isinstance(stats, str) else stats)
    except TypeError:
        raise ArgumentTypeError(f"stats must be a non-empty subset of {ALL_STATS}, got {stats!r}") from None
    if not wanted or not wanted <= set(ALL_STATS):
        raise ValueError(f"stats must be a non-empty subset of {ALL_STATS}, got {stats!r}")
    if "argmax" in wanted:
        wanted.add("max")
    mask = sum(_STAT_BITS[name] for name in wanted)
    m = _arrays.view(matrix, "matrix", ndim=2)
    _arrays.require_contiguous_rows(m, "matrix")
    rows, cols = m.shape
    if rows == 0:
        raise ValueError("matrix must have at least one row: column statistics of an empty column are undefined")
    weights = None
    if row_weights is not None:
        weights = _arrays.convert_like(row_weights, "row_weights", m)
        if weights.shape != (rows,):
            raise ValueError(f"row_weights must have shape ({rows},) to match matrix, got {weights.shape}")
        if not _all_finite(weights.array):
            raise ValueError("row_weights must be finite (it holds NaN or infinity, or None converted to NaN)")

    dtypes = {"max": m.dtype, "argmax": "int64", "min": m.dtype, "sum": "float64"}
    _arrays.check_allocation(cols * sum(_ITEMSIZE[dtypes[name]] for name in wanted)
                             + _column_stats_workspace_bytes(m, rows, cols), m, "column_stats")
    out = ColumnStats(**{name: _arrays.empty(m, (cols,), dtypes[name]) if name in wanted else None
                         for name in ALL_STATS})
    outs = [0 if a is None else _arrays.address(a) for a in out]
    _backend.call("column_stats", m, mask, m.address, rows, cols, m.strides[0], m.dtype,
                  weights.address if weights else 0, *outs,
                  workspace=lambda cuda: cuda.column_stats_workspace_bytes(m.dtype, rows, cols))
    return out


NEAREST_METRICS = ("inner_product", "squared_l2", "l1")


class Nearest(NamedTuple):
    """The best input for each query; arrays of the queries' kind (numpy or torch) and device."""

    value: Any  #: float64: the winner's <x, y>, ||x - y||^2 or ||x - y||_1, recomputed in float64
    index: Any  #: int64: the winner's row in ``inputs``, the lowest among equal scores


def nearest(queries: Any, inputs: Any, metric: str, *, tensor_cores: bool = False) -> Nearest:
    """For each query y, the input x that maximises <x, y> or minimises ||x - y||^2 or ||x - y||_1.

    These are the sups over inputs in the Bayes capacity of a mechanism with a finite input set X,
    C = integral over y of max_{x in X} f(x)(y) dy ([004] Biswas et al., Def. III.1):

    - ``"squared_l2"``: Gaussian, log f(x)(y) = -||x - y||^2 / (2 sigma^2) + const, so the max over
      x is at the nearest input, min_x ||x - y||^2;
    - ``"inner_product"``: VMF on the sphere, log f(x)(y) = kappa <x, y> + const, max_x <x, y>;
    - ``"l1"``: Laplace, log f(x)(y) = -||x - y||_1 / b + const, min_x ||x - y||_1.

    The n_queries x n_inputs matrix of scores is never formed: the kernels fuse the reduction
    into a blocked, GEMM-like pass (CPU: AVX2/FMA tiles and OpenMP; CUDA: shared-memory tiles).

    Args:
        queries: (n_queries, p) float32 or float64 numpy array or torch tensor (CPU or CUDA), the
            outputs y. Rows must be contiguous; the row stride is free.
        inputs: (n_inputs, p) array of the same dtype and device, n_inputs >= 1, the inputs x.
        metric: ``"inner_product"``, ``"squared_l2"`` or ``"l1"``.
        tensor_cores: CUDA float32 with ``"inner_product"`` or ``"squared_l2"`` only: multiply on
            TF32 tensor cores (compute capability 8.0+). Faster, but scores then carry a relative
            error of about 1e-3 of ||x|| ||y|| (after centring), so among inputs that close the
            winner may differ from the fp32 one; its returned value is still exact.

    Returns:
        :class:`Nearest` (value, index), each of length n_queries.

    Accuracy. Winners are chosen by scores in the data's dtype: the inner product
    accumulated with fma in coordinate order; for ``"squared_l2"``,
    ||x - c||^2 - 2 <x - c, y - c> with c the inputs' mean (the expansion of the distance, which
    lets the kernel run at GEMM speed; centring keeps its cancellation, about
    p eps (||x - c||^2 + ||y - c||^2), small); for ``"l1"``, the sum of |x_k - y_k| in order.
    Inputs whose scores differ by less than that error may come out in either order. The
    returned value is the winner's, recomputed directly in float64 (no cancellation), so it is
    within that error of the true optimum and exact for the chosen input. Exact ties (duplicated
    inputs, symmetric points) go to the lowest index. Results are deterministic, independent of
    the thread count, and (without tensor cores) identical on CPU and CUDA.

    Raises TypeError/ValueError naming the argument for a wrong type, dtype, shape, device or
    metric, non-finite values, or values so large that squared distances would overflow, for
    unaligned arrays (pass a copy) and non-dense tensors; and AllocationTooLarge (a MemoryError and
    a ValueError) before allocating when the outputs and workspace (e.g. the squared-L2 input norms
    of a stride-0 view of 2^31 rows) exceed the memory still available.
    """
    choice(metric, "metric", NEAREST_METRICS)
    boolean(tensor_cores, "tensor_cores")
    q = _arrays.view(queries, "queries", ndim=2)
    x = _arrays.view(inputs, "inputs", ndim=2)
    if x.dtype != q.dtype:
        raise TypeError(f"inputs has dtype {x.dtype} but queries has dtype {q.dtype}; they must match")
    _arrays.require_same_device(x, "inputs", q, "queries")
    n_queries, p = q.shape
    n_inputs = x.shape[0]
    if x.shape[1] != p:
        raise ValueError(f"queries and inputs must have the same number of columns, got {p} and {x.shape[1]}")
    if p == 0:
        raise ValueError("queries and inputs must have at least one column")
    if n_inputs == 0:
        raise ValueError("inputs must have at least one row: the best of no inputs is undefined")
    _arrays.require_contiguous_rows(q, "queries")
    _arrays.require_contiguous_rows(x, "inputs")
    if tensor_cores and (not q.is_cuda or q.dtype != "float32" or metric == "l1"):
        raise ValueError("tensor_cores=True needs CUDA float32 data and metric 'inner_product' or 'squared_l2'")

    _arrays.check_allocation(_nearest_bytes(metric, q, n_queries, n_inputs, p, tensor_cores), q, "nearest")

    input_stats = column_stats(x.array, stats=("max", "min", "sum") if metric == "squared_l2" else ("max", "min"))
    _check_magnitude(input_stats, "inputs", q.dtype, p)
    if n_queries:
        _check_magnitude(column_stats(q.array, stats=("max", "min")), "queries", q.dtype, p)
    center = None
    if metric == "squared_l2":
        center = _arrays.convert_like(_arrays.quotient(input_stats.sum, n_inputs), "center", x)

    out = Nearest(_arrays.empty(q, (n_queries,), "float64"), _arrays.empty(q, (n_queries,), "int64"))
    _backend.call("nearest", q, metric, q.dtype, q.address, n_queries, q.strides[0], x.address, n_inputs,
                  x.strides[0], p, center.address if center else 0, _arrays.address(out.value),
                  _arrays.address(out.index), cuda_args=(tensor_cores,),
                  workspace=lambda cuda: cuda.nearest_workspace_bytes(metric, q.dtype, n_queries, n_inputs,
                                                                      tensor_cores, q.device_index))
    return out


def _check_magnitude(stats: ColumnStats, name: str, dtype: str, p: int) -> None:
    """Values must be finite, and small enough that p (2 max|v|)^2, a bound on every squared
    distance and inner product, stays finite in ``dtype``."""
    low, high = float(stats.min.min()), float(stats.max.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{name} must be finite (it holds NaN or infinity)")
    bound = math.sqrt(float(np.finfo(dtype).max) / p) / 2
    if max(-low, high) > bound:
        raise ValueError(f"{name} has values up to {max(-low, high):.3g} in magnitude; with p = {p} squared "
                         f"distances would overflow {dtype} (keep them below {bound:.3g})")


_ITEMSIZE = {"float32": 4, "float64": 8, "int64": 8}
# CPU kernels' constants (csrc/cpu/column_stats.cpp, csrc/cpu/nearest.cpp) that bound their workspaces.
_COLUMN_PARTIAL_BYTES = 32  # ColumnPartial<T>: max, argmax, min and a double sum
_MAX_ROW_CHUNKS = 1024
_NEAREST_MAX_RANGE = 1 << 30
_NEAREST_INPUT_BLOCK = 120
_NEAREST_QUERY_BLOCK = 512
_NEAREST_TILE_QUERIES = 32  # the widest tile (AVX-512 float32): query blocks are whole tiles
_NEAREST_TILE_INPUTS = 12
_NEAREST_PACKED_INPUT_BUDGET = 512 << 20
_NEAREST_PACKED_QUERY_BUDGET = 1 << 20


def _all_finite(values: Any) -> bool:
    if _arrays.is_tensor(values):
        return bool(_arrays._loaded_torch().isfinite(values).all())
    return bool(np.isfinite(values).all())


def _column_stats_workspace_bytes(m: _arrays.ArrayView, rows: int, cols: int) -> int:
    if m.is_cuda:
        return _backend.cuda().column_stats_workspace_bytes(m.dtype, rows, cols)
    # Per-chunk partials, at most 1024 chunks, when there are fewer column blocks than threads.
    return min(rows, _MAX_ROW_CHUNKS) * cols * _COLUMN_PARTIAL_BYTES if cols < 4096 * _backend.num_threads() else 0


def _nearest_bytes(metric: str, q: _arrays.ArrayView, n_queries: int, n_inputs: int, p: int,
                   tensor_cores: bool) -> int:
    """An upper bound on what :func:`nearest` allocates: outputs, the input statistics pass,
    and the kernel's workspace (input norms, per-range winners, packing buffers)."""
    itemsize = _ITEMSIZE[q.dtype]
    total = 16 * n_queries + p * (3 * itemsize + 16)  # outputs; column statistics and centre of the inputs
    if n_queries == 0:
        return total
    if q.is_cuda:
        return total + _backend.cuda().nearest_workspace_bytes(metric, q.dtype, n_queries, n_inputs, tensor_cores,
                                                              q.device_index)
    threads = _backend.num_threads()
    if metric == "squared_l2":
        total += n_inputs * itemsize
    query_blocks = -(-n_queries // _NEAREST_QUERY_BLOCK)
    ranges = max(-(-n_inputs // _NEAREST_MAX_RANGE), min(-(-2 * threads // query_blocks),
                                                        -(-n_inputs // _NEAREST_INPUT_BLOCK)))
    total += ranges * n_queries * (itemsize + 8)
    total += min(-(-n_inputs // _NEAREST_TILE_INPUTS) * _NEAREST_TILE_INPUTS * p * itemsize,
                 _NEAREST_PACKED_INPUT_BUDGET)
    query_block = min(_NEAREST_QUERY_BLOCK, -(-n_queries // _NEAREST_TILE_QUERIES) * _NEAREST_TILE_QUERIES)
    total += threads * itemsize * (min(query_block * p, _NEAREST_PACKED_QUERY_BUDGET) + 2048 * query_block)
    return total
