"""Book-keeping for a mixture of experts as Hugging Face builds it: the experts module of Mixtral,
Qwen-MoE, OLMoE, DeepSeek, GPT-OSS and the other models whose experts class transformers decorates
with ``use_experts_implementation`` (the experts' weights in 3D parameters, one matrix per expert,
the forward any of transformers' implementations: eager, ``batched_mm``, ``grouped_mm``).

The module takes the tokens flattened to (N, d) (N = B T), each token's top-k experts e_{n,j} and
routing weights w_{n,j}, and returns y_n = sum_j w_{n,j} D_e phi(U_e x_n) (biases added where it
has them; phi the activation, or the gate ``act(gate) * up`` of the two halves of U_e x_n). Each
pair r = (token n, slot j) routed to expert e is one row of two Linear layers of expert e: the up
projection, input x_n and output gradient u_r = dL/d(U_e x_n), and the down projection, input
h_r = phi(U_e x_n) and output gradient v_r = w_{n,j} g_n, with g_n the module's output gradient.
So the per-sample gradient of U (all experts) has, per expert e, the Linear layer's form
sum_{r in R(i, e)} u_r x_r^T over the rows R(i, e) of sample i routed to e, and

    |G_i(U)|_F^2 = sum_e sum_{r, s in R(i, e)} (x_r . x_s)(u_r . u_s),

the ghost norm of each (sample, expert) group of about T k / E rows (a (T k / E)^2 Gram instead of
the expert's matrix: Bu et al.'s mixed rule, per group), and the clipped sum of expert e is one
matrix product over its rows, sum_r f_{i(r)} u_r x_r^T (book-keeping: Bu et al., "Differentially
Private Optimization on Large Model at Small Cost", ICML 2023); where the groups' gradients are
formed for their norms instead, the sum adds those (:func:`~privleak.dpsgd.layers.formed_sums`).
u_r and h_r are recomputed after the backward pass from the recorded x, routing and g: the up
projection and phi again, and one product with D_e for u (about a third of the module's forward
and backward); the rows are grouped by expert, then sample.
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from privleak.dpsgd import graph
from privleak.dpsgd.layers import (
    Layer,
    _common,
    _formed_weight_grads,
    _input_nodes,
    _scaled,
    _zero_dropped,
    formed_sums,
    forms_weight_grads,
    layer_kind,
    row_norms,
    samples_per_chunk,
    weight_norms,
)


class _Projection(NamedTuple):
    """One of the experts' two Linear layers: weight (E, out, in), or (E, in, out) transposed, and
    bias (E, out) or None."""

    weight: nn.Parameter
    bias: Optional[nn.Parameter]


class _Routed(NamedTuple):
    """The recorded calls' (token, expert) pairs, sorted by expert, then sample: per pair its
    sample, expert, call, token (its row in that call) and routing weight, and the recomputed
    output gradient u of the up projection and input h of the down projection (the other two
    factors, x and w g, are gathered from the recorded tensors when wanted)."""

    samples: torch.Tensor  # (R,) int64
    experts: torch.Tensor  # (R,) int64
    calls: torch.Tensor  # (R,) int64
    tokens: torch.Tensor  # (R,) int64
    routing: torch.Tensor  # (R,)
    u: torch.Tensor  # (R, p)
    h: torch.Tensor  # (R, I)
    counts: list  # pairs per expert

    def size(self) -> int:
        return self.u.numel() + self.h.numel()


@layer_kind("transformers.models.*.modeling_*.*Experts")
class ExpertsLayer(Layer):
    """A Hugging Face experts module (``use_experts_implementation``): the per-sample norms of its
    up (or gate-up) and down projections' 3D weights and biases from ghost norms of each (sample,
    expert) group of routed tokens, the clipped sums one product per expert (module docstring).
    Registered by name, so privleak needs no transformers to import; an experts class of another
    form (a norm after each expert, expert parallelism, no such attributes) takes the replay
    (:class:`~privleak.dpsgd.layers.FunctionalLayer`)."""

    uses_per_call = None  # the eager forward indexes each expert's matrix: one use per expert hit
    flattened_batch_calls = True

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        gated = getattr(module, "has_gate", None)
        up, activation = ("gate_up_proj", "_apply_gate") if gated else ("up_proj", "act_fn")
        needed = ("has_gate", "has_bias", "is_transposed", "num_experts", activation)
        return (super().takes(module) and all(hasattr(module, a) for a in needed)
                and not getattr(module, "has_post_expert_norm", False)
                and not getattr(module, "_is_expert_parallel", False)
                and all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).ndim == 3
                        for n in (up, "down_proj")))

    def __init__(self, name: str, module: nn.Module):
        super().__init__(name, module)
        up = "gate_up_proj" if module.has_gate else "up_proj"
        self.projections = tuple(
            _Projection(getattr(module, n), getattr(module, f"{n}_bias") if module.has_bias else None)
            for n in (up, "down_proj"))

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return []
        bound = inspect.signature(self.module.forward).bind(*args, **kwargs)
        hidden, index, weights = list(bound.arguments.values())[:3]
        inputs, inner = _input_nodes([hidden, weights]), {}
        self.uses.append(graph.count_uses([output.grad_fn], self.parameters, stop=inputs,
                                          graph=f"the output of {self.describe()}", parents=inner))
        self.inner |= inner.keys() - inputs
        device = output.device.type  # the recomputation runs under the same autocast as this call
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.calls.append((self.keep(hidden), index.detach(), self.keep(weights), autocast))
        self.sources.append(hidden.grad_fn)
        self.edges.append(get_gradient_edge(output))
        self.grads.append([None])
        return [output]

    def clear(self) -> None:
        super().clear()
        self.kept_rows: Optional[_Routed] = None  # the norms' recomputed pairs, kept for the sums
        self.groups: Optional[_Groups] = None  # the norms' (sample, expert) groups
        self.bias_rows: dict = {}  # per bias, its groups' rows whose norms were taken
        self.inner: set = set()  # the autograd nodes of the calls' forwards

    def inner_nodes(self) -> set:
        """The experts' forwards take the tokens sorted by expert (transformers' grouped_mm), which
        the rule reads by routing, not row by row."""
        return self.inner

    def batch_sizes(self) -> list[int]:
        return [call[0].shape[0] for call in self.calls]

    def unflatten(self, call: int, batch: int) -> None:
        self.flattened[call] = batch

    def take_grad(self, call: int, output: int, grad: torch.Tensor, norm_type: int) -> None:
        self.grads[call][output] = grad  # (B T, d) as the call's input

    def _routed(self) -> _Routed:
        """The recorded calls' pairs, recomputed and sorted by expert, then sample."""
        found = [self._routed_call(call) for call in range(len(self.calls))]
        if len(found) == 1:
            return found[0]
        columns = [torch.cat(column) for column in zip(*[r[:-1] for r in found])]
        samples, experts = columns[:2]
        order = torch.argsort(experts * max(call[1].shape[0] for call in self.calls) + samples)  # sample < tokens
        return _Routed(*(t[order] for t in columns), torch.bincount(experts, minlength=len(found[0].counts)).tolist())

    def _routed_call(self, call: int) -> _Routed:
        m = self.module
        (hidden, index, weights, (device, enabled, dtype)), g = self.calls[call], self.grads[call]
        tokens, top_k = index.shape
        per_sample = tokens // self.flattened.get(call, tokens)
        token = torch.arange(tokens, device=index.device).repeat_interleave(top_k)
        experts, samples, routing = index.reshape(-1), token // per_sample, weights.reshape(-1)
        valid = experts < m.num_experts  # transformers' sentinel: a slot routed to no expert here
        order = torch.argsort(experts * tokens + samples)
        order = order[valid[order]]
        experts, samples, token, routing = experts[order], samples[order], token[order], routing[order]
        counts = torch.bincount(experts, minlength=m.num_experts).tolist()
        g = g.reshape(-1, g.shape[-1])
        (up_weight, up_bias), (down_weight, _) = self.projections
        rows, start = [], 0
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for e, n in enumerate(counts):
                if n:
                    pick = token[start:start + n]
                    pre = self._linear(hidden[pick], up_weight[e], None if up_bias is None else up_bias[e])
                    h = m._apply_gate(pre.requires_grad_()) if m.has_gate else m.act_fn(pre.requires_grad_())
                    v = g[pick] * routing[start:start + n, None].to(g.dtype)
                    down = down_weight[e].detach()
                    dh = v @ (down.T if m.is_transposed else down).to(v.dtype)
                    (u,) = torch.autograd.grad(h, pre, dh.to(h.dtype))
                    rows.append((u, h.detach()))
                    start += n
        if rows:
            u, h = (torch.cat(column) for column in zip(*rows))
        else:  # no pair routed here
            up = up_weight.shape[2 if m.is_transposed else 1]
            u, h = hidden.new_zeros(0, up), hidden.new_zeros(0, down_weight.shape[1 if m.is_transposed else 2])
        return _Routed(samples, experts, torch.full_like(samples, call), token, routing, u, h, counts)

    def _gathered(self, routed: _Routed) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, v): each pair's input x_n of the up projection and output gradient w g_n of the down
        projection, from its call's recorded input and output gradient."""
        if len(self.calls) == 1:
            hidden, g = self.calls[0][0], self.grads[0].reshape(-1, self.grads[0].shape[-1])
            return hidden[routed.tokens], g[routed.tokens] * routed.routing[:, None].to(g.dtype)
        x = self.calls[0][0].new_empty(len(routed.tokens), self.calls[0][0].shape[-1])
        v = self.grads[0].new_empty(len(routed.tokens), self.grads[0].shape[-1])
        for call, ((hidden, *_), g) in enumerate(zip(self.calls, self.grads)):
            pick = routed.calls == call
            tokens = routed.tokens[pick]
            x[pick] = hidden[tokens]
            v[pick] = g.reshape(-1, g.shape[-1])[tokens] * routed.routing[pick, None].to(g.dtype)
        return x, v

    def _factors(self, routed: _Routed) -> tuple[tuple, tuple]:
        """((x, u), (h, v)): the input and output gradient of each pair's up and down projections."""
        x, v = self._gathered(routed)
        return _common(x, routed.u), _common(routed.h, v)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The projection of one expert, ``weight`` its (out, in) matrix or (in, out) transposed."""
        weight = weight.detach()
        return F.linear(x, weight.T if self.module.is_transposed else weight, None if bias is None else bias.detach())

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        """The norms; the pairs' recomputed u and h are kept for :meth:`sums_by_parameter` where
        they are no larger than the sums that replace them (the module's trained parameters; for
        gated experts, S <= E d pairs): the layers free their inputs and output gradients as their
        sums are made, so holding the pairs until then adds nothing to the clip's peak (bench
        Mixtral, B 16: 50 MB of them a layer, as its sums; the step 1.40x -> 1.32x of non-private,
        B 8: 1.44x -> 1.21x). Larger, they are recomputed (a third of the module's forward and
        backward again)."""
        routed = self._routed()
        if routed.size() <= sum(p.numel() for p in self.parameters):
            self.kept_rows = routed
        groups = self.groups = _Groups(routed.experts * batch + routed.samples, routed.samples, routed.experts)
        norms = {}
        for (weight, bias), (a, g) in zip(self.projections, self._factors(routed)):
            if self.trains(weight):
                lost = self.lost.setdefault(id(weight), [])
                norms[id(weight)] = groups.per_sample(groups.weight_norms(a, g, norm_type, self.may_sync, lost), batch)
            if self.trains(bias):
                self.bias_rows[id(bias)] = rows = groups.sums(g)
                norms[id(bias)] = groups.per_sample(row_norms(rows, norm_type), batch)
        return norms

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """Per expert, sum_r f_{i(r)} g_r a_r^T, one matrix product over its pairs where the norms
        were ghost norms (the pairs of groups whose ghost norms were computed again in float64 left
        out of it and added by a float64 one:
        :func:`~privleak.dpsgd.layers.clipped_weight_sum`'s reason); where they came from each
        group's gradients formed, those formed again, weighted and added into their experts
        (:func:`~privleak.dpsgd.layers.formed_sums`' reason); a bias's, its groups' rows as the
        norms had them. The pairs are the norms' (kept, or recomputed by the same calls), a dropped
        sample's zeroed rather than left out, so that the groups stay the norms'."""
        routed, self.kept_rows = self.kept_rows, None
        routed = self._routed() if routed is None else routed
        groups, rows_kept = self.groups, None if keep is None else keep[routed.samples]
        groups_kept = None if keep is None else keep[groups.samples]
        experts = len(routed.counts)
        sums = {}
        for (weight, bias), (a, g) in zip(self.projections, self._factors(routed)):
            f = factors.get(id(weight))
            if self.trains(weight) and groups.forms(a, g, norm_type):
                total = groups.formed_sums(a, g, f[groups.samples], groups_kept, experts)
                sums[id(weight)] = total.transpose(1, 2).contiguous() if self.module.is_transposed else total
            elif self.trains(weight):
                lost = self.lost.get(id(weight))
                apart = torch.zeros(len(groups.samples), dtype=torch.bool, device=a.device).index_fill_(
                    0, torch.cat(lost), True)[groups.group] if lost else None  # per pair
                summed = rows_kept if apart is None else ~apart if rows_kept is None else rows_kept & ~apart
                left, right = _common(_zero_dropped(_scaled(g, f[routed.samples]), summed), _zero_dropped(a, summed))
                total = self._per_expert(left, right, routed.counts, weight, torch.float32)
                if apart is not None:
                    pairs = (apart if rows_kept is None else apart & rows_kept).nonzero()[:, 0]
                    left = g[pairs].double() * f[routed.samples[pairs]][:, None].double()
                    counts = torch.bincount(routed.experts[pairs], minlength=experts).tolist()
                    total += self._per_expert(left, a[pairs].double(), counts, weight, torch.float64).float()
                sums[id(weight)] = total
            if self.trains(bias):
                rows = _zero_dropped(self.bias_rows.pop(id(bias)), groups_kept)
                sums[id(bias)] = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device).index_add_(
                    0, groups.experts, rows.float() * factors[id(bias)][groups.samples][:, None])
        return sums

    def _per_expert(self, left: torch.Tensor, right: torch.Tensor, counts: list, weight: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """(E, p, d) (transposed: (E, d, p)) in ``dtype``: per expert e, sum_r L_r R_r^T over its
        ``counts[e]`` pairs, which follow those of the experts before it."""
        total = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                left_e, right_e = left[start:start + n], right[start:start + n]
                total[e] = (right_e.T @ left_e) if self.module.is_transposed else (left_e.T @ right_e)
                start += n
        return total


class _Groups:
    """The (sample, expert) groups of rows sorted by ``key`` (expert, then sample): each row's
    group and place in it, for the groups' rows padded with zeros to one length (zero rows add
    nothing to a Gram or a gradient)."""

    def __init__(self, key: torch.Tensor, samples: torch.Tensor, experts: torch.Tensor):
        starts = torch.ones_like(key, dtype=torch.bool)
        starts[1:] = key[1:] != key[:-1]
        self.group = starts.cumsum(0) - 1
        self.samples, self.experts = samples[starts], experts[starts]  # each group's sample and expert
        sizes = torch.bincount(self.group, minlength=len(self.samples))
        self.place = torch.arange(len(key), device=key.device) - (sizes.cumsum(0) - sizes)[self.group]
        self.length = int(sizes.max()) if len(key) else 0

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros(len(self.samples), self.length, rows.shape[-1])
        out[self.group, self.place] = rows
        return out

    def weight_norms(self, a: torch.Tensor, g: torch.Tensor, norm_type: int, may_sync: bool,
                     lost: list) -> torch.Tensor:
        """Each group's norm of sum_r g_r a_r^T (:func:`~privleak.dpsgd.layers.weight_norms`: the
        ghost norm, the groups whose norms are computed again in float64 appended to ``lost``; or
        the gradient, a few groups at a time where the gradients are formed)."""
        if not len(self.samples):
            return torch.zeros(0, dtype=torch.float64, device=a.device)
        a, g = self.padded(a), self.padded(g)
        if self.forms(a, g, norm_type):
            step = self._step(a, g)
            return torch.cat([weight_norms(a[i:i + step], g[i:i + step], norm_type, may_sync=may_sync)
                              for i in range(0, len(a), step)])
        return weight_norms(a, g, norm_type, may_sync=may_sync, lost=lost)

    def forms(self, a: torch.Tensor, g: torch.Tensor, norm_type: int) -> bool:
        """Whether :meth:`weight_norms` forms the groups' gradients, for rows a (R, d), g (R, p)."""
        return forms_weight_grads(self.length, a.shape[-1], g.shape[-1], norm_type)

    def _step(self, a: torch.Tensor, g: torch.Tensor) -> int:
        """Groups at a time whose gradients are formed, for padded a (G, n, d), g (G, n, p)."""
        return samples_per_chunk(self.length * (a.shape[-1] + g.shape[-1]), a.shape[-1] * g.shape[-1], at_least=1,
                                 on_gpu=a.is_cuda)

    def formed_sums(self, a: torch.Tensor, g: torch.Tensor, factors: torch.Tensor, keep: Optional[torch.Tensor],
                    experts: int) -> torch.Tensor:
        """(E, p, d): the groups' gradients that :meth:`weight_norms` formed, formed again in the same
        chunks by the same calls, each weighted by its group's factor and added into its expert."""
        a, g = self.padded(a), self.padded(g)
        step, total = self._step(a, g), None
        for i in range(0, len(a), step):
            chunk = slice(i, i + step)
            part = formed_sums(*_formed_weight_grads(a[chunk], g[chunk]), len(a[chunk]), {None: factors[chunk]},
                               None if keep is None else keep[chunk], into=(self.experts[chunk], experts))[None]
            total = part if total is None else total.add_(part)
        return total

    def sums(self, rows: torch.Tensor) -> torch.Tensor:
        """(groups, p): each group's rows summed, float32 at least."""
        dtype = torch.promote_types(rows.dtype, torch.float32)
        return torch.zeros(len(self.samples), rows.shape[-1], dtype=dtype, device=rows.device).index_add_(
            0, self.group, rows.to(dtype))

    def per_sample(self, values: torch.Tensor, batch: int) -> torch.Tensor:
        """(B,) float64: the groups' values added per sample."""
        return torch.zeros(batch, dtype=torch.float64, device=values.device).index_add_(0, self.samples,
                                                                                        values.double())
