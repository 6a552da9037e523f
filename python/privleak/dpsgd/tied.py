"""Tied weights in book-keeping: one parameter used by several layers (a language model's token
embedding and its output head, ``lm_head.weight = wte.weight`` in GPT-2), with exact per-sample
norms and no per-sample gradient formed.

Each layer k that uses the parameter contributes G^k_i to sample i's gradient, and the norm that
is clipped is that of the sum:

    |sum_k G^k_i|_F^2 = sum_k |G^k_i|_F^2 + 2 sum_{k<l} <G^k_i, G^l_i>.

The layers give their own squared norms (ghost norms); the cross terms come from their factors.
A Linear-like layer's gradient of a (m, n) weight is G_i = sum_s L_{i,s} R_{i,s}^T over its
positions s (nn.Linear: L = the output gradients g, R = the inputs a; GPT-2's transposed Conv1D:
L = a, R = g; nn.Embedding: L = the one-hot rows of the ids, R = g), so

    <G_i, G'_i> = sum_{s,t} (L_{i,s} . L'_{i,t}) (R_{i,s} . R'_{i,t}),

the ghost norm's formula with two layers' factors (Goodfellow 2015; Li et al., ICLR 2022): for
one-hot L the dot products are the other side's entries at the ids, L'_{i,t}[id_{i,s}], or the
equality of two ids. It costs two S x T Gram matrices a sample, as a ghost norm does. The
clipped sum is each layer's clipped sum with the one clip factor of the parameter, added.

private-transformers (Li et al.) unties such a parameter instead ("ghost clipping can't handle
parameter sharing", its FAQ). An L1 clip norm (Laplace) does not split over the layers this way,
and is refused for a tied parameter.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from privleak.dpsgd import ghost_norm

#: Values of the two S x T Gram matrices held at once while the cross terms are formed: samples
#: are taken a few at a time beyond it (a GPT-2 at T = 1024 holds 2^20 of them a sample).
_GRAM_BUDGET = 2**24


class Factors(NamedTuple):
    """A layer's per-sample gradient of a (m, n) parameter, G_i = sum_s L_{i,s} R_{i,s}^T:
    ``left`` (B, S, m) dense, or integer ids (B, S) standing for one-hot rows of m; ``right``
    (B, S, n)."""

    left: torch.Tensor
    right: torch.Tensor

    @property
    def one_hot(self) -> bool:
        return not self.left.is_floating_point()


def _left_gram(first: Factors, second: Factors, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, T): L_{i,s} . L'_{i,t}, in ``dtype``. A dense side is read only at the other's ids
    (a head's (B, T, V) logit gradients: no copy of them in another dtype)."""
    if first.one_hot and second.one_hot:
        return (first.left.unsqueeze(2) == second.left.unsqueeze(1)).to(dtype)
    if first.one_hot:
        return _left_gram(second, first, dtype).transpose(1, 2)
    if second.one_hot:  # L_s . e_{id_t} = L_s[id_t]
        ids = second.left.unsqueeze(1).expand(-1, first.left.shape[1], -1)
        return first.left.gather(2, ids).to(dtype)
    return torch.bmm(first.left.to(dtype), second.left.to(dtype).transpose(1, 2))


def cross_term(first: Factors, second: Factors) -> torch.Tensor:
    """(B,) float64: <G_i, G'_i> = sum_{s,t} (L_s . L'_t)(R_s . R'_t) for each sample i, from two
    layers' :class:`Factors` of one parameter (the module docstring). Float32 products (float64
    for float64 factors), summed in float64; a few samples at a time."""
    dtype = torch.promote_types(torch.promote_types(first.right.dtype, second.right.dtype), torch.float32)
    batch, positions = first.right.shape[0], first.right.shape[1] * second.right.shape[1]
    step = max(1, _GRAM_BUDGET // max(2 * positions, 1))
    terms = []
    for i in range(0, batch, step):
        a, b = (Factors(f.left[i:i + step], f.right[i:i + step]) for f in (first, second))
        right = torch.bmm(a.right.to(dtype), b.right.to(dtype).transpose(1, 2))
        terms.append((_left_gram(a, b, dtype) * right).sum((1, 2), dtype=torch.float64))
    return torch.cat(terms) if terms else torch.zeros(0, dtype=torch.float64, device=first.right.device)


def cross_terms(factors: list) -> torch.Tensor:
    """(B,) float64: 2 sum_{k<l} <G^k_i, G^l_i> over the layers' :class:`Factors` of one parameter."""
    pairs = [cross_term(first, second) for k, first in enumerate(factors) for second in factors[k + 1:]]
    return 2 * sum(pairs[1:], pairs[0])


def tied_norms(own: torch.Tensor, factors: list, *, may_sync: bool = True, lost: Optional[list] = None) -> torch.Tensor:
    """(B,) float64 |sum_k G^k_i|^2: the layers' own squared norms ``own`` (added; each one
    vouched for by its layer) plus :func:`cross_terms`, vouched for as the ghost norms are
    (:func:`~privleak.dpsgd.ghost_norm.vouched`) by their rounding bound, 2 sum_{k<l} c_kl S^k S^l
    with S^k = sum_s |L^k_s| |R^k_s| and c_kl = (m + n) u for float32 products of the two Grams'
    lengths (n u alone where a left side is one-hot: its Gram is exact), plus the float64 sum's:
    two layers whose gradients nearly cancel (an embedding and the head tied to it) left a sum
    that float32 could not hold, and a sample unclipped at 2.8 times its clip norm. Past the
    bound's 2^-4 of the total, those samples' totals are computed again from float64 factors,
    sum_{k,l} <G^k, G^l> (``may_sync``: a host read may wait for the rows, unlike in a CUDA
    graph's capture, where the total is only raised). Their rows are appended to ``lost`` where
    given, for :func:`clipped_sum`."""
    total = own + cross_terms(factors)
    exact = all(f.right.dtype == torch.float64 for f in factors)
    again = None if exact or not may_sync else functools.partial(_again, factors)
    return ghost_norm.vouched(total, _cross_bound(factors), again, lost)


def clipped_sum(factors: list, weights: torch.Tensor, rows: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """float64, ``parameter``'s shape: sum_{i in rows} w_i sum_k G^k_i, the layers' gradients of
    samples ``rows`` added in float64 before one rounding. For the samples whose totals were
    computed again (:func:`tied_norms`' ``lost``): their layers' gradients cancel, and each
    layer's float32 sum rounds its own gradient, which is far larger than the total; the
    update released one at 1 + 1.7e-5 times its clip norm."""
    total = torch.zeros(parameter.shape, dtype=torch.float64, device=parameter.device)
    scale = weights[rows].double().view(-1, 1, 1)
    for factor in factors:
        right = (factor.right[rows].double() * scale).flatten(0, 1)
        if factor.one_hot:
            total.index_add_(0, factor.left[rows].flatten(), right)
        else:
            total.addmm_(factor.left[rows].double().flatten(0, 1).T, right)
    return total


def _row_norms(factor: Factors) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) float64 |L_s| and |R_s| (|L_s| = 1 for a one-hot row)."""
    right = ghost_norm.float_norms(factor.right, 2).double()
    if factor.one_hot:
        return torch.ones_like(right), right
    return ghost_norm.float_norms(factor.left, 2).double(), right


def _cross_bound(factors: list, *, pairs_only: bool = True) -> torch.Tensor:
    """(B,) float64: the bound on the rounding of 2 sum_{k<l} <G^k, G^l> (with ``pairs_only``
    False, of sum_{k,l}: the pairs k = l too), 3% of room as the ghost norms' bound has. Not
    :func:`~privleak.dpsgd.ghost_norm.rounding_bound`'s coefficient: torch's bmm chains run the
    Grams' whole lengths (no chunks of 128), and a one-hot side's Gram is exact. Plus what the
    roundings below the normal range lose (:func:`~privleak.dpsgd.ghost_norm.underflow_bound`'s
    reason), tiny (n_L S_R^k S_R^l + n_R S_L^k S_L^l + S T) with S_L = sum_s |L_s|, S_R likewise,
    the last term the float32 products of the two Grams' S T entries."""
    norms = [_row_norms(f) for f in factors]
    spreads = [torch.linalg.vecdot(left, right) for left, right in norms]
    sums = [(left.sum(1), right.sum(1)) for left, right in norms]
    bound = torch.zeros_like(spreads[0])
    for k, first in enumerate(factors):
        for other in range(k if not pairs_only else k + 1, len(factors)):
            second = factors[other]
            exact = all(f.right.dtype == torch.float64 for f in (first, second))
            u = 2.0**-53 if exact else 2.0**-24
            left_length = 0 if first.one_hot or second.one_hot else first.left.shape[2]
            lengths = first.right.shape[2] + left_length
            terms = first.right.shape[1] * second.right.shape[1]
            coefficient = (lengths * u + (terms + 67) * 2.0**-53) * 1.03
            (left_k, right_k), (left_l, right_l) = sums[k], sums[other]
            underflow = ghost_norm.smallest_normal(torch.float64 if exact else torch.float32) * (
                left_length * right_k * right_l + first.right.shape[2] * left_k * left_l + terms)
            bound = bound + (1 if k == other else 2) * (coefficient * spreads[k] * spreads[other] + underflow)
    return bound


def _again(factors: list, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The totals sum_{k,l} <G^k, G^l> of samples ``rows`` from float64 factors, and their bound."""
    exact = [Factors(f.left[rows] if f.one_hot else f.left[rows].double(), f.right[rows].double()) for f in factors]
    total = sum(cross_term(first, second) * (1 if k == other else 2)
                for k, first in enumerate(exact) for other, second in enumerate(exact) if other >= k)
    return total, _cross_bound(exact, pairs_only=False)
