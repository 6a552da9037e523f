"""Pure numpy references of privleak's kernels: what the tests compare the kernels to.

Each function computes the same result as its kernel the obvious way, with no concern for speed.
"""
from __future__ import annotations

import numpy as np


def column_stats(matrix: np.ndarray, row_weights: np.ndarray | None = None):
    """Reference for :func:`privleak.reductions.column_stats`: (max, argmax, min, sum) per column."""
    values = matrix if row_weights is None else row_weights.astype(matrix.dtype)[:, None] * matrix
    return values.max(axis=0), values.argmax(axis=0), values.min(axis=0), values.sum(axis=0, dtype=np.float64)


def nearest(queries: np.ndarray, inputs: np.ndarray, metric: str):
    """Reference for :func:`privleak.reductions.nearest`: (value, index) per query, by brute force
    in float64 over the full matrix of <x, y>, ||x - y||^2 or ||x - y||_1 (direct differences,
    no expansion), with numpy's argmax/argmin (the first of equal values)."""
    x = inputs.astype(np.float64)
    value, index = np.empty(len(queries)), np.empty(len(queries), dtype=np.int64)
    for start in range(0, len(queries), 16):  # 16 queries at a time bounds the temporary
        y = queries[start:start + 16].astype(np.float64)
        if metric == "inner_product":
            values = y @ x.T
            best = values.argmax(axis=1)
        else:
            differences = y[:, None, :] - x[None, :, :]
            values = (differences**2).sum(axis=-1) if metric == "squared_l2" else np.abs(differences).sum(axis=-1)
            best = values.argmin(axis=1)
        value[start:start + 16], index[start:start + 16] = values[np.arange(len(y)), best], best
    return value, index


# ----------------------------------------------------------------------------- counter-based noise
# These mirror csrc/common/{philox,fp_math,noise}.h operation for operation in numpy's IEEE
# float32/float64 arithmetic, so the kernels must match them bit for bit.

_PHILOX_MUL = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
_NOISE_STREAMS = {"gaussian": 1, "laplace": 2}


def philox4x32_10(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of counters of shape (..., 4) (uint32) under a key of two 32-bit words."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = key
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0, p1 = _PHILOX_MUL[0] * c[0], _PHILOX_MUL[1] * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & mask,
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & mask]
        k0, k1 = (k0 + _PHILOX_WEYL[0]) & 0xFFFFFFFF, (k1 + _PHILOX_WEYL[1]) & 0xFFFFFFFF
    return np.stack(c, axis=-1).astype(np.uint32)


def _log_positive(x: np.ndarray) -> np.ndarray:
    t = x.dtype.type
    bits_type, mantissa_bits, bias, terms = (
        (np.uint32, 23, 127, 5) if x.dtype == np.float32 else (np.uint64, 52, 1023, 11))
    bits = x.view(bits_type)
    exponent = (bits >> bits_type(mantissa_bits)).astype(np.int64) - bias
    m = ((bits & bits_type((1 << mantissa_bits) - 1)) | bits_type(bias << mantissa_bits)).view(x.dtype)
    big = m > t(1.41421356237309504880)
    m = np.where(big, m * t(0.5), m)
    exponent = exponent + big
    s = (m - t(1)) / (m + t(1))
    s2 = s * s
    series = np.full_like(x, t(1) / t(2 * terms - 1))
    for k in range(terms - 2, -1, -1):
        series = t(1) / t(2 * k + 1) + s2 * series
    e = exponent.astype(x.dtype)
    return e * t(6.93147180369123816490e-01) + (t(2) * s * series + e * t(1.90821492927058770002e-10))


_SIN_COEFFICIENTS = [1.0, -0.16666666666666666, 0.008333333333333333, -0.0001984126984126984,
                     2.7557319223985893e-06, -2.505210838544172e-08, 1.6059043836821613e-10,
                     -7.647163731819816e-13, 2.8114572543455206e-15, -8.22063524662433e-18]
_COS_COEFFICIENTS = [1.0, -0.5, 0.041666666666666664, -0.001388888888888889, 2.48015873015873e-05,
                     -2.755731922398589e-07, 2.08767569878681e-09, -1.1470745597729725e-11,
                     4.779477332387385e-14, -1.5619206968586225e-16]


def _cos_sin_two_pi(u: np.ndarray):
    t = u.dtype.type
    terms = 5 if u.dtype == np.float32 else 10
    quarter_turns = u * t(4)
    q = np.trunc(quarter_turns + t(0.5))
    a = (quarter_turns - q) * t(1.57079632679489661923)
    a2 = a * a
    sin_series = np.full_like(u, t(_SIN_COEFFICIENTS[terms - 1]))
    cos_series = np.full_like(u, t(_COS_COEFFICIENTS[terms - 1]))
    for k in range(terms - 2, -1, -1):
        sin_series = t(_SIN_COEFFICIENTS[k]) + a2 * sin_series
        cos_series = t(_COS_COEFFICIENTS[k]) + a2 * cos_series
    s, c = a * sin_series, cos_series
    quadrant = q.astype(np.int64) & 3
    cos_out = np.choose(quadrant, [c, -s, -c, s])
    sin_out = np.choose(quadrant, [s, c, -s, -c])
    return cos_out, sin_out


def _uniform_open_zero32(bits: np.ndarray, nbits: int) -> np.ndarray:
    step = np.float32(2.0 ** -nbits)
    return bits.astype(np.float32) * step + step * np.float32(0.5)


def _uniform_open_zero64(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    bits53 = ((hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)) >> np.uint64(11)
    return bits53.astype(np.float64) * 1.1102230246251565e-16 + 5.551115123125783e-17


def noise(distribution: str, n: int, key: int, offset: int = 0, dtype=np.float32) -> np.ndarray:
    """Unit-scale noise elements offset .. offset + n - 1 under ``key``, as the kernels draw them
    (float32 generation for float32, float64 generation for float64)."""
    dtype = np.dtype(dtype)
    per_block = 4 if dtype == np.float32 else 2
    first, end = offset // per_block, -(-(offset + n) // per_block)
    blocks = np.arange(first, end, dtype=np.uint64)
    stream = (_NOISE_STREAMS[distribution] << 1) | (dtype == np.float64)
    counter = np.stack([blocks & np.uint64(0xFFFFFFFF), blocks >> np.uint64(32),
                        np.full_like(blocks, stream), np.zeros_like(blocks)], axis=-1).astype(np.uint32)
    w = philox4x32_10(counter, (key & 0xFFFFFFFF, key >> 32))
    if distribution == "gaussian":
        if dtype == np.float32:
            u = _uniform_open_zero32(w, 32)
            pairs = [(u[:, 0], u[:, 1]), (u[:, 2], u[:, 3])]
        else:
            pairs = [(_uniform_open_zero64(w[:, 0], w[:, 1]), _uniform_open_zero64(w[:, 2], w[:, 3]))]
        values = []
        for u1, u2 in pairs:
            r = np.sqrt(dtype.type(-2) * _log_positive(u1))
            c, s = _cos_sin_two_pi(u2)
            values += [r * c, r * s]
    else:
        if dtype == np.float32:
            words = [w[:, i] for i in range(4)]
            magnitudes = [-_log_positive(_uniform_open_zero32(x >> np.uint32(1), 31)) for x in words]
            signs = [x & np.uint32(1) for x in words]
        else:
            magnitudes = [-_log_positive(_uniform_open_zero64(w[:, 2 * i], w[:, 2 * i + 1])) for i in range(2)]
            signs = [w[:, 2 * i + 1] & np.uint32(1) for i in range(2)]
        values = [np.where(sign == 1, -mag, mag) for mag, sign in zip(magnitudes, signs)]
    flat = np.stack(values, axis=-1).reshape(-1)
    start = offset - first * per_block
    return flat[start:start + n]


# ----------------------------------------------------------------------------- DP-SGD clipping


def clip_and_accumulate(per_sample_grads, clip_norms, per_layer, noise=None, batch_size=None):
    """Reference for :func:`privleak.dpsgd.clip_and_accumulate`, in float64 torch: returns the
    list of (sum_b clip(g_b) + noise) / L, with ``noise`` a list of tensors (or None)."""
    import torch

    grads = [g.double().reshape(g.shape[0], -1) for g in per_sample_grads]
    squares = torch.stack([(g * g).sum(dim=1) for g in grads], dim=1)
    norms = squares.sqrt() if per_layer else squares.sum(dim=1, keepdim=True).sqrt()
    c = torch.tensor(clip_norms, dtype=torch.float64)
    factors = torch.where(norms > c, c / norms, torch.ones_like(norms)).float().double()
    factors = factors.expand(-1, len(grads))
    scale = grads[0].shape[0] if batch_size is None else batch_size
    outs = []
    for t, g in enumerate(grads):
        total = (factors[:, t:t + 1] * g).sum(dim=0)
        if noise is not None:
            total = total + noise[t].double().reshape(-1)
        outs.append((total / scale).reshape(per_sample_grads[t].shape[1:]))
    return outs
