"""Book-keeping of a convolution whose forward computes the weight it convolves with from its
parameters: weight standardisation (Qiao et al. 2019, "Micro-Batch Training with Batch-Channel
Normalization and Weight Standardization"), NF-Nets' scaled standardisation with a gain, a
DropConnect mask, fake quantisation. Such a module is an ``nn.Conv1d`` / ``nn.Conv2d`` subclass
with a forward of its own, ``F.conv2d(x, w, bias, ...)`` with w = phi(theta) made from its
parameters theta before the batch comes in.

The per-sample gradient of theta is the vector-Jacobian product of phi with the per-sample
gradient of the computed weight w, which is a convolution's: G_i(theta) = J_phi^T G_i(w), where
G_i(w)[o, c, k] = sum_t g_i[o, t] x_i[c, s t - p + d k] (privleak's per-sample convolution kernel).
So the rule takes the one convolution of each forward call (a torch function mode on through the
call records its input x, the w it got and its geometry), forms G_i(w) and maps it back to theta
with one batched vector-Jacobian product through phi's own graph (``is_grads_batched``), with no
replay of the forward; the clipped sum is J_phi^T of the convolution's weight gradient of x and
the output gradients scaled by the clip factors, sum_i f_i J^T G_i(w) = J^T sum_i f_i G_i(w).
The w the forward used is the one differentiated, so a mask drawn at random in the forward
(DropConnect) is the call's own, where a replay could not redraw it.

A call that does not fit takes the fallback, the replay of
:class:`~privleak.dpsgd.layers.FunctionalLayer`, as every call of that step: its forward makes no
convolution or several, returns something other than the convolution's output or changes it in
place, computes the bias, uses a parameter outside the computed weight (in the convolution's input,
or after it), or makes a weight that depends on the batch (a dynamic convolution; seen through
the inputs with grad: one computed from a first layer's input is not).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from privleak.dpsgd import conv_grads, graph
from privleak.dpsgd.layers import (
    ConvLayer,
    Forming,
    FunctionalLayer,
    _batch_of,
    _common,
    _input_nodes,
    _scaled,
    _zero_dropped,
    bias_rows,
)

_CONVOLUTIONS = {torch.conv1d: 1, torch.conv2d: 2}  # torch.nn.functional's conv1d and conv2d are these
_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_VJP_VALUES = 1 << 20  # values of the per-sample gradients a vector-Jacobian product takes at a time (below)


class Convolution(NamedTuple):
    """One forward call's convolution: its input (kept, detached), the weight it computed (with
    the graph back to the parameters), the bias passed (a trainable parameter of the module, or
    None), and its geometry as one int per spatial dim."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    stride: list
    padding: list
    dilation: list
    groups: int


class _Recorder(TorchFunctionMode):
    """On through one forward call of the module: keeps each convolution it makes (``found``)."""

    def __init__(self):
        super().__init__()
        self.found: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if func in _CONVOLUTIONS and torch.is_grad_enabled():  # the node and version tell a later in-place op
            self.found.append((_CONVOLUTIONS[func], {**dict(zip(_ARGUMENTS, args)), **kwargs}, output,
                               output.grad_fn, output._version))
        return output


def _per_dim(value: Any, dims: int) -> list:
    """One int per spatial dim, as torch expands a number or a one-element list."""
    values = [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)]
    return values * dims if len(values) == 1 else values


def _padding(value: Any, weight: torch.Tensor, dilation: list) -> Optional[list]:
    """Zero padding per spatial dim; None for a 'same' padding that is not symmetric."""
    dims = weight.ndim - 2
    if value == "valid":
        return [0] * dims
    if value == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
        return [t // 2 for t in totals] if all(t % 2 == 0 for t in totals) else None
    return _per_dim(value, dims)


def _graph_nodes(root, inputs: frozenset) -> Optional[set]:
    """The autograd nodes of the graph from node ``root`` (none for None); None where it reaches
    one of ``inputs`` (a weight computed from the batch)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node in inputs:
            return None
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return seen


class ComputedWeightConvLayer(FunctionalLayer):
    """An ``nn.Conv1d`` / ``nn.Conv2d`` subclass with a forward of its own (the module docstring):
    the fallback's recording, with each call's convolution kept, and its per-sample gradients and
    clipped sums from the convolution rule and one vector-Jacobian product through the computed
    weight where every call of the step fits."""

    intercepts_forward = True
    chunk_at_least = 8  # a chunk's per-sample gradients are one kernel call each, not a replay

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        """Any Conv1d or Conv2d subclass with a forward of its own, a parametrized one too: the
        weight its convolution gets is what the rule reads."""
        return isinstance(module, (nn.Conv1d, nn.Conv2d))

    def clear(self) -> None:
        super().clear()
        self.convolutions: list = []  # per call, its Convolution, or None where the call does not fit

    def forward_mode(self) -> _Recorder:
        return _Recorder()

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        recorder, self.recorder = self.recorder, None
        outputs = super().record(args, kwargs, output)
        if outputs:
            convolution = self._fitting(recorder, tree_flatten((args, kwargs))[0], output)
            self.convolutions.append(convolution)
            if convolution is not None:  # no broadcast rule: its watched nodes would run the weight's graph in
                self.watched[-1] = []  # the step's backward, which would then free it before the norms
                self.calls[-1] = (*self.calls[-1][:4], None)
        return outputs

    def _fitting(self, recorder: Optional[_Recorder], leaves: list, output: Any) -> Optional[Convolution]:
        """The call's convolution where the call fits the rule (the module docstring), else None: its
        output is the call's, unchanged since (no in-place op); the parameters enter it only through
        the computed weight and the bias, and the weight's graph does not reach the call's inputs
        (``leaves``, its arguments as given: their autograd nodes are where the module's graph ends)."""
        if recorder is None or len(recorder.found) != 1:
            return None
        dims, bound, y, node, version = recorder.found[0]
        x, w, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        if (y is not output or y.grad_fn is not node or y._version != version or not isinstance(x, torch.Tensor)
                or x.ndim != dims + 2 or x.shape[0] != _batch_of(leaves) or not w.requires_grad
                or (bias is not None and bias.requires_grad and not any(bias is p for p in self.parameters))):
            return None
        inputs = _input_nodes(leaves)
        inside = _graph_nodes(w.grad_fn, inputs)
        if (inside is None or not any(p is not bias for p in self.parameters)
                or any(getattr(n, "variable", None) is bias for n in inside if bias is not None)):
            return None
        # Outside the weight's graph the parameters are used only as the convolution's bias and
        # (a weight used as it is) weight, and the weight's graph is entered only by the
        # convolution's weight edge (its input 1): a node shared with the input's graph (x * s and
        # w * s of one s) would count once in a count of uses.
        parents: dict = {}
        outside = graph.count_uses([node], self.parameters, stop=inputs | inside, parents=parents)
        if outside != [(p is bias) + (p is w) for p in self.parameters] or any(
                parents.get(n, []) != ([(node, 1)] if n is w.grad_fn else []) for n in inside):
            return None
        dilation = _per_dim(bound.get("dilation", 1), dims)
        padding = _padding(bound.get("padding", 0), w, dilation)
        if padding is None:
            return None
        return Convolution(self.keep(x), w, bias if bias is not None and bias.requires_grad else None,
                           _per_dim(bound.get("stride", 1), dims), padding, dilation, int(bound.get("groups", 1)))

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        self.convolutions = [c for call, c in enumerate(self.convolutions) if call in new]

    def _fits(self) -> bool:
        return bool(self.convolutions) and all(c is not None for c in self.convolutions) and not (
            self.shared_calls or self.flattened or self.flattened_outputs)

    def _forming(self, batch: int) -> Forming:
        """Whole where no larger than the inputs and output gradients the layer holds, else a few
        samples at a time for the norms: the second pass that then makes the clipped sum is one
        weight-gradient convolution and one vector-Jacobian product, not a replay, so it pays to
        hold less (WRN-16-4 weight-standardised, B 64: the 16 x 16 stage's 147k weights a sample
        formed whole held 4 x 38 MB past the non-private peak)."""
        if not self._fits():
            return super()._forming(batch)
        return Forming.AFTER if self._per_sample_size() <= self._held_per_sample(batch) else Forming.NEVER

    def _held_per_sample(self, batch: int) -> int:
        """The fallback's count, and the convolutions' inputs where the forward made them (padded)."""
        leaves = {x.untyped_storage().data_ptr() for leaves, *_ in self.calls for x in leaves
                  if isinstance(x, torch.Tensor)}
        made = sum(c.input.numel() for c in self.convolutions
                   if c is not None and c.input.untyped_storage().data_ptr() not in leaves)
        return super()._held_per_sample(batch) + made // max(batch, 1)

    def _weight_parameters(self, convolution: Convolution) -> list:
        return [p for p in self.parameters if p is not convolution.bias]

    def per_sample_grads(self, batch: int, samples: slice = slice(None)) -> dict:
        """G_i(theta) = J^T G_i(w) per call, added over the calls (the module docstring); the bias's
        per-sample gradients are the output gradients summed over positions."""
        if not self._fits():
            return super().per_sample_grads(batch, samples)
        grads: dict = {}
        for c, (g,) in zip(self.convolutions, self.grads):
            x, g = _common(c.input[samples], g[samples])
            per_sample = conv_grads.per_sample_conv_grads(x, g, list(c.weight.shape[2:]), c.stride, c.padding,
                                                          c.dilation, c.groups)
            params = self._weight_parameters(c)
            step = max(1, _VJP_VALUES // c.weight.numel())
            pulled = [torch.autograd.grad(c.weight, params, part.to(c.weight.dtype), retain_graph=True,
                                          allow_unused=True, is_grads_batched=True) for part in per_sample.split(step)]
            terms = {id(p): torch.zeros(x.shape[0], *p.shape, dtype=p.dtype, device=p.device) if t[0] is None
                     else torch.cat(t) for p, t in zip(params, zip(*pulled))}
            if c.bias is not None:
                terms[id(c.bias)] = bias_rows([g], channels_last=False)
            for key, t in terms.items():
                grads[key] = t if key not in grads else grads[key] + t
        return grads

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor]) -> dict:
        """J^T of the convolution's weight gradient of x and f g per call: one of each per distinct
        tensor of factors (flat clipping gives every parameter the same one, per-layer clipping each
        its own; told apart by identity, as the fallback's)."""
        if not self._fits():
            return super().sums_by_parameter(factors, keep)
        sums: dict = {}
        for c, (g,) in zip(self.convolutions, self.grads):
            x, g = _common(_zero_dropped(c.input, keep), _zero_dropped(g, keep))
            groups: dict = {}  # id of a factors tensor: (it, its parameters)
            for p in self._weight_parameters(c):
                groups.setdefault(id(factors[id(p)]), (factors[id(p)], []))[1].append(p)
            for f, params in groups.values():
                weight_grad = torch.ops.aten.convolution_backward(
                    _scaled(g, f), x, c.weight.detach().to(x.dtype), None, c.stride, c.padding, c.dilation, False,
                    [0] * len(c.stride), c.groups, [False, True, False])[1]
                pulled = torch.autograd.grad(c.weight, params, weight_grad.to(c.weight.dtype), retain_graph=True,
                                             allow_unused=True)
                for p, t in zip(params, pulled):
                    t = torch.zeros_like(p) if t is None else t
                    sums[id(p)] = t if id(p) not in sums else sums[id(p)] + t
            if c.bias is not None:
                term = bias_rows([_scaled(g, factors[id(c.bias)])], channels_last=False).sum(0)
                sums[id(c.bias)] = term if id(c.bias) not in sums else sums[id(c.bias)] + term
        return sums


ConvLayer.own_forward_rule = ComputedWeightConvLayer
