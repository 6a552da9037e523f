"""The DP-SGD step around a model: per-sample gradients, batch sampling, the private update, the
optimizer wrapper and the privacy report of a run."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from privleak import validation
from privleak.dpsgd.clip import _check_grads
from privleak.dpsgd.config import DPSGDConfig, check_config
from privleak.dpsgd.mechanism import Sampling


def per_sample_gradients(model: torch.nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    """Per-sample gradients of ``loss_fn(model(x_b), y_b)`` for every trainable parameter.

    Computed with ``torch.func`` (``vmap`` of ``grad`` over a ``functional_call``), so any model
    without batch-coupled layers (BatchNorm in training mode) works; an embedding with ``max_norm``
    (its forward changes its weights by the data) is refused. Random ops (dropout in
    training mode) draw for each sample on its own (``randomness="different"``), as one batched
    forward draws a mask per sample. Returns one (B, *p.shape) tensor per parameter with
    ``requires_grad``, in ``model.parameters()`` order.
    """
    from torch.func import grad, vmap

    from privleak.dpsgd.layers import check_no_embedding_max_norm
    from privleak.dpsgd.stateless import functional_call

    check_no_embedding_max_norm(model)

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_of_one(params, x, y):
        out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    # torch.func cannot vmap cuDNN's recurrent layers: their flatten_parameters reads the batched
    # weights' data pointers (pytorch/pytorch#105982). torch's own RNN kernels take their place.
    cudnn = torch.backends.cudnn.enabled
    if any(isinstance(m, torch.nn.RNNBase) for m in model.modules()) and any(p.is_cuda for p in params.values()):
        torch.backends.cudnn.enabled = False
    try:
        grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0), randomness="different")(params, inputs, targets)
    finally:
        torch.backends.cudnn.enabled = cudnn
    return [grads[name].contiguous() for name in names]


def sample_batch(num_examples: int, batch_size: int, sampling: str = "poisson",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Indices of one DP-SGD batch: Poisson sampling (each example independently with rate
    batch_size / num_examples; the batch size varies, the accountant's assumption for
    amplification by subsampling) or a fixed-size sample without replacement. The indices are on
    ``generator``'s device (a CUDA generator draws on its GPU), else on torch's default device."""
    num_examples = validation.integer(num_examples, "num_examples", low=1)
    batch_size = validation.integer(batch_size, "batch_size", low=1)
    if batch_size > num_examples:
        raise ValueError(f"batch_size must be <= num_examples, got {batch_size} and {num_examples}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise validation.ArgumentTypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    device = generator.device if generator is not None else None
    if _check_sampling(sampling) == "poisson":
        draws = torch.rand(num_examples, generator=generator, device=device)
        return torch.nonzero(draws < batch_size / num_examples).flatten()
    return torch.randperm(num_examples, generator=generator, device=device)[:batch_size]


def _check_sampling(sampling: str) -> str:
    return validation.choice(sampling, "sampling", ("poisson", "fixed"))


def _check_expected_batch_size(value, sampling: str = "poisson") -> float:
    """L > 0; under fixed-size sampling a whole number, every batch's size (a fractional L was
    accounted as the even integer it rounds to: 2.5 reported at epsilon 14.4, as batches of 2, for
    at least 19.5)."""
    if sampling == "fixed":
        return float(validation.integer(value, "expected_batch_size", low=1, integral_float=True))
    return validation.positive(value, "expected_batch_size")


def privatize(per_sample_grads: Sequence[torch.Tensor], config: DPSGDConfig, expected_batch_size: float,
              generator=None) -> list:
    """The update DP-SGD leaks for one batch (what an honest-but-curious server sees), per tensor:
    ``config.mechanism``'s release of the per-sample gradients clipped as ``config`` says."""
    grads = _check_grads(per_sample_grads)
    config = check_config(config, len(grads))
    expected_batch_size = _check_expected_batch_size(expected_batch_size)
    config.mechanism.check_generator(generator)
    return config.mechanism.release(grads, config.clipping(len(grads)), expected_batch_size, generator,
                                    config.non_finite)


class PrivacyReport(NamedTuple):
    """A DP-SGD run's privacy, as epsilon and as the Bayes capacity of one leaked update."""

    epsilon: float  #: epsilon(delta) over the run (accounting module)
    delta: float
    steps: int
    capacity_bits: float  #: log2 Bayes capacity of one leaked update (capacity module)
    capacity_log: float  #: the same, natural log


def privacy_report(config: DPSGDConfig, parameter_shapes: Sequence[Sequence[int]], *, expected_batch_size: float,
                   dataset_size: int, steps: int, delta: float, sampling: str = "poisson") -> PrivacyReport:
    """epsilon of ``steps`` DP-SGD steps, sampled at rate q = expected_batch_size / dataset_size,
    next to the Bayes capacity of the channel one step's update goes through.

    ``sampling`` says how the batches were drawn (:func:`sample_batch`): "poisson" (add/remove
    neighbours) or "fixed", batches of expected_batch_size examples without replacement
    (replace-one neighbours). The mechanism does the accounting (its ``epsilon``) and gives the
    capacity (its ``log_capacity``); see each mechanism class. No steps: epsilon 0.
    """
    sizes = _parameter_sizes(parameter_shapes)
    config = check_config(config, len(sizes))
    sampling = _check_sampling(sampling)
    steps = validation.integer(steps, "steps", low=0)
    dataset_size = validation.integer(dataset_size, "dataset_size", low=1)
    expected_batch_size = _check_expected_batch_size(expected_batch_size, sampling)
    if expected_batch_size > dataset_size:
        raise ValueError(f"expected_batch_size must be <= dataset_size, got {expected_batch_size!r} and {dataset_size}")
    delta = validation.probability(delta, "delta", open_high=True)
    config.mechanism.check_privacy_report(delta)
    if sum(sizes) == 0 or (config.per_layer and 0 in sizes):
        raise ValueError("parameter_shapes must have at least one element"
                         f"{' in each tensor' if config.per_layer else ''}, "
                         f"got {[tuple(shape) for shape in parameter_shapes]}")
    runs = Sampling(sampling, expected_batch_size / dataset_size, dataset_size)
    epsilon = config.mechanism.epsilon(steps, delta, runs)
    log_capacity = config.mechanism.log_capacity(sizes, config.clipping(len(sizes)), expected_batch_size)
    return PrivacyReport(epsilon, delta, steps, log_capacity.bits, log_capacity.log)


def _parameter_sizes(parameter_shapes) -> list[int]:
    """The element counts of ``parameter_shapes``, a non-empty sequence of shapes of ints >= 0."""
    if isinstance(parameter_shapes, (str, bytes, torch.Tensor, np.ndarray)) or \
            not isinstance(parameter_shapes, Iterable):
        raise validation.ArgumentTypeError(f"parameter_shapes must be a sequence of shapes, got "
                                           f"{type(parameter_shapes).__name__} {parameter_shapes!r}")
    shapes = list(parameter_shapes)
    if not shapes:
        raise ValueError("parameter_shapes must not be empty")
    sizes = []
    for i, shape in enumerate(shapes):
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise validation.ArgumentTypeError(f"parameter_shapes[{i}] must be a shape (a sequence of ints), got "
                                               f"{type(shape).__name__} {shape!r}")
        sizes.append(math.prod(validation.integer(d, f"parameter_shapes[{i}]", low=0) for d in shape))
    return sizes


class DPOptimizer:
    """DP-SGD around any torch optimizer.

    ``step(per_sample_grads)`` privatises the per-sample gradients (:func:`privatize`), writes the
    result into the parameters' ``.grad`` and steps the wrapped optimizer; it returns the leaked
    update. Per-sample gradients come in the order of the optimizer's trainable parameters (param
    groups in order; a frozen one, ``requires_grad`` False, as a LoRA model's base weights in an
    optimizer of all its parameters, gets no gradient and is passed over, as Opacus does); a
    gradient whose shape is not its parameter's is rejected. ``sampling`` is how the
    batches are drawn ("poisson" or "fixed", :func:`sample_batch`), for the privacy report.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: DPSGDConfig, expected_batch_size: float,
                 generator=None, sampling: str = "poisson"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise validation.ArgumentTypeError("optimizer must be a torch.optim.Optimizer, "
                                               f"got {type(optimizer).__name__}")
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("optimizer holds no trainable parameters (none with requires_grad)")
        self.sampling = _check_sampling(sampling)
        self.optimizer = optimizer
        self.config = check_config(config, len(self.params))
        self.expected_batch_size = _check_expected_batch_size(expected_batch_size, self.sampling)
        self.config.mechanism.check_generator(generator)
        self.generator = generator
        self.steps = 0

    def privacy_report(self, dataset_size: int, delta: float) -> PrivacyReport:
        """:func:`privacy_report` for the steps taken so far."""
        return privacy_report(self.config, [p.shape for p in self.params], expected_batch_size=self.expected_batch_size,
                              dataset_size=dataset_size, steps=self.steps, delta=delta, sampling=self.sampling)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def check_batch_size(self, samples: int) -> None:
        """Under fixed-size sampling every batch is expected_batch_size examples: the report's
        replace-one accounting and the update's division are for that size (ten batches of 32 at
        expected_batch_size 8 were reported at epsilon 6.45 for the 13.1 they took, each update
        divided by 8)."""
        if self.sampling == "fixed" and samples != self.expected_batch_size:
            raise ValueError(f"sampling='fixed' draws batches of expected_batch_size={self.expected_batch_size:g} "
                             f"examples, got a batch of {samples}: the privacy report accounts for batches of "
                             "that size; draw them with sample_batch, or use sampling='poisson'")

    def _accounting(self) -> dict:
        """What the privacy report's epsilon depends on besides the steps: saved with them, so that a
        run resumed under another mechanism or sampling is refused, not reported as one run."""
        return {"mechanism": repr(self.config.mechanism), "expected_batch_size": self.expected_batch_size,
                "sampling": self.sampling}

    def state_dict(self) -> dict:
        """The DP state to save with the model's and the optimizer's: the steps taken (the privacy
        report counts them), the seeded noise generator's (key, offset) (None for a
        :class:`~privleak.mechanisms.SecureNoiseGenerator`, which takes a fresh key in every
        process) and what the report's epsilon depends on besides them ('accounting': the
        mechanism, the expected batch size, the sampling). Restored by :meth:`load_state_dict`;
        without it, a resumed run would report the epsilon of its own steps only, and a generator
        seeded again would draw the first steps' noise once more, which cancels between the two
        releases. The key is in the state: keep it as secret as the seed."""
        from privleak import mechanisms

        generator = mechanisms.generator_in_use(self.generator)
        return {"steps": self.steps,
                "generator": generator.get_state() if isinstance(generator, mechanisms.NoiseGenerator) else None,
                "accounting": self._accounting()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state: the steps, and the (key, offset) into this optimizer's
        seeded generator (privleak's default one where it was built with none). A secure generator
        on either side keeps its own state: it never repeats. A state saved under another
        mechanism, expected batch size or sampling is refused: the report would compose the saved
        steps as this run's (100 steps at sigma 0.6 resumed at 3.0 were reported at epsilon 0.11
        for 3.8); a state from before it was saved (no 'accounting') is taken on trust. The model
        may differ (another set of trainable parameters). Refused after a step of this run: the
        count would drop its releases (a review's repro reported 4 releases as 3)."""
        from privleak import mechanisms

        if not isinstance(state, dict) or not {"steps", "generator"} <= set(state) <= {"steps", "generator",
                                                                                       "accounting"}:
            raise validation.ArgumentTypeError("state must be a dict with the keys 'steps' and 'generator' (and "
                                               f"'accounting'), as state_dict() makes, got {state!r}")
        steps = validation.integer(state["steps"], "state['steps']", low=0)
        if self.steps:
            raise ValueError(f"load_state_dict(): this run has taken {self.steps} step(s), whose releases the loaded "
                             "count would drop from the privacy report (and a seeded generator would replay the "
                             "saved run's noise): load the state before the first step")
        saved = state.get("accounting")
        if saved is not None:
            own = self._accounting()
            if not isinstance(saved, dict) or set(saved) != set(own):
                raise validation.ArgumentTypeError(f"state['accounting'] must be a dict with the keys {sorted(own)}, "
                                                   f"as state_dict() makes, got {saved!r}")
            for key, value in own.items():
                if key == "expected_batch_size":  # a batch size computed (0.07 * 100) is the one typed (7)
                    same = isinstance(saved[key], (int, float)) and math.isclose(saved[key], value, rel_tol=1e-12)
                else:
                    same = saved[key] == value
                if not same:
                    raise ValueError(f"state was saved by a run with {key} {saved[key]!r}, and this one has "
                                     f"{value!r}: the privacy report would compose its steps as this run's; "
                                     "resume with the same settings, or account for the two runs apart")
        generator = mechanisms.generator_in_use(self.generator)
        if state["generator"] is not None and isinstance(generator, mechanisms.NoiseGenerator):
            generator.set_state(state["generator"])
        self.steps = steps

    def step(self, per_sample_grads: Sequence[torch.Tensor]) -> list:
        per_sample_grads = _check_grads(per_sample_grads)
        if len(per_sample_grads) != len(self.params):
            raise ValueError(f"got {len(per_sample_grads)} per-sample gradients for {len(self.params)} parameters")
        for i, (g, p) in enumerate(zip(per_sample_grads, self.params)):
            if not isinstance(g, torch.Tensor) or g.shape[1:] != p.shape:
                shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise ValueError(f"per_sample_grads[{i}] must be (B, *{tuple(p.shape)}), the shape of the optimizer's "
                                 f"parameter {i}, got {shape}: give them in the optimizer's parameter order")
        self.check_batch_size(per_sample_grads[0].shape[0])
        update = privatize(per_sample_grads, self.config, self.expected_batch_size, self.generator)
        self.apply(update)
        return update

    def apply(self, update: Sequence[torch.Tensor]) -> None:
        """Step the optimizer with the released ``update`` as the trained parameters' ``.grad``,
        and count the step. Every other parameter the optimizer holds (one frozen after it was
        built, or frozen from the start) has its ``.grad`` cleared first: a backward pass run
        before freezing left one, and the optimizer would apply it, unclipped and without noise,
        at every step (a review's repro: a frozen weight moved by lr times it each step)."""
        trained = {id(p) for p in self.params}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in trained:
                    p.grad = None
        for p, u in zip(self.params, update):
            p.grad = u.to(p.dtype)
        self.optimizer.step()
        self.steps += 1
