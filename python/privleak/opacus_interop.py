"""privleak's fused clipping and its noise inside Opacus.

Opacus users switch in two lines, after ``PrivacyEngine.make_private``:

    from privleak.opacus_interop import PrivleakDPOptimizer
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer)                           # Gaussian, Alg. 1
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer, mechanism="vmf", kappa=k)  # VMF, Alg. 2
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer, mechanism="laplace")       # L1 clip, Laplace

``from_opacus`` takes the optimizer of each of Opacus's three engines, single-process or
distributed, and returns privleak's counterpart, which keeps the engine's clipping rule:

* ``DPOptimizer`` (``grad_sample_mode="hooks"`` or ``"functorch"``, flat clipping) becomes
  :class:`PrivleakDPOptimizer`;
* ``DPPerLayerOptimizer`` (``clipping="per_layer"``, one max_grad_norm per parameter) becomes
  :class:`PrivleakPerLayerDPOptimizer`;
* ``DPOptimizerFastGradientClipping`` (``grad_sample_mode="ghost"``: Opacus's ghost clipping, whose
  loss wrapper clips in a second backward pass and leaves the clipped sum in ``p.grad``) becomes
  :class:`PrivleakGhostClippingDPOptimizer`. Ghost clipping clips in L2 only, so an L1 mechanism
  (Laplace) is refused there;
* their distributed forms, which ``make_private`` gives for a model wrapped in Opacus's
  ``DifferentiallyPrivateDistributedDataParallel`` (``DistributedDPOptimizer``,
  ``SimpleDistributedPerLayerOptimizer``, ``DistributedDPOptimizerFastGradientClipping``), become
  :class:`PrivleakDistributedDPOptimizer`, :class:`PrivleakDistributedPerLayerDPOptimizer` and
  :class:`PrivleakDistributedGhostClippingDPOptimizer`: each process clips its share, and the
  processes' clipped sums are privatised once, on the first process, whose update every process
  steps with (:class:`_AcrossProcesses`; every mechanism, VMF and secure noise included). Every
  process calls ``from_opacus`` with the same arguments, which it checks.

Each keeps Opacus's interface and hooks (gradient accumulation, skipped steps, empty Poisson
batches, the accountant's step hook for the Gaussian mechanism) and its secure mode; it replaces two
steps:

* ``clip_and_accumulate`` runs :func:`privleak.dpsgd.clip_and_accumulate` on the parameters'
  ``grad_sample`` (flat, or per layer with each tensor's own norm; two passes, no intermediate
  copies; in float32 where the parameters' dtypes differ or are float64; ``non_finite="drop"``
  leaves out samples whose gradients are not finite, where by default they raise). Per-sample
  gradients already clipped, with no ``zero_grad()`` since, are refused as Opacus refuses them.
  Opacus divides by norm + 1e-6 where privleak clips exactly to the norm, so clipped samples
  differ by about 1e-6 relative. Under ghost clipping Opacus's module has already clipped.
* ``add_noise`` is the mechanism's noise on the clipped sum
  (:meth:`privleak.dpsgd.DPSGDMechanism.noise`): privleak's counter-based Gaussian noise (std
  noise_multiplier x max_grad_norm, with per-layer norms c_t the L2 norm |(c_t)|_2 as in Opacus;
  reproducible from ``noise_generator``; Opacus's ``noise_generator``, a ``torch.Generator`` privleak's
  noise does not draw from, is refused), or for ``mechanism="vmf"`` a VMF(kappa) draw around the
  sum's direction (Biswas et al., Alg. 2), which is then the whole update (``scale_grad`` leaves it
  alone), or any other registered mechanism's (Laplace clips in L1 and adds
  Laplace(noise_multiplier x max_grad_norm) per coordinate).

Opacus's own accountant covers the Gaussian mechanism only. With any other mechanism its step
hook is left off, so that it records no Gaussian steps that never happened; account those runs
with the mechanism's ``epsilon`` (or :func:`privleak.dpsgd.privacy_report`). An engine made with
``secure_mode=True`` gets privleak's secure noise (a
:class:`~privleak.mechanisms.SecureNoiseGenerator` unless one is given); a mechanism without a
secure mode (VMF) is refused. Opacus's adaptive-clipping optimizer, its FSDP optimizer and its
``DistributedPerLayerOptimizer`` (which clips and noises in backward hooks; ``make_private`` gives
the simple one) do other work in the replaced steps and are refused.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from opacus.optimizers import (
    DistributedDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
    SimpleDistributedPerLayerOptimizer,
)
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.optimizers.utils import params as _trained_params

from privleak import dpsgd, validation
from privleak import mechanisms as _mechanisms
from privleak.dpsgd import distributed

#: The keywords of Opacus's DPOptimizer that its **kwargs do not swallow.
_OPACUS_KEYWORDS = frozenset({"generator", "secure_mode"})


class PrivleakDPOptimizer(DPOptimizer):
    """An Opacus ``DPOptimizer`` whose clipping and noise are privleak's (module docstring).

    ``mechanism`` is a :class:`privleak.dpsgd.DPSGDMechanism` or a registered name; with a name,
    its parameters come from the keywords (``kappa=`` for VMF), and a mechanism with a
    ``noise_multiplier`` takes Opacus's."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: Union[float, list], expected_batch_size: Optional[int], loss_reduction: str = "mean",
                 mechanism: Union[str, dpsgd.DPSGDMechanism] = "gaussian", noise_generator=None,
                 non_finite: str = "raise", **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise validation.ArgumentTypeError("optimizer must be a torch.optim.Optimizer, "
                                               f"got {type(optimizer).__name__}")
        noise_multiplier = validation.non_negative(noise_multiplier, "noise_multiplier")
        max_grad_norm = self._check_max_grad_norm(max_grad_norm, optimizer)
        if expected_batch_size is not None:
            expected_batch_size = validation.positive(expected_batch_size, "expected_batch_size")
        loss_reduction = validation.choice(loss_reduction, "loss_reduction", ("mean", "sum"))
        if loss_reduction == "mean" and expected_batch_size is None:
            raise ValueError("expected_batch_size must be given (a number > 0) with loss_reduction='mean'")
        if not isinstance(mechanism, dpsgd.DPSGDMechanism):
            fields = {field.name for field in dataclasses.fields(dpsgd.mechanism.get(mechanism))}
            parameters = {name: kwargs.pop(name) for name in list(kwargs) if name in fields}
            if "noise_multiplier" in fields:
                parameters["noise_multiplier"] = noise_multiplier
            mechanism = dpsgd.mechanism.create(mechanism, parameters)
        elif getattr(mechanism, "noise_multiplier", noise_multiplier) != noise_multiplier:
            # Opacus's accountant records the optimizer's noise_multiplier for every step.
            raise ValueError(f"mechanism: its noise_multiplier {mechanism.noise_multiplier!r} is not the optimizer's "
                             f"noise_multiplier {noise_multiplier!r}, which Opacus's accountant records; give the "
                             "mechanism by name (it takes the optimizer's), or make the engine with that noise")
        if unknown := sorted(set(kwargs) - _OPACUS_KEYWORDS):
            # Opacus's DPOptimizer takes **kwargs and drops them: a misspelt noise_generator would go unseeded.
            raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))} for the "
                            f"{mechanism.name} mechanism and Opacus's optimizer")
        if kwargs.get("generator") is not None and not kwargs.get("secure_mode"):
            # Opacus's noise draws from it; privleak's never does: a seeded run would go unseeded
            raise ValueError("generator: Opacus's noise generator (make_private's noise_generator) is not what "
                             "privleak's noise draws from; for a seeded run pass noise_generator="
                             "privleak.mechanisms.NoiseGenerator(seed)")
        self.non_finite = validation.choice(non_finite, "non_finite", ("raise", "drop"))
        if self.non_finite == "drop" and not self.clips_samples:
            raise ValueError("non_finite='drop': ghost clipping's norms cannot tell which sample is not finite; use "
                             "Opacus's hooks or functorch mode")
        self._check_mechanism(mechanism)
        mechanism.check_generator(noise_generator)
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction, **kwargs)
        if self.secure_mode:
            if not mechanism.secure:
                raise ValueError(f"secure_mode: the {mechanism.name} mechanism has no secure mode yet")
            if noise_generator is None:
                noise_generator = _mechanisms.SecureNoiseGenerator()
            elif not isinstance(noise_generator, _mechanisms.SecureNoiseGenerator):
                raise ValueError("secure_mode needs noise_generator to be a SecureNoiseGenerator (or None)")
        self.mechanism = mechanism
        self.noise_generator = noise_generator

    #: whether privleak's kernel clips the per-sample gradients (else Opacus's ghost clipping has)
    clips_samples = True

    @staticmethod
    def _check_max_grad_norm(max_grad_norm, optimizer: torch.optim.Optimizer) -> float:
        return validation.positive(max_grad_norm, "max_grad_norm")

    def _check_mechanism(self, mechanism: dpsgd.DPSGDMechanism) -> None:
        """Refuse a mechanism this optimizer's clipping cannot serve (flat clipping serves all)."""

    @classmethod
    def from_opacus(cls, optimizer: DPOptimizer, **kwargs) -> "PrivleakDPOptimizer":
        """privleak's counterpart of an Opacus optimizer (flat, per-layer or ghost clipping, module
        docstring), with the same hyperparameters, wrapped optimizer, secure mode and (Gaussian)
        accountant hook. Called on a subclass, it takes that subclass's Opacus optimizer only."""
        counterpart = _COUNTERPARTS.get(type(optimizer))
        if counterpart is None or not issubclass(counterpart, cls):
            accepted = ", ".join(opacus.__name__ for opacus, ours in _COUNTERPARTS.items() if issubclass(ours, cls))
            raise TypeError(f"optimizer must be an Opacus {accepted}, got {type(optimizer).__name__}")
        if optimizer.generator is not None and not optimizer.secure_mode and "generator" not in kwargs:
            kwargs["generator"] = optimizer.generator  # refused above: its seed would not reach privleak's noise
        new = counterpart(optimizer.original_optimizer, noise_multiplier=optimizer.noise_multiplier,
                          max_grad_norm=counterpart._opacus_max_grad_norm(optimizer),
                          expected_batch_size=optimizer.expected_batch_size, loss_reduction=optimizer.loss_reduction,
                          secure_mode=optimizer.secure_mode, **kwargs)
        if isinstance(new.mechanism, dpsgd.Gaussian):  # Opacus's accountants model Gaussian noise only
            new.attach_step_hook(optimizer.step_hook)
        if isinstance(optimizer, DPOptimizerFastGradientClipping):
            # make_private's ghost loss wrapper still holds the Opacus optimizer and calls its zero_grad
            # between its two backward passes; that one never hears of a skipped step (gradient
            # accumulation, BatchMemoryManager), so it dropped the sums accumulated so far.
            optimizer.zero_grad = new.zero_grad
        return new

    @staticmethod
    def _opacus_max_grad_norm(optimizer: DPOptimizer):
        return optimizer.max_grad_norm

    def _clipping(self) -> dpsgd.Clipping:
        return dpsgd.Clipping((self.max_grad_norm,), False)

    def clip_and_accumulate(self) -> None:
        """Clip the per-sample gradients and add their sum to ``summed_grad``. Per-sample gradients
        already clipped (no ``zero_grad()`` since the last step or skipped step) are refused, as
        Opacus refuses them: they were clipped again, a sample's share of a release reaching 2
        and 3 times max_grad_norm (a review's repros)."""
        for p in self.params:
            _check_processed_flag(p.grad_sample)
        clipping = self._clipping()
        grads = dpsgd.clip.kernel_rows([self._get_flat_grad_sample(p) for p in self.params])
        summed = dpsgd.clip_and_accumulate(grads, list(clipping.norms), per_layer=clipping.per_layer, batch_size=1.0,
                                           non_finite=self.non_finite, norm_type=self.mechanism.clip_norm_type).grads
        for p, s in zip(self.params, summed):
            s = s.to(p.dtype)
            if p.summed_grad is None:
                p.summed_grad = s
            else:  # in place, as Opacus adds: the mark of a released sum stays on it
                p.summed_grad += s
            _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        for p in self.params:
            _check_processed_flag(p.summed_grad)
        updates = self._released([p.summed_grad for p in self.params])
        for p, update in zip(self.params, updates):
            p.grad = update.to(p.dtype).view_as(p)
            _mark_as_processed(p.summed_grad)

    def _released(self, sums: list) -> list:
        """The mechanism's release of the clipped sums, as the "average" of a batch of 1 (Opacus
        divides by its batch size in scale_grad)."""
        return self.mechanism.noise(sums, self._clipping(), 1.0, self.noise_generator)

    def scale_grad(self) -> None:
        if not self.mechanism.releases_direction:
            super().scale_grad()


class PrivleakPerLayerDPOptimizer(PrivleakDPOptimizer, DPPerLayerOptimizer):
    """Opacus's ``DPPerLayerOptimizer`` with privleak's clipping and noise: parameter t is clipped to
    its own ``max_grad_norm[t]`` (in the mechanism's norm), and the noise is calibrated to the
    sensitivity of the clipped sum, |(c_t)|_2 in L2 (Opacus's rule) or sum_t c_t in L1."""

    @staticmethod
    def _check_max_grad_norm(max_grad_norm, optimizer: torch.optim.Optimizer) -> list:
        norms = validation.reals(max_grad_norm, "max_grad_norm", low=0, low_open=True)
        count = len(_trained_params(optimizer))  # as Opacus counts them: frozen ones have none
        if norms.shape != (count,):
            raise ValueError(f"max_grad_norm must be a list of {count} clip norms, one per trainable parameter of "
                             f"the optimizer, got {max_grad_norm!r}")
        return norms.tolist()

    @staticmethod
    def _opacus_max_grad_norm(optimizer: DPPerLayerOptimizer) -> list:
        return list(optimizer.max_grad_norms)

    def _clipping(self) -> dpsgd.Clipping:
        return dpsgd.Clipping(tuple(self.max_grad_norms), True)


class PrivleakGhostClippingDPOptimizer(PrivleakDPOptimizer, DPOptimizerFastGradientClipping):
    """Opacus's ghost-clipping optimizer with privleak's noise. Opacus's module and loss wrapper
    compute the per-sample norms without per-sample gradients and leave the clipped sum (L2, flat)
    in ``p.grad``; this optimizer privatises that sum with the mechanism's noise."""

    def _check_mechanism(self, mechanism: dpsgd.DPSGDMechanism) -> None:
        if mechanism.clip_norm_type != 2:
            raise ValueError(f"mechanism: ghost clipping clips in L2, but the {mechanism.name} mechanism clips in "
                             f"L{mechanism.clip_norm_type}: use Opacus's hooks or functorch mode")

    clip_and_accumulate = DPOptimizerFastGradientClipping.clip_and_accumulate
    clips_samples = False

    def _released(self, sums: list) -> list:
        """Raise for a clipped sum that is not finite (Opacus's ghost norms of a sample with a NaN
        or inf in it make its clip factor NaN), as privleak's kernel raises for such a sample:
        Gaussian noise had carried the NaN into the parameters silently."""
        if not bool(torch.stack([s.isfinite().all() for s in sums]).all()):
            raise ValueError("the clipped sum of Opacus's ghost clipping is not finite: a sample's gradient is "
                             "(a NaN or inf in its input or loss); ghost clipping cannot tell which sample, so "
                             "the step is refused")
        return super()._released(sums)


class _AcrossProcesses:
    """The clipped sums of Opacus's processes (``DifferentiallyPrivateDistributedDataParallel``,
    each with its share of the batch) privatised once: reduced to the first process, which
    releases their sum with its noise generator, and broadcast
    (:func:`privleak.dpsgd.distributed.release_across`). Opacus's own distributed optimizers add
    noise to the first process's sum before an all-reduce, which suits additive noise only, not
    VMF's release of the normalised direction nor secure noise on the sum's grid. The update is
    the one a single process would release on the whole batch; with ``loss_reduction="mean"``
    (Opacus's ``expected_batch_size`` is each process's share) it is divided by the number of
    processes, as Opacus's is. The processes' settings are compared when they build it."""

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        agreed = {"mechanism": self.mechanism, "max_grad_norm": self._clipping(),
                  "expected_batch_size": self.expected_batch_size, "loss_reduction": self.loss_reduction,
                  "secure_mode": self.secure_mode, "the parameters' shapes": [tuple(p.shape) for p in self.params]}
        distributed.check_agreed(agreed, None, "optimizer")

    def _released(self, sums: list) -> list:
        release = super()._released
        return distributed.release_across(None, [s.contiguous() for s in sums], lambda sums, _: release(sums), None)

    def reduce_gradients(self) -> None:
        if self.loss_reduction == "mean" and not self.mechanism.releases_direction:
            torch._foreach_div_([p.grad for p in self.params], self.world_size)


class PrivleakDistributedDPOptimizer(_AcrossProcesses, PrivleakDPOptimizer, DistributedDPOptimizer):
    """Opacus's ``DistributedDPOptimizer`` with privleak's clipping and noise, the processes' sums
    privatised once (:class:`_AcrossProcesses`)."""


class PrivleakDistributedPerLayerDPOptimizer(_AcrossProcesses, PrivleakPerLayerDPOptimizer,
                                             SimpleDistributedPerLayerOptimizer):
    """Opacus's ``SimpleDistributedPerLayerOptimizer`` with privleak's per-layer clipping and noise,
    the processes' sums privatised once (:class:`_AcrossProcesses`)."""


class PrivleakDistributedGhostClippingDPOptimizer(_AcrossProcesses, PrivleakGhostClippingDPOptimizer,
                                                  DistributedDPOptimizerFastGradientClipping):
    """Opacus's ``DistributedDPOptimizerFastGradientClipping`` with privleak's noise, the processes'
    sums privatised once (:class:`_AcrossProcesses`)."""


#: Opacus's optimizer -> privleak's counterpart (``from_opacus``)
_COUNTERPARTS = {
    DPOptimizer: PrivleakDPOptimizer,
    DPPerLayerOptimizer: PrivleakPerLayerDPOptimizer,
    DPOptimizerFastGradientClipping: PrivleakGhostClippingDPOptimizer,
    DistributedDPOptimizer: PrivleakDistributedDPOptimizer,
    SimpleDistributedPerLayerOptimizer: PrivleakDistributedPerLayerDPOptimizer,
    DistributedDPOptimizerFastGradientClipping: PrivleakDistributedGhostClippingDPOptimizer,
}
