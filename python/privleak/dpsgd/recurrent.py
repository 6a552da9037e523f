"""Book-keeping's rule for recurrent layers: nn.RNN, nn.LSTM and nn.GRU.

Their weights are used at every step inside one fused op whose backward keeps the gates'
gradients to itself. The rule runs the recurrence again after the backward pass, step by step in
batched ops (torch's equations), and takes one backward pass of it from the recorded output
gradients to each step's pre-activations: then W_ih (x_t W_ih^T + b_ih, a = the layer's input
x_t), W_hh (h_{t-1} W_hh^T + b_hh, a = h_{t-1}) and an LSTM's projection W_hr are each a Linear
layer over the T steps, whose per-sample norms are ghost norms (or the layer's per-sample
gradient, by the mixed rule) and whose clipped sum is one GEMM; a bias's per-sample gradient is
its pre-activations' gradients summed over the steps (Bu et al.'s book-keeping, as for a
transformer's Linear layers; Opacus's DPLSTM gets there by rebuilding the module from Linear
layers run step by step in the forward pass).

torch puts the batch in dim 1 of the input unless ``batch_first``, always in dim 1 of the hidden
states (h_0, c_0 in; h_n, c_n out), and a ``PackedSequence`` (sequences of different lengths)
holds the samples' steps interleaved in one tensor. Each call is recorded batch first: the input
padded to (B, T, d) with the lengths (B,) of a packed one, and the initial states as (B, L D, h);
the output gradients are read the same way. Past its length a sample's state stays as it was,
so the reverse direction starts at its last step, as the packed op does. A module with a
parametrized weight (weight_norm on ``weight_hh_l0``) is replayed instead, one sample at a time
(vmap has no batching rule for the fused ops).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_unflatten

from privleak.dpsgd.layers import FunctionalLayer, clipped_product, computes_parameters, layer_kind, weight_norms


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
        self._unrolled = not computes_parameters(module)

    def clear(self) -> None:
        super().clear()
        self.layouts: list = []  # per call, before finish(): how its output gradients hold the batch
        self.sites: dict = {}  # by parameter id, a weight's (g, a) over every call's steps

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        if self.module.training and self.module.dropout > 0 and self.module.num_layers > 1 and torch.is_grad_enabled():
            raise ValueError(self.random_replay())
        return super().record(args, kwargs, output)

    def finish(self) -> None:
        """Each call's sites (:func:`unrolled_sites`): the weights' output gradients and inputs laid
        end to end over the calls' steps, the biases' per-sample gradients added up."""
        super().finish()
        if not self._unrolled or not self.calls:
            return
        weights: dict = {}
        for (leaves, spec, live, replay, _), grads in zip(self.calls, self.grads):
            (x, lengths, states), _ = tree_unflatten(leaves, spec)
            cotangents = [None] * 3
            for k, g in zip(live, grads):
                cotangents[k] = g
            with replay.context(self._spectral_norms):
                sites = unrolled_sites(self.module, x, lengths, states, cotangents)
            for name, rows in sites.biases.items():
                key = id(self.module.get_parameter(name))
                self.per_sample[key] = rows if key not in self.per_sample else self.per_sample[key] + rows
            for name, pair in sites.weights.items():
                weights.setdefault(id(self.module.get_parameter(name)), []).append(pair)
        self.sites = {key: tuple(torch.cat(side, 1) for side in zip(*pairs)) for key, pairs in weights.items()}

    def rows(self, batch: int) -> dict:
        return self.per_sample if self._unrolled else super().rows(batch)

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        if not self._unrolled:
            return super().norms_by_parameter(batch, norm_type)
        return {key: weight_norms(a, g, norm_type, deferred=True) for key, (g, a) in self.sites.items()}

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor]) -> dict:
        if not self._unrolled:
            return super().sums_by_parameter(factors, keep)
        return {key: clipped_product(g, a, factors[key], keep) for key, (g, a) in self.sites.items()}

    def random_replay(self) -> str:
        return (f"{self.describe()} has dropout={self.module.dropout} between its layers in training mode, which its "
                "steps run again cannot repeat: use dropout=0 (an nn.Dropout between recurrent modules is no "
                "matter) or call .eval() on it")

    def separated(self, args: tuple, kwargs: dict, output: Any) -> Any:
        return output  # the output and the final states come from one op, none from another

    def output_tensors(self, output: Any) -> list[torch.Tensor]:
        out, states = output
        return [out.data if isinstance(out, PackedSequence) else out,
                *(states if isinstance(states, tuple) else (states,))]

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
        if grad is None:  # an output the loss does not use
            pass
        elif self.calls[call][2][output] > 0:  # a final state (L D, B, h)
            grad = grad.transpose(0, 1)
        elif self.layouts[call].packed is not None:
            steps, order, unorder = self.layouts[call].packed
            grad = pad_packed_sequence(PackedSequence(grad, steps, order, unorder), batch_first=True,
                                       total_length=self.layouts[call].length)[0]
        elif not self.module.batch_first:
            grad = grad.transpose(0, 1)
        super().take_grad(call, output, grad, norm_type)

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


class _Sites(NamedTuple):
    """A call's book-keeping of the module, by parameter name: each weight's (g, a), its output
    gradients (B, T, out) and inputs (B, T, in) at the T steps, whose per-sample gradient is
    sum_t g_t a_t^T as a Linear layer's; each bias's per-sample gradients (B, out)."""

    weights: dict
    biases: dict


def unrolled_sites(module: nn.RNNBase, x: torch.Tensor, lengths: Optional[torch.Tensor], states: tuple,
                   cotangents: list) -> _Sites:
    """The module's book-keeping sites on a recorded call: its recurrence run step by step in
    batched ops (torch's equations for RNN, LSTM with projections and GRU, each layer and
    direction), the steps past a sample's length leaving its state as it was (a packed sequence;
    the reverse direction so starts at each sample's last step), then one backward pass from the
    output gradients ``cotangents`` [(B, T, D out) or None, (B, L D, out) or None, (B, L D, h) or
    None] to the pre-activations x_t W_ih^T + b_ih (g of W_ih and b_ih, a = the layer's input),
    h_{t-1} W_hh^T + b_hh (g of W_hh and b_hh, a = h_{t-1}) and, with projections, h_t = W_hr h'_t
    (g of W_hr, a = h'_t)."""
    directions, layers = 2 if module.bidirectional else 1, module.num_layers
    hidden, out = module.hidden_size, module.proj_size or module.hidden_size
    batch, steps = x.shape[:2]
    params = {name: p.detach() for name, p in module.named_parameters()}
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    lstm, gru = module.mode == "LSTM", module.mode == "GRU"
    active = None if lengths is None else (torch.arange(steps)[None] < lengths[:, None]).to(x.device)
    zeros = x.new_zeros(batch, layers * directions, hidden)
    h_start = states[0] if states else x.new_zeros(batch, layers * directions, out)
    c_start = states[1] if lstm and states else zeros
    watched: list = []  # (name, a, g-source: a tensor (B, T, n) or a list of T step tensors (B, n) in time order)
    finals_h, finals_c = [], []
    with torch.enable_grad():
        layer_input = x.detach()
        for layer in range(layers):
            outputs = []
            for direction in range(directions):
                suffix = f"l{layer}" + ("_reverse" if direction else "")
                w_hh, b_hh, w_hr = params[f"weight_hh_{suffix}"], params.get(f"bias_hh_{suffix}"), None
                gi = _watched(torch.nn.functional.linear(layer_input, params[f"weight_ih_{suffix}"],
                                                         params.get(f"bias_ih_{suffix}")))
                if module.proj_size:
                    w_hr = params[f"weight_hr_{suffix}"]
                h, c = h_start[:, layer * directions + direction], c_start[:, layer * directions + direction]
                gh_steps, h_before, projected, unprojected, out_steps = ([None] * steps for _ in range(5))
                for t in (range(steps - 1, -1, -1) if direction else range(steps)):
                    gh = _watched(torch.nn.functional.linear(h, w_hh, b_hh))
                    gh_steps[t], h_before[t] = gh, h.detach()
                    if lstm:
                        i, f, g, o = (gi[:, t] + gh).chunk(4, 1)
                        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                        h_new = torch.sigmoid(o) * torch.tanh(c_new)
                        if w_hr is not None:
                            unprojected[t] = h_new.detach()
                            h_new = projected[t] = _watched(torch.nn.functional.linear(h_new, w_hr))
                    elif gru:
                        i_r, i_z, i_n = gi[:, t].chunk(3, 1)
                        h_r, h_z, h_n = gh.chunk(3, 1)
                        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
                        h_new = (1 - z) * torch.tanh(i_n + r * h_n) + z * h
                    else:
                        pre = gi[:, t] + gh
                        h_new = torch.tanh(pre) if module.mode == "RNN_TANH" else torch.relu(pre)
                    if active is None:
                        h, out_steps[t] = h_new, h_new
                        c = c_new if lstm else c
                    else:
                        on = active[:, t, None]
                        h, out_steps[t] = torch.where(on, h_new, h), torch.where(on, h_new, 0.0)
                        c = torch.where(on, c_new, c) if lstm else c
                outputs.append(torch.stack(out_steps, 1))
                finals_h.append(h)
                finals_c.append(c)
                watched += [(f"weight_ih_{suffix}", layer_input.detach(), gi), (f"bias_ih_{suffix}", None, gi),
                            (f"weight_hh_{suffix}", torch.stack(h_before, 1), gh_steps),
                            (f"bias_hh_{suffix}", None, gh_steps)]
                if w_hr is not None:
                    watched.append((f"weight_hr_{suffix}", torch.stack(unprojected, 1), projected))
            layer_input = torch.cat(outputs, 2) if directions == 2 else outputs[0]
        results = [layer_input, torch.stack(finals_h, 1), torch.stack(finals_c, 1)]
        given = [(y, g) for y, g in zip(results, cotangents) if g is not None]
        sources = [s for _, _, source in watched for s in (source if isinstance(source, list) else [source])]
        unique = list({id(s): s for s in sources}.values())
        found = torch.autograd.grad([y for y, _ in given], unique, [g for _, g in given], allow_unused=True)
    grad_of = {id(s): torch.zeros_like(s) if g is None else g for s, g in zip(unique, found)}
    weights, biases, stacked = {}, {}, {}  # stacked: a list of steps' gradients, once for its weight and bias
    for name, a, source in watched:
        if name not in trained:  # a bias the module has not, or a frozen parameter
            continue
        if isinstance(source, list):
            if id(source) not in stacked:
                stacked[id(source)] = torch.stack([grad_of[id(s)] for s in source], 1)
            g = stacked[id(source)]
        else:
            g = grad_of[id(source)]
        if a is None:
            biases[name] = g.sum(1, dtype=torch.promote_types(g.dtype, torch.float32))
        else:
            weights[name] = (g, a)
    return _Sites(weights, biases)


def _watched(pre_activation: torch.Tensor) -> torch.Tensor:
    """A tensor whose gradient the backward pass is asked for: a leaf that requires it where
    nothing before it does (the first step from a given state, the first layer's input)."""
    return pre_activation if pre_activation.requires_grad else pre_activation.requires_grad_()
