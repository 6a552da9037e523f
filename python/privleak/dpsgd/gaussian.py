"""Alg. 1 of DP-SGD (Abadi et al., CCS 2016; Alg. 1 of Biswas et al.): the Gaussian mechanism."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from privleak import mechanisms as _noise
from privleak import validation
from privleak.dpsgd.clip import _check_release_range, clip_and_accumulate
from privleak.dpsgd.mechanism import Clipping, DPSGDMechanism, Sampling, register


@register
@dataclass(frozen=True)
class Gaussian(DPSGDMechanism):
    """Clip each per-sample gradient in L2 norm to c, sum, add N(0, (noise_multiplier c)^2 I),
    divide by the expected batch size L:

        g~ = (sum_b clip_c(g_b) + N(0, sigma^2 c^2 I)) / L.

    With per-layer clipping to (c_t) the noise std is sigma |(c_t)|_2, the sensitivity of the
    concatenation (Opacus's convention). The noise is drawn inside the fused clipping kernel; with
    a :class:`~privleak.mechanisms.SecureNoiseGenerator` the discretised secure noise is added to
    the exact clipped sum instead, its std raised to cover the grid's rounding
    (:func:`~privleak.mechanisms.secure_scale`). ``noise_multiplier = 0`` is the noiseless clipped
    average.
    """

    noise_multiplier: float = 1.0

    name = "gaussian"
    secure = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", validation.non_negative(self.noise_multiplier, "noise_multiplier"))

    def noise_std(self, clipping: Clipping) -> float:
        """Standard deviation of the noise on the clipped sum: sigma c, or sigma |(c_t)|_2 per layer."""
        return self.noise_multiplier * clipping.total(2)

    def drawn_std(self, clipping: Clipping, batch_size: float, count: int, generator) -> float:
        """The std of the noise drawn on ``count`` values of the clipped sum over ``batch_size``:
        sigma c / L, for secure noise raised to cover its grid's rounding (the sensitivity c / L,
        :func:`~privleak.mechanisms.secure_scale`)."""
        std = self.noise_std(clipping) / batch_size
        if std > 0 and isinstance(generator, _noise.SecureNoiseGenerator):
            return _noise.secure_scale("gaussian", std, clipping.total(2) / batch_size, count)
        return std

    def release(self, per_sample_grads: Sequence[torch.Tensor], clipping: Clipping, batch_size: float,
                generator, non_finite: str) -> list:
        std = self.drawn_std(clipping, 1.0, sum(math.prod(g.shape[1:]) for g in per_sample_grads), generator)
        return clip_and_accumulate(per_sample_grads, list(clipping.norms), per_layer=clipping.per_layer,
                                   noise_std=std, batch_size=batch_size, generator=generator,
                                   non_finite=non_finite).grads

    def check_release_range(self, batch: int, clipping: Clipping, batch_size: float, generator) -> None:
        std = self.noise_std(clipping)
        _check_release_range(batch, list(clipping.norms), std, batch_size,
                             std > 0 and isinstance(generator, _noise.SecureNoiseGenerator))

    def noise(self, average: Sequence[torch.Tensor], clipping: Clipping, batch_size: float, generator, *,
              inplace: bool = False) -> list:
        std = self.drawn_std(clipping, batch_size, sum(a.numel() for a in average), generator)
        if std == 0:
            return list(average) if inplace else [a.clone() for a in average]
        add = _noise.add_gaussian_noise_ if inplace else _noise.add_gaussian_noise
        return list(add(list(average), std, generator=generator))

    @classmethod
    def calibrate(cls, epsilon: float, delta: float) -> "Gaussian":
        """sigma = 2 sigma*(epsilon, delta), sigma* the analytic calibration (Balle and Wang 2018)
        at sensitivity 1: two clipped gradients differ by up to 2c."""
        from privleak import accounting

        return cls(2.0 * accounting.analytic_gaussian_noise_multiplier(epsilon, delta))

    def update_epsilon(self, delta: float) -> float:
        from privleak import accounting

        if self.noise_multiplier == 0 or delta == 0:  # no Gaussian noise gives pure DP
            return math.inf
        return accounting.analytic_gaussian_epsilon(self.noise_multiplier / 2.0, delta)

    def check_privacy_report(self, delta: float) -> None:
        if self.noise_multiplier == 0:
            raise ValueError("config.noise_multiplier must be > 0 for a privacy report: without noise there is no "
                             "privacy to report")
        if delta == 0:
            raise ValueError("delta must be > 0 for the Gaussian mechanism (it is not pure DP)")

    def epsilon(self, steps: int, delta: float, sampling: Sampling) -> float:
        """dp-accounting's PLD epsilon for Poisson sampling, its RDP epsilon for fixed-size batches
        (its PLD has no such event)."""
        from privleak import accounting

        if steps == 0:
            return 0.0
        fixed = {"sampling": "fixed", "dataset_size": sampling.dataset_size, "accountant": "rdp"} \
            if sampling.kind == "fixed" else {}
        return accounting.gaussian_epsilon(self.noise_multiplier, steps, delta, sampling_rate=sampling.rate, **fixed)

    def log_capacity(self, sizes: Sequence[int], clipping: Clipping, batch_size: float):
        """N(x, (sigma c / L)^2 I) over the ball of radius c (flat clipping), or over the product
        of the per-layer balls (:func:`privleak.capacity.dpsgd_gaussian`, ``dpsgd_gaussian_per_layer``)."""
        from privleak import capacity

        # The capacity depends on noise_multiplier / L only; capacity takes an integer L, so a
        # fractional expected batch size (Poisson sampling) goes in as L = 1 with sigma / L.
        sigma, batch = self.noise_multiplier, batch_size
        if not float(batch).is_integer():
            sigma, batch = sigma / batch, 1
        batch = int(batch)
        if clipping.per_layer:
            return capacity.dpsgd_gaussian_per_layer(sizes, clipping.norms, sigma, batch).log_capacity()
        return capacity.dpsgd_gaussian(sum(sizes), clipping.norms[0], sigma, batch).log_capacity()
