"""A book-keeping step whose forward, backward and clip replay from a CUDA graph
(:meth:`BookKeeping.graphed <privleak.dpsgd.BookKeeping.graphed>`).

On a GPU a small model's book-keeping step is the host's: the Python of the hooks, the graph
walks and the layers' rules, and a kernel launch per op, while the GPU waits (the transformer of
the bench at B 64 kept an H100 busy 3.75 ms of a 17.2 ms step). A CUDA graph records the step's
kernels once and launches them all in one call.

Only what is a function of the batch and the parameters alone is captured: the loss's forward,
the backward to the layers' outputs, the norms, the clip factors and the clipped sums. The noise,
the optimizer step and the step count run eagerly after each replay, exactly as in
:meth:`BookKeeping.step <privleak.dpsgd.BookKeeping.step>`, the noise drawn from the generator's
state on the host: a graph replays its kernels' arguments as captured, so noise inside it would
be the same every step. The non-finite check (a host sync) runs after the replay too, before the
noise and the optimizer, so a batch that raises leaves the model and the step count as they were.

A graph's tensors have fixed shapes, and Poisson batches do not: the graph is captured for
``max_batch`` samples, and a batch of B <= max_batch fills its first B rows, the others padded
with copies of the batch's first sample whose losses are multiplied by 0. Their gradients are
then exactly 0 and add nothing to the sums (their norms are 0, their clip factor 1), so the update
is the one of the B samples alone, up to float32 rounding (the GEMMs have other shapes). An empty
batch, or one larger than ``max_batch``, takes the eager step.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch

from privleak import validation
from privleak.dpsgd import graph as graph_walk
from privleak.dpsgd.bookkeeping import check_losses


class GraphedStep:
    """``bk.step(loss_fn(*inputs))`` with the forward, backward and clip replayed from a CUDA
    graph (module docstring); made by :meth:`BookKeeping.graphed
    <privleak.dpsgd.BookKeeping.graphed>`. On a CPU there is no graph: each call runs the same
    padded step eagerly (the same update; no faster than :meth:`~privleak.dpsgd.BookKeeping.step`).

    Calling it with a batch's inputs (each with the batch in dim 0, the example's other dims,
    dtype and device) returns the update as ``step`` does. On a GPU the update's tensors are the
    graph's outputs, which the next call overwrites: clone them to keep them.
    """

    def __init__(self, bookkeeping, loss_fn: Callable, example_inputs: tuple, *, max_batch: Optional[int] = None,
                 warmup: int = 2):
        if not callable(loss_fn):
            raise validation.ArgumentTypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if bookkeeping._replicas is not None:
            raise ValueError("graphed(): the model is a DistributedDataParallel, whose forward has not been checked "
                             "under CUDA graph capture; take its steps with step()")
        if not example_inputs:
            raise ValueError("example_inputs: give at least one input tensor of loss_fn (the batch in dim 0)")
        batch = _batch_size(example_inputs, "example_inputs")
        if batch == 0:
            raise ValueError("example_inputs: the example batch is empty; give at least one sample")
        self.max_batch = validation.integer(batch if max_batch is None else max_batch, "max_batch", low=batch)
        _warn_of_eager_steps(self.max_batch, bookkeeping._dp)
        self.device = bookkeeping.params[0].device
        for i, x in enumerate(example_inputs):
            if x.device != self.device:
                raise ValueError(f"example_inputs[{i}] is on {x.device}, the model's parameters on {self.device}")
        if bookkeeping._accumulated is not None:
            raise ValueError("graphed(): physical batches have been accumulated since the last step; step() first")
        self._bk, self._loss_fn = bookkeeping, loss_fn
        self._averaged = bookkeeping._averages_in_clip()
        self._inputs = tuple(torch.empty((self.max_batch, *x.shape[1:]), dtype=x.dtype, device=self.device)
                             for x in example_inputs)
        self._positions = torch.arange(self.max_batch, device=self.device)
        self._count = torch.zeros((), dtype=torch.int64, device=self.device)
        self._fill(example_inputs, batch)
        warmup = validation.integer(warmup, "warmup", low=1)
        self._graph = None
        try:
            if self.device.type == "cuda":
                self._graph, self._outputs = self._capture(warmup)
            else:  # the same runs, which check loss_fn as the capture's warm-up does
                for _ in range(warmup):
                    self._clipped_sums()
        except BaseException:
            bookkeeping._clear()  # a failed run's records, which the next step would count as its own
            raise
        # A graph reads the parameters and buffers where they were at its capture, and runs the
        # modules in the mode they were in (dropout or not).
        self._storage = _storage(bookkeeping.model) if self._graph is not None else None
        self._modes = _modes(bookkeeping.model) if self._graph is not None else None

    def __call__(self, *inputs) -> list:
        bk = self._bk
        if len(inputs) != len(self._inputs):
            raise ValueError(f"inputs: the step was made for {len(self._inputs)} input(s) of loss_fn, got "
                             f"{len(inputs)}")
        batch = _batch_size(inputs, "inputs")
        for i, (x, static) in enumerate(zip(inputs, self._inputs)):
            if x.ndim != static.ndim or x.shape[1:] != static.shape[1:] or x.dtype != static.dtype \
                    or x.device != static.device:
                raise ValueError(f"inputs[{i}] must be like the example: (B, {', '.join(map(str, static.shape[1:]))}) "
                                 f"{static.dtype} on {static.device}, got {tuple(x.shape)} {x.dtype} on {x.device}")
        if bk._accumulated is not None:
            raise ValueError("physical batches have been accumulated since the last step; step() them first")
        if self._storage is not None and _storage(bk.model) != self._storage:
            raise ValueError("the model's parameters or buffers are not where graphed() found them (model.to(), "
                             ".half(), a parameter's .data or a state dict assigned): make a new graphed step")
        if self._modes is not None and _modes(bk.model) != self._modes:
            raise ValueError("the model's modules are not in the train()/eval() mode that graphed() captured them "
                             "in: set it back (model.train() after an evaluation), or make a new graphed step")
        bk._clear()  # forward passes run since the last step (an evaluation with grad): none of this batch's
        bk._check_model()  # a replay runs none of the captured part's Python
        bk._check_batch_size(batch)
        if batch == 0 or batch > self.max_batch:
            return bk.step(self._loss_fn(*inputs) if batch else None)
        self._fill(inputs, batch)
        if self._graph is None:
            sums, norm_sums = self._clipped_sums()
        else:
            self._graph.replay()
            sums, norm_sums = self._outputs
        bk._check_finite(norm_sums, batch)
        return bk._release(sums, self._averaged, batch)

    def _fill(self, inputs: tuple, batch: int) -> None:
        """The batch into the graph's inputs, the rows past it copies of its first sample."""
        for static, x in zip(self._inputs, inputs):
            static[:batch].copy_(x)
            if batch < self.max_batch:
                static[batch:].copy_(x[:1].expand_as(static[batch:]))
        self._count.fill_(batch)

    def _clipped_sums(self) -> tuple:
        """The captured part: (sums, norm sums) of the batch in the graph's inputs, its padding's
        losses multiplied by 0, nothing waiting for the device."""
        losses = check_losses(self._loss_fn(*self._inputs))
        if losses.shape != (self.max_batch,):
            raise ValueError(f"loss_fn must return the per-sample losses, shape ({self.max_batch},) for inputs of "
                             f"{self.max_batch} rows, got {tuple(losses.shape)}")
        losses = losses * (self._positions < self._count).to(losses.dtype)
        return self._bk._clipped_batch(losses, self._averaged, self.max_batch, synced=False)

    def _capture(self, warmup: int) -> tuple:
        """Warm up on a side stream (lazy state: the clip norms' tensor, cuBLAS's workspace), as
        torch's graph capture asks, then capture :meth:`_clipped_sums`. The warm-up runs only the
        captured part, which changes nothing: no noise, no optimizer step."""
        if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
            # The warm-up would fill autocast's cache of low-precision weights, which the graph
            # would then read every replay: the weights as they were at the capture.
            raise ValueError("graphed() under torch.autocast with its weight cache: pass cache_enabled=False, or put "
                             "the autocast inside loss_fn")
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        # The model's device current throughout (torch's default capture stream is on the device
        # current when it was made); a capture error of this thread only (a DataLoader's pinning
        # thread may call what a global capture refuses).
        with torch.cuda.device(self.device):
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._clipped_sums()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    outputs = self._clipped_sums()
            except BaseException as error:
                error.add_note("privleak: BookKeeping.graphed() could not capture the step that its warm-up ran "
                               "(loss_fn must run without host syncs or data-dependent shapes); BookKeeping.step "
                               "works without a graph")
                raise
        # Tensors made outside the graph's pool that its kernels read, held by caches that could
        # let them go (an eager step with other layers in use, other views): held here too, or a
        # replay would read freed memory.
        self._read = [self._bk._clip_norm_cache[1], *graph_walk.kept_view_positions()]
        return graph, outputs


def _warn_of_eager_steps(max_batch: int, dp) -> None:
    """Warn where Poisson batches would often be larger than the graph (those steps run eagerly),
    with a max_batch that a batch exceeds in fewer than 1 of 10^4 steps. The batch size of Poisson
    sampling at rate q from N examples is Binomial(N, q), whose upper tail is below that of the
    Poisson(L = N q) used here (N is not known)."""
    if dp.sampling != "poisson":
        return
    from scipy import stats  # here: scipy.stats took 0.9 s of every `import privleak.dpsgd`

    expected = dp.expected_batch_size
    larger = float(stats.poisson.sf(max_batch, expected))
    if larger > 0.01:
        enough = int(stats.poisson.isf(1e-4, expected))
        warnings.warn(f"max_batch={max_batch}: a Poisson batch of expected size {expected:g} is larger in "
                      f"{math.ceil(100 * larger)}% of steps, which take the eager step; max_batch={enough} keeps all "
                      "but 1 in 10^4 on the graph (its padding rows are computed too)", stacklevel=4)


def _storage(model: torch.nn.Module) -> list:
    """Where each parameter and buffer of ``model`` is: (data pointer, dtype, device)."""
    return [(t.data_ptr(), t.dtype, t.device) for t in (*model.parameters(), *model.buffers())]


def _modes(model: torch.nn.Module) -> list:
    """Each module's ``training`` flag."""
    return [m.training for m in model.modules()]


def _batch_size(inputs: tuple, name: str) -> int:
    """The batch size of ``inputs``: tensors with the batch in dim 0, all of one size there."""
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise validation.ArgumentTypeError(f"{name}[{i}] must be a torch tensor, got {type(x).__name__}")
        if x.ndim == 0:
            raise ValueError(f"{name}[{i}] must have the batch in dim 0, got a 0-d tensor")
    sizes = {x.shape[0] for x in inputs}
    if len(sizes) != 1:
        raise ValueError(f"{name} must all have the batch in dim 0, got dim 0 sizes {[x.shape[0] for x in inputs]}")
    return sizes.pop()
