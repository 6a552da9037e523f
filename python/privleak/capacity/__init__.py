"""Bayes capacity of continuous mechanisms in closed form, in log space.

For a mechanism f from inputs X to densities on outputs Y, the continuous Bayes capacity is

    C_Bayes(f) = integral over y of sup_{x in X} f(x)(y) dy            ([004] Def. III.1, Eq. 4)

the largest multiplicative leakage of f to any Bayesian adversary; its log is Sibson's mutual
information of order infinity. For DP-SGD gradients (p = 10^3 to 10^9 coordinates) it is far
beyond float64 (e^(10^8) is common), so every function here returns a :class:`LogCapacity`
(natural log and bits) and never the capacity itself.

What is here, and where it differs from [004] (Biswas et al., *Bayes' capacity as a measure for
reconstruction attacks in federated learning*):

- Gaussian mechanism over an L2 ball (Thm III.1): the theorem's second term is twice the truth
  (its value at radius 0 is 2, but a mechanism with a single input has capacity 1); see
  :func:`gaussian_ball_log_capacity`.
- Gaussian mechanism over a product of balls (per-layer clipping): the exact capacity is the
  product of the blocks' capacities. [004] instead plugs "R = number of layers, each clipped to
  1" into Thm III.1, a ball that contains the product and gives a larger, loose value; see
  :func:`gaussian_product_of_balls_log_capacity`.
- VMF mechanism on the sphere (Thm IV.1): correct as stated; see :func:`vmf_log_capacity`.
- DP-SGD with Gaussian noise (Alg. 1): the theorem leaves out the batch size. The noise has
  standard deviation c sigma / L around an average that can be anywhere in the ball of radius c,
  so the capacity depends on L / sigma (not on c); see :func:`dpsgd_gaussian`. Alg. 2 releases
  VMF noise around the normalised average, whose capacity has no batch size to leave out.

For any other input set given as a finite (possibly huge) set of points, :func:`estimate` gives a
Monte Carlo estimate with a confidence interval, for Gaussian, VMF and Laplace noise
(:class:`GaussianNoise`, :class:`VMFNoise`, :class:`LaplaceNoise`).

The closed forms live in :mod:`privleak.capacity.closed_form`, the estimator in
:mod:`privleak.capacity.estimator`; this package exports both.
"""
from privleak.capacity.closed_form import (
    GAUSSIAN_SUM_MAX_DIM,
    GaussianBallChannel,
    LogCapacity,
    VMFChannel,
    dpsgd_gaussian,
    dpsgd_gaussian_per_layer,
    dpsgd_vmf,
    gaussian_ball_log_capacity,
    gaussian_product_of_balls_log_capacity,
    vmf_log_capacity,
)
from privleak.capacity.estimator import CapacityEstimate, GaussianNoise, LaplaceNoise, VMFNoise, estimate

__all__ = [
    "GAUSSIAN_SUM_MAX_DIM", "CapacityEstimate", "GaussianBallChannel", "GaussianNoise", "LaplaceNoise", "LogCapacity",
    "VMFChannel", "VMFNoise", "dpsgd_gaussian", "dpsgd_gaussian_per_layer", "dpsgd_vmf", "estimate",
    "gaussian_ball_log_capacity", "gaussian_product_of_balls_log_capacity", "vmf_log_capacity",
]
