"""privleak's fused clipping and its noise inside Opacus.

Opacus users switch in two lines, after ``PrivacyEngine.make_private``:

    from privleak.opacus_interop import PrivleakDPOptimizer
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer)                           # Gaussian, Alg. 1
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer, mechanism="vmf", kappa=k)  # VMF, Alg. 2

The optimizer keeps Opacus's interface and hooks (gradient accumulation, skipped steps, empty
Poisson batches, the accountant's step hook for the Gaussian mechanism) and its secure mode; it
replaces two steps:

* ``clip_and_accumulate`` runs :func:`privleak.dpsgd.clip_and_accumulate` on the parameters'
  ``grad_sample`` (flat clipping to ``max_grad_norm``, two passes, no intermediate copies).
  Opacus divides by norm + 1e-6 where privleak clips exactly to the norm, so clipped samples differ
  by about 1e-6 relative.
* ``add_noise`` draws privleak's counter-based Gaussian noise (std noise_multiplier x
  max_grad_norm, reproducible from ``noise_generator``), or for ``mechanism="vmf"`` replaces the
  clipped average by a VMF(kappa) draw around its direction (Biswas et al., Alg. 2), which is then
  the whole update (``scale_grad`` leaves it alone).

Opacus's own accountant covers the Gaussian mechanism only. With ``mechanism="vmf"`` its step
hook is left off, so that it records no Gaussian steps that never happened; account VMF runs with
:func:`privleak.accounting.vmf_privacy`. An engine made with ``secure_mode=True`` gets privleak's
secure noise (a :class:`~privleak.mechanisms.SecureNoiseGenerator` unless one is given); VMF has
no secure mode yet, so that combination is refused. Only Opacus's ``DPOptimizer`` itself (flat
clipping) is taken: its per-layer, adaptive, distributed and ghost-clipping subclasses do other
work in the replaced steps.
"""
from __future__ import annotations

from typing import Optional

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from privleak import dpsgd, validation
from privleak import mechanisms as _mechanisms


class PrivleakDPOptimizer(DPOptimizer):
    """An Opacus ``DPOptimizer`` whose clipping and noise are privleak's (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: Optional[int], loss_reduction: str = "mean", mechanism: str = "gaussian",
                 kappa: Optional[float] = None, noise_generator=None, **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise validation.ArgumentTypeError("optimizer must be a torch.optim.Optimizer, "
                                               f"got {type(optimizer).__name__}")
        noise_multiplier = validation.non_negative(noise_multiplier, "noise_multiplier")
        max_grad_norm = validation.positive(max_grad_norm, "max_grad_norm")
        if expected_batch_size is not None:
            expected_batch_size = validation.positive(expected_batch_size, "expected_batch_size")
        loss_reduction = validation.choice(loss_reduction, "loss_reduction", ("mean", "sum"))
        if loss_reduction == "mean" and expected_batch_size is None:
            raise ValueError("expected_batch_size must be given (a number > 0) with loss_reduction='mean'")
        mechanism = validation.choice(mechanism, "mechanism", ("gaussian", "vmf"))
        if mechanism == "vmf" and kappa is None:
            raise ValueError("the VMF mechanism needs kappa: kappa must be a number > 0, got None")
        if kappa is not None:
            kappa = validation.positive(kappa, "kappa")
        _mechanisms._check_generator(noise_generator)
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction, **kwargs)
        if self.secure_mode:
            if mechanism == "vmf":
                raise ValueError("secure_mode: the VMF mechanism has no secure mode yet")
            if noise_generator is None:
                noise_generator = _mechanisms.SecureNoiseGenerator()
            elif not isinstance(noise_generator, _mechanisms.SecureNoiseGenerator):
                raise ValueError("secure_mode needs noise_generator to be a SecureNoiseGenerator (or None)")
        self.mechanism, self.kappa = mechanism, kappa
        self.noise_generator = noise_generator

    @classmethod
    def from_opacus(cls, optimizer: DPOptimizer, **kwargs) -> "PrivleakDPOptimizer":
        """The same hyperparameters, wrapped optimizer, secure mode and (Gaussian) accountant hook
        as an Opacus ``DPOptimizer``, which this optimizer replaces."""
        if type(optimizer) is not DPOptimizer:
            raise TypeError(f"optimizer must be an Opacus DPOptimizer (flat clipping), got {type(optimizer).__name__}")
        new = cls(optimizer.original_optimizer, noise_multiplier=optimizer.noise_multiplier,
                  max_grad_norm=optimizer.max_grad_norm, expected_batch_size=optimizer.expected_batch_size,
                  loss_reduction=optimizer.loss_reduction, secure_mode=optimizer.secure_mode, **kwargs)
        if new.mechanism == "gaussian":
            new.attach_step_hook(optimizer.step_hook)
        return new

    def clip_and_accumulate(self) -> None:
        grads = [self._get_flat_grad_sample(p).contiguous() for p in self.params]
        summed = dpsgd.clip_and_accumulate(grads, self.max_grad_norm, batch_size=1.0).grads
        for p, s in zip(self.params, summed):
            s = s.to(p.dtype)
            p.summed_grad = s if p.summed_grad is None else p.summed_grad + s
            _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        for p in self.params:
            _check_processed_flag(p.summed_grad)
        if self.mechanism == "vmf":
            updates = dpsgd.vmf_release([p.summed_grad for p in self.params], self.kappa, self.noise_generator)
        else:
            std = self.noise_multiplier * self.max_grad_norm
            updates = [_mechanisms.add_gaussian_noise(p.summed_grad, std, generator=self.noise_generator)
                       if std > 0 else p.summed_grad.clone() for p in self.params]
        for p, update in zip(self.params, updates):
            p.grad = update.to(p.dtype).view_as(p)
            _mark_as_processed(p.summed_grad)

    def scale_grad(self) -> None:
        if self.mechanism == "gaussian":
            super().scale_grad()
