"""Book-keeping's rule for recurrent layers: nn.RNN, nn.LSTM and nn.GRU.

Their weights are used at every step inside one fused op whose backward keeps the gates'
gradients to itself. The rule puts a node of its own in the loss's graph in place of that op's
(same outputs), whose backward is a backward pass through the steps written out with torch's
equations: each step's pre-activation gradients from the output gradients, the gates recomputed
from the recorded output in batched ops (the layers below the last run again by the fused op).
Then W_ih (x_t W_ih^T + b_ih, a = the layer's input x_t), W_hh (h_{t-1} W_hh^T + b_hh,
a = h_{t-1}) and an LSTM's projection W_hr are each a Linear layer over the T steps, whose
per-sample norms are ghost norms (or the layer's per-sample gradient, by the mixed rule) and whose
clipped sum is one GEMM; a bias's per-sample gradient is its pre-activations' gradients summed
over the steps (Bu et al.'s book-keeping, as for a transformer's Linear layers; Opacus's DPLSTM
gets there by rebuilding the module from Linear layers run step by step in the forward pass). The
same pass gives the input's and initial states' gradients, so torch's own backward of the module,
which would form the weights' gradients again, never runs.

torch puts the batch in dim 1 of the input unless ``batch_first``, always in dim 1 of the hidden
states (h_0, c_0 in; h_n, c_n out), and a ``PackedSequence`` (sequences of different lengths)
holds the samples' steps interleaved in one tensor. Each call is recorded batch first: the input
padded to (B, T, d) with the lengths (B,) of a packed one, and the initial states as (B, L D, h);
the output gradients are read the same way. Past its length a sample's state stays as it was,
so the reverse direction starts at its last step, as the packed op does. A module whose weights
are not each a Parameter under its own name (a parametrization or the deprecated weight_norm on
``weight_hh_l0``, one Parameter under two names) is replayed instead, one sample at a time (vmap
has no batching rule for the fused ops). A weight assigned to the module from outside its forward
(AWD-LSTM's WeightDrop) is not reproduced by the replay either: BookKeeping's check of the first
sample finds it.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_unflatten

from privleak.dpsgd.layers import FunctionalLayer, clipped_weight_sum, computes_parameters, layer_kind, weight_norms


class _Layout(NamedTuple):
    """Where a call's output keeps the batch: a packed output's steps and order (the input's,
    without its data; None: not packed), and its padded length."""

    packed: Optional[tuple]
    length: int


@layer_kind(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentLayer(FunctionalLayer):
    """nn.RNN, nn.LSTM and nn.GRU (any layers, bidirectional, projections, packed or padded input,
    given or zero initial states) by book-keeping over their unrolled steps (module docstring).
    Outputs in the order output, h_n (, c_n). Dropout between layers in training mode is refused:
    the steps run again could not draw the same masks."""

    broadcast_calls = flattened_batch_calls = flattened_output_calls = False

    def __init__(self, name: str, module: nn.Module):
        super().__init__(name, module)
        # torch.func has no batching rule for the fused RNN ops: vmap's fallback ran 7x slower than
        # a loop of ordinary backward passes (an LSTM of 128 over 50 steps, B 64: 795 -> 110 ms a
        # step on the CPU), and it cannot batch packed sequences of different lengths at all.
        self._one_at_a_time = True
        # Book-keeping proper needs the weights by name; a parametrized one is replayed.
        self._unrolled = not computes_parameters(module) and _weights_by_name(module)

    def clear(self) -> None:
        super().clear()
        self.layouts: list = []  # per call: how its output and their gradients hold the batch
        self.outputs: list = []  # per call: its output as torch gave it, for the unrolled steps, and its version
        self.call_sites: list = []  # per call: its unrolled sites, where the backward pass formed them
        self.sites: dict = {}  # by parameter id, a weight's (g, a) over every call's steps

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        if self.module.training and self.module.dropout > 0 and self.module.num_layers > 1 and torch.is_grad_enabled():
            raise ValueError(self.random_replay())
        calls = len(self.calls)
        live = super().record(args, kwargs, output)
        if len(self.calls) > calls:
            out = self.output_tensors(output)[0].detach()
            self.outputs.append((out, out._version))
            self.call_sites.append(None)
        return live

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        kept = sorted(new, key=new.get)
        self.layouts, self.outputs, self.call_sites = ([per_call[call] for call in kept]
                                                       for per_call in (self.layouts, self.outputs, self.call_sites))

    def finish(self) -> None:
        """Each call's sites (:func:`unrolled_sites`): the weights' output gradients and inputs laid
        end to end over the calls' steps, the biases' per-sample gradients added up."""
        super().finish()
        if not self._unrolled or not self.calls:
            return
        weights: dict = {}
        for call, grads in enumerate(self.grads):
            sites = self.call_sites[call] or self._unrolled_sites(call, grads)  # grads: output, h_n (, c_n)
            for name, rows in sites.biases.items():
                key = id(self.module.get_parameter(name))
                self.per_sample[key] = rows if key not in self.per_sample else self.per_sample[key] + rows
            for name, pair in sites.weights.items():
                weights.setdefault(id(self.module.get_parameter(name)), []).append(pair)
        self.sites = {key: pairs[0] if len(pairs) == 1 else tuple(torch.cat(side, 1) for side in zip(*pairs))
                      for key, pairs in weights.items()}

    def _unrolled_sites(self, call: int, grads: list, inputs: tuple = (False, False, False)) -> _Sites:
        """:func:`unrolled_sites` of recorded call ``call`` whose live outputs' gradients (batch
        first, as :meth:`take_grad` keeps them) are ``grads``."""
        leaves, spec, live, replay, _ = self.calls[call]
        (x, lengths, states), _ = tree_unflatten(leaves, spec)
        output, version = self.outputs[call]
        if output._version != version:
            raise ValueError(f"the output of {self.describe()} was changed in place after its forward: book-keeping "
                             "recomputes its gates from it; change a copy (out.clone()) or use an out-of-place op")
        cotangents = [None] * 3
        for k, g in zip(live, grads):
            cotangents[k] = g
        with replay.context(self._spectral_norms):
            return unrolled_sites(self.module, x, lengths, states, self._padded(self.layouts[call], output), cotangents,
                                  inputs)

    def separated(self, args: tuple, kwargs: dict, output: Any) -> Any:
        """The call's outputs from :class:`_Unrolled` in place of torch's fused op, whose backward
        then never runs: book-keeping's pass through the steps gives the gradients it would give
        below (an LSTM of 128 over 50 steps at B 64: torch's backward took 4.6 ms of a 26 ms
        step, most of it for the weights' gradients, which book-keeping does not use)."""
        outputs = self.output_tensors(output)
        if not self._unrolled or not any(y.requires_grad for y in outputs):
            return output
        x, hx = _arguments(args, kwargs)
        trained = [p for p in self.module.parameters() if p.requires_grad]
        states = hx if isinstance(hx, tuple) else (hx, None)
        new = _Unrolled.apply(self, len(self.calls), outputs, x.data if isinstance(x, PackedSequence) else x,
                              *states, *trained)
        out, final = output
        if isinstance(out, PackedSequence):
            new_out = PackedSequence(new[0], out.batch_sizes, out.sorted_indices, out.unsorted_indices)
        else:
            new_out = new[0]
        return new_out, (tuple(new[1:]) if isinstance(final, tuple) else new[1])

    def backward_call(self, call: int, grads: tuple, needed: tuple) -> tuple:
        """:class:`_Unrolled`'s backward for call ``call``, from its outputs' gradients ``grads``
        as torch holds them: the gradients of the input, h_0, c_0 (where ``needed``) and of the
        trained parameters. In book-keeping's backward pass (the outputs' gradients were taken)
        the call's sites are kept for :meth:`finish` and the parameters get none; in another
        (a backward the user runs), the parameters get the batch's gradients, as torch's would."""
        taken = [g for g in self.grads[call] if g is not None]
        if taken:
            sites = self._unrolled_sites(call, self.grads[call], needed)
        else:
            live = self.calls[call][2]
            sites = self._unrolled_sites(call, [g if g is None else self._batch_first(call, k, g)
                                                for k, g in zip(live, grads)], needed)
        d_x, d_h0, d_c0 = sites.inputs
        layout = self.layouts[call]
        if d_x is not None:
            d_x = self._torch_layout(layout, d_x)
        d_states = tuple(None if d is None else d.transpose(0, 1) for d in (d_h0, d_c0))
        if taken:
            self.call_sites[call] = sites
            return (d_x, *d_states, *[None] * (len(needed) - 3))
        batch_grads = {name: torch.einsum("bto,bti->oi", g, a) for name, (g, a) in sites.weights.items()}
        batch_grads.update({name: rows.sum(0) for name, rows in sites.biases.items()})
        return (d_x, *d_states, *[batch_grads[name].to(p.dtype) for name, p in self.module.named_parameters()
                                  if p.requires_grad])

    def rows(self, batch: int) -> dict:
        return self.per_sample if self._unrolled else super().rows(batch)

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        if not self._unrolled:
            return super().norms_by_parameter(batch, norm_type)
        return {key: weight_norms(a, g, norm_type, deferred=True, may_sync=self.may_sync,
                                  lost=self.lost.setdefault(key, []))
                for key, (g, a) in self.sites.items()}

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        if not self._unrolled:
            return super().sums_by_parameter(factors, keep, norm_type)
        return {key: clipped_weight_sum(a, g, factors[key], keep, norm_type, lost=self.lost.get(key))
                for key, (g, a) in self.sites.items()}

    def random_replay(self) -> str:
        return (f"{self.describe()} has dropout={self.module.dropout} between its layers in training mode, which its "
                "steps run again cannot repeat: use dropout=0 (an nn.Dropout between recurrent modules is no "
                "matter) or call .eval() on it")

    def output_tensors(self, output: Any) -> list[torch.Tensor]:
        out, states = output
        return [out.data if isinstance(out, PackedSequence) else out,
                *(states if isinstance(states, tuple) else (states,))]

    def packings(self) -> list:
        return [layout.packed[1:] for layout in self.layouts if layout.packed is not None]

    def batch_dims(self, call: int) -> list[Optional[int]]:
        """The output's: dim 0 batch first, 1 sequence first, None packed; h_n's and c_n's: 1."""
        output = None if self.layouts[call].packed is not None else 0 if self.module.batch_first else 1
        return [output if k == 0 else 1 for k in self.calls[call][2]]

    def replayed_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(padded input (B, T, d), lengths (B,) or None, initial states (B, L D, h) each), {}."""
        x, states = _arguments(args, kwargs)
        if isinstance(x, PackedSequence):
            padded, lengths = pad_packed_sequence(x, batch_first=True)
            self.layouts.append(_Layout((x.batch_sizes, x.sorted_indices, x.unsorted_indices), padded.shape[1]))
        else:
            if x.ndim != 3:
                raise ValueError(f"{self.describe()} got an input of shape {tuple(x.shape)}, without a batch: "
                                 "book-keeping splits its input by sample")
            padded, lengths = x if self.module.batch_first else x.transpose(0, 1), None
            self.layouts.append(_Layout(None, padded.shape[1]))
        states = () if states is None else states if isinstance(states, tuple) else (states,)
        return (padded, lengths, tuple(s.transpose(0, 1) for s in states)), {}

    def take_grad(self, call: int, output: int, grad: Optional[torch.Tensor], norm_type: int) -> None:
        if grad is not None:  # None: an output the loss does not use
            grad = self._batch_first(call, self.calls[call][2][output], grad)
        super().take_grad(call, output, grad, norm_type)

    def batch_first(self, call: int, output: int, grad: torch.Tensor, batch: int) -> torch.Tensor:
        return self._batch_first(call, self.calls[call][2][output], grad)  # a packed sequence's rows padded

    def _batch_first(self, call: int, output: int, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of output ``output`` (0: the output, else a final state (L D, B, h)) of
        call ``call`` as torch holds it, batch first."""
        return grad.transpose(0, 1) if output > 0 else self._padded(self.layouts[call], grad)

    def _torch_layout(self, layout: _Layout, padded: torch.Tensor) -> torch.Tensor:
        """A call's input gradient (B, T, d) in the layout of the input torch was given (packed
        data, or the batch where the module puts it): :meth:`_padded` undone."""
        if layout.packed is None:
            return padded if self.module.batch_first else padded.transpose(0, 1)
        steps, order, _ = layout.packed
        batch = padded.shape[0]
        by_step = (padded if order is None else padded.index_select(0, order)).transpose(0, 1)  # sorted by length
        held = (torch.arange(batch)[None] < steps[:, None]).flatten().nonzero().squeeze(1)  # (t, sample) in the data
        return by_step.reshape(-1, padded.shape[2])[held.to(padded.device)]

    def _padded(self, layout: _Layout, out: torch.Tensor) -> torch.Tensor:
        """A call's output, or its gradient, as torch holds it (packed data, or padded with the
        batch where the module puts it), padded batch first (B, T, D out)."""
        if layout.packed is not None:
            steps, order, unorder = layout.packed
            return pad_packed_sequence(PackedSequence(out, steps, order, unorder), batch_first=True,
                                       total_length=layout.length)[0]
        return out if self.module.batch_first else out.transpose(0, 1)

    def _outputs(self, params: dict, values: list, spec) -> list[torch.Tensor]:
        """The module on a recorded call (:meth:`replayed_call`), its outputs batch first: the
        output padded to (n, T, D h), then h_n (, c_n) as (n, L D, h)."""
        from torch.func import functional_call

        (x, lengths, states), _ = tree_unflatten(values, spec)
        if lengths is not None:
            given = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        else:
            given = x if self.module.batch_first else x.transpose(0, 1)
        hidden = tuple(s.transpose(0, 1) for s in states)
        if not hidden:
            hidden = None
        elif len(hidden) == 1:
            hidden = hidden[0]
        out, final = functional_call(self.module, params, (given, hidden))
        if lengths is not None:
            out = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
        elif not self.module.batch_first:
            out = out.transpose(0, 1)
        return [out, *(s.transpose(0, 1) for s in (final if isinstance(final, tuple) else (final,)))]


def _arguments(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(input, hx) of an RNN's forward call."""
    named = dict(zip(("input", "hx"), args), **kwargs)
    return named["input"], named.get("hx")


def _weights_by_name(module: nn.RNNBase) -> bool:
    """Whether each weight the fused op takes is a Parameter of the module under its own name, as
    the steps written out read them: not a plain tensor that a forward pre-hook computes (the
    deprecated ``torch.nn.utils.weight_norm`` on ``weight_hh_l0``, AWD-LSTM's WeightDrop), nor one
    Parameter under two names (``bias_hh_l0`` set to ``bias_ih_l0``: listed once by
    ``named_parameters``, the other's gradient was left out). Such a module is replayed."""
    found = [module._parameters.get(name) for name in module._flat_weights_names]
    return all(isinstance(p, nn.Parameter) for p in found) and len({id(p) for p in found}) == len(found)


class _Unrolled(torch.autograd.Function):
    """A recorded call of a recurrent module in the loss's graph, in place of torch's fused op
    (:meth:`RecurrentLayer.separated`): the same outputs, whose backward is the pass through the
    steps of :func:`unrolled_sites` (:meth:`RecurrentLayer.backward_call`)."""

    @staticmethod
    def forward(ctx, layer: RecurrentLayer, call: int, outputs: list, x: torch.Tensor,
                h0: Optional[torch.Tensor], c0: Optional[torch.Tensor], *parameters: torch.Tensor) -> tuple:
        ctx.layer, ctx.call = layer, call
        ctx.set_materialize_grads(False)
        # saved (unread) so that autograd refuses a weight changed in place before the backward, as
        # for the fused op's saved weights: the steps written out read the weights as they are then
        ctx.save_for_backward(*parameters)
        return tuple(y.detach() for y in outputs)

    @staticmethod
    @once_differentiable  # its backward runs without a graph: a second derivative through it is refused
    def backward(ctx, *grads: Optional[torch.Tensor]) -> tuple:
        ctx.saved_tensors  # noqa: B018 (read for autograd's check of their versions)
        return None, None, None, *ctx.layer.backward_call(ctx.call, grads, ctx.needs_input_grad[3:])


class _Sites(NamedTuple):
    """A call's book-keeping of the module, by parameter name: each weight's (g, a), its output
    gradients (B, T, out) and inputs (B, T, in) at the T steps, whose per-sample gradient is
    sum_t g_t a_t^T as a Linear layer's; each bias's per-sample gradients (B, out)."""

    weights: dict
    biases: dict
    inputs: tuple  # the gradients asked for of the input (B, T, in) and initial states (B, L D, ·), or None


_FUSED = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}
_WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")  # torch's order in a layer's direction


def unrolled_sites(module: nn.RNNBase, x: torch.Tensor, lengths: Optional[torch.Tensor], states: tuple,
                   output: torch.Tensor, cotangents: list, inputs: tuple = (False, False, False)) -> _Sites:
    """The module's book-keeping sites on a recorded call whose output was ``output`` (B, T, D out):
    the layers below the last run again by torch's fused op (:func:`_layer_outputs`), then a
    backward pass through the steps written out for each layer and direction (:func:`_lstm`,
    :func:`_gru`, :func:`_rnn`), from the output gradients ``cotangents`` [(B, T, D out) or None,
    (B, L D, out) or None, (B, L D, h) or None] to the pre-activations x_t W_ih^T + b_ih (g of W_ih
    and b_ih, a = the layer's input), h_{t-1} W_hh^T + b_hh (g of W_hh and b_hh, a = h_{t-1}) and,
    with projections, h_t = W_hr h'_t (g of W_hr, a = h'_t); and, where ``inputs`` asks, on to the
    input and the initial states h_0, c_0. Past a sample's length (a packed sequence) its state
    stays as it was, and the steps there have no gradient."""
    directions, layers = 2 if module.bidirectional else 1, module.num_layers
    width = module.proj_size or module.hidden_size
    batch, steps = x.shape[:2]
    params = {name: p.detach() for name, p in module.named_parameters()}
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    on = None if lengths is None else (torch.arange(steps)[None] < lengths[:, None]).to(x.device)[..., None]
    h0 = states[0] if states else x.new_zeros(batch, layers * directions, width)
    c0 = states[1] if len(states) > 1 else x.new_zeros(batch, layers * directions, module.hidden_size)
    weights, biases, starts = {}, {}, [None] * (layers * directions)
    with torch.no_grad():
        outputs = _layer_outputs(module, x.detach(), lengths, h0, c0, params) + [output]
        dtype = outputs[-1].dtype
        d_output, d_h, d_c = (None if g is None else g.to(dtype) for g in cotangents)
        d_output = torch.zeros_like(outputs[-1]) if d_output is None else d_output
        for layer in reversed(range(layers)):
            d_input = None
            for direction in range(directions):
                k, suffix = layer * directions + direction, f"l{layer}" + ("_reverse" if direction else "")
                part = slice(direction * width, (direction + 1) * width)
                run = _Run(outputs[layer].to(dtype), outputs[layer + 1][..., part], h0[:, k].to(dtype),
                           c0[:, k].to(dtype), d_output[..., part], _or_zeros(d_h, k, h0), _or_zeros(d_c, k, c0), on,
                           direction == 1, *(params.get(f"{kind}_{suffix}") for kind in _WEIGHTS))
                grads = _BACKWARD[module.mode](run)
                sites = [("weight_ih", grads.ih, run.x), ("weight_hh", grads.hh, grads.h_before)]
                if grads.projection is not None:
                    sites.append(("weight_hr", *grads.projection))
                for kind, g, a in sites:
                    if f"{kind}_{suffix}" in trained:
                        weights[f"{kind}_{suffix}"] = (g, a)
                # (g, its rows): an RNN's or LSTM's ih and hh are one tensor, summed once. Told apart by
                # identity, not id(): a frozen direction's g, freed, left its id to a later one's.
                summed: list = []
                for kind, g in (("bias_ih", grads.ih), ("bias_hh", grads.hh)):
                    if f"{kind}_{suffix}" in trained:
                        rows = next((rows for other, rows in summed if other is g), None)
                        if rows is None:
                            rows = g.sum(1, dtype=torch.promote_types(g.dtype, torch.float32))
                            summed.append((g, rows))
                        biases[f"{kind}_{suffix}"] = rows
                starts[k] = grads.h0, grads.c0
                if layer or inputs[0]:
                    into = grads.ih @ run.w_ih
                    d_input = into if d_input is None else d_input + into
            d_output = d_input
    d_h0, d_c0 = (torch.stack(side, 1) if wanted and side[0] is not None else None
                  for wanted, side in zip(inputs[1:], zip(*starts)))
    return _Sites(weights, biases, (d_output if inputs[0] else None, d_h0, d_c0))


def _or_zeros(grads: Optional[torch.Tensor], k: int, like: torch.Tensor) -> torch.Tensor:
    """A final state's gradient (B, n) at layer-direction k, zeros where the loss does not use it."""
    return like.new_zeros(like.shape[0], like.shape[2]) if grads is None else grads[:, k]


def _layer_outputs(module: nn.RNNBase, x: torch.Tensor, lengths: Optional[torch.Tensor], h0: torch.Tensor,
                   c0: torch.Tensor, params: dict) -> list[torch.Tensor]:
    """[x, then the output (B, T, D out) of each layer below the last], by torch's fused op on one
    layer at a time: the module's own call keeps them to itself."""
    fused, directions, steps = _FUSED[module.mode], 2 if module.bidirectional else 1, x.shape[1]
    packed = None if lengths is None else pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    data, outputs = None if packed is None else packed.data, [x]
    for layer in range(module.num_layers - 1):
        rows = slice(layer * directions, (layer + 1) * directions)
        hx = [s[:, rows].transpose(0, 1) for s in ((h0, c0) if module.mode == "LSTM" else (h0,))]
        hx = [s.contiguous() if packed is None else s.index_select(1, packed.sorted_indices) for s in hx]
        hx = hx if module.mode == "LSTM" else hx[0]
        weights = [params[name] for end in ("", "_reverse")[:directions] for kind in _WEIGHTS
                   if (name := f"{kind}_l{layer}{end}") in params]
        settings = (module.bias, 1, 0.0, False, module.bidirectional)
        if packed is None:
            outputs.append(fused(outputs[-1], hx, weights, *settings, True)[0])
        else:
            data = fused(data, packed.batch_sizes, hx, weights, *settings)[0]
            outputs.append(pad_packed_sequence(PackedSequence(data, packed.batch_sizes, packed.sorted_indices,
                                                              packed.unsorted_indices),
                                               batch_first=True, total_length=steps)[0])
    return outputs


class _Run(NamedTuple):
    """One direction of one layer on a call, batch first: its input x (B, T, in) and output
    y (B, T, out), initial states h0 (B, out) and c0 (B, h) (an LSTM's), the gradients of its
    output dy (B, T, out) and of its final states dh_n, dc_n, the steps each sample takes
    (B, T, 1) or None (all), whether it runs in reverse, and its weights (a bias or W_hr None
    where the module has none)."""

    x: torch.Tensor
    y: torch.Tensor
    h0: torch.Tensor
    c0: torch.Tensor
    dy: torch.Tensor
    dh_n: torch.Tensor
    dc_n: torch.Tensor
    on: Optional[torch.Tensor]
    reverse: bool
    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: Optional[torch.Tensor]
    b_hh: Optional[torch.Tensor]
    w_hr: Optional[torch.Tensor]

    def backward_steps(self) -> list[int]:
        """The steps in the order the backward pass takes them: the forward pass's, reversed."""
        steps = self.x.shape[1]
        return list(range(steps)) if self.reverse else list(range(steps - 1, -1, -1))

    def before(self, after: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The state before each step (B, T, n) from the state after each: the one a step earlier
        in the direction's time, ``start`` at the first; in reverse, a step past a sample's length
        holds ``start`` (the reverse pass begins at each sample's last step)."""
        start = start[:, None]
        if not self.reverse:
            return torch.cat((start, after[:, :-1]), 1)
        later = after[:, 1:] if self.on is None else torch.where(self.on[:, 1:], after[:, 1:], start)
        return torch.cat((later, start), 1)

    def active(self, *factors: torch.Tensor) -> tuple:
        """The factors zeroed past each sample's length, where the steps have no gradient."""
        if self.on is None:
            return factors
        return tuple(f * (self.on if f.ndim == 3 else self.on[..., None]) for f in factors)

    def kept(self, keep: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The part of the state gradient a step passes back as it is (None: none): 1 past a
        sample's length, where the state stays."""
        if self.on is None:
            return keep
        return (~self.on).to(self.y.dtype) if keep is None else torch.where(self.on, keep, 1.0)


class _Gradients(NamedTuple):
    """A run's gradients of x_t W_ih^T + b_ih (B, T, G h) and of h_{t-1} W_hh^T + b_hh (the same
    tensor where they are equal), the states h_{t-1} (B, T, out), with projections W_hr's (g, a),
    and the gradients of its initial states h0 (B, out) and c0 (B, h) (an LSTM's; else None)."""

    ih: torch.Tensor
    hh: torch.Tensor
    h_before: torch.Tensor
    projection: Optional[tuple]
    h0: torch.Tensor
    c0: Optional[torch.Tensor]


def _through_time(run: _Run, g_hh: torch.Tensor, step, keep: Optional[torch.Tensor]) -> tuple:
    """The backward pass through the steps: dh_t = dy_t + dh_{t+1} keep_{t+1} + g_{t+1} W_hh for
    t+1 the next step in the direction's time (dh_n after the last), where ``step(t, dh_t)`` writes
    g_t = g_hh[:, t], the gradient of h_{t-1} W_hh^T + b_hh. Returns dh (B, T, out) and dh_0."""
    d_states, carried = torch.empty_like(run.dy), run.dh_n
    # each step's views made at once: indexing them a step at a time was most of a small batch's ops
    dy, dh_out, g_out = run.dy.unbind(1), d_states.unbind(1), g_hh.unbind(1)
    keeps = None if keep is None else keep.unbind(1)
    for t in run.backward_steps():
        dh = torch.add(dy[t], carried, out=dh_out[t])
        step(t, dh)
        carried = torch.mm(g_out[t], run.w_hh) if keeps is None else torch.addmm(dh * keeps[t], g_out[t], run.w_hh)
    return d_states, carried


def _lstm(run: _Run) -> _Gradients:
    """torch's LSTM: i, f, g, o = sigma, sigma, tanh, sigma(x W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh),
    c_t = f c_{t-1} + i g, h'_t = o tanh(c_t), h_t = h'_t (or W_hr h'_t, projections)."""
    batch, steps, hidden = run.y.shape[0], run.y.shape[1], run.w_hh.shape[0] // 4
    h_before = run.before(run.y, run.h0)
    into_c, from_h, into_o, keep_c, h_inner = _lstm_factors(run, h_before)
    grads = torch.empty(batch, steps, 4 * hidden, dtype=into_c.dtype, device=into_c.device)
    gates, d_c = grads.view(batch, steps, 4, hidden), [run.dc_n]
    into_c, from_h, into_o, keep_c = into_c.unbind(1), from_h.unbind(1), into_o.unbind(1), keep_c.unbind(1)
    into_c_out, into_o_out = gates[:, :, :3].unbind(1), gates[:, :, 3].unbind(1)

    def step(t: int, dh: torch.Tensor) -> None:
        dm = dh if run.w_hr is None else torch.mm(dh, run.w_hr)
        total = torch.addcmul(d_c[0], dm, from_h[t])
        torch.mul(total.unsqueeze(1), into_c[t], out=into_c_out[t])
        torch.mul(dm, into_o[t], out=into_o_out[t])
        d_c[0] = total * keep_c[t]

    d_states, d_h0 = _through_time(run, grads, step, run.kept(None))
    projection = None if h_inner is None else (d_states, h_inner)  # W_hr's (g, a = h'_t)
    return _Gradients(grads, grads, h_before, projection, d_h0, d_c[0])


def _lstm_factors(run: _Run, h_before: torch.Tensor) -> tuple:
    """What the steps of an LSTM's backward pass read, from its gates recomputed: dc_t/d(i, f, g)
    (B, T, 3, h), dh'_t/dc_t and dh'_t/do_t (B, T, h) each, zero past a sample's length, the part
    of dc_t that c_{t-1} gets (f_t, 1 past the length), and with projections h'_t (else None). Its
    own function, so that the gates and cell states are freed before the pass allocates its
    gradients (the tutorial LSTM's step, peak RSS after a first step: B 64 30-32 -> 25-26 MiB,
    B 256 123 -> 104 MiB, the non-private step's 26 and 103)."""
    i, f, g, o = (F.linear(run.x, run.w_ih, run.b_ih) + F.linear(h_before, run.w_hh, run.b_hh)).chunk(4, 2)
    i, f, g, o = i.sigmoid(), f.sigmoid(), _tanh(g), o.sigmoid()
    c = _cell_states(run, f, i * g)
    tanh_c = _tanh(c)
    into_c = torch.stack((g * i * (1 - i), run.before(c, run.c0) * f * (1 - f), i * (1 - g * g)), 2)
    into_c, from_h, into_o = run.active(into_c, o * (1 - tanh_c * tanh_c), tanh_c * o * (1 - o))
    keep_c = f if run.on is None else torch.where(run.on, f, 1.0)
    h_inner = None if run.w_hr is None else run.active(o * tanh_c)[0]
    return into_c, from_h, into_o, keep_c, h_inner


def _cell_states(run: _Run, f: torch.Tensor, ig: torch.Tensor) -> torch.Tensor:
    """An LSTM's cell states after each step (B, T, h): c_t = f_t c_{t-1} + (i g)_t from c0, held past
    a sample's length."""
    c, states = run.c0, [None] * f.shape[1]
    ig, f, on = ig.unbind(1), f.unbind(1), None if run.on is None else run.on.unbind(1)
    for t in reversed(run.backward_steps()):
        new = torch.addcmul(ig[t], f[t], c)
        c = states[t] = new if on is None else torch.where(on[t], new, c)
    return torch.stack(states, 1)


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) as 2 sigma(2x) - 1 on a CPU (error 2e-7): torch's tanh is scalar there, its sigmoid
    vectorised (64 x 50 x 128 floats: 480 us against 96 us on AVX-512)."""
    return x.tanh() if x.is_cuda else torch.sigmoid(2 * x).mul_(2).sub_(1)


def _gru(run: _Run) -> _Gradients:
    """torch's GRU: r, z = sigma(x W_i{r,z}^T + b_i{r,z} + h_{t-1} W_h{r,z}^T + b_h{r,z}),
    n = tanh(x W_in^T + b_in + r (h_{t-1} W_hn^T + b_hn)), h_t = (1 - z) n + z h_{t-1}."""
    batch, steps, hidden = run.y.shape[0], run.y.shape[1], run.w_hh.shape[0] // 3
    h_before = run.before(run.y, run.h0)
    into_hh, into_n, keep = _gru_factors(run, h_before)
    grads_hh = torch.empty(batch, steps, 3 * hidden, dtype=into_hh.dtype, device=into_hh.device)
    gates, into_step = grads_hh.view(batch, steps, 3, hidden).unbind(1), into_hh.unbind(1)

    def step(t: int, dh: torch.Tensor) -> None:
        torch.mul(dh.unsqueeze(1), into_step[t], out=gates[t])

    d_states, d_h0 = _through_time(run, grads_hh, step, keep)
    # x W_ih^T + b_ih's gradients: r's and z's are h_{t-1} W_hh^T + b_hh's, n's lacks the factor r
    grads_ih = grads_hh.clone()
    torch.mul(d_states, into_n, out=grads_ih.view(batch, steps, 3, hidden)[:, :, 2])
    return _Gradients(grads_ih, grads_hh, h_before, None, d_h0, None)


def _gru_factors(run: _Run, h_before: torch.Tensor) -> tuple:
    """What a GRU's backward pass reads, from its gates recomputed: dh_t/d(h_{t-1} W_hh^T + b_hh)
    (B, T, 3, h) and dh_t/d(x W_in^T + b_in) (B, T, h), zero past a sample's length, and the part
    of dh_t that h_{t-1} gets as it is (z_t, 1 past the length). Its own function, as
    :func:`_lstm_factors`, so that the gates are freed before the pass allocates its gradients."""
    (i_r, i_z, i_n), (h_r, h_z, h_n) = (F.linear(run.x, run.w_ih, run.b_ih).chunk(3, 2),
                                        F.linear(h_before, run.w_hh, run.b_hh).chunk(3, 2))
    r, z = (i_r + h_r).sigmoid(), (i_z + h_z).sigmoid()
    n = _tanh(i_n + r * h_n)
    into_n = (1 - z) * (1 - n * n)  # dh/d(i_n + r h_n)
    into_r, into_z = into_n * h_n * r * (1 - r), (h_before - n) * z * (1 - z)
    into_hh, into_n = run.active(torch.stack((into_r, into_z, into_n * r), 2), into_n)
    return into_hh, into_n, run.kept(z)


def _rnn(run: _Run, slope) -> _Gradients:
    """torch's Elman RNN: h_t = tanh or relu(x W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh), whose
    derivative ``slope(h_t)`` is 1 - h_t^2 or [h_t > 0]."""
    h_before = run.before(run.y, run.h0)
    slopes, = run.active(slope(run.y))
    grads = torch.empty_like(slopes)
    slope_at, grad_at = slopes.unbind(1), grads.unbind(1)

    def step(t: int, dh: torch.Tensor) -> None:
        torch.mul(dh, slope_at[t], out=grad_at[t])

    return _Gradients(grads, grads, h_before, None, _through_time(run, grads, step, run.kept(None))[1], None)


_BACKWARD = {"LSTM": _lstm, "GRU": _gru,
             "RNN_TANH": functools.partial(_rnn, slope=lambda h: 1 - h * h),
             "RNN_RELU": functools.partial(_rnn, slope=lambda h: (h > 0).to(h.dtype))}
