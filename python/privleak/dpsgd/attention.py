"""nn.MultiheadAttention under book-keeping (:class:`privleak.dpsgd.BookKeeping`).

The module computes its projections functionally, ``F.linear`` on ``in_proj_weight`` (or its
rows) and on ``out_proj``'s parameters inside ``F.multi_head_attention_forward``, out of any
module hook's sight. While a recorded forward call runs, a torch function mode takes that one
call and computes it by :func:`attention_forward`, which does what torch's function does, op for
op, but keeps each projection's input and output: each is an nn.Linear to book-keeping, its
per-sample norm the ghost norm (or the per-sample gradient, by the mixed rule) and its clipped
sum one GEMM (:mod:`privleak.dpsgd.layers`). Nothing is recomputed, so dropout on the attention
weights is allowed, and no sample's gradients are formed for the weights.

The rows of ``in_proj_weight`` that a projection uses are its rows in the parameter: torch
projects self-attention with all 3E rows at once, a query and a shared key-value with E and 2E,
three inputs with E each. Disjoint rows' per-sample gradients are disjoint blocks of the
parameter's, so their squared norms (or L1 norms) add. ``bias_k`` and ``bias_v`` are appended to
every sample's keys and values: each sample's gradient is that of its own copy.

:func:`attention_forward` checks its arguments and converts the masks with torch's own private
helpers (``F._mha_shape_check``, ``F._canonical_mask``), so that errors and mask forms are
torch's; a torch that renames them fails the tests (tests/test_bookkeeping_attention.py compares
the function with torch's on every form of its arguments).
"""
from __future__ import annotations

import inspect
import math
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from privleak.dpsgd import graph
from privleak.dpsgd.layers import Layer, _common, _input_nodes, clipped_weight_sum, layer_kind, total, weight_norms


class Projection(NamedTuple):
    """One F.linear of the attention: rows ``rows`` (start, stop) of the parameter ``weight`` and
    ``bias_rows`` of ``bias`` (None: none, or frozen); its input (positions, B, d; None for a frozen
    weight) and output (positions, B, p), positions first as torch's attention lays them out (the
    output projection's (T B, d) rows are read as (T, B, d)). The output is dropped once its
    gradient edge is taken."""

    weight: torch.Tensor
    rows: tuple
    bias: Optional[torch.Tensor]
    bias_rows: tuple
    inputs: Optional[torch.Tensor]
    output: Optional[torch.Tensor]


class Appended(NamedTuple):
    """``bias_k`` or ``bias_v`` (1, 1, E) repeated over the batch (1, B, E) and appended to the keys
    or values: each sample's gradient is the output gradient of its copy."""

    parameter: torch.Tensor
    output: Optional[torch.Tensor]


def attention_forward(project, append, query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                      in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                      training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                      use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
                      static_k=None, static_v=None, average_attn_weights=True, is_causal=False):
    """``F.multi_head_attention_forward`` (torch's arguments and semantics: the masks' forms, the
    causal hint, the attention weights with ``need_weights``, dropout drawn as torch draws it), with
    each projection made by ``project(x, weight, bias, rows, bias_rows)`` (the parameters; (start,
    stop) of the rows of each it uses)
    and ``bias_k``/``bias_v`` repeated over the batch by ``append(parameter, batch)``, so that the
    caller keeps what book-keeping needs. For batched inputs (positions, B, E); nn.MultiheadAttention
    passes no static keys or values."""
    if static_k is not None or static_v is not None:
        raise ValueError("book-keeping's nn.MultiheadAttention rule takes no static_k or static_v")
    if not F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads):
        raise ValueError("nn.MultiheadAttention got an unbatched (2-D) query: book-keeping needs the batch's samples")
    tgt_len, bsz, embed_dim = query.shape
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA takes the hint alone
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}")
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")

    E = embed_dim
    if not use_separate_proj_weight:
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        w = in_proj_weight
        if key is value and query is key:  # self-attention: one product of all 3E rows
            proj = project(query, w, in_proj_bias, (0, 3 * E), (0, 3 * E))
            q, k, v = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        elif key is value:  # a query and a shared key-value
            q = project(query, w, in_proj_bias, (0, E), (0, E))
            kv = project(key, w, in_proj_bias, (E, 3 * E), (E, 3 * E))
            k, v = kv.unflatten(-1, (2, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        else:
            q, k, v = (project(x, w, in_proj_bias, rows, rows)
                       for x, rows in zip((query, key, value), ((0, E), (E, 2 * E), (2 * E, 3 * E))))
    else:
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                                 f"{value.shape[:2]}")
        q, k, v = (project(x, w, in_proj_bias, (0, E), (i * E, (i + 1) * E))
                   for i, (x, w) in enumerate(((query, q_proj_weight), (key, k_proj_weight), (value, v_proj_weight))))

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, key.shape[0]):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(tgt_len, key.shape[0])}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, key.shape[0]):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(bsz * num_heads, tgt_len, key.shape[0])}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, append(bias_k, bsz)])
        v = torch.cat([v, append(bias_v, bsz)])
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    elif bias_k is not None or bias_v is not None:
        raise AssertionError("bias_k and bias_v must both be set or both be None")

    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    if add_zero_attn:
        zeros = torch.zeros((bsz * num_heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                 f"{key_padding_mask.shape}")
        key_padding_mask = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(
            bsz * num_heads, 1, src_len)
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0

    if need_weights:
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = project(out, out_proj_weight, out_proj_bias, (0, E), (0, E))
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        return out.view(tgt_len, bsz, out.size(1)), weights.mean(dim=1) if average_attn_weights else weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k, v = (x.view(bsz, num_heads, src_len, head_dim) for x in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = project(out, out_proj_weight, out_proj_bias, (0, E), (0, E))
    return out.view(tgt_len, bsz, out.size(1)), None


_SIGNATURE = inspect.signature(attention_forward)


class _Recorder(TorchFunctionMode):
    """On through one recorded forward call of ``module``: computes its
    ``F.multi_head_attention_forward`` by :func:`attention_forward`, keeping in ``found`` the
    projections and appended biases whose outputs need gradients for a trainable parameter; every
    other torch function runs as it is. Only the module's one call with grad is taken: a mode left
    on by an interrupted forward (a KeyboardInterrupt runs no forward hook) passes the rest on."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.found: list = []
        self.batch = 0
        self.done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.multi_head_attention_forward or self.done or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        bound = _SIGNATURE.bind(self._project, self._append, *args, **kwargs)
        if bound.arguments["out_proj_weight"] is not self.module.out_proj.weight:  # another module's
            return func(*args, **kwargs)
        self.done = True
        self.batch = bound.arguments["query"].shape[1] if bound.arguments["query"].ndim == 3 else 0
        return attention_forward(*bound.args, **bound.kwargs)

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: tuple,
                 bias_rows: tuple) -> torch.Tensor:
        def used(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:  # torch's split and chunk are such views
            return p if stop - start == p.shape[0] else p[start:stop]

        y = F.linear(x, used(weight, *rows), None if bias is None else used(bias, *bias_rows))
        trained = weight.requires_grad, bias is not None and bias.requires_grad
        if y.requires_grad and any(trained):  # the input only for a trained weight
            self.found.append(Projection(weight, rows, bias if trained[1] else None, bias_rows,
                                         x if trained[0] else None, y))
        return y

    def _append(self, parameter: torch.Tensor, batch: int):
        y = parameter.repeat(1, batch, 1)
        if parameter.requires_grad:
            self.found.append(Appended(parameter, y))
        return y


@layer_kind(nn.MultiheadAttention)
class MultiheadAttentionLayer(Layer):
    """nn.MultiheadAttention (any ``batch_first``, self- or cross-attention, ``kdim``/``vdim``,
    ``bias``, ``add_bias_kv``, ``add_zero_attn``, masks, dropout): each projection an nn.Linear to
    book-keeping (module docstring). The layer answers for ``out_proj``'s parameters too."""

    claims_children = True
    uses_per_call = None
    intercepts_forward = True

    def clear(self) -> None:
        super().clear()
        self.batches: list[int] = []
        self.call_edge_lists: list = []
        self.sites: dict = {}  # after finish: parameter id -> (weight, [(rows, inputs, output grads)]), batch first

    def forward_mode(self) -> _Recorder:
        """Takes the forward call's attention (:class:`_Recorder`)."""
        return _Recorder(self.module)

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        recorder, self.recorder = self.recorder, None
        if recorder is None or not output[0].requires_grad:
            return []
        roots = [t.grad_fn for t in output if t is not None and t.grad_fn is not None]  # (output, weights or None)
        self.uses.append(graph.count_uses(roots, self.parameters, stop=_input_nodes([*args, *kwargs.values()]),
                                          graph=f"the output of {self.describe()}"))
        outputs = [site.output for site in recorder.found]
        # The outputs are not kept (their gradients come by their edges): autograd frees them.
        self.calls.append([site._replace(inputs=None if site.inputs is None else self.keep(site.inputs), output=None)
                           if isinstance(site, Projection) else site._replace(output=None) for site in recorder.found])
        self.sources.append(None)
        self.batches.append(recorder.batch)
        edges = [get_gradient_edge(y) for y in outputs]
        self.edges.extend(edges)
        self.call_edge_lists.append(edges)
        self.grads.append([None] * len(outputs))
        return outputs

    def batch_sizes(self) -> list[int]:
        return self.batches

    def call_edges(self, call: int) -> list:
        return self.call_edge_lists[call]

    def batch_dims(self, call: int) -> list:
        """torch's attention projects sequence first: (T, B, E) projections hold the batch in dim 1;
        the output projection's (T B, E) rows are no batch's alone (-1)."""
        return [1 if len(edge.node._input_metadata[edge.output_nr].shape) == 3 else -1
                for edge in self.call_edge_lists[call]]

    def batch_first(self, call: int, output: int, grad: torch.Tensor, batch: int) -> torch.Tensor:
        """The output projection's (T B, E) rows as :meth:`finish` reads them, position by position."""
        return grad.unflatten(0, (-1, batch)).transpose(0, 1) if grad.ndim == 2 else grad.transpose(0, 1)

    def finish(self) -> None:
        """Each weight's uses as disjoint row blocks of inputs and output gradients, batch first
        (:func:`_blocks`); the biases' and ``bias_k``/``bias_v``'s per-sample gradients formed."""
        batch = self.batches[0] if self.batches else 0
        weights: dict = {}
        for sites, grads in zip(self.calls, self.grads):
            for site, g in zip(sites, grads):
                if g is None:  # the loss does not use this call's output
                    continue
                if isinstance(site, Appended):  # (1, B, E): each sample's copy
                    self._add(site.parameter, slice(None), g[0].reshape(batch, 1, 1, -1))
                    continue
                if g.ndim == 2:  # the output projection's (T B, p) rows
                    g = g.unflatten(0, (-1, batch))
                if site.bias is not None:  # over the positions (dim 0); half precision would round: float32
                    self._add(site.bias, slice(*site.bias_rows), g.sum(0, dtype=torch.promote_types(g.dtype,
                                                                                                     torch.float32)))
                if site.inputs is not None:
                    # Batch first, once, for the ghost-norm kernel and the GEMM alike (a self-attention's
                    # input is a view of a batch-first tensor already; the rest are copied).
                    a = site.inputs if site.inputs.ndim == 3 else site.inputs.unflatten(0, (-1, batch))
                    weights.setdefault(id(site.weight), (site.weight, []))[1].append(
                        (site.rows, a.transpose(0, 1).contiguous(), g.transpose(0, 1).contiguous()))
        self.sites = {key: (weight, _blocks(found)) for key, (weight, found) in weights.items()}
        self.calls, self.grads = [], []

    def _add(self, parameter: torch.Tensor, rows: slice, values: torch.Tensor) -> None:
        """Add per-sample gradients ``values`` (B, ...) into rows ``rows`` of the parameter's."""
        key = id(parameter)
        if key not in self.per_sample:
            self.per_sample[key] = values.new_zeros(values.shape[0], *parameter.shape,
                                                    dtype=torch.promote_types(values.dtype, torch.float32))
        self.per_sample[key][:, rows] += values

    def norms(self, batch: int, norm_type: int) -> dict:
        """Each weight's norms, its blocks' added; zeros for a parameter the step did not use."""
        found = {key: [weight_norms(*_common(a, g), norm_type, deferred=len(blocks) == 1, may_sync=self.may_sync,
                                    lost=self.lost.setdefault((key, rows), []))
                       for rows, a, g in blocks]
                 for key, (_, blocks) in self.sites.items()}  # one block: BookKeeping's one kernel call for all
        norms = {key: total(ns) for key, ns in found.items()}
        return {**{id(p): torch.zeros(batch, dtype=torch.float64, device=p.device) for p in self.parameters
                   if id(p) not in self.per_sample}, **norms}

    def clipped_sums(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """Each weight's blocks' sums (f g)^T a in its rows; zeros for a parameter the step did not use."""
        sums = {}
        for p in self.parameters:
            if id(p) in factors:
                sums[id(p)] = summed = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for (start, stop), a, g in self.sites.get(id(p), (None, ()))[1]:
                    summed[start:stop] += clipped_weight_sum(*_common(a, g), factors[id(p)], keep, norm_type,
                                                             lost=self.lost.get((id(p), (start, stop))))
        return sums


def _blocks(found: list) -> list:
    """Uses [(rows, inputs, output grads)] of one weight as disjoint row blocks: a use's output
    gradients split where another use's rows start or stop (the module called once as
    self-attention, once with other keys), then the uses of the same rows laid end to end along
    their positions (the per-sample gradient of a block sums over them)."""
    cuts = sorted({r for rows, _, _ in found for r in rows})
    pieces: dict = {}
    for (start, stop), a, g in found:
        inner = [c for c in cuts if start <= c <= stop]
        for lo, hi in zip(inner, inner[1:]):
            pieces.setdefault((lo, hi), []).append((a, g[..., lo - start:hi - start]))
    return [((lo, hi), *(parts[0] if len(parts) == 1 else (torch.cat([a for a, _ in parts], 1),
                                                          torch.cat([g for _, g in parts], 1))))
            for (lo, hi), parts in sorted(pieces.items())]


@layer_kind(nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
class SequenceFirstTransformerLayer(Layer):
    """torch's transformer layers (and nn.Transformer, built of them) with ``batch_first=False``,
    refused when BookKeeping is built: their Linear and LayerNorm layers would take the positions
    (dim 0) for the samples, which a sequence as long as the batch would not reveal. With
    ``batch_first=True`` the layers' children take their own rules."""

    hook_without_parameters = True

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        return not module.self_attn.batch_first

    def __init__(self, name: str, module: nn.Module):
        super().__init__(name, module)
        raise ValueError(f"{self.describe()} has batch_first=False: its Linear and LayerNorm layers would read the "
                         "sequence (dim 0) as the batch, and book-keeping splits every layer's input by sample along "
                         "dim 0; build it with batch_first=True")
