"""Reductions over the rows of a matrix, the building blocks of the leakage metrics.

A channel is a row-stochastic matrix C (rows: secrets, columns: observations). Its Bayes capacity
is the sum of the column maxima, its LDP epsilon needs the column maxima and minima, and with a
prior pi the posterior vulnerability and the output distribution are the column maxima and sums
of pi_x * C[x, y] (Biswas et al., Sec. II; Zhang et al., Def. 4.2 and 5.1). :func:`column_stats`
gives all of these in one pass over the matrix, on CPU or CUDA, without copying it.
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from privleak import _arrays, _backend

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
        row_weights: optional 1-D array of length ``matrix.shape[0]``; converted to the matrix's
            kind, dtype and device (a copy of this vector only).
        stats: which of "max", "argmax", "min", "sum" to compute (all by default). Fewer
            statistics make a faster pass: the column maxima alone (Bayes capacity) run at memory
            speed. "argmax" implies "max".

    Returns:
        :class:`ColumnStats` of arrays of length ``matrix.shape[1]``.

    Ties in the max go to the lowest row index. NaN propagates as in numpy: a column holding NaN
    has NaN max, min and sum, and its argmax is the first NaN. Results are deterministic and
    identical on CPU and CUDA, for any thread count.
    """
    wanted = set([stats] if isinstance(stats, str) else stats)
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

    dtypes = {"max": m.dtype, "argmax": "int64", "min": m.dtype, "sum": "float64"}
    out = ColumnStats(**{name: _arrays.empty(m, (cols,), dtypes[name]) if name in wanted else None
                         for name in ALL_STATS})
    outs = [0 if a is None else _arrays.address(a) for a in out]
    args = (mask, m.address, rows, cols, m.strides[0], m.dtype, weights.address if weights else 0, *outs)
    if m.is_cuda:
        cuda = _backend.cuda()
        workspace_bytes = cuda.column_stats_workspace_bytes(m.dtype, rows, cols)
        workspace = _arrays.empty(m, (workspace_bytes,), "uint8") if workspace_bytes else None
        cuda.column_stats(*args, _arrays.address(workspace) if workspace_bytes else 0, m.device_index, m.stream)
    else:
        _backend.core.column_stats(*args)
    return out
