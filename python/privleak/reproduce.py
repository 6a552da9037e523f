"""``privleak reproduce``: the experiment of paper 004, Sec. IV-A, Fig. 1 and 2.

For each mechanism (Gaussian, Alg. 1; VMF, Alg. 2) and each epsilon of a sweep, train the paper's
small network with federated DP-SGD (:mod:`privleak.fl`), let the honest-but-curious server attack
the last round's one-image updates with Inverting Gradients (:mod:`privleak.attacks`), and put
the reconstruction error next to two measures of the leak: the epsilon of one update and the Bayes
capacity of the channel the update goes through (:mod:`privleak.capacity`).

**Comparable epsilons.** The paper says only that both mechanisms "use comparable epsilon, delta
guarantees". privleak makes that exact, for one leaked update as local DP (any two of the client's
clipped gradients are neighbours, which is what a reconstruction attack is about):

* VMF: the density ratio is at most exp(2 kappa) on the unit sphere, so kappa = epsilon / 2 (pure
  DP, attained; :func:`privleak.accounting.vmf_privacy`).
* Gaussian: the clipped gradients fill a ball of radius c, sensitivity 2c, so the noise multiplier
  is 2 sigma(epsilon, delta) with sigma the exact analytic-Gaussian calibration
  (:func:`privleak.accounting.analytic_gaussian_noise_multiplier`).

A noiseless row (clipping only) shows what the attack does when nothing protects the update.
"""
from __future__ import annotations

import inspect
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from privleak import attacks, datasets, dpsgd, fl, report, validation
from privleak.models import PaperNetwork, parameter_count

#: The default sweep: paper 004's two mechanisms. Any registered name (dpsgd.mechanism.names()) works.
MECHANISMS = ("gaussian", "vmf")
SEED_LIMIT = 2 ** 63  #: seeds are ints in [0, SEED_LIMIT)
NOISELESS = report.NOISELESS
#: The noiseless row's step: the clipped average, no noise (the Gaussian mechanism at noise 0).
NOISELESS_MECHANISM = dpsgd.Gaussian(0.0)


@dataclass(frozen=True)
class Experiment:
    """What ``privleak reproduce`` runs. The defaults finish in minutes on 2 CPU cores;
    :data:`PAPER_SCALE` is closer to the paper's (and Geiping et al.'s) budget. ``attack`` is any
    :class:`privleak.attacks.GradientAttack`."""

    dataset: str = "mnist-5k"
    epsilons: tuple = (10.0, 173.0, 1e3, 3e3, 1e4, 3e4, 1e5, 1e6)
    mechanisms: tuple = MECHANISMS
    delta: float = 1e-5
    clip_norm: float = 1.0
    clients: int = 8  #: one attacked image per client and setting
    examples_per_client: int = 16
    rounds: int = 3  #: the last round's updates are attacked
    learning_rate: float = 0.1
    attack: attacks.GradientAttack = field(default_factory=lambda: attacks.InvertingGradients(1500, 2))
    grid_epsilons: tuple = (173.0, 1e4, 1e5)  #: rows of the reconstruction figure (Fig. 2 uses 173)
    seed: int = 0

    def __post_init__(self):
        if not self.epsilons or any(not (e > 0 and math.isfinite(e)) for e in self.epsilons):
            raise ValueError(f"epsilons must be positive and finite, got {self.epsilons!r}")
        known = dpsgd.mechanism.names()
        if not self.mechanisms or any(m not in known for m in self.mechanisms):
            raise ValueError(f"mechanisms must be taken from {known}, got {self.mechanisms!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive, got {self.clip_norm!r}")
        for name in ("clients", "examples_per_client", "rounds"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.grid_epsilons or any(not (e > 0 and math.isfinite(e)) for e in self.grid_epsilons):
            raise ValueError(f"grid_epsilons must be positive and finite, got {self.grid_epsilons!r}")
        if not isinstance(self.attack, attacks.GradientAttack):
            raise ValueError(f"attack must be a privleak.attacks.GradientAttack, got {type(self.attack).__name__}")
        # torch.Generator.manual_seed takes seed and seed + 1; NoiseGenerator takes it modulo 2^64.
        validation.integer(self.seed, "seed", low=0, high=SEED_LIMIT - 1)


PAPER_SCALE = Experiment(
    epsilons=(1.0, 10.0, 50.0, 173.0, 500.0, 1e3, 3e3, 1e4, 3e4, 1e5, 3e5, 1e6),
    clients=32, examples_per_client=32, rounds=5,
    attack=attacks.InvertingGradients(iterations=4800, restarts=4))


class Setting(NamedTuple):
    """One row of the sweep: a mechanism calibrated to an epsilon, or the noiseless row.

    A mechanism's parameters read as attributes too (``setting.noise_multiplier``,
    ``setting.kappa``, ...): nan where this setting's mechanism has no such parameter."""

    mechanism: str  #: a registered name, or NOISELESS
    epsilon: float  #: of one update, local DP; inf for the noiseless row
    noise: Optional[dpsgd.DPSGDMechanism]  #: the mechanism's calibrate(epsilon, delta); None for the noiseless row
    log2_capacity: float  #: Bayes capacity of one update's channel, in bits; inf without noise

    @property
    def parameters(self) -> dict:
        """The mechanism's parameters ({} for the noiseless row)."""
        return {} if self.noise is None else self.noise.parameters()

    @classmethod
    def from_row(cls, row: dict) -> "Setting":
        """The setting of a CSV row (:func:`run`'s rows, or :func:`read_csv`'s)."""
        if row["mechanism"] == NOISELESS:
            return cls(NOISELESS, row["epsilon"], None, row["log2_capacity"])
        fields = report.parameter_columns((row["mechanism"],))
        noise = dpsgd.mechanism.create(row["mechanism"], {name: row[name] for name in fields})
        return cls(row["mechanism"], row["epsilon"], noise, row["log2_capacity"])

    def __getattr__(self, name: str):
        if not name.startswith("_") and name in report.parameter_columns(dpsgd.mechanism.names()):
            return float(self.parameters.get(name, math.nan))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def settings(experiment: Experiment, dim: int) -> list:
    """The noiseless row, then every (mechanism, epsilon): the mechanism's own calibration of one
    update to (epsilon, delta) (``calibrate``) and the Bayes capacity of its channel for a network
    of ``dim`` parameters, flat clipping, one-image batches (``log_capacity``)."""
    rows = [Setting(NOISELESS, math.inf, None, math.inf)]
    for name in experiment.mechanisms:
        calibrate = dpsgd.mechanism.get(name).calibrate
        for epsilon in experiment.epsilons:
            config = dpsgd.DPSGDConfig(experiment.clip_norm, calibrate(epsilon, experiment.delta))
            bits = config.mechanism.log_capacity([dim], config.clipping(1), 1).bits
            rows.append(Setting(name, epsilon, config.mechanism, bits))
    return rows


def dpsgd_config(setting: Setting, clip_norm: float) -> dpsgd.DPSGDConfig:
    """The DP-SGD configuration of one setting of the sweep."""
    return dpsgd.DPSGDConfig(clip_norm, NOISELESS_MECHANISM if setting.noise is None else setting.noise)


class Attacked(NamedTuple):
    """The last round's updates of one setting, and the images behind them."""

    parameters: list
    updates: list
    images: torch.Tensor
    labels: torch.Tensor
    dataset_indices: torch.Tensor


def train_and_collect(experiment: Experiment, data: datasets.ImageDataset, setting: Setting) -> Attacked:
    """Federated DP-SGD with one-image batches; the server keeps the last round's updates."""
    needed = experiment.clients * experiment.examples_per_client
    if needed > len(data.labels):
        raise ValueError(f"clients x examples_per_client = {experiment.clients} x {experiment.examples_per_client} "
                         f"= {needed} images, but data set {data.name} has {len(data.labels)}")
    generator = torch.Generator().manual_seed(experiment.seed)
    order = torch.randperm(len(data.labels), generator=generator)[: experiment.clients * experiment.examples_per_client]
    shards = order.reshape(experiment.clients, experiment.examples_per_client)
    clients = [fl.Client(data.images[rows], data.labels[rows]) for rows in shards]
    torch.manual_seed(experiment.seed)  # the same starting network for every setting
    model = PaperNetwork(data.image_shape, data.num_classes)
    federation = fl.run(model, clients, dpsgd_config(setting, experiment.clip_norm), rounds=experiment.rounds,
                        batch_size=1, learning_rate=experiment.learning_rate, seed=experiment.seed)
    last = federation.updates_of_round(experiment.rounds - 1)
    picked = torch.stack([shards[u.client][u.private_batches[0][0]] for u in last])
    stack = [torch.stack(tensors) for tensors in zip(*(u.parameters for u in last))]
    updates = [torch.stack(tensors) for tensors in zip(*(u.update for u in last))]
    return Attacked(stack, updates, data.images[picked], data.labels[picked], picked)


class Results(NamedTuple):
    rows: list  #: one dict per attacked image (the CSV's rows)
    settings: list
    reconstructions: torch.Tensor  #: (settings, clients, C, H, W)
    originals: torch.Tensor  #: (settings, clients, C, H, W): the attacked clients' true images
    dim: int
    seconds: float


def csv_fields(mechanisms: tuple = MECHANISMS) -> tuple:
    """reconstructions.csv's columns: one per parameter of the default mechanisms (noise_multiplier,
    kappa) and of ``mechanisms`` (:func:`privleak.report.parameter_columns`)."""
    return ("mechanism", "epsilon", "delta", *report.parameter_columns((*MECHANISMS, *mechanisms)), "log2_capacity",
            "client", "dataset_index", "label", "inferred_label", "mse", "psnr", "ssim")


CSV_FIELDS = csv_fields()  #: the columns for the default mechanisms


def run(experiment: Experiment, progress: Optional[Callable[[str, int, int], None]] = None) -> Results:
    """Train every setting, then attack all their updates in one batched run of ``experiment.attack``."""
    started = time.perf_counter()
    data = datasets.load(experiment.dataset)
    dim = parameter_count(PaperNetwork(data.image_shape, data.num_classes))
    grid = settings(experiment, dim)
    collected = []
    for i, setting in enumerate(grid):
        collected.append(train_and_collect(experiment, data, setting))
        if progress is not None:
            progress("federated training", i + 1, len(grid))
    parameters = [torch.cat(parts) for parts in zip(*(c.parameters for c in collected))]
    updates = [torch.cat(parts) for parts in zip(*(c.updates for c in collected))]
    model = PaperNetwork(data.image_shape, data.num_classes)
    iterations = experiment.attack.iterations
    reconstruction = experiment.attack.reconstruct(
        model, updates, data.image_shape, parameters=parameters,
        generator=torch.Generator().manual_seed(experiment.seed + 1),
        progress=None if progress is None else (lambda done: progress("attack", done, iterations)))
    originals = torch.cat([c.images for c in collected])
    labels = torch.cat([c.labels for c in collected])
    dataset_indices = torch.cat([c.dataset_indices for c in collected])
    mse = attacks.mse(reconstruction.images, originals)
    psnr = attacks.psnr(reconstruction.images, originals)
    ssim = attacks.ssim(reconstruction.images, originals)
    columns = report.parameter_columns((*MECHANISMS, *experiment.mechanisms))
    rows = []
    for a in range(len(labels)):
        setting = grid[a // experiment.clients]
        rows.append({
            "mechanism": setting.mechanism, "epsilon": setting.epsilon, "delta": experiment.delta,
            **report.parameter_cells(setting.noise, columns),
            "log2_capacity": setting.log2_capacity, "client": a % experiment.clients,
            "dataset_index": int(dataset_indices[a]),
            "label": int(labels[a]), "inferred_label": int(reconstruction.labels[a]),
            "mse": float(mse[a]), "psnr": float(psnr[a]), "ssim": float(ssim[a]),
        })
    shape = (len(grid), experiment.clients, *data.image_shape)
    return Results(rows, grid, reconstruction.images.reshape(shape), originals.reshape(shape), dim,
                   time.perf_counter() - started)


# ----------------------------------------------------------------------------- outputs


class Summary(NamedTuple):
    """One setting's scores, aggregated over its attacked images."""

    setting: Setting
    mean_mse: float
    median_mse: float
    mean_psnr: float
    mean_ssim: float
    label_accuracy: float


def summarise(rows: list, grid: list) -> list:
    summaries = []
    for setting in grid:
        mine = [r for r in rows if r["mechanism"] == setting.mechanism and r["epsilon"] == setting.epsilon]
        mse = np.array([r["mse"] for r in mine])
        summaries.append(Summary(setting, float(mse.mean()), float(np.median(mse)),
                                 float(np.mean([r["psnr"] for r in mine])), float(np.mean([r["ssim"] for r in mine])),
                                 float(np.mean([r["label"] == r["inferred_label"] for r in mine]))))
    return summaries


def mechanism_gap(summaries: list, measure: str) -> float:
    """How far apart the mechanisms' MSE curves are when plotted against ``measure``.

    Paper 004's Fig. 1 claims that at equal Bayes capacity the Gaussian and VMF mechanisms give
    similar MSE, and at equal epsilon they do not. This makes that a number: for every ordered pair
    of distinct mechanisms (mine, other) in ``summaries``, for every setting of mine whose measure
    lies within other's range, the distance between its mean MSE and other's MSE curve (linear in
    log measure) at that point; averaged over all of them. Smaller means the measure predicts the
    attack regardless of mechanism. nan if no two mechanisms' ranges overlap.
    """
    names = list(dict.fromkeys(s.setting.mechanism for s in summaries if s.setting.mechanism != NOISELESS))
    gaps = []
    for mine in names:
        for other in names:
            if other == mine:
                continue
            points = sorted((getattr(s.setting, measure), s.mean_mse) for s in summaries
                            if s.setting.mechanism == other)
            if len(points) < 2:
                continue
            x, y = np.log([p[0] for p in points]), np.array([p[1] for p in points])
            for s in summaries:
                value = getattr(s.setting, measure)
                if s.setting.mechanism == mine and x[0] <= math.log(value) <= x[-1]:
                    gaps.append(abs(s.mean_mse - float(np.interp(math.log(value), x, y))))
    return float(np.mean(gaps)) if gaps else math.nan


def rank_correlations(summaries: list) -> dict:
    """Spearman correlation of the mean MSE with epsilon and with the log Bayes capacity, all
    mechanisms pooled, the noiseless row left out."""
    from scipy.stats import spearmanr

    noisy = [s for s in summaries if s.setting.mechanism != NOISELESS]
    mse = [s.mean_mse for s in noisy]
    return {measure: float(spearmanr([getattr(s.setting, measure) for s in noisy], mse).statistic)
            for measure in ("epsilon", "log2_capacity")}


def write_csv(rows: list, path: str, fields: tuple = CSV_FIELDS) -> None:
    """``rows`` (dicts with keys ``fields``) as CSV, floats as repr (:func:`privleak.report.write_csv`)."""
    report.write_csv(rows, path, fields)


read_csv = report.read_csv


def _plot_mse_against(summaries: list, rows: list, measure: str, xlabel: str, path: str) -> None:
    with report.figure(path) as (axes,):
        for mechanism, mine in report.by_mechanism(summaries, lambda s: s.setting.mechanism):
            x = [getattr(s.setting, measure) for s in mine]
            per_image = [[r["mse"] for r in rows if r["mechanism"] == mechanism and r["epsilon"] == s.setting.epsilon]
                         for s in mine]
            report.curve(axes, mechanism, x, [s.mean_mse for s in mine],
                         yerr=[np.std(v) / math.sqrt(len(v)) for v in per_image])
        noiseless = [s for s in summaries if s.setting.mechanism == NOISELESS]
        if noiseless:
            axes.axhline(noiseless[0].mean_mse, color=report.colour(NOISELESS), linestyle="--",
                         label=report.legend_label(NOISELESS))
        axes.set_xscale("log")
        axes.set_xlabel(xlabel)
        axes.set_ylabel("reconstruction MSE (mean over images)")


def _grid_rows(results: Results, grid_epsilons: tuple) -> list:
    """Rows of the reconstruction figure: the originals, no noise, then for each of
    ``grid_epsilons`` each mechanism at the sweep's epsilon nearest to it."""
    rows = [("original", results.originals[0]), (report.legend_label(NOISELESS), results.reconstructions[0])]
    indexed = list(enumerate(results.settings))
    groups = report.by_mechanism(indexed, lambda pair: pair[1].mechanism)
    for wanted in grid_epsilons:
        for mechanism, mine in groups:
            i, setting = min(mine, key=lambda pair: abs(math.log(pair[1].epsilon / wanted)))
            rows.append((f"{report.legend_label(mechanism)}, eps = {setting.epsilon:g}", results.reconstructions[i]))
    return rows


def _plot_reconstructions(results: Results, grid_epsilons: tuple, path: str) -> None:
    plt = report.pyplot()
    rows = _grid_rows(results, grid_epsilons)
    columns = results.originals.shape[1]
    figure, axes = plt.subplots(len(rows), columns, figsize=(1.1 * columns + 1.6, 1.2 * len(rows)), squeeze=False)
    for r, (title, images) in enumerate(rows):
        for c in range(columns):
            axes[r, c].imshow(images[c].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray", vmin=0, vmax=1)
            axes[r, c].set_xticks([])
            axes[r, c].set_yticks([])
        axes[r, 0].set_ylabel(title, rotation=0, ha="right", va="center", fontsize=8)
    report.save(figure, path)


_number = report.number  # kept for callers of the old private helper


def _calibration(name: str) -> str:
    """The first sentence of a mechanism's ``calibrate`` docstring: how it meets (epsilon, delta)."""
    doc = " ".join(inspect.getdoc(dpsgd.mechanism.get(name).calibrate).split())
    return doc.split(". ")[0].rstrip(".")


def report_markdown(experiment: Experiment, results: Results, summaries: list) -> str:
    mechanisms = [name for name, _ in report.by_mechanism(summaries, lambda s: s.setting.mechanism)]
    columns = report.parameter_columns((*MECHANISMS, *experiment.mechanisms))
    lines = [
        "# privleak reproduce",
        "",
        f"Paper 004 (Biswas et al.), Sec. IV-A: Inverting Gradients against federated DP-SGD with "
        f"{' and '.join(report.legend_label(m) for m in mechanisms)} noise. Run time {results.seconds:.0f} s.",
        "",
        "## Parameters",
        "",
        f"- data: {experiment.dataset}; network: {results.dim} parameters (privleak.models.PaperNetwork)",
        f"- federated DP-SGD: {experiment.clients} clients x {experiment.examples_per_client} examples, "
        f"{experiment.rounds} rounds, one-image batches, clip norm {experiment.clip_norm:g}, "
        f"learning rate {experiment.learning_rate:g}; the last round's {experiment.clients} updates are attacked",
        f"- epsilon: of one update as local DP, delta = {experiment.delta:g}; "
        + "; ".join(f"{m}: {_calibration(m)}" for m in mechanisms),
        f"- attack: {experiment.attack.describe()}, labels inferred from the last layer",
        f"- seed {experiment.seed}",
        "",
        "## Results",
        "",
    ]
    lines += report.markdown_table(
        ["mechanism", "epsilon", *(report.column_title(c) for c in columns), "log2 Bayes capacity", "mean MSE",
         "median MSE", "mean PSNR", "mean SSIM", "label accuracy"],
        ([s.setting.mechanism, s.setting.epsilon, *(getattr(s.setting, c) for c in columns), s.setting.log2_capacity,
          s.mean_mse, s.median_mse, s.mean_psnr, s.mean_ssim, s.label_accuracy] for s in summaries))
    correlations = rank_correlations(summaries)
    lines += ["", "## Which measure predicts the attack", ""]
    lines += report.markdown_table(
        ["measure", "gap between the mechanisms' MSE curves", "Spearman rho with MSE, mechanisms pooled"],
        [["epsilon", mechanism_gap(summaries, "epsilon"), f"{correlations['epsilon']:.3f}"],
         ["log2 Bayes capacity", mechanism_gap(summaries, "log2_capacity"), f"{correlations['log2_capacity']:.3f}"]])
    lines += [
        "",
        "The gap is the mean distance, in MSE, from each setting of one mechanism to the other "
        "mechanism's curve at the same value of the measure (privleak.reproduce.mechanism_gap): "
        "the smaller it is, the better the measure predicts the attack whatever the mechanism.",
        "",
        "![epsilon vs MSE](epsilon_vs_mse.png) ![Bayes capacity vs MSE](capacity_vs_mse.png)",
        "",
        "![reconstructions](reconstructions.png)",
        "",
        "Per-image scores: reconstructions.csv.",
        "",
    ]
    return "\n".join(lines)


def write_outputs(experiment: Experiment, results: Results, out: str) -> dict:
    """reconstructions.csv, epsilon_vs_mse.png, capacity_vs_mse.png, reconstructions.png, report.md."""
    os.makedirs(out, exist_ok=True)
    summaries = summarise(results.rows, results.settings)
    paths = {name: os.path.join(out, name) for name in
             ("reconstructions.csv", "epsilon_vs_mse.png", "capacity_vs_mse.png", "reconstructions.png", "report.md")}
    report.write_csv(results.rows, paths["reconstructions.csv"], csv_fields(experiment.mechanisms))
    _plot_mse_against(summaries, results.rows, "epsilon", "epsilon of one update (local DP)",
                      paths["epsilon_vs_mse.png"])
    _plot_mse_against(summaries, results.rows, "log2_capacity", "log2 Bayes capacity of one update (bits)",
                      paths["capacity_vs_mse.png"])
    _plot_reconstructions(results, experiment.grid_epsilons, paths["reconstructions.png"])
    with open(paths["report.md"], "w") as stream:
        stream.write(report_markdown(experiment, results, summaries))
    return paths
