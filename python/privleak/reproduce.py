"""``privleak reproduce``: the experiment of paper 004, Sec. IV-A, Fig. 1 and 2.

For each mechanism (Gaussian, Alg. 1; VMF, Alg. 2) and each epsilon of a sweep, train the paper's
small network with federated DP-SGD (:mod:`privleak.fl`), let the honest-but-curious server attack
the last round's updates (each of a batch of ``batch_size`` images) with Inverting Gradients
(:mod:`privleak.attacks`), and put the reconstruction error next to two measures of the leak: the
epsilon of one update and the Bayes capacity of the channel the update goes through
(:mod:`privleak.capacity`). Next to them, two measures of what the attack sees: the noise's norm
against the clipped update's, and the cosine between the release and the clipped update.

**Conventions.** The paper says only that both mechanisms "use comparable epsilon, delta
guarantees". How an epsilon becomes noise is a :class:`Convention`, one class each:

* :class:`PrivleakConvention` (default): one leaked update as local DP, any two of the client's
  clipped gradients are neighbours (what a reconstruction attack is about); flat clipping.
  VMF: kappa = epsilon / 2, the tight pure-DP value. Gaussian: the clipped gradients fill a ball
  of radius c, sensitivity 2c, so the noise multiplier is 2 sigma(epsilon, delta), sigma the
  exact analytic-Gaussian calibration. Each mechanism's own ``calibrate``.
* :class:`PaperConvention`: paper 004's own reading. VMF: kappa = epsilon (App. A, epsilon
  d_theta-privacy of Weggenmann and Kerschbaum). Gaussian: Alg. 1 adds N(0, c^2 sigma^2) to the
  sum, the add/remove sensitivity c of Abadi et al., with sigma the analytic calibration or the
  classic sqrt(2 ln(1.25/delta)) / epsilon (valid only for epsilon <= 1). Per-layer clipping,
  each of the network's R parameter tensors to c (Thm III.1's "R layers, each clipped to 1"), and
  the Bayes capacity of that product of balls.

A noiseless row (clipping only) shows what the attack does when nothing protects the update.
"""
from __future__ import annotations

import inspect
import math
import os
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from privleak import accounting, attacks, datasets, dpsgd, fl, report, validation
from privleak.models import PaperNetwork, parameter_count

#: The default sweep: paper 004's two mechanisms. Any registered name (dpsgd.mechanism.names()) works.
MECHANISMS = ("gaussian", "vmf")
SEED_LIMIT = 2 ** 63  #: seeds are ints in [0, SEED_LIMIT)
NOISELESS = report.NOISELESS
#: The noiseless row's step: the clipped average, no noise (the Gaussian mechanism at noise 0).
NOISELESS_MECHANISM = dpsgd.Gaussian(0.0)
CALIBRATIONS = ("analytic", "classic")  #: PaperConvention's Gaussian calibrations


# ----------------------------------------------------------------------------- conventions


class Convention(ABC):
    """How a sweep's epsilon becomes a DP-SGD mechanism, and how the clients clip.

    Subclasses are frozen dataclasses; :attr:`label` names one in the CSV and the report."""

    name: ClassVar[str]
    per_layer: ClassVar[bool]  #: clip each parameter tensor to c (else the whole gradient)

    @property
    def label(self) -> str:
        """The convention as the CSV's ``convention`` column writes it (:func:`convention`)."""
        return self.name

    @abstractmethod
    def calibrate(self, mechanism: str, epsilon: float, delta: float, clipping: dpsgd.Clipping) -> dpsgd.DPSGDMechanism:
        """The registered ``mechanism`` whose one update is (epsilon, delta) under this convention,
        for a step clipped as ``clipping`` says."""

    @abstractmethod
    def epsilon_axis(self) -> str:
        """The epsilon axis's label: what epsilon means here."""

    @abstractmethod
    def describe(self, mechanisms: Sequence[str], tensors: int) -> list:
        """Report lines: the clipping, and how each mechanism meets its epsilon."""

    def check(self, mechanisms: Sequence[str]) -> None:
        """Refuse mechanisms this convention has no calibration for (ValueError); the base class
        calibrates every registered one."""
        for name in mechanisms:
            dpsgd.mechanism.get(name)

    def caveats(self, epsilons: Sequence[float]) -> list:
        """Sentences the report must carry for a sweep over ``epsilons`` (each also a warning)."""
        return []

    def config(self, clip_norm: float, mechanism: dpsgd.DPSGDMechanism) -> dpsgd.DPSGDConfig:
        """The clients' DP-SGD configuration for ``mechanism``."""
        return dpsgd.DPSGDConfig(clip_norm, mechanism, per_layer=self.per_layer)


def _calibration(name: str) -> str:
    """The first sentence of a mechanism's ``calibrate`` docstring: how it meets (epsilon, delta)."""
    doc = " ".join(inspect.getdoc(dpsgd.mechanism.get(name).calibrate).split())
    return doc.split(". ")[0].rstrip(".")


@dataclass(frozen=True)
class PrivleakConvention(Convention):
    """privleak's: one update as local DP for any two clipped gradients, flat clipping; each
    mechanism's own ``calibrate`` (Gaussian: sensitivity 2c; VMF: kappa = epsilon / 2)."""

    name = "privleak"
    per_layer = False

    def calibrate(self, mechanism: str, epsilon: float, delta: float, clipping: dpsgd.Clipping) -> dpsgd.DPSGDMechanism:
        return dpsgd.mechanism.get(mechanism).calibrate(epsilon, delta)

    def epsilon_axis(self) -> str:
        return "epsilon of one update (privleak: Gaussian sensitivity 2c, kappa = eps/2)"

    def describe(self, mechanisms: Sequence[str], tensors: int) -> list:
        return ["convention privleak: epsilon of one update as local DP, any two clipped gradients as neighbours; "
                "flat clipping; " + "; ".join(f"{m}: {_calibration(m)}" for m in mechanisms)]


@dataclass(frozen=True)
class PaperConvention(Convention):
    """Paper 004's: VMF kappa = epsilon (App. A); the Gaussian's noise N(0, c^2 sigma^2) on the
    sum (Alg. 1 line 10) with sigma calibrated at sensitivity c, analytically (Balle and Wang
    2018) or by the classic sqrt(2 ln(1.25/delta)) / epsilon (Dwork and Roth Thm A.1, proved
    only for epsilon < 1); per-layer clipping, each parameter tensor to c (Thm III.1).

    With R tensors clipped to c each, one sample moves the sum by up to c sqrt(R) (add/remove),
    2 c sqrt(R) (replace), so the Gaussian's stated epsilon holds for a change of c in the sum,
    the convention's reading of Alg. 1, not for one sample of the batch; privleak's own epsilon
    of the same release is the CSV's ``update_epsilon``. In privleak's Gaussian the noise std is
    noise_multiplier |(c_t)|_2 = noise_multiplier c sqrt(R), so noise_multiplier = sigma / sqrt(R).

    A "layer" is a parameter tensor, as in Opacus's per-layer clipping (and privleak's
    ``DPSGDConfig(per_layer=True)``): PaperNetwork's 4 layers are R = 8 tensors, 4 weights and 4
    biases. Clipping a layer's weight and bias together would need grouped clipping, which the
    fused kernel does not do."""

    calibration: str = "analytic"

    name = "paper"
    per_layer = True

    def __post_init__(self) -> None:
        validation.choice(self.calibration, "calibration", CALIBRATIONS)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.calibration}"

    def sigma(self, epsilon: float, delta: float) -> float:
        """Alg. 1's sigma: the noise std on the clipped sum over c, at sensitivity c."""
        if self.calibration == "classic":
            return math.sqrt(2.0 * math.log(1.25 / delta)) / validation.positive(epsilon, "epsilon")
        return accounting.analytic_gaussian_noise_multiplier(epsilon, delta)

    def check(self, mechanisms: Sequence[str]) -> None:
        for name in mechanisms:
            if not issubclass(dpsgd.mechanism.get(name), (dpsgd.Gaussian, dpsgd.VMF)):
                raise ValueError(f"mechanisms: the paper convention calibrates Alg. 1 (Gaussian) and Alg. 2 (VMF) "
                                 f"only, not {name!r}")

    def calibrate(self, mechanism: str, epsilon: float, delta: float, clipping: dpsgd.Clipping) -> dpsgd.DPSGDMechanism:
        self.check((mechanism,))
        kind = dpsgd.mechanism.get(mechanism)
        if issubclass(kind, dpsgd.VMF):
            return kind(kappa=validation.positive(epsilon, "epsilon"))
        # One tensor's clip norm c over the concatenation's |(c_t)|_2: the std becomes sigma c.
        return kind(noise_multiplier=self.sigma(epsilon, delta) * clipping.norms[0] / clipping.total(2))

    def epsilon_axis(self) -> str:
        return f"epsilon of one update (paper 004: Gaussian sensitivity c, {self.calibration} sigma, kappa = eps)"

    def describe(self, mechanisms: Sequence[str], tensors: int) -> list:
        sigma = {"analytic": "the analytic Gaussian calibration (Balle and Wang 2018)",
                 "classic": "the classic sqrt(2 ln(1.25/delta)) / epsilon"}[self.calibration]
        how = {dpsgd.Gaussian: f"noise N(0, c^2 sigma^2) on the clipped sum (Alg. 1), sigma {sigma} at sensitivity c "
                               f"(add/remove, Abadi et al.); privleak's noise multiplier is sigma / sqrt({tensors})",
               dpsgd.VMF: "kappa = epsilon (App. A)"}
        lines = [f"convention paper ({self.calibration}): per-layer clipping, each of the network's {tensors} "
                 "parameter tensors (weights and biases) to c, as Opacus's per-layer clipping; Bayes capacity of "
                 "that product of balls"]
        for name in mechanisms:
            kind = dpsgd.mechanism.get(name)
            lines.append(f"{name}: " + next(text for base, text in how.items() if issubclass(kind, base)))
        lines.append("the Gaussian's epsilon is for a change of c in the clipped sum; one sample moves it by up to "
                     f"c sqrt({tensors}) (add/remove): the update epsilon column is privleak's epsilon of the same "
                     "release (any two clipped gradients)")
        return lines

    def caveats(self, epsilons: Sequence[float]) -> list:
        if self.calibration != "classic" or all(e <= 1.0 for e in epsilons):
            return []
        above = ", ".join(f"{e:g}" for e in epsilons if e > 1.0)
        return [f"the classic calibration sigma = sqrt(2 ln(1.25/delta)) / epsilon is not a valid (epsilon, delta) "
                f"calibration above epsilon = 1 (Dwork and Roth, Thm A.1, needs epsilon < 1); here at epsilon {above} "
                "the releases are not (epsilon, delta)-DP as labelled: see the update epsilon column"]


CONVENTIONS = {"privleak": PrivleakConvention, "paper": PaperConvention}  #: --convention's choices


def convention(label: str) -> Convention:
    """The convention a CSV's ``convention`` cell names (:attr:`Convention.label`)."""
    name, _, calibration = str(label).partition("-")
    if name not in CONVENTIONS or (calibration and name != PaperConvention.name):
        raise ValueError(f"convention must be one of privleak, {', '.join(f'paper-{c}' for c in CALIBRATIONS)}; "
                         f"got {label!r}")
    return CONVENTIONS[name](calibration) if calibration else CONVENTIONS[name]()


# ----------------------------------------------------------------------------- engines


class Engine(ABC):
    """Where a setting's federated training runs; every engine leaks the same updates for the same
    seed, so the attack and the report do not depend on it (``--engine``)."""

    name: ClassVar[str]

    @abstractmethod
    def train(self, experiment: "Experiment", model: torch.nn.Module, clients: list,
              config: dpsgd.DPSGDConfig) -> fl.Federation:
        """Train ``model`` on ``clients`` (the experiment's shards, in order) for the experiment's
        rounds, and return what the server saw."""

    def describe(self) -> str:
        return self.name


class InProcess(Engine):
    """:func:`privleak.fl.run`: clients and server in this process (the default)."""

    name = "local"

    def train(self, experiment, model, clients, config):
        return fl.run(model, clients, config, rounds=experiment.rounds, batch_size=experiment.batch_size,
                      learning_rate=experiment.learning_rate, seed=experiment.seed)


class FlowerSimulation(Engine):
    """:func:`privleak.flower.run`: every client a Flower ClientApp that takes its DP-SGD step
    (noise included) itself, an honest-but-curious Flower ServerApp, on Flower's simulation."""

    name = "flower"

    def train(self, experiment, model, clients, config):
        from privleak import flower

        return flower.run(model, clients, config, rounds=experiment.rounds, batch_size=experiment.batch_size,
                          learning_rate=experiment.learning_rate, seed=experiment.seed)


@dataclass(frozen=True)
class FlowerDeployment(Engine):
    """Flower's Deployment Runtime: the sweep's settings run one after the other as
    :mod:`privleak.flower_app` runs on the SuperLink at ``superlink`` (``HOST:PORT``), which needs
    ``experiment.clients`` SuperNodes started with ``--node-config "partition-id=K
    num-partitions=N"`` and the data set on every node. The App draws the same shards and the same
    starting network as the other engines (``data-seed`` = ``model-seed`` = the experiment's seed);
    the ServerApp's record is read back here, so the SuperLink must share this file system."""

    superlink: str
    insecure: bool = False
    root_certificates: Optional[str] = None
    timeout: float = 3600.0
    name: ClassVar[str] = "flower-deployment"

    def train(self, experiment, model, clients, config):
        import tempfile

        from privleak import flower_app

        with tempfile.TemporaryDirectory(prefix="privleak-reproduce-") as directory:
            settings = self.settings(experiment, config, os.path.join(directory, "record.pt"))
            flower_app.write_app(directory, settings)
            return flower_app.submit(directory, self.superlink, insecure=self.insecure,
                                     root_certificates=self.root_certificates, network=model, timeout=self.timeout)

    @staticmethod
    def settings(experiment: "Experiment", config: dpsgd.DPSGDConfig, record: str):
        """The App's settings for one setting of the sweep (:class:`privleak.flower_app.Settings`)."""
        from privleak import flower_app

        return flower_app.Settings(
            rounds=experiment.rounds, clients=experiment.clients, examples_per_client=experiment.examples_per_client,
            mechanism=config.mechanism.name, mechanism_parameters=tuple(config.mechanism.parameters().items()),
            clip_norm=config.clip_norm, per_layer=config.per_layer, batch_size=experiment.batch_size,
            learning_rate=experiment.learning_rate, seed=experiment.seed, dataset=experiment.dataset,
            data_seed=experiment.seed, model_seed=experiment.seed, share_batches=True, record=record)

    def describe(self) -> str:
        return f"{self.name} at {self.superlink}"


# ----------------------------------------------------------------------------- the experiment


@dataclass(frozen=True)
class Experiment:
    """What ``privleak reproduce`` runs. The defaults finish in minutes on 2 CPU cores;
    :data:`PAPER_SCALE` is closer to the paper's (and Geiping et al.'s) budget. ``attack`` is any
    :class:`privleak.attacks.GradientAttack`, ``convention`` any :class:`Convention`."""

    dataset: str = "mnist-5k"
    epsilons: tuple = (10.0, 173.0, 1e3, 3e3, 1e4, 3e4, 1e5, 1e6)
    mechanisms: tuple = MECHANISMS
    delta: float = 1e-5
    clip_norm: float = 1.0
    clients: int = 8  #: one attacked update per client and setting
    examples_per_client: int = 16
    rounds: int = 3  #: the last round's updates are attacked
    learning_rate: float = 0.1
    attack: attacks.GradientAttack = field(default_factory=lambda: attacks.InvertingGradients(1500, 2))
    grid_epsilons: tuple = (173.0, 1e4, 1e5)  #: rows of the reconstruction figure (Fig. 2 uses 173)
    seed: int = 0
    batch_size: int = 1  #: images behind each client's update
    convention: Convention = PrivleakConvention()
    engine: Engine = InProcess()  #: where the federated training runs

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
        for name in ("clients", "examples_per_client", "rounds", "batch_size"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.batch_size > self.examples_per_client:
            raise ValueError(f"batch_size {self.batch_size} exceeds examples_per_client {self.examples_per_client}")
        if not self.grid_epsilons or any(not (e > 0 and math.isfinite(e)) for e in self.grid_epsilons):
            raise ValueError(f"grid_epsilons must be positive and finite, got {self.grid_epsilons!r}")
        if not isinstance(self.attack, attacks.GradientAttack):
            raise ValueError(f"attack must be a privleak.attacks.GradientAttack, got {type(self.attack).__name__}")
        if not isinstance(self.convention, Convention):
            raise ValueError(f"convention must be a privleak.reproduce.Convention, got "
                             f"{type(self.convention).__name__}")
        self.convention.check(self.mechanisms)
        if not isinstance(self.engine, Engine):
            raise ValueError(f"engine must be a privleak.reproduce.Engine, got {type(self.engine).__name__}")
        # torch.Generator.manual_seed takes seed and seed + 1; NoiseGenerator takes it modulo 2^64.
        validation.integer(self.seed, "seed", low=0, high=SEED_LIMIT - 1)


PAPER_SCALE = Experiment(
    epsilons=(1.0, 10.0, 50.0, 173.0, 500.0, 1e3, 3e3, 1e4, 3e4, 1e5, 3e5, 1e6),
    clients=32, examples_per_client=32, rounds=5,
    attack=attacks.InvertingGradients(iterations=4800, restarts=4))


class Setting(NamedTuple):
    """One row of the sweep: a mechanism calibrated to an epsilon under a convention, or the
    noiseless row.

    A mechanism's parameters read as attributes too (``setting.noise_multiplier``,
    ``setting.kappa``, ...): nan where this setting's mechanism has no such parameter."""

    mechanism: str  #: a registered name, or NOISELESS
    epsilon: float  #: of one update, under ``convention``; inf for the noiseless row
    noise: Optional[dpsgd.DPSGDMechanism]  #: the convention's calibration; None for the noiseless row
    log2_capacity: float  #: Bayes capacity of one update's channel, in bits; inf without noise
    convention: Convention = PrivleakConvention()

    @property
    def parameters(self) -> dict:
        """The mechanism's parameters ({} for the noiseless row)."""
        return {} if self.noise is None else self.noise.parameters()

    def update_epsilon(self, delta: float) -> float:
        """privleak's epsilon of this setting's one update, whatever its convention: any two clipped
        gradients as neighbours (the mechanism's ``update_epsilon``); inf without noise."""
        return math.inf if self.noise is None else float(self.noise.update_epsilon(delta))

    def config(self, clip_norm: float) -> dpsgd.DPSGDConfig:
        """The clients' DP-SGD configuration."""
        return self.convention.config(clip_norm, NOISELESS_MECHANISM if self.noise is None else self.noise)

    @classmethod
    def from_row(cls, row: dict) -> "Setting":
        """The setting of a CSV row (:func:`run`'s rows, or :func:`read_csv`'s)."""
        rules = convention(row.get("convention", PrivleakConvention.name))
        if row["mechanism"] == NOISELESS:
            return cls(NOISELESS, row["epsilon"], None, row["log2_capacity"], rules)
        fields = report.parameter_columns((row["mechanism"],))
        noise = dpsgd.mechanism.create(row["mechanism"], {name: row[name] for name in fields})
        return cls(row["mechanism"], row["epsilon"], noise, row["log2_capacity"], rules)

    def __getattr__(self, name: str):
        if not name.startswith("_") and name in report.parameter_columns(dpsgd.mechanism.names()):
            return float(self.parameters.get(name, math.nan))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def settings(experiment: Experiment, sizes: Union[int, Sequence[int]]) -> list:
    """The noiseless row, then every (mechanism, epsilon): the convention's calibration of one
    update to (epsilon, delta) and the Bayes capacity of its channel (``log_capacity``) for a
    network whose parameter tensors have ``sizes`` elements (an int: one tensor), clipped as the
    convention says, ``experiment.batch_size`` images per update. The convention's caveats are
    issued as warnings."""
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    rules = experiment.convention
    for caveat in rules.caveats(experiment.epsilons):
        warnings.warn(caveat, UserWarning, stacklevel=2)
    clipping = rules.config(experiment.clip_norm, NOISELESS_MECHANISM).clipping(len(sizes))
    rows = [Setting(NOISELESS, math.inf, None, math.inf, rules)]
    for name in experiment.mechanisms:
        for epsilon in experiment.epsilons:
            noise = rules.calibrate(name, epsilon, experiment.delta, clipping)
            bits = noise.log_capacity(sizes, clipping, experiment.batch_size).bits
            rows.append(Setting(name, epsilon, noise, bits, rules))
    return rows


def dpsgd_config(setting: Setting, clip_norm: float) -> dpsgd.DPSGDConfig:
    """The DP-SGD configuration of one setting of the sweep (:meth:`Setting.config`)."""
    return setting.config(clip_norm)


class Attacked(NamedTuple):
    """The last round's updates of one setting, and the images behind them. A client's B images
    are rows c B .. c B + B - 1 of ``images``, ``labels`` and ``dataset_indices``."""

    parameters: list  #: (clients, *shape) per trainable parameter: the model each update was taken at
    updates: list  #: (clients, *shape) per trainable parameter: the releases
    images: torch.Tensor
    labels: torch.Tensor
    dataset_indices: torch.Tensor
    clean: list  #: (clients, *shape) per trainable parameter: the clipped noiseless updates
    batch_size: int = 1


def clipped_updates(model: torch.nn.Module, parameters: Sequence[torch.Tensor], images: torch.Tensor,
                    labels: torch.Tensor, config: dpsgd.DPSGDConfig, batch_size: int) -> list:
    """What each client's update is before noise: its batch's per-sample gradients at
    ``parameters`` (one (clients, *shape) tensor per trainable parameter), clipped and averaged as
    ``config`` clips (:class:`privleak.dpsgd.ClipOnly`). ``images`` and ``labels`` hold the
    clients' batches one after the other."""
    clip_only = config.replace(mechanism=dpsgd.ClipOnly(config.mechanism.clip_norm_type))
    trainable = [p for p in model.parameters() if p.requires_grad]
    clients = parameters[0].shape[0]
    per_client = []
    for k in range(clients):
        with torch.no_grad():
            for p, q in zip(trainable, parameters):
                p.copy_(q[k])
        rows = slice(k * batch_size, (k + 1) * batch_size)
        grads = dpsgd.per_sample_gradients(model, F.cross_entropy, images[rows], labels[rows])
        per_client.append(dpsgd.privatize(grads, clip_only, batch_size))
    return [torch.stack(parts) for parts in zip(*per_client)]


def train_and_collect(experiment: Experiment, data: datasets.ImageDataset, setting: Setting) -> Attacked:
    """Federated DP-SGD with batches of ``experiment.batch_size``; the server keeps the last round's
    updates, and the clipped noiseless update of each is recomputed from its batch."""
    needed = experiment.clients * experiment.examples_per_client
    if needed > len(data.labels):
        raise ValueError(f"clients x examples_per_client = {experiment.clients} x {experiment.examples_per_client} "
                         f"= {needed} images, but data set {data.name} has {len(data.labels)}")
    generator = torch.Generator().manual_seed(experiment.seed)
    # the shards of fl.split_among_clients (and of the Flower App's nodes) for this generator
    order = torch.randperm(len(data.labels), generator=generator)[: experiment.clients * experiment.examples_per_client]
    shards = order.reshape(experiment.clients, experiment.examples_per_client)
    clients = [fl.Client(data.images[rows], data.labels[rows]) for rows in shards]
    torch.manual_seed(experiment.seed)  # the same starting network for every setting
    model = PaperNetwork(data.image_shape, data.num_classes)
    config = setting.config(experiment.clip_norm)
    federation = experiment.engine.train(experiment, model, clients, config)
    last = federation.updates_of_round(experiment.rounds - 1)
    picked = torch.cat([shards[u.client][u.private_batches[0]] for u in last])
    stack = [torch.stack(tensors) for tensors in zip(*(u.parameters for u in last))]
    updates = [torch.stack(tensors) for tensors in zip(*(u.update for u in last))]
    images, labels = data.images[picked], data.labels[picked]
    clean = clipped_updates(model, stack, images, labels, config, experiment.batch_size)
    return Attacked(stack, updates, images, labels, picked, clean, experiment.batch_size)


class NoiseMeasures(NamedTuple):
    noise_norm_ratio: torch.Tensor  #: (A,) |release - noiseless release| / |noiseless release|
    cosine: torch.Tensor  #: (A,) cosine between the release and the clipped update


def noise_measures(released: Sequence[torch.Tensor], clean: Sequence[torch.Tensor],
                   releases_direction: bool) -> NoiseMeasures:
    """How far the noise takes each release (one (A, *shape) tensor per parameter) from its
    clipped noiseless update ``clean``: the noise's norm against the noiseless release's (the
    clipped update, or its unit direction for a mechanism that ``releases_direction``, VMF), and
    the cosine between release and clipped update, what the attack's objective compares."""
    r = torch.cat([t.flatten(1) for t in released], 1).double()
    x = torch.cat([t.flatten(1) for t in clean], 1).double()
    x_norm, r_norm = x.norm(dim=1), r.norm(dim=1)
    reference = x / x_norm[:, None] if releases_direction else x
    return NoiseMeasures((r - reference).norm(dim=1) / reference.norm(dim=1),
                         (r * x).sum(1) / (r_norm * x_norm))


class Results(NamedTuple):
    rows: list  #: one dict per attacked image (the CSV's rows)
    settings: list
    #: (settings, clients B, C, H, W): each update's reconstructions, paired with its true images
    #: (attacks.match_batches)
    reconstructions: torch.Tensor
    originals: torch.Tensor  #: (settings, clients B, C, H, W): the attacked clients' true images
    dim: int
    seconds: float
    attacked: list  #: one :class:`Attacked` per setting


def csv_fields(mechanisms: tuple = MECHANISMS) -> tuple:
    """reconstructions.csv's columns: one per parameter of the default mechanisms (noise_multiplier,
    kappa) and of ``mechanisms`` (:func:`privleak.report.parameter_columns`)."""
    return ("convention", "mechanism", "epsilon", "update_epsilon", "delta",
            *report.parameter_columns((*MECHANISMS, *mechanisms)), "log2_capacity", "noise_norm_ratio", "cosine",
            "client", "image", "dataset_index", "label", "attack_label", "labels_given", "mse", "psnr", "ssim")


CSV_FIELDS = csv_fields()  #: the columns for the default mechanisms


def _attack(experiment: Experiment, model, collected: list, grid: list, image_shape,
            progress: Optional[Callable[[str, int, int], None]]) -> tuple:
    """Every setting's updates attacked in batched runs, one per clipping rule (the attack models
    the clients' clipping, which depends on the mechanism's norm); (images, labels) in the
    settings' order."""
    b = experiment.batch_size
    groups: dict = {}
    for i, setting in enumerate(grid):
        config = setting.config(experiment.clip_norm)
        key = (config.clipping(len(collected[i].updates)), config.mechanism.clip_norm_type)
        groups.setdefault(key, (config, []))[1].append(i)
    iterations, total = experiment.attack.iterations, experiment.attack.iterations * len(groups)
    images, labels = [None] * len(grid), [None] * len(grid)
    for g, (config, members) in enumerate(groups.values()):
        parameters = [torch.cat(parts) for parts in zip(*(collected[i].parameters for i in members))]
        updates = [torch.cat(parts) for parts in zip(*(collected[i].updates for i in members))]
        truth = torch.cat([collected[i].labels for i in members])
        given = attacks.attack_labels(model, updates, b, truth)
        done = g * iterations
        reconstruction = experiment.attack.reconstruct(
            model, updates, image_shape, labels=given.labels, parameters=parameters, batch_size=b, config=config,
            generator=torch.Generator().manual_seed(experiment.seed + 1),
            progress=None if progress is None else (lambda n, done=done: progress("attack", done + n, total)))
        matched = attacks.match_batches(reconstruction, torch.cat([collected[i].images for i in members]))
        per = experiment.clients * b
        for j, i in enumerate(members):
            rows = slice(j * per, (j + 1) * per)
            images[i] = matched.images[rows]
            labels[i] = (matched.labels[rows], given.given[j * experiment.clients:(j + 1) * experiment.clients])
    return images, labels


def run(experiment: Experiment, progress: Optional[Callable[[str, int, int], None]] = None) -> Results:
    """Train every setting, then attack all their updates in batched runs of ``experiment.attack``."""
    started = time.perf_counter()
    data = datasets.load(experiment.dataset)
    network = PaperNetwork(data.image_shape, data.num_classes)
    sizes = [p.numel() for p in network.parameters() if p.requires_grad]
    grid = settings(experiment, sizes)
    collected = []
    for i, setting in enumerate(grid):
        collected.append(train_and_collect(experiment, data, setting))
        if progress is not None:
            progress("federated training", i + 1, len(grid))
    found, labels = _attack(experiment, network, collected, grid, data.image_shape, progress)
    columns = report.parameter_columns((*MECHANISMS, *experiment.mechanisms))
    b, rows = experiment.batch_size, []
    for setting, attacked, images, (attack_labels, given) in zip(grid, collected, found, labels):
        measures = noise_measures(attacked.updates, attacked.clean,
                                  setting.noise is not None and setting.noise.releases_direction)
        mse = attacks.mse(images, attacked.images)
        psnr = attacks.psnr(images, attacked.images)
        ssim = attacks.ssim(images, attacked.images)
        common = {"convention": setting.convention.label, "mechanism": setting.mechanism, "epsilon": setting.epsilon,
                  "update_epsilon": setting.update_epsilon(experiment.delta), "delta": experiment.delta,
                  **report.parameter_cells(setting.noise, columns), "log2_capacity": setting.log2_capacity}
        for a in range(len(attacked.labels)):
            client = a // b
            rows.append({
                **common, "noise_norm_ratio": float(measures.noise_norm_ratio[client]),
                "cosine": float(measures.cosine[client]), "client": client, "image": a % b,
                "dataset_index": int(attacked.dataset_indices[a]), "label": int(attacked.labels[a]),
                "attack_label": int(attack_labels[a]), "labels_given": int(given[client]),
                "mse": float(mse[a]), "psnr": float(psnr[a]), "ssim": float(ssim[a]),
            })
    return Results(rows, grid, torch.stack(found), torch.stack([c.images for c in collected]),
                   parameter_count(network), time.perf_counter() - started, collected)


# ----------------------------------------------------------------------------- outputs


class Summary(NamedTuple):
    """One setting's scores, aggregated over its attacked images."""

    setting: Setting
    mean_mse: float
    median_mse: float
    mean_psnr: float
    mean_ssim: float
    label_accuracy: float  #: of the labels the attack inferred; nan where all were given
    mean_noise_norm_ratio: float = math.nan
    mean_cosine: float = math.nan


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else math.nan


def summarise(rows: list, grid: list) -> list:
    """One :class:`Summary` per setting of ``grid``, from its rows (per image). The noise measures
    are per update: averaged over the updates, each once."""
    summaries = []
    for setting in grid:
        mine = [r for r in rows if r["mechanism"] == setting.mechanism and r["epsilon"] == setting.epsilon]
        mse = np.array([r["mse"] for r in mine])
        updates = list({r["client"]: r for r in mine}.values())
        summaries.append(Summary(
            setting, float(mse.mean()), float(np.median(mse)), _mean([r["psnr"] for r in mine]),
            _mean([r["ssim"] for r in mine]), _mean([r["label"] == r["attack_label"] for r in mine
                                                     if not r["labels_given"]]),
            _mean([r["noise_norm_ratio"] for r in updates]), _mean([r["cosine"] for r in updates])))
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
    with report.figure(path, legend_fontsize=8) as (axes,):
        counts = set()
        for mechanism, mine in report.by_mechanism(summaries, lambda s: s.setting.mechanism):
            x = [getattr(s.setting, measure) for s in mine]
            per_image = [[r["mse"] for r in rows if r["mechanism"] == mechanism and r["epsilon"] == s.setting.epsilon]
                         for s in mine]
            counts.update(len(v) for v in per_image)
            report.curve(axes, mechanism, x, [s.mean_mse for s in mine],
                         yerr=[report.standard_error(v) for v in per_image],
                         label=f"{report.legend_label(mechanism)} ({report.STANDARD_ERROR_LEGEND})")
        noiseless = [s for s in summaries if s.setting.mechanism == NOISELESS]
        if noiseless:
            axes.axhline(noiseless[0].mean_mse, color=report.colour(NOISELESS), linestyle="--",
                         label=report.legend_label(NOISELESS))
        axes.set_xscale("log")
        axes.set_xlabel(xlabel, fontsize=8)
        axes.set_ylabel("reconstruction MSE (mean over images)")
        axes.set_title(report.standard_error_caption(sorted(counts)), fontsize=8)


GRID_COLUMNS = 16  #: at most this many attacked images per row of reconstructions.png


def _grid_rows(results: Results, grid_epsilons: tuple) -> list:
    """Rows of the reconstruction figure as (title, setting index or None for the originals):
    the originals, no noise, then for each of ``grid_epsilons`` each mechanism at the sweep's
    epsilon nearest to it."""
    rows = [("original", None), (report.legend_label(NOISELESS), 0)]
    indexed = list(enumerate(results.settings))
    groups = report.by_mechanism(indexed, lambda pair: pair[1].mechanism)
    for wanted in grid_epsilons:
        for mechanism, mine in groups:
            i, setting = min(mine, key=lambda pair: abs(math.log(pair[1].epsilon / wanted)))
            rows.append((f"{report.legend_label(mechanism)}, eps = {setting.epsilon:g}", i))
    return rows


def _plot_reconstructions(results: Results, grid_epsilons: tuple, path: str) -> None:
    """The first :data:`GRID_COLUMNS` attacked images and their reconstructions, each
    reconstruction with its MSE underneath."""
    plt = report.pyplot()
    rows = _grid_rows(results, grid_epsilons)
    columns = min(results.originals.shape[1], GRID_COLUMNS)
    originals = results.originals[0, :columns]
    figure, axes = plt.subplots(len(rows), columns, figsize=(1.1 * columns + 1.6, 1.35 * len(rows)), squeeze=False)
    for r, (title, index) in enumerate(rows):
        images = originals if index is None else results.reconstructions[index, :columns]
        errors = None if index is None else attacks.mse(images, originals)
        for c in range(columns):
            axes[r, c].imshow(images[c].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray", vmin=0, vmax=1)
            axes[r, c].set_xticks([])
            axes[r, c].set_yticks([])
            if errors is not None:
                axes[r, c].set_xlabel(f"MSE {float(errors[c]):.3f}", fontsize=6, labelpad=1)
        axes[r, 0].set_ylabel(title, rotation=0, ha="right", va="center", fontsize=8)
    report.save(figure, path)


_number = report.number  # kept for callers of the old private helper


def report_markdown(experiment: Experiment, results: Results, summaries: list) -> str:
    mechanisms = [name for name, _ in report.by_mechanism(summaries, lambda s: s.setting.mechanism)]
    columns = report.parameter_columns((*MECHANISMS, *experiment.mechanisms))
    tensors = len(results.attacked[0].updates) if results.attacked else 1
    rules = experiment.convention
    b = experiment.batch_size
    batches = "one-image batches" if b == 1 else f"batches of {b} images"
    lines = [
        "# privleak reproduce",
        "",
        f"Paper 004 (Biswas et al.), Sec. IV-A: Inverting Gradients against federated DP-SGD with "
        f"{' and '.join(report.legend_label(m) for m in mechanisms)} noise, convention {rules.label}. "
        f"Run time {results.seconds:.0f} s.",
        "",
        "## Parameters",
        "",
        f"- data: {experiment.dataset}; network: {results.dim} parameters in {tensors} tensors "
        "(privleak.models.PaperNetwork)",
        f"- federated DP-SGD: {experiment.clients} clients x {experiment.examples_per_client} examples, "
        f"{experiment.rounds} rounds, {batches}, clip norm c = {experiment.clip_norm:g}, "
        f"learning rate {experiment.learning_rate:g}; the last round's {experiment.clients} updates are attacked; "
        f"engine {experiment.engine.describe()}",
        f"- epsilon: of one update, delta = {experiment.delta:g}",
        *(f"- {line}" for line in rules.describe(mechanisms, tensors)),
        f"- attack: {experiment.attack.describe()}; "
        + ("labels inferred from the last layer (iDLG)" if b == 1 else
           f"{b} dummy images per update, labels inferred from the last layer's weight rows where exactly {b} "
           "classes show (else the true labels are given: the labels given column), reconstructions paired with "
           "the true images by the least-MSE assignment"),
        f"- seed {experiment.seed}",
    ]
    caveats = rules.caveats(experiment.epsilons)
    if caveats:
        lines += ["", *(f"**Caveat:** {caveat}." for caveat in caveats)]
    lines += ["", "## Results", ""]
    lines += report.markdown_table(
        ["convention", "mechanism", "epsilon", "update epsilon", *(report.column_title(c) for c in columns),
         "log2 Bayes capacity", "noise norm ratio", "cosine", "mean MSE", "median MSE", "mean PSNR", "mean SSIM",
         "label accuracy"],
        ([s.setting.convention.label, s.setting.mechanism, s.setting.epsilon,
          s.setting.update_epsilon(experiment.delta), *(getattr(s.setting, c) for c in columns),
          s.setting.log2_capacity, s.mean_noise_norm_ratio, s.mean_cosine, s.mean_mse, s.median_mse, s.mean_psnr,
          s.mean_ssim, s.label_accuracy] for s in summaries))
    lines += [
        "",
        "epsilon is under the row's convention; update epsilon is privleak's epsilon of the same release (any two "
        "clipped gradients as neighbours). noise norm ratio: |release - noiseless release| / |noiseless release| "
        "(the noiseless release is the clipped update, or its direction for VMF); cosine: between the release and "
        "the clipped update; both averaged over the attacked updates. label accuracy: of the labels the attack "
        "inferred (- where all were given).",
    ]
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
        f"Figures: mean MSE per setting; {report.standard_error_caption([experiment.clients * b])}.",
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
    _plot_mse_against(summaries, results.rows, "epsilon", experiment.convention.epsilon_axis(),
                      paths["epsilon_vs_mse.png"])
    _plot_mse_against(summaries, results.rows, "log2_capacity", "log2 Bayes capacity of one update (bits)",
                      paths["capacity_vs_mse.png"])
    _plot_reconstructions(results, experiment.grid_epsilons, paths["reconstructions.png"])
    with open(paths["report.md"], "w") as stream:
        stream.write(report_markdown(experiment, results, summaries))
    return paths
