"""Monte Carlo Bayes capacity of a finite input set: privleak.capacity.estimate against the plain
SciPy form a user would write, in one run.

    python bench/bench_estimator.py [--inputs 50000] [--dim 16] [--samples 20000] [--threads 2]

Both sides draw the same outputs from the mixture of the noise around the inputs (the estimator's
default proposal) and average the same importance weights w(y) = max_i f(x_i)(y) / q(y):

- privleak: ``capacity.estimate`` (the mixture's exponents shifted by a running max and
  exponentiated in place, the draws shared among privleak's threads);
- scipy: per chunk of proposal points, ``scipy.spatial.distance.cdist`` and
  ``scipy.special.logsumexp``, one thread (as docs/capacity.md's estimator did before).

Each side's median wall time over rounds taken in turns, their ratio, and the two estimates of
log2 C (which must agree: the same draws, the same weights up to rounding).
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import privleak
from _measure import cpu_name, seconds_by_round
from privleak import capacity
from scipy.spatial.distance import cdist
from scipy.special import logsumexp

CHUNK = 2**22  # exponents a step, as the estimator's


def scipy_estimate(noise_std: float, inputs: np.ndarray, n_samples: int, seed: int, batch: int = 4096) -> float:
    """log2 C by the estimator's draws, with scipy's cdist and logsumexp over the whole mixture."""
    rng = np.random.default_rng(seed)
    points = inputs.astype(np.float64)
    chunk = max(1, CHUNK // batch)
    log_w = []
    for start in range(0, n_samples, batch):
        count = min(batch, n_samples - start)
        means = points[rng.integers(len(points), size=count)]
        outputs = (means + noise_std * rng.standard_normal(means.shape)).astype(inputs.dtype).astype(np.float64)
        top, log_sum = np.full(count, -np.inf), np.full(count, -np.inf)  # the mixture, a chunk at a time
        for first in range(0, len(points), chunk):
            exponents = -cdist(outputs, points[first:first + chunk], "sqeuclidean") / (2 * noise_std**2)
            new_top = np.maximum(top, exponents.max(axis=1))
            log_sum = np.logaddexp(log_sum + (top - new_top), logsumexp(exponents - new_top[:, None], axis=1))
            top = new_top
        log_w.append(-log_sum + math.log(len(points)))  # the sup over the inputs is the top exponent
    log_w = np.concatenate(log_w)
    return float((logsumexp(log_w) - math.log(n_samples)) / math.log(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--noise-std", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=privleak.num_threads(), help="privleak's threads")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    privleak.set_num_threads(args.threads)
    inputs = np.random.default_rng(0).uniform(-1, 1, (args.inputs, args.dim)).astype(np.float32)
    found = {}
    sides = {
        "privleak": lambda: found.__setitem__("privleak", capacity.estimate(
            capacity.GaussianNoise(args.noise_std), inputs, args.samples, seed=1).bits),
        "scipy": lambda: found.__setitem__("scipy", scipy_estimate(args.noise_std, inputs, args.samples, 1)),
    }
    times = seconds_by_round(sides, rounds=args.rounds, repeat=1)
    print(f"{cpu_name()}; privleak {args.threads} threads; N = {args.inputs}, p = {args.dim}, "
          f"n = {args.samples}, Gaussian noise std {args.noise_std}")
    for side in sides:
        print(f"{side:>9}: {np.median(times[side]):7.2f} s   log2 C = {found[side]:.10f}")
    print(f"scipy / privleak: {np.median(times['scipy']) / np.median(times['privleak']):.2f}x")
    assert abs(found["privleak"] - found["scipy"]) < 1e-9, found


if __name__ == "__main__":
    main()
