"""Ghost norms: each sample's squared gradient norm of a layer from the layer's inputs and output
gradients, without forming the per-sample gradient (Goodfellow 2015; Li et al., ICLR 2022; Bu et
al., ICML 2023).

A layer y_t = W a_t (+ b) applied at positions t = 1..T of sample i has the per-sample weight
gradient G_i = sum_t g_{i,t} a_{i,t}^T, with g_{i,t} = dL_i / dy_{i,t}. Its squared Frobenius norm is

    |G_i|_F^2 = sum_{t,s} (a_{i,t} . a_{i,s}) (g_{i,t} . g_{i,s}),

which costs O(T^2 (d + p)) instead of O(T d p). An Embedding's input is one-hot, so
a_t . a_s = [id_t == id_s].

These are the pure references; the kernels (where built) must equal them.
"""
from __future__ import annotations

import torch


def ghost_norm_squared_reference(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64: sum_{t,s} (a_t . a_s)(g_t . g_s) per sample, for activations (B, T, d) and
    output gradients (B, T, p), from the two T x T Gram matrices in float64."""
    a, g = activations.double(), output_grads.double()
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))


def embedding_ghost_norm_squared_reference(ids: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64: sum_{t,s} [id_t == id_s](g_t . g_s) per sample, for token ids (B, T) and output
    gradients (B, T, p): the squared norm of an Embedding's per-sample weight gradient."""
    g = output_grads.double()
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).double()
    return (same * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))


def ghost_norm_squared(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64 squared per-sample norms of a Linear-like layer's weight gradient (module docstring)."""
    return ghost_norm_squared_reference(activations, output_grads)


def embedding_ghost_norm_squared(ids: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """(B,) float64 squared per-sample norms of an Embedding's weight gradient (module docstring)."""
    return embedding_ghost_norm_squared_reference(ids, output_grads)
