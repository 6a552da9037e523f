"""privleak's fused clipping and its noise inside Opacus.

Opacus users switch in two lines, after ``PrivacyEngine.make_private``:

    from privleak.opacus_interop import PrivleakDPOptimizer
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer)                           # Gaussian, Alg. 1
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer, mechanism="vmf", kappa=k)  # VMF, Alg. 2

The optimizer keeps Opacus's interface and hooks (gradient accumulation, skipped steps, the
accountant's step hook); it replaces two steps:

* ``clip_and_accumulate`` runs :func:`privleak.dpsgd.clip_and_accumulate` on the parameters'
  ``grad_sample`` (flat clipping to ``max_grad_norm``, two passes, no intermediate copies).
  Opacus divides by norm + 1e-6 where privleak clips exactly to the norm, so clipped samples differ
  by about 1e-6 relative.
* ``add_noise`` draws privleak's counter-based Gaussian noise (std noise_multiplier x
  max_grad_norm, reproducible from ``noise_generator``), or for ``mechanism="vmf"`` replaces the
  clipped average by a VMF(kappa) draw around its direction (Biswas et al., Alg. 2), which is then
  the whole update (``scale_grad`` leaves it alone).

Opacus's own accountant covers the Gaussian mechanism only; for VMF use
:func:`privleak.accounting.vmf_privacy`.
"""
from __future__ import annotations

from typing import Optional

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from privleak import dpsgd
from privleak import mechanisms as _mechanisms


class PrivleakDPOptimizer(DPOptimizer):
    """An Opacus ``DPOptimizer`` whose clipping and noise are privleak's (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: Optional[int], loss_reduction: str = "mean", mechanism: str = "gaussian",
                 kappa: Optional[float] = None, noise_generator=None, **kwargs):
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction, **kwargs)
        if mechanism not in ("gaussian", "vmf"):
            raise ValueError(f"mechanism must be 'gaussian' or 'vmf', got {mechanism!r}")
        if mechanism == "vmf" and kappa is None:
            raise ValueError("the VMF mechanism needs kappa")
        self.mechanism, self.kappa = mechanism, kappa
        self.noise_generator = noise_generator

    @classmethod
    def from_opacus(cls, optimizer: DPOptimizer, **kwargs) -> "PrivleakDPOptimizer":
        """The same hyperparameters and wrapped optimizer as an Opacus ``DPOptimizer``."""
        return cls(optimizer.original_optimizer, noise_multiplier=optimizer.noise_multiplier,
                   max_grad_norm=optimizer.max_grad_norm, expected_batch_size=optimizer.expected_batch_size,
                   loss_reduction=optimizer.loss_reduction, **kwargs)

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
            flat = torch.cat([p.summed_grad.reshape(-1) for p in self.params])
            if not bool(flat.any()):
                raise ValueError("the clipped average gradient is zero: Alg. 2 has no direction to perturb")
            direction = _mechanisms.vmf_sample(flat, self.kappa, 1, generator=self.noise_generator)[0]
            parts = direction.split([p.numel() for p in self.params])
            updates = [part.view_as(p) for part, p in zip(parts, self.params)]
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
