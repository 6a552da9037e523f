"""Leakage metrics of discrete channels.

A channel is a row-stochastic matrix C: rows are secrets x, columns are observations y, and
C[x, y] is the probability of observing y when the secret is x. A prior pi is a distribution over
the rows. This module gives the figures that the papers in ``shared/papers`` use:

- [004] Biswas et al., *Bayes' capacity as a measure for reconstruction attacks in federated
  learning*: Bayes vulnerability, g-vulnerability and g-leakage (Sec. II-B), Bayes capacity
  (Eq. 3) and its logarithm, the Sibson mutual information of order infinity (Sec. I).
- [000] Zhang, Fei, Chen, Jin, *Deciphering the Interplay between LDP, ABP and MBP*: Average
  Bayesian Privacy (Def. 4.1), Maximum Bayesian Privacy (Def. 4.2), LDP (Def. 5.1).
- [001] Zhang, Chen, *Bridging Privacy and Robustness*: the same notions with an attacker whose
  prior differs from the true one (Thm IV.6).
- [003] lecture notes: mutual information and local information privacy (LIP).

The implications between these notions are in :mod:`privleak.relations`.

Conventions
-----------
- Epsilons (LDP, LIP, MBP, ABP) and Shannon mutual information use natural logarithms; figures
  whose name ends in ``_bits`` use base 2.
- Channels are numpy arrays or torch tensors (CPU or CUDA) of float32 or float64 whose rows are
  contiguous. They are never copied (integer numpy input is converted to float64 first, and an
  array without contiguous rows is made contiguous, one not aligned to its element size is
  copied to aligned memory: all copies). Metrics read the matrix through
  :func:`privleak.reductions.column_stats`, one pass per statistic set, plus one matrix-vector
  product that checks the row sums. Priors and gains are small: they are converted to float64.
- Checks: a channel must be 2-D with at least one row and one column, its entries finite and
  non-negative, and every row sum within :data:`ROW_SUM_TOLERANCE` of 1: 1e-5 for float32 (a
  float32 row normalised in float32 sums to 1 within about 2^-24 * log2(columns), below 3e-6 for
  1e5 columns; the check's own float32 product adds about as much) and 1e-9 for float64. A prior
  must be 1-D with one entry per row, finite, non-negative and sum to 1 within the same tolerance
  for its dtype. Violations raise ValueError naming the argument; anything that is not a numpy
  array or torch tensor raises TypeError.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Union

import numpy as np

from privleak import _arrays, validation
from privleak.reductions import ColumnStats, column_stats

ROW_SUM_TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-9}

# Metrics that need more than column statistics (mutual information, g-leakage, ABP) convert the
# channel to float64 one block of about this many entries at a time, never the whole matrix.
_BLOCK_ENTRIES = 1 << 20

Gain = Union[np.ndarray, Callable[[np.ndarray, np.ndarray], Any]]


# --- checking inputs -------------------------------------------------------------------------


def as_channel(channel: Any, name: str = "channel") -> Any:
    """Check that ``channel`` is a channel matrix; return it ready for the kernels.

    Returns the same array (a float64 copy for integer/bool numpy input, a contiguous copy when
    its rows are not contiguous). Raises TypeError for anything but a numpy array or torch tensor
    of a real dtype, and ValueError naming ``name`` for a wrong shape, non-finite or negative
    entries, or a row whose sum is farther than ``ROW_SUM_TOLERANCE[dtype]`` from 1.
    """
    matrix, _ = _checked_channel(channel, name)
    return matrix


def as_prior(prior: Any, n_secrets: int | None = None, name: str = "prior") -> np.ndarray:
    """Check that ``prior`` is a distribution over ``n_secrets`` secrets; return it as float64.

    Raises TypeError for anything but a numpy array or torch tensor, and ValueError naming
    ``name`` for a shape other than ``(n_secrets,)``, non-finite or negative entries, or a sum
    farther than ``ROW_SUM_TOLERANCE[dtype]`` from 1 (1e-9 for non-float32 input).
    """
    values = _as_numpy(prior, name)
    if values.dtype.kind not in "biuf":
        raise TypeError(f"{name} must have a real dtype, got {values.dtype}")
    tolerance = ROW_SUM_TOLERANCE.get(values.dtype, ROW_SUM_TOLERANCE[np.dtype(np.float64)])
    values = values.astype(np.float64)
    if n_secrets is not None and values.shape != (n_secrets,):
        raise ValueError(f"{name} must have shape ({n_secrets},), one entry per channel row, got {values.shape}")
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} has non-finite entries")
    if (values < 0).any():
        raise ValueError(f"{name} has negative entries")
    total = values.sum()
    if abs(total - 1.0) > tolerance:
        raise ValueError(f"{name} sums to {float(total)!r}, not 1 (tolerance {tolerance:g})")
    return values


def as_gain(gain: Gain, n_secrets: int, name: str = "gain") -> np.ndarray:
    """A gain as a float64 matrix G[w, x] (actions x secrets), checked.

    ``gain`` is either a matrix with ``n_secrets`` columns or a function ``gain(w, x)`` of integer
    index arrays, vectorised as in numpy, whose actions are the secrets themselves (see
    :func:`gain_matrix` for other action sets). Entries must be finite; they may be negative.
    """
    if callable(gain):
        return gain_matrix(gain, n_secrets, n_secrets)
    values = _as_numpy(gain, name)
    if values.dtype.kind not in "biuf":
        raise TypeError(f"{name} must have a real dtype, got {values.dtype}")
    if values.ndim != 2 or values.shape[0] == 0 or values.shape[1] != n_secrets:
        raise ValueError(f"{name} must have shape (n_actions >= 1, {n_secrets}), got {values.shape}")
    values = values.astype(np.float64)
    if not np.isfinite(values).all():
        raise ValueError(f"{name} has non-finite entries")
    return values


def gain_matrix(gain_function: Callable[[np.ndarray, np.ndarray], Any], n_actions: int, n_secrets: int) -> np.ndarray:
    """G[w, x] = gain_function(w, x) for actions w < n_actions and secrets x < n_secrets.

    The function is called once with broadcasting index arrays ``w`` of shape (n_actions, 1) and
    ``x`` of shape (1, n_secrets) ([004], Sec. II-B: a gain function g: W x X -> R).
    """
    n_actions = validation.integer(n_actions, "n_actions", low=1)
    n_secrets = validation.integer(n_secrets, "n_secrets", low=1)
    _check_matrix_fits(n_actions, n_secrets, "gain_matrix")
    values = gain_function(np.arange(n_actions)[:, None], np.arange(n_secrets)[None, :])
    try:
        matrix = np.array(np.broadcast_to(np.asarray(values, dtype=np.float64), (n_actions, n_secrets)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"gain_function must return real numbers broadcastable to ({n_actions}, {n_secrets}), "
                         f"got {type(values).__name__} {getattr(values, 'shape', '')}: {error}") from None
    if not np.isfinite(matrix).all():
        raise ValueError("gain_function returned non-finite values")
    return matrix


def within_distance_gain(n_secrets: int, distance: float) -> np.ndarray:
    """Gain of guessing within ``distance`` on the ordered secrets 0..n-1: G[w, x] = [|w - x| <= d].

    The "guess a value close to the secret" attacker of [004], Sec. II-B; distance 0 is the
    identity gain of Eq. (1), whose g-vulnerability is the Bayes vulnerability.
    """
    n_secrets = validation.integer(n_secrets, "n_secrets", low=1)
    distance = validation.non_negative(distance, "distance", allow_inf=True)
    return gain_matrix(lambda w, x: np.abs(w - x) <= distance, n_secrets, n_secrets)


def prior_mismatch(true_prior: Any, attacker_prior: Any) -> float:
    """epsilon = max_x |log(attacker_prior[x] / true_prior[x])|, the condition of [000] Thm 5.4.

    Secrets that both priors rule out are skipped; one ruled out by only one prior gives inf.
    """
    true_values = as_prior(true_prior, name="true_prior")
    attacker_values = as_prior(attacker_prior, true_values.size, name="attacker_prior")
    either = (true_values > 0) | (attacker_values > 0)
    with np.errstate(divide="ignore"):
        log_ratios = np.log(attacker_values[either]) - np.log(true_values[either])
    return float(np.abs(log_ratios).max())


# --- Bayes vulnerability, capacity, Sibson MI of order infinity -------------------------------


def prior_bayes_vulnerability(prior: Any) -> float:
    """V(pi) = max_x pi[x]: the chance of guessing the secret in one try ([004], Sec. II-B)."""
    return float(as_prior(prior).max())


def posterior_bayes_vulnerability(channel: Any, prior: Any) -> float:
    """V(pi, C) = sum_y max_x pi[x] C[x, y] ([004], Sec. II-B, with the identity gain of Eq. 1)."""
    return _bayes_vulnerabilities(channel, prior)[0]


def multiplicative_bayes_leakage(channel: Any, prior: Any) -> float:
    """L(pi, C) = V(pi, C) / V(pi) ([004], Sec. II-B)."""
    posterior, prior_vulnerability = _bayes_vulnerabilities(channel, prior)
    return posterior / prior_vulnerability


def additive_bayes_leakage(channel: Any, prior: Any) -> float:
    """V(pi, C) - V(pi): the gain in one-try guessing probability ([004], Sec. II-B)."""
    posterior, prior_vulnerability = _bayes_vulnerabilities(channel, prior)
    return posterior - prior_vulnerability


def min_entropy_leakage_bits(channel: Any, prior: Any) -> float:
    """log2 V(pi, C) / V(pi): the multiplicative Bayes leakage in bits ([004], Sec. II-B)."""
    return math.log2(multiplicative_bayes_leakage(channel, prior))


def bayes_capacity(channel: Any) -> float:
    """C_Bayes(C) = sum_y max_x C[x, y] ([004], Eq. 3).

    The multiplicative Bayes leakage under the uniform prior, and the largest multiplicative
    g-leakage over all priors and non-negative gains (see :func:`privleak.relations.g_leakage_bound`).
    """
    _, stats = _checked_channel(channel)
    return _sum(stats.max)


def sibson_mi_infinity_bits(channel: Any, prior: Any = None) -> float:
    """Sibson mutual information of order infinity: log2 sum_y max_{x: pi[x] > 0} C[x, y] ([004], Sec. I).

    It depends on the prior only through its support; without a prior (or with one of full
    support) it is log2 of the Bayes capacity, i.e. the min-entropy leakage under the uniform
    prior, the largest over all priors.
    """
    matrix, stats = _checked_channel(channel)
    if prior is None:
        return math.log2(_sum(stats.max))
    support = as_prior(prior, matrix.shape[0]) > 0
    return math.log2(_capacity_over_rows(matrix, support))


# --- g-vulnerability and g-leakage -----------------------------------------------------------


def prior_g_vulnerability(prior: Any, gain: Gain) -> float:
    """V_g(pi) = max_w sum_x pi[x] g(w, x) ([004], Sec. II-B)."""
    weights = as_prior(prior)
    return float((as_gain(gain, weights.size) @ weights).max())


def posterior_g_vulnerability(channel: Any, prior: Any, gain: Gain) -> float:
    """V_g(pi, C) = sum_y max_w sum_x pi[x] C[x, y] g(w, x) ([004], Sec. II-B).

    Costs n_actions x n_secrets x n_observations multiply-adds (a matrix product).
    """
    return _g_vulnerabilities(channel, prior, gain)[0]


def multiplicative_g_leakage(channel: Any, prior: Any, gain: Gain) -> float:
    """L_g(pi, C) = V_g(pi, C) / V_g(pi) ([004], Sec. II-B); needs V_g(pi) > 0."""
    posterior, prior_vulnerability = _g_vulnerabilities(channel, prior, gain)
    if prior_vulnerability <= 0:
        raise ValueError(f"the prior g-vulnerability is {prior_vulnerability!r}; multiplicative g-leakage needs it > 0")
    return posterior / prior_vulnerability


def additive_g_leakage(channel: Any, prior: Any, gain: Gain) -> float:
    """V_g(pi, C) - V_g(pi) ([004], Sec. II-B)."""
    posterior, prior_vulnerability = _g_vulnerabilities(channel, prior, gain)
    return posterior - prior_vulnerability


# --- Shannon mutual information --------------------------------------------------------------


def mutual_information_nats(channel: Any, prior: Any) -> float:
    """I(X; Y) = sum_{x,y} pi[x] C[x, y] log(C[x, y] / p(y)), p(y) = sum_x pi[x] C[x, y] ([003]).

    In nats (divide by ln 2 for bits), to compare with the LIP bound
    :func:`privleak.relations.mi_from_lip`.
    """
    matrix, _ = _checked_channel(channel)
    weights = as_prior(prior, matrix.shape[0])
    output = _column_stats(matrix, weights, ("sum",)).sum
    # p(y) = 0 means C[x, y] = 0 for every possible x, so those terms are 0 whatever stands in the
    # denominator; 1 keeps them finite. (It also absorbs a weight product that underflowed.)
    output = np.where(output > 0, output, 1.0)
    total = 0.0
    for rows, block in _float64_blocks(matrix, axis=0):
        block_weights = weights[rows]
        total += float(block_weights @ _relative_entropy_by_row(block, output))
    return max(total, 0.0)


# --- LDP, LIP, MBP, ABP ----------------------------------------------------------------------


def ldp_epsilon(channel: Any) -> float:
    """The smallest epsilon for which C is epsilon-LDP ([000] Def. 5.1, [003]).

    epsilon = max_y log(max_x C[x, y] / min_x C[x, y]) over the columns with a non-zero entry;
    inf if such a column also has a zero, 0 for a single-row channel. Def. 5.1 quantifies over
    sets S of observations, but a ratio of sums never exceeds the largest ratio of its terms, so
    single observations give the same epsilon.
    """
    _, stats = _checked_channel(channel)
    produced = stats.max > 0
    if (stats.min[produced] == 0).any():
        return math.inf
    log_ratios = np.log(stats.max[produced].astype(np.float64)) - np.log(stats.min[produced].astype(np.float64))
    return float(log_ratios.max())


def lip_epsilons(channel: Any, prior: Any) -> tuple[float, float]:
    """Upper and lower LIP epsilons (eps_U, eps_L) of C under the prior ([003], "LIP").

    eps_U = max log(P(x|y) / P(x)) and eps_L = -min log(P(x|y) / P(x)), over secrets x with
    pi[x] > 0 and observations y with p(y) > 0. Since P(x|y) / P(x) = C[x, y] / p(y), both come
    from the column max and min of C over the prior's support and p(y); eps_L is inf if a
    possible observation rules out a possible secret. Both are >= 0 (rounding is clipped).
    Rows outside the prior's support are gathered into a copy; with a full-support prior nothing
    is copied.
    """
    matrix, stats = _checked_channel(channel)
    weights = as_prior(prior, matrix.shape[0])
    output = _column_stats(matrix, weights, ("sum",)).sum
    support = weights > 0
    if not support.all():
        stats = _column_stats(_take_rows(matrix, np.flatnonzero(support)), None, ("max", "min"))
    observed = output > 0
    log_output = np.log(output[observed])
    upper = np.log(stats.max[observed].astype(np.float64)) - log_output
    with np.errstate(divide="ignore"):
        lower = log_output - np.log(stats.min[observed].astype(np.float64))
    return max(float(upper.max()), 0.0), max(float(lower.max()), 0.0)


def mbp_xi(channel: Any, prior: Any) -> float:
    """xi of xi-Maximum Bayesian Privacy ([000] Def. 4.2, [001] Def. IV.3) under the prior.

    xi = max_{x, y} |log(P(x|y) / P(x))| = max(eps_U, eps_L) of :func:`lip_epsilons`: MBP is the
    symmetric form of LIP.
    """
    return max(lip_epsilons(channel, prior))


def abp_epsilons(channel: Any, attacker_prior: Any) -> np.ndarray:
    """epsilon_{p,a} = sqrt(JS(F^A || F^B)) for each true secret ([000] Def. 4.1, Thm 5.4).

    The attacker holds the prior q = F^B (which may differ from the true prior, as in Thm 5.4) and
    updates it by Bayes' rule ([001], Eq. 27): P_q(d|y) = q[d] C[d, y] / p_q(y). When the true
    secret is x, the attacker's expected posterior belief is
    F^A_x(d) = sum_y C[x, y] P_q(d|y), and the returned entry x is sqrt(JS(F^A_x || q)) with the
    JS divergence in nats (so at most sqrt(ln 2)). Costs n_secrets^2 x n_observations
    multiply-adds. Raises ValueError if some secret can produce an observation to which q gives
    probability 0 (the attacker's posterior is then undefined).
    """
    matrix, _ = _checked_channel(channel)
    n_secrets = matrix.shape[0]
    belief = as_prior(attacker_prior, n_secrets, name="attacker_prior")
    output = _column_stats(matrix, belief, ("sum",)).sum
    expected_posterior = np.zeros((n_secrets, n_secrets))
    for columns, block in _float64_blocks(matrix, axis=1):
        block_output = output[columns]
        seen = block_output > 0
        if (block[:, ~seen] > 0).any():
            raise ValueError("attacker_prior gives probability 0 to an observation the channel can produce")
        block = block[:, seen]
        expected_posterior += (block / block_output[seen]) @ (block * belief[:, None]).T
    # JS = sum_d q[d] phi(F[d] / q[d]) in the form without cancellation near F = q (no leakage):
    # the two relative entropies of the mixture cancel to a rounding of 1e-16, 1e-8 after the root.
    # Where q[d] = 0 the term's limit is F[d] ln(2) / 2.
    possible = belief > 0
    divergence = _js_generator(expected_posterior[:, possible] / belief[possible]) @ belief[possible]
    divergence += 0.5 * math.log(2.0) * expected_posterior[:, ~possible].sum(axis=1)
    return np.sqrt(np.maximum(divergence, 0.0))


def abp_epsilon(channel: Any, attacker_prior: Any) -> float:
    """Worst-case ABP: max over true secrets x of :func:`abp_epsilons` ([000] Def. 4.1)."""
    return float(abp_epsilons(channel, attacker_prior).max())


# --- channel algebra -------------------------------------------------------------------------


def cascade(first: Any, second: Any) -> Any:
    """The channel X -> Y -> Z that feeds the output of ``first`` into ``second``: first @ second.

    [004], Sec. II-A: the composition D o C of the paper is the matrix product C . D.
    """
    first = as_channel(first, "first")
    second = as_channel(second, "second")
    if first.shape[1] != second.shape[0]:
        raise ValueError(f"first has {first.shape[1]} observations but second has {second.shape[0]} secrets")
    return first @ second


def parallel_composition(first: Any, second: Any) -> Any:
    """Both channels applied to the same secret, independently: (C || D)[x, (y, z)] = C[x, y] D[x, z].

    Column y * second.shape[1] + z holds the observation pair (y, z) (a row-wise Kronecker product;
    the parallel composition of quantitative information flow, on the channel model of [004] Sec. II-A).
    """
    first = as_channel(first, "first")
    second = as_channel(second, "second")
    if first.shape[0] != second.shape[0]:
        raise ValueError(f"first has {first.shape[0]} secrets but second has {second.shape[0]}")
    return (first[:, :, None] * second[:, None, :]).reshape(first.shape[0], -1)


def deterministic_channel(mapping: Any, n_outputs: int) -> np.ndarray:
    """The 0/1 channel of a function f: F[x, y] = 1 if y == mapping[x] ([004], Sec. II-A)."""
    n_outputs = validation.integer(n_outputs, "n_outputs", low=1)
    targets = as_mapping(mapping, n_outputs)
    _check_matrix_fits(targets.size, n_outputs, "deterministic_channel")
    matrix = np.zeros((targets.size, n_outputs))
    matrix[np.arange(targets.size), targets] = 1.0
    return matrix


def deterministic_preprocessing(mapping: Any, channel: Any) -> Any:
    """The channel x -> channel[mapping[x]]: a function of the secret fed into ``channel``.

    Equal to cascade(deterministic_channel(mapping, n), channel) but only gathers rows. The Bayes
    capacity can only drop (see :func:`privleak.relations.capacity_after_deterministic_preprocessing`).
    """
    matrix = as_channel(channel)
    return _take_rows(matrix, as_mapping(mapping, matrix.shape[0]))


def as_mapping(mapping: Any, n_targets: int, name: str = "mapping") -> np.ndarray:
    """Check that ``mapping`` is a non-empty 1-D integer array with values in [0, n_targets)."""
    values = _as_numpy(mapping, name)
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {values.dtype}")
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {values.shape}")
    if values.min() < 0 or values.max() >= n_targets:
        raise ValueError(f"{name} has values outside [0, {n_targets})")
    return values.astype(np.int64)


# --- internals -------------------------------------------------------------------------------


def _check_matrix_fits(rows: int, cols: int, what: str) -> None:
    """A float64 rows x cols matrix must fit in the memory still available (checked before allocating)."""
    nbytes = 8 * rows * cols
    available = _arrays._cpu_available_bytes()
    if nbytes > available:
        raise _arrays.AllocationTooLarge(f"{what}: a {rows} x {cols} float64 matrix needs {nbytes} bytes "
                                         f"({nbytes / 2**30:.3g} GiB), but only {available} bytes are available")


def _as_numpy(values: Any, name: str) -> np.ndarray:
    if _arrays.is_tensor(values):
        return values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        return values
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(values).__name__}")


def _checked_channel(channel: Any, name: str = "channel") -> tuple[Any, ColumnStats]:
    """The checked matrix and its unweighted column statistics, which the check needs anyway."""
    if _arrays.is_tensor(channel):
        if str(channel.dtype) not in ("torch.float32", "torch.float64"):
            raise TypeError(f"{name} must have dtype float32 or float64, got {channel.dtype}")
        matrix = channel.detach()
        if matrix.ndim == 2 and matrix.shape[1] > 1 and matrix.stride(1) != 1:
            matrix = matrix.contiguous()
        if matrix.layout == torch_strided() and matrix.numel() and matrix.data_ptr() % matrix.element_size():
            matrix = matrix.clone()  # unaligned (torch.frombuffer at an odd offset): the kernels need aligned data
    elif isinstance(channel, np.ndarray):
        if channel.dtype.kind in "biu":
            matrix = channel.astype(np.float64)
        elif channel.dtype in ROW_SUM_TOLERANCE:
            matrix = channel
        else:
            raise TypeError(f"{name} must have dtype float32 or float64, got {channel.dtype}")
        if matrix.ndim == 2 and matrix.shape[1] > 1 and matrix.strides[1] != matrix.itemsize:
            matrix = np.ascontiguousarray(matrix)
        if not matrix.flags.aligned:
            matrix = matrix.copy()  # a view at an odd byte offset: the kernels need aligned data
    else:
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(channel).__name__}")
    if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"{name} must be a 2-D array with at least one row and one column, "
                         f"got shape {tuple(matrix.shape)}")

    stats = _column_stats(matrix, None, ("max", "min"))
    # NaN fails both comparisons; an inf entry makes its column max inf.
    if not ((stats.min >= 0).all() and np.isfinite(stats.max).all()):
        column = int(np.flatnonzero(~((stats.min >= 0) & np.isfinite(stats.max)))[0])
        values = _as_numpy(matrix[:, column], name)
        row = int(np.flatnonzero(~np.isfinite(values) | (values < 0))[0])
        problem = "a non-finite" if not np.isfinite(values[row]) else "a negative"
        raise ValueError(f"{name} has {problem} entry {float(values[row])!r} at row {row}, column {column}")
    tolerance = ROW_SUM_TOLERANCE[np.dtype(str(matrix.dtype).removeprefix("torch."))]
    sums = _as_numpy(matrix @ _ones_like_row(matrix), name).astype(np.float64)
    off = np.abs(sums - 1.0) > tolerance
    if off.any():
        row = int(np.flatnonzero(off)[0])
        raise ValueError(f"{name} row {row} sums to {float(sums[row])!r}, not 1 "
                         f"(tolerance {tolerance:g} for {matrix.dtype})")
    return matrix, stats


def torch_strided() -> Any:
    return _arrays._loaded_torch().strided


def _ones_like_row(matrix: Any) -> Any:
    if _arrays.is_tensor(matrix):
        return matrix.new_ones(matrix.shape[1])
    return np.ones(matrix.shape[1], dtype=matrix.dtype)


def _column_stats(matrix: Any, row_weights: np.ndarray | None, stats: tuple[str, ...]) -> ColumnStats:
    """column_stats of only the statistics asked for (a faster pass), as numpy arrays (one entry per column)."""
    return ColumnStats(*(None if values is None else _as_numpy(values, "column_stats")
                         for values in column_stats(matrix, row_weights, stats=stats)))


def _sum(values: np.ndarray) -> float:
    return float(values.astype(np.float64).sum())


def _capacity_over_rows(matrix: Any, rows: np.ndarray) -> float:
    """sum_y max_{x in rows} C[x, y] for a boolean row mask, without copying the rows.

    Weights 1 on the chosen rows and 0 elsewhere leave each column max over the chosen rows,
    because the entries are non-negative.
    """
    return _sum(_column_stats(matrix, rows.astype(np.float64), ("max",)).max)


def _bayes_vulnerabilities(channel: Any, prior: Any) -> tuple[float, float]:
    """(V(pi, C), V(pi))."""
    matrix, _ = _checked_channel(channel)
    weights = as_prior(prior, matrix.shape[0])
    return _sum(_column_stats(matrix, weights, ("max",)).max), float(weights.max())


def _g_vulnerabilities(channel: Any, prior: Any, gain: Gain) -> tuple[float, float]:
    """(V_g(pi, C), V_g(pi)); the posterior one a column block of C at a time."""
    matrix, _ = _checked_channel(channel)
    weights = as_prior(prior, matrix.shape[0])
    gains = as_gain(gain, matrix.shape[0])
    weighted_gains = gains * weights  # G[w, x] pi[x]
    posterior = sum(_sum(_column_stats(weighted_gains @ block, None, ("max",)).max)
                    for _, block in _float64_blocks(matrix, axis=1))
    return posterior, float((gains @ weights).max())


def _float64_blocks(matrix: Any, axis: int) -> Iterator[tuple[slice, np.ndarray]]:
    """Consecutive row (axis 0) or column (axis 1) blocks of the matrix as float64 numpy copies."""
    length, other = matrix.shape[axis], matrix.shape[1 - axis]
    step = max(1, _BLOCK_ENTRIES // other)
    for start in range(0, length, step):
        span = slice(start, min(start + step, length))
        block = matrix[span] if axis == 0 else matrix[:, span]
        yield span, _as_numpy(block, "channel").astype(np.float64, copy=False)


def _js_generator(t: Any) -> Any:
    """phi with JS(A || B) = sum_d B[d] phi(A[d] / B[d]) (natural log), elementwise (a float for a
    float).

    Near t = 1 the two logs cancel to O((t - 1)^2), which left a rounding error of 1e-17 (5e-9
    after the square root of a JS distance). There, with u = (t - 1) / (t + 1),
    phi = (log(1 - u^2) + 2 u atanh(u)) / (2 (1 - u)), whose terms are -u^2 and 2 u^2: no
    cancellation.
    """
    t = np.asarray(t, dtype=np.float64)
    u = (t - 1.0) / (t + 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        stable = (np.log1p(-u * u) + 2.0 * u * np.arctanh(u)) / (2.0 * (1.0 - u))
        direct = 0.5 * (np.where(t > 0, t * np.log(2.0 * t / (1.0 + t)), 0.0) + np.log(2.0 / (1.0 + t)))
    result = np.where(np.abs(u) < 0.5, stable, direct)
    return float(result) if result.ndim == 0 else result


def _relative_entropy_by_row(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum_j a[i, j] log(a[i, j] / b[i, j]) for each row i (b broadcasts), with 0 log 0 = 0.

    Needs b > 0 wherever a > 0. Works in place on one temporary: twice as fast as
    scipy.special.rel_entr, which matters for mutual information over 1e9 entries.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = a / b
    # a = 0 gives a ratio of 0 (or NaN for 0/0); fmax turns both into a finite log that a = 0 zeroes.
    np.fmax(terms, np.finfo(terms.dtype).tiny, out=terms)
    np.log(terms, out=terms)
    terms *= a
    return terms.sum(axis=-1)


def _take_rows(matrix: Any, rows: np.ndarray) -> Any:
    if _arrays.is_tensor(matrix):
        import torch

        return matrix[torch.as_tensor(rows, device=matrix.device)]
    return matrix[rows]
