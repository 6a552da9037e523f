"""Alg. 2 of Biswas et al.: DP-SGD with von Mises-Fisher noise on the direction of the update."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from privleak import mechanisms as _noise
from privleak import validation
from privleak.dpsgd.mechanism import Clipping, DPSGDMechanism, Sampling, register


@register
@dataclass(frozen=True)
class VMF(DPSGDMechanism):
    """Clip, average, scale to unit length, release one draw of VMF(that direction, ``kappa``)
    (:func:`vmf_release`). The direction can be any unit vector, so one update is 2 kappa-DP for
    any two inputs (and kappa-metric-DP in the Euclidean distance of the directions)."""

    kappa: float

    name = "vmf"
    releases_direction = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kappa", validation.positive(self.kappa, "kappa"))

    def noise(self, average: Sequence[torch.Tensor], clipping: Clipping, batch_size: float, generator, *,
              inplace: bool = False) -> list:
        return vmf_release(average, self.kappa, generator)

    @classmethod
    def calibrate(cls, epsilon: float, delta: float) -> "VMF":
        """kappa = epsilon / 2, the tight pure-DP value (delta is not used)."""
        return cls(validation.positive(epsilon, "epsilon") / 2.0)

    def update_epsilon(self, delta: float) -> float:
        return 2.0 * self.kappa

    def epsilon(self, steps: int, delta: float, sampling: Sampling) -> float:
        """privleak's exact subsampled pure-DP composition (:func:`privleak.accounting.vmf_privacy`);
        the amplification log(1 + q (e^eps - 1)) holds for both samplings (Balle, Barthe and
        Gaboardi 2018), each with its own neighbours."""
        from privleak import accounting

        if steps == 0:
            return 0.0
        return accounting.vmf_privacy(self.kappa, steps, delta, sampling_rate=sampling.rate).epsilon

    def log_capacity(self, sizes: Sequence[int], clipping: Clipping, batch_size: float):
        """VMF(kappa) over the whole sphere S^(p-1) (:func:`privleak.capacity.dpsgd_vmf`)."""
        from privleak import capacity

        return capacity.dpsgd_vmf(sum(sizes), self.kappa).log_capacity()


def vmf_release(average: Sequence[torch.Tensor], kappa: float, generator=None) -> list:
    """Lines 10-11 of Alg. 2: scale the clipped average gradient (one tensor per parameter) to unit
    length over all tensors together and release one draw of VMF(that direction, kappa).

    A zero average (an empty batch, or every sample's gradient zero or dropped) has no direction;
    it releases a uniform draw on the sphere instead, a normalised standard Gaussian vector. The
    uniform law is the average of VMF(mu, kappa) over all mu, so the step stays 2 kappa-DP, and
    the data never decide whether the step raises. A float16 or bfloat16 average gives a float32
    direction.
    """
    if isinstance(average, (torch.Tensor, np.ndarray, str, bytes)) or not isinstance(average, Iterable):
        raise validation.ArgumentTypeError(f"average must be a sequence of tensors, got {type(average).__name__}")
    average = list(average)
    if not average or not all(isinstance(a, torch.Tensor) for a in average):
        raise validation.ArgumentTypeError("average must be a non-empty sequence of torch tensors")
    _noise._check_generator(generator)
    if isinstance(generator, _noise.SecureNoiseGenerator):
        raise ValueError("vmf_release has no secure mode yet: pass a NoiseGenerator")
    if sum(a.numel() for a in average) < 2:
        raise ValueError("average must have 2 or more elements in all: VMF draws a direction on the sphere S^(p-1), "
                         "p >= 2")
    flat = average[0].reshape(-1) if len(average) == 1 else torch.cat([a.reshape(-1) for a in average])
    if flat.dtype in (torch.float16, torch.bfloat16):  # the sampler works in float32 or float64
        flat = flat.float()
    if bool(flat.any()):
        direction = _noise.vmf_sample(flat, kappa, 1, generator=generator)[0]
    else:
        gaussian = _noise.gaussian_noise(flat.numel(), generator=generator, dtype=flat.dtype, device=flat.device)
        direction = gaussian / torch.linalg.vector_norm(gaussian)
    return [part.reshape(a.shape) for part, a in zip(direction.split([a.numel() for a in average]), average)]
