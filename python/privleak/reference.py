"""Pure numpy references of privleak's kernels: what the tests compare the kernels to.

Each function computes the same result as its kernel the obvious way, with no concern for speed.
"""
from __future__ import annotations

import numpy as np


def column_stats(matrix: np.ndarray, row_weights: np.ndarray | None = None):
    """Reference for :func:`privleak.reductions.column_stats`: (max, argmax, min, sum) per column."""
    values = matrix if row_weights is None else row_weights.astype(matrix.dtype)[:, None] * matrix
    return values.max(axis=0), values.argmax(axis=0), values.min(axis=0), values.sum(axis=0, dtype=np.float64)
