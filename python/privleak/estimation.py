"""``privleak estimate``: MBP and ABP of federated DP-SGD, measured by attacking it.

The estimators of :mod:`privleak.bayesian_privacy` ([000] App. C, D) need many releases of the
mechanism and many attack runs on each. The data space is a client's n private images, with a
uniform prior. Release w_m is the one-image update of image m mod n (the setting of
:mod:`privleak.reproduce`), privatised by a fresh draw of the mechanism's noise (Gaussian, Alg. 1,
or VMF, Alg. 2). Inverting Gradients runs T times on every release, each run from its own random
start, and each run names the image it recovered: the candidate most similar (SSIM) to its
reconstruction, provided the SSIM exceeds a threshold. That is the success criterion Omega; it
makes f(. | w_m), the recovery frequencies, the attacker's posterior over the n images.

From the counts come xi^ and C1^, C2^ with their confidence intervals, next to the MBP bound that
the mechanism's pure LDP epsilon implies, log(1/n + (1 - 1/n) e^eps0) with eps0 its one-update
epsilon at delta = 0 (``update_epsilon(0)``: 2 kappa for VMF); none (inf) for a mechanism with no
finite pure epsilon, such as the Gaussian.

The attack is ``Estimation.attack``, any :class:`privleak.attacks.GradientAttack` with one run per
update (``restarts`` 1).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from privleak import attacks, bayesian_privacy, datasets, dpsgd, report, reproduce
from privleak.mechanisms import NoiseGenerator
from privleak.models import PaperNetwork, parameter_count


@dataclass(frozen=True)
class Estimation:
    """What ``privleak estimate`` runs; the defaults take a few minutes on 2 CPU cores."""

    dataset: str = "mnist-5k"
    epsilons: tuple = (1e3, 3e3, 1e4)
    mechanisms: tuple = reproduce.MECHANISMS
    delta: float = 1e-5
    clip_norm: float = 1.0
    images: int = 4  #: n: the data space, the client's private images
    releases: int = 8  #: M; release m leaks image m mod n
    runs: int = 32  #: T: attack runs per release
    threshold: float = 0.0  #: a run names no image unless its best SSIM exceeds this
    confidence: float = 0.95
    attack: attacks.GradientAttack = field(default_factory=lambda: attacks.InvertingGradients(300))
    seed: int = 0

    def __post_init__(self):
        for name in ("images", "releases", "runs"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.images < 2:
            raise ValueError(f"images must be >= 2 (the prior is uniform over them), got {self.images}")
        if not isinstance(self.attack, attacks.GradientAttack):
            raise ValueError(f"attack must be a privleak.attacks.GradientAttack, got {type(self.attack).__name__}")
        if self.attack.restarts != 1:
            raise ValueError("every attack run is counted, so the attack must have restarts=1")
        if not -1.0 <= self.threshold < 1.0:
            raise ValueError(f"threshold is an SSIM and must be in [-1, 1), got {self.threshold!r}")
        # The sweep's own checks (epsilons, mechanisms, delta, clip_norm, seed).
        reproduce.Experiment(epsilons=self.epsilons, mechanisms=self.mechanisms, delta=self.delta,
                             clip_norm=self.clip_norm, seed=self.seed)


class SettingEstimate(NamedTuple):
    setting: reproduce.Setting
    recovery_rate: float  #: runs that named the leaked image, over all runs
    mean_ssim: float  #: of each run's reconstruction with the leaked image
    mbp: bayesian_privacy.MBPEstimate
    abp: bayesian_privacy.ABPEstimate
    implied_mbp_bound: float  #: what the mechanism's pure LDP epsilon implies; inf if it has none


def best_match(scores: np.ndarray, threshold: float) -> np.ndarray:
    """Omega: run t on release m recovers image d when d is the candidate most similar to the
    run's reconstruction and the similarity exceeds ``threshold``."""
    return (scores == scores.max(axis=2, keepdims=True)) & (scores > threshold)


def _scores(experiment: Estimation, model, clean: "reproduce.Attacked", config: dpsgd.DPSGDConfig,
            noise: NoiseGenerator, generator) -> np.ndarray:
    """SSIM of every run's reconstruction with every candidate image: (M releases, T runs, n images)."""
    m, t, n = experiment.releases, experiment.runs, experiment.images
    leaks = torch.arange(m) % n
    released = [dpsgd.privatize([g[i:i + 1] for g in clean.updates], config, 1, noise) for i in leaks.tolist()]
    leaked = [torch.stack(parts).repeat_interleave(t, 0) for parts in zip(*released)]
    runs = leaks.repeat_interleave(t)
    result = experiment.attack.reconstruct(model, leaked, clean.images.shape[1:], labels=clean.labels[runs],
                                           parameters=[p[runs] for p in clean.parameters], generator=generator)
    reconstructions = result.images.repeat_interleave(n, 0)
    candidates = clean.images.repeat(m * t, 1, 1, 1)
    return attacks.ssim(reconstructions, candidates).numpy().reshape(m, t, n)


def _own_similarity(scores: np.ndarray, n: int) -> np.ndarray:
    """SSIM of each run with the image its release leaked, (M, T)."""
    leaks = np.arange(scores.shape[0]) % n
    return scores[np.arange(scores.shape[0]), :, leaks]


def _recovery_rate(counts: bayesian_privacy.RecoveryCounts, n: int) -> float:
    leaks = np.arange(counts.successes.shape[0]) % n
    return float(counts.successes[np.arange(len(leaks)), leaks].sum() / (len(leaks) * counts.trials))


def pure_epsilon(noise: dpsgd.DPSGDMechanism) -> float:
    """The mechanism's epsilon of one update at delta = 0 (any two clipped gradients); inf if it
    has none (the Gaussian)."""
    try:
        return float(noise.update_epsilon(0.0))
    except ValueError:  # an approximate-DP accountant that refuses delta = 0
        return math.inf


def implied_mbp_bound(noise: dpsgd.DPSGDMechanism, prior: np.ndarray) -> float:
    """The MBP bound of :func:`privleak.bayesian_privacy.implied_mbp_bound` at the mechanism's pure
    one-update epsilon; inf without one."""
    epsilon = pure_epsilon(noise)
    return math.inf if math.isinf(epsilon) else bayesian_privacy.implied_mbp_bound(epsilon, prior)


def run(experiment: Estimation, progress: Optional[Callable[[str, int, int], None]] = None) -> list:
    """Estimate MBP and ABP for every (mechanism, epsilon) of the sweep (module docstring)."""
    data = datasets.load(experiment.dataset)
    dim = parameter_count(PaperNetwork(data.image_shape, data.num_classes))
    sweep = reproduce.Experiment(dataset=experiment.dataset, epsilons=experiment.epsilons,
                                 mechanisms=experiment.mechanisms, delta=experiment.delta,
                                 clip_norm=experiment.clip_norm, clients=experiment.images, rounds=1,
                                 seed=experiment.seed)
    noiseless, *grid = reproduce.settings(sweep, dim)
    # The clean one-image updates at the first round's model: the mechanisms add only noise to them.
    clean = reproduce.train_and_collect(sweep, data, noiseless)
    model = PaperNetwork(data.image_shape, data.num_classes)
    noise = NoiseGenerator(experiment.seed)
    generator = torch.Generator().manual_seed(experiment.seed + 1)
    prior = np.full(experiment.images, 1.0 / experiment.images)
    estimates = []
    for i, setting in enumerate(grid):
        scores = _scores(experiment, model, clean, reproduce.dpsgd_config(setting, experiment.clip_norm), noise,
                         generator)
        counts = bayesian_privacy.count_recoveries(scores, best_match, experiment.threshold, batch_size=1)
        bound = implied_mbp_bound(setting.noise, prior)
        estimates.append(SettingEstimate(
            setting, _recovery_rate(counts, experiment.images),
            float(_own_similarity(scores, experiment.images).mean()),
            bayesian_privacy.estimate_mbp(counts, prior, confidence=experiment.confidence),
            bayesian_privacy.estimate_abp(counts, prior, releases="drawn", confidence=experiment.confidence), bound))
        if progress is not None:
            progress("settings", i + 1, len(grid))
    return estimates


def csv_fields(mechanisms: tuple = reproduce.MECHANISMS) -> tuple:
    """bayesian_privacy.csv's columns: one per parameter of the default mechanisms (noise_multiplier,
    kappa) and of ``mechanisms``."""
    return ("mechanism", "epsilon", *report.parameter_columns((*reproduce.MECHANISMS, *mechanisms)),
            "log2_capacity", "recovery_rate", "mean_ssim", "xi", "xi_low", "xi_high", "implied_mbp_bound", "c1",
            "c1_low", "c1_high", "c2", "c2_low", "c2_high")


CSV_FIELDS = csv_fields()  #: the columns for the default mechanisms


def _mechanisms(estimates: list) -> tuple:
    return tuple(dict.fromkeys(e.setting.mechanism for e in estimates))


def rows(estimates: list) -> list:
    """One dict per estimate, the keys :func:`csv_fields` of the estimates' mechanisms."""
    columns = report.parameter_columns((*reproduce.MECHANISMS, *_mechanisms(estimates)))
    return [{
        "mechanism": e.setting.mechanism, "epsilon": e.setting.epsilon,
        **report.parameter_cells(e.setting.noise, columns),
        "log2_capacity": e.setting.log2_capacity, "recovery_rate": e.recovery_rate,
        "mean_ssim": e.mean_ssim, "xi": e.mbp.xi, "xi_low": e.mbp.interval[0], "xi_high": e.mbp.interval[1],
        "implied_mbp_bound": e.implied_mbp_bound, "c1": e.abp.c1, "c1_low": e.abp.c1_interval[0],
        "c1_high": e.abp.c1_interval[1], "c2": e.abp.c2, "c2_low": e.abp.c2_interval[0],
        "c2_high": e.abp.c2_interval[1]} for e in estimates]


def _plot(estimates: list, path: str) -> None:
    """Left: xi^ where finite, and the lower end of its interval (what the attack proves at least),
    with the MBP bound the LDP epsilon implies. Right: C1^ and its interval."""
    with report.figure(path, 2, figsize=(10, 4), legend_fontsize=7) as (left, right):
        for mechanism, mine in report.by_mechanism(estimates, lambda e: e.setting.mechanism):
            x = np.array([e.setting.epsilon for e in mine])
            xi = np.array([e.mbp.xi for e in mine])
            finite = np.isfinite(xi)
            report.curve(left, mechanism, x[finite], xi[finite], fmt="x", label=f"xi^ ({mechanism})")
            report.curve(left, mechanism, x, [e.mbp.interval[0] for e in mine], alpha=0.6,
                         label=f"lower {mine[0].mbp.confidence:.0%} bound on xi ({mechanism})")
            bounds = np.array([e.implied_mbp_bound for e in mine])
            if np.isfinite(bounds).all():
                report.curve(left, mechanism, x, bounds, fmt=":", label=f"MBP bound from LDP ({mechanism})")
            c1 = np.array([e.abp.c1 for e in mine])
            below = c1 - np.array([e.abp.c1_interval[0] for e in mine])
            above = np.array([e.abp.c1_interval[1] for e in mine]) - c1
            report.curve(right, mechanism, x, c1, yerr=[below, above], label=f"C1^ ({mechanism})")
        left.set_yscale("symlog", linthresh=1.0)
        left.set_ylabel("maximum Bayesian privacy xi (nats)")
        right.set_ylabel("C1 = sqrt(JS(f^O || f^B))")
        for axes in (left, right):
            axes.set_xscale("log")
            axes.set_xlabel("epsilon of one update (local DP)")


def write_outputs(estimates: list, out: str) -> dict:
    """bayesian_privacy.csv and bayesian_privacy.png in ``out``."""
    os.makedirs(out, exist_ok=True)
    paths = {"csv": os.path.join(out, "bayesian_privacy.csv"), "plot": os.path.join(out, "bayesian_privacy.png")}
    report.write_csv(rows(estimates), paths["csv"], csv_fields(_mechanisms(estimates)))
    _plot(estimates, paths["plot"])
    return paths
