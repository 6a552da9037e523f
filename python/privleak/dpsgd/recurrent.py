"""Book-keeping's rule for recurrent layers: nn.RNN, nn.LSTM and nn.GRU.

Their weights are used at every time step inside one fused op, so no ghost norm applies: the
per-sample gradients of the module alone come from its replay (:class:`~privleak.dpsgd.layers.
FunctionalLayer`). What this rule adds is where the batch is. torch puts it in dim 1 of the
input unless ``batch_first``, always in dim 1 of the hidden states (h_0, c_0 in; h_n, c_n out),
and a ``PackedSequence`` (sequences of different lengths, as Opacus's DPLSTM takes them) holds
the samples' steps interleaved in one tensor. Each call is recorded batch first: the input
padded to (B, T, d) with the lengths (B,) of a packed one, and the initial states as (B, L D, h);
the output gradients are read the same way, so the replay splits every argument and output by
sample along dim 0. The replay runs one sample at a time (vmap has no batching rule for the
fused RNN ops, and cannot batch sequences of different lengths); the clipped sum is one backward
pass over the batch.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_unflatten

from privleak.dpsgd.layers import FunctionalLayer, layer_kind


class _Layout(NamedTuple):
    """Where a call's output keeps the batch: a packed output's steps and order (the input's,
    without its data; None: not packed), and its padded length."""

    packed: Optional[tuple]
    length: int


@layer_kind(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentLayer(FunctionalLayer):
    """nn.RNN, nn.LSTM and nn.GRU (any layers, bidirectional, projections, packed or padded input,
    given or zero initial states), replayed with each call's arguments and outputs batch first
    (module docstring). Outputs in the order output, h_n (, c_n)."""

    broadcast_calls = flattened_batch_calls = flattened_output_calls = False

    def __init__(self, name: str, module: nn.Module):
        super().__init__(name, module)
        # torch.func has no batching rule for the fused RNN ops: vmap's fallback ran 7x slower than
        # a loop of ordinary backward passes (an LSTM of 128 over 50 steps, B 64: 795 -> 110 ms a
        # step on the CPU), and it cannot batch packed sequences of different lengths at all.
        self._one_at_a_time = True

    def clear(self) -> None:
        super().clear()
        self.layouts: list = []  # per call, before finish(): how its output gradients hold the batch

    def random_replay(self) -> str:
        return (f"{self.describe()} has dropout={self.module.dropout} between its layers in training mode, which a "
                "replay per sample cannot repeat: use dropout=0 (an nn.Dropout between recurrent modules is no "
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
        elif output > 0:  # a final state (L D, B, h)
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
