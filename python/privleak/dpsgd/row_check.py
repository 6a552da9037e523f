"""The check, at every step, that every layer's rows are its samples' (``BookKeeping(...,
check_every_step=True)``).

Book-keeping reads row i of every layer's output gradient as sample i's. The graph checks
(:mod:`privleak.dpsgd.graph`) refuse the ways of moving rows they know (``h[order]``, writes,
stacks); the first sample's check refuses what its own backward pass shows, once. This check
refuses any way, at every step: a backward pass of the losses weighted at random, sum_i w_i L_i,
gives each row j of a layer's output gradient w_i times its gradient in the step's own backward
pass (of sum_i L_i) exactly where row j depends on sample i alone. A row read as sample j that
holds sample k's gradient (rows moved) has w_k in place of w_j; one that mixes samples, a
combination of theirs. Each row is compared by its norm and its projection on a random direction:
both must be w_j times the step's (exactly, the weights being powers of two, but for kernels
whose order of summation varies). Its cost: one more backward pass to the
layers' outputs (no parameter gradient): 1.17-1.46x book-keeping's step on the benchmarks' models.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

#: the loss weights: 2^k, k uniform in -8 .. 8. A power of two scales every number of the pass
#: exactly (no rounding, in any float format, short of overflow or underflow), so a row that is
#: its sample's alone comes out exactly w_j times the step's, on the CPU; a row moved is off by a
#: factor of 2 at least, unless the two samples drew the same weight (1 pair in 17 each step)
_EXPONENTS = 8
#: rows compared to this share of their own norm: room for kernels whose sums' order varies from
#: run to run (atomics on a GPU); a row mixing in another sample's gradient at 1% of its own is found
_TOLERANCE = 1e-2
#: rows below this share of their output's largest row, or below this share of the largest of
#: any output, are not compared: such a variation of order is relative to the larger rows
_NEGLIGIBLE, _NEGLIGIBLE_OF_ALL = 1e-4, 1e-12


class RowCheck:
    """Per-row sketches (norm, projection on a random direction) of each watched layer output's
    gradient, from two backward passes: the weighted one (:meth:`weighted_pass`) and the step's
    own (:meth:`watching`), compared by :meth:`raise_if_moved`."""

    def __init__(self, outputs: list, batch: int, device: torch.device, generator: torch.Generator):
        # (what, gradient edge, the dim of the batch in it), the batch in dim 0 or 1 (or flattened in dim 0)
        self.outputs = [(what, edge, dim) for what, edge, dim in outputs if dim in (0, 1)]
        self.batch = batch
        exponents = torch.randint(-_EXPONENTS, _EXPONENTS + 1, (batch,), generator=generator)
        self.weights = torch.exp2(exponents.double()).to(device)
        self.directions: dict = {}  # output index: the random direction its rows are projected on
        self.generator = generator
        self.index = {(edge.node, edge.output_nr): index for index, (_, edge, _) in enumerate(self.outputs)}
        self.sketches: tuple = ({}, {})  # weighted, the step's: output index -> (norms, projections)
        self.which = 0  # the pass being sketched

    def _rows(self, grad: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
        """(B, -1): each sample's rows of an output gradient, or None where it has no batch's rows."""
        if grad.ndim <= dim or grad.shape[dim] == 0 or grad.shape[dim] % self.batch:
            return None
        return grad.movedim(dim, 0).reshape(self.batch, -1)

    def _sketch(self, index: int, grad: Optional[torch.Tensor]) -> None:
        rows = None if grad is None else self._rows(grad, self.outputs[index][2])
        if rows is None or rows.shape[1] == 0:
            return
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()
        if index not in self.directions:
            direction = torch.randn(rows.shape[1], generator=self.generator, dtype=rows.dtype)
            self.directions[index] = direction.to(device=rows.device)
        # in the gradient's precision (a float64 copy of every gradient cost as much again): its
        # rounding, ~1e-6 of a row in float32, is far under the tolerance
        self.sketches[self.which][index] = (torch.linalg.vector_norm(rows, dim=1).double(),
                                            (rows @ self.directions[index]).double())

    def _sketch_from_node(self, index: int, grad_outputs: tuple) -> None:
        self._sketch(index, grad_outputs[self.outputs[index][1].output_nr])

    def observe(self, edges: list, grads: tuple) -> None:
        """Sketch the watched ones of the results ``grads`` of a backward pass to ``edges``: their
        nodes did not run, so their pre-hooks did not see them."""
        for edge, grad in zip(edges, grads):
            if (index := self.index.get((edge.node, edge.output_nr))) is not None:
                self._sketch(index, grad)

    def _watch(self, which: int) -> list:
        self.which = which
        return [edge.node.register_prehook(functools.partial(self._sketch_from_node, index))
                for index, (_, edge, _) in enumerate(self.outputs)]

    def weighted_pass(self, losses: torch.Tensor, edges: list) -> None:
        """The backward pass of sum_i w_i L_i to the layers' outputs ``edges`` (no parameter
        gradient), the graph kept for the step's, sketching the watched outputs' gradients."""
        handles = self._watch(0)
        try:
            self.observe(edges, torch.autograd.grad(losses, edges, grad_outputs=self.weights.to(losses.dtype),
                                                    retain_graph=True, allow_unused=True))
        finally:
            for handle in handles:
                handle.remove()

    def watching(self):
        """A context in which the step's backward pass sketches the watched outputs' gradients
        that its nodes see (the others: :meth:`observe`)."""
        return _Watching(self._watch(1))

    def raise_if_moved(self) -> None:
        """Raise naming the first output whose row j is not w_j times the step's (in norm or in its
        projection): a row that holds another sample's gradient, or several samples'."""
        weighted, own = self.sketches
        compared = [index for index in range(len(self.outputs)) if index in weighted and index in own]
        largest = max((float(own[index][0].max()) for index in compared), default=0.0) * float(self.weights.max())
        for index in compared:
            what = self.outputs[index][0]
            (norms_w, projections_w), (norms, projections) = weighted[index], own[index]
            # a projection's rounding is a random walk over the row's elements: the norm's order, not its bound's
            scale = self.weights * norms
            bound = _TOLERANCE * scale + _NEGLIGIBLE * float(scale.max()) + _NEGLIGIBLE_OF_ALL * largest
            off = ((norms_w - scale).abs() > bound) | ((projections_w - self.weights * projections).abs() > bound)
            if bool(off.any()):
                row = int(off.nonzero()[0])
                raise ValueError(
                    f"per_sample_losses: row {row} of the output gradient of {what} is not sample {row}'s alone: a "
                    f"backward pass of the losses weighted at random (w_{row} = {float(self.weights[row]):.4f}) gave "
                    f"it a norm of {float(norms_w[row]):.6g}, where w_{row} times the step's is "
                    f"{float(scale[row]):.6g}. "
                    "Book-keeping reads row i of every layer as sample i, and would clip parts of different samples "
                    "together: the rows are taken in another order, or mixed with other samples', between that layer "
                    "and the losses (a sort, a shuffle, a write at other rows, samples added together); order the "
                    "batch before the model, inputs and targets alike")


class _Watching:
    def __init__(self, handles: list):
        self.handles = handles

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
