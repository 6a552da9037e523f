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
whose order of summation varies). Its cost: one more backward pass to the layers' outputs (no
parameter gradient): 1.17-1.46x book-keeping's step on the benchmarks' models.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

#: the loss weights: 2^k, k uniform in -8 .. 8. A power of two scales every number of the pass
#: exactly (no rounding, in any float format, short of overflow or underflow), so a row that is
#: its sample's alone comes out exactly w_j times the step's, on the CPU; a row moved is off by a
#: factor of 2 at least, unless the two samples drew the same weight (1 pair in 17 each step)
_EXPONENTS = 8
#: rows compared to this share of their own norm: room for kernels whose sums' order varies from
#: run to run (atomics on a GPU), which round each row by its own values (a row's output gradient
#: is made from that row's alone); a row mixing in another sample's gradient at 1% of its own is found
_TOLERANCE = 1e-2
#: rows under this share of the largest row of any output are not compared: weighted, they may
#: fall among float32's subnormal numbers, which a power of two does not scale exactly
_NEGLIGIBLE = 1e-30


class RowCheck:
    """Per-row sketches (norm, projection on a random direction) of each watched layer output's
    gradient, from two backward passes: the weighted one (:meth:`weighted_pass`) and the step's
    own (:meth:`watching`), compared by :meth:`raise_if_moved`."""

    def __init__(self, outputs: list, batch: int, device: torch.device, generator: torch.Generator):
        # (what, gradient edge, its gradient with the samples in dim 0 as read, or None where no row is a sample's)
        self.outputs = outputs
        self.batch = batch
        exponents = torch.randint(-_EXPONENTS, _EXPONENTS + 1, (batch,), generator=generator)
        self.weights = torch.exp2(exponents.double()).to(device)
        self.directions: dict = {}  # output index: the random direction its rows are projected on
        self.generator = generator
        self.index = {(edge.node, edge.output_nr): index for index, (_, edge, _) in enumerate(self.outputs)}
        self.sketches: tuple = ({}, {})  # weighted, the step's: output index -> (norms, projections)

    def _sketch(self, which: int, index: int, grad: Optional[torch.Tensor]) -> None:
        rows = None if grad is None else self.outputs[index][2](grad)
        if rows is None or rows.ndim == 0 or rows.shape[0] == 0 or rows.shape[0] % self.batch:
            return
        rows = rows.reshape(self.batch, -1)  # a batch flattened with other dims: whole rows, sample after sample
        if rows.shape[1] == 0:
            return
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()
        if index not in self.directions:
            direction = torch.randn(rows.shape[1], generator=self.generator, dtype=rows.dtype)
            self.directions[index] = direction.to(device=rows.device)
        # in the gradient's precision (a float64 copy of every gradient cost as much again): its
        # rounding, ~1e-6 of a row in float32, is far under the tolerance
        self.sketches[which][index] = (torch.linalg.vector_norm(rows, dim=1).double(),
                                            (rows @ self.directions[index]).double())

    def _sketch_from_node(self, which: int, index: int, grad_outputs: tuple) -> None:
        self._sketch(which, index, grad_outputs[self.outputs[index][1].output_nr])

    def observe(self, edges: list, grads: tuple, which: int = 1) -> None:
        """Sketch the watched ones of the results ``grads`` of a backward pass to ``edges`` (the
        weighted one's: ``which`` 0; the step's: 1): their nodes did not run, so their pre-hooks
        did not see them."""
        for edge, grad in zip(edges, grads):
            if (index := self.index.get((edge.node, edge.output_nr))) is not None:
                self._sketch(which, index, grad)

    @contextlib.contextmanager
    def _watching(self, which: int):
        handles = [edge.node.register_prehook(functools.partial(self._sketch_from_node, which, index))
                   for index, (_, edge, _) in enumerate(self.outputs)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def weighted_pass(self, losses: torch.Tensor, edges: list) -> None:
        """The backward pass of sum_i w_i L_i to the layers' outputs ``edges`` (no parameter
        gradient), the graph kept for the step's, sketching the watched outputs' gradients."""
        with self._watching(0):
            self.observe(edges, torch.autograd.grad(losses, edges, grad_outputs=self.weights.to(losses.dtype),
                                                    retain_graph=True, allow_unused=True), which=0)

    def watching(self):
        """A context in which the step's backward pass sketches the watched outputs' gradients
        that its nodes see (the others: :meth:`observe`)."""
        return self._watching(1)

    def raise_if_moved(self) -> None:
        """Raise naming the first output whose row j is not w_j times the step's (in norm or in its
        projection): a row that holds another sample's gradient, or several samples'."""
        weighted, own = self.sketches
        compared = [index for index in range(len(self.outputs)) if index in weighted and index in own]
        largest = max((float(own[index][0].max()) for index in compared), default=0.0)
        for index in compared:
            what = self.outputs[index][0]
            (norms_w, projections_w), (norms, projections) = weighted[index], own[index]
            # each row divided by its own weight (exact: a power of two), so that its bound is its own
            # sample's, whatever weight another drew (a row's projection is at most its norm times
            # the direction's, which is of the order of 1 per element: held to the row's norm too)
            bound = _TOLERANCE * norms + _NEGLIGIBLE * largest
            off = ((norms_w / self.weights - norms).abs() > bound) | \
                ((projections_w / self.weights - projections).abs() > bound)
            if bool(off.any()):
                row = int(off.nonzero()[0])
                scale = self.weights * norms
                raise ValueError(
                    f"per_sample_losses: row {row} of the output gradient of {what} is not sample {row}'s alone: a "
                    f"backward pass of the losses weighted at random (w_{row} = {float(self.weights[row]):.4f}) gave "
                    f"it a norm of {float(norms_w[row]):.6g}, where w_{row} times the step's is "
                    f"{float(scale[row]):.6g}. "
                    "Book-keeping reads row i of every layer as sample i, and would clip parts of different samples "
                    "together: the rows are taken in another order, or mixed with other samples', between that layer "
                    "and the losses (a sort, a shuffle, a write at other rows, samples added together); order the "
                    "batch before the model, inputs and targets alike")

