"""DP-SGD with L1 clipping and Laplace noise: the Laplace mechanism on the clipped sum."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy.special import gammaincc, gammaln

from privleak import mechanisms as _noise
from privleak import validation
from privleak.dpsgd.mechanism import Clipping, DPSGDMechanism, Sampling, register


@register
@dataclass(frozen=True)
class Laplace(DPSGDMechanism):
    """Clip each per-sample gradient in L1 norm to c, sum, add Laplace noise of scale
    b = noise_multiplier c_1 to every coordinate, divide by the expected batch size L:

        g~ = (sum_i clip1_c(g_i) + Lap(b)^P) / L,     clip1_c(g) = g min(1, c / |g|_1),

    with c_1 = c (flat clipping) or sum_t c_t (per-layer clipping to (c_t): L1 norms of the
    tensors add up). This is the Laplace mechanism (Dwork and Roth 2014, Thm 3.6; lecture notes
    Sec. 2.3): f + Lap(Delta_1 / epsilon) is epsilon-DP for f of L1 sensitivity Delta_1. Adding or
    removing one sample moves the clipped sum by at most c_1, so a step is (1 / noise_multiplier)-DP
    for add/remove neighbours (Poisson sampling); replacing one moves it by up to 2 c_1, so
    (2 / noise_multiplier)-DP for replace-one neighbours (fixed-size batches) and for one update
    with any two clipped gradients as neighbours. Pure DP: delta = 0 per step.
    """

    noise_multiplier: float = 1.0

    name = "laplace"
    clip_norm_type = 1
    secure = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", validation.positive(self.noise_multiplier, "noise_multiplier"))

    def scale(self, clipping: Clipping) -> float:
        """b, the Laplace scale on the clipped sum: noise_multiplier times the L1 clip norm c_1."""
        return self.noise_multiplier * clipping.total(1)

    def noise(self, average: Sequence[torch.Tensor], clipping: Clipping, batch_size: float, generator, *,
              inplace: bool = False) -> list:
        scale = self.scale(clipping) / batch_size
        if isinstance(generator, _noise.SecureNoiseGenerator):  # its grid's rounding covered
            scale = _noise.secure_scale("laplace", scale, clipping.total(1) / batch_size,
                                        sum(a.numel() for a in average))
        add = _noise.add_laplace_noise_ if inplace else _noise.add_laplace_noise
        return list(add(list(average), scale, generator=generator))

    @classmethod
    def calibrate(cls, epsilon: float, delta: float) -> "Laplace":
        """noise_multiplier = 2 / epsilon: one update is epsilon-DP for any two clipped gradients
        (sensitivity 2 c_1); delta is not used."""
        return cls(2.0 / validation.positive(epsilon, "epsilon"))

    def update_epsilon(self, delta: float) -> float:
        return 2.0 / self.noise_multiplier

    def epsilon(self, steps: int, delta: float, sampling: Sampling) -> float:
        """The exact composition of ``steps`` subsampled pure-DP steps of epsilon
        1 / noise_multiplier (Poisson, add/remove) or 2 / noise_multiplier (fixed size, replace one),
        through the randomised-response pair that dominates every pure-DP mechanism
        (:func:`privleak.accounting.vmf_privacy` uses the same composition). Sound for Laplace,
        whose own privacy loss is smaller than randomised response's, and tight for the worst
        epsilon-DP mechanism."""
        from privleak import accounting

        if steps == 0:
            return 0.0
        step = (1.0 if sampling.kind == "poisson" else 2.0) / self.noise_multiplier
        return accounting._subsampled_pure_dp_composition(step, sampling.rate, steps, delta)

    def log_capacity(self, sizes: Sequence[int], clipping: Clipping, batch_size: float):
        """Bayes capacity of y = x + Lap(b / L)^p over the L1 ball of radius c, where the clipped
        average x lies (per layer: over the product of L1 balls of radii c_t).

        The closed form (derived for privleak): the L1 distance from y to the ball B_c is
        max(0, |y|_1 - c), and the L1 ball of radius r has volume (2 r)^p / p!, so with
        a = c / (b / L)

            C = integral of sup_x f(x)(y) dy = sum_{j=0}^{p} a^j / j! = e^a P(Poisson(a) <= p).

        Per layer, the L1 distance to a product of balls is the sum of the per-layer distances, so
        the integral factorises: log C = sum_t log C(p_t, a_t). As p grows, C -> e^a with
        a = L / noise_multiplier. Checked against direct integration in tests/test_laplace_dpsgd.py.
        """
        from privleak.capacity import LogCapacity

        scale = self.scale(clipping) / batch_size
        if not clipping.per_layer:
            return LogCapacity.from_log(log_l1_ball_capacity(sum(sizes), clipping.norms[0] / scale))
        return LogCapacity.from_log(math.fsum(log_l1_ball_capacity(p, c / scale)
                                              for p, c in zip(sizes, clipping.norms)))


def log_l1_ball_capacity(dim: int, a: float) -> float:
    """log sum_{j=0}^{dim} a^j / j!: the log Bayes capacity of Laplace noise of scale 1 over the
    L1 ball of radius ``a`` in R^dim (:meth:`Laplace.log_capacity`).

    For a <= dim + 1 it is a + log Q(dim + 1, a), Q the regularised upper incomplete gamma
    function (Q(dim + 1, a) = P(Poisson(a) <= dim) >= 1/2 there, so no underflow). Beyond, the
    last term dominates: dim log a - log dim! + log sum_m prod_{i<m} (dim - i) / a, whose terms
    fall at least as fast as exp(-m^2 / (2 a)) and (dim / a)^m, summed until they are below
    e^-40 of the first.
    """
    dim = validation.integer(dim, "dim", low=1)
    a = validation.non_negative(a, "a")
    if a <= dim + 1:
        return a + math.log(gammaincc(dim + 1, a))
    cutoff = min(dim, int(40.0 * math.sqrt(a)) + 100, int(40.0 / -math.log(dim / a)) + 2 if dim else 0)
    log_terms = np.concatenate(([0.0], np.cumsum(np.log((dim - np.arange(cutoff)) / a))))
    top = log_terms.max()
    return dim * math.log(a) - float(gammaln(dim + 1.0)) + top + math.log(float(np.exp(log_terms - top).sum()))
