"""privleak's Flower App: :mod:`privleak.flower`'s ClientApp and honest-but-curious ServerApp,
configured by the run config, for Flower's Deployment Runtime (a SuperLink, SuperNodes on the
clients' machines, ``flwr run``).

:func:`write_app` writes the App's project folder: one ``pyproject.toml`` whose components are
``privleak.flower_app:serverapp`` and ``privleak.flower_app:clientapp`` (this module, imported from
the installed privleak on every machine: nothing to build or install at run time) and whose run
config is a :class:`Settings`. Each SuperNode trains on its own shard of a data set that ships with
privleak (or a folder of IDX files present on the node): ``--node-config "partition-id=K
num-partitions=N"`` picks shard K of :func:`privleak.fl.split_among_clients` with the settings'
``data-seed``, the shards :func:`privleak.fl.run` and ``privleak reproduce`` use. The ServerApp
starts from :class:`privleak.models.PaperNetwork` seeded with ``model-seed``, checks every reply's
privacy metadata against the settings (:class:`privleak.flower.CuriousFedAvg`) and, if ``record``
names a file, saves what it saw there (:func:`load_record` reads it back as a
:class:`privleak.fl.Federation`). :func:`submit` runs ``flwr run`` against a SuperLink and returns
that Federation, with the attack hooks replayed on it.

Commands (Flower 1.41; ``--insecure`` only for tests: deployments use TLS)::

    flower-superlink --insecure --port 9093 --disable-runtime-dependency-installation
    flower-supernode --insecure --superlink SERVER:9093 --port 9094 --node-config "partition-id=0 num-partitions=2"
    flower-supernode --insecure --superlink SERVER:9093 --port 9095 --node-config "partition-id=1 num-partitions=2"
    flwr run APP_DIR privleak --stream     # $FLWR_HOME/config.toml: [superlink.privleak] address, insecure
"""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from privleak import datasets, dpsgd, fl, flower, validation
from privleak.models import PaperNetwork

try:
    import tomli
    import tomli_w
    from flwr.app import ArrayRecord, Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as error:
    raise ImportError("privleak.flower_app needs Flower: pip install 'privleak[flower]'") from error

__all__ = ["Settings", "write_app", "client_data", "model", "load_record", "submit", "serverapp", "clientapp"]

#: the record file's format tag
RECORD_FORMAT = "privleak.flower_app.record/1"
#: the SuperLink connection :func:`submit` writes into its Flower configuration
CONNECTION = "privleak"


class Settings(NamedTuple):
    """An experiment, as the App's run config holds it (``[tool.flwr.app.config]``, keys with
    dashes: ``examples-per-client``; the mechanism's parameters under ``mechanism-parameters``)."""

    rounds: int
    clients: int  #: SuperNodes, partition ids 0 .. clients - 1
    examples_per_client: int
    mechanism: str  #: a registered DP-SGD mechanism (:func:`privleak.dpsgd.mechanism.names`)
    mechanism_parameters: tuple = ()  #: (name, value) pairs, e.g. (("kappa", 1000.0),)
    clip_norm: Union[float, tuple] = 1.0  #: one norm, or one per trainable tensor with per_layer
    per_layer: bool = False
    batch_size: int = 1
    local_steps: int = 1
    learning_rate: float = 0.1
    server_learning_rate: float = 1.0
    privatize: str = "client"  #: see :func:`privleak.flower.client_app`
    secure_noise: bool = False
    seed: Optional[int] = None  #: :func:`privleak.fl.client_streams`' seed; None: fresh entropy
    dataset: str = "sklearn-digits"  #: a name :func:`privleak.datasets.load` takes, on every node
    data_seed: int = 0  #: the shards: split_among_clients with torch.Generator().manual_seed(data_seed)
    model_seed: int = 0  #: the initial model: PaperNetwork built after torch.manual_seed(model_seed)
    share_batches: bool = False  #: clients send their batches' indices (experiments only)
    record: str = ""  #: file the ServerApp saves its record to ("": none)
    round_timeout: float = 600.0  #: seconds a round waits for the clients

    def config(self) -> dpsgd.DPSGDConfig:
        """The DP-SGD configuration of every local step."""
        return dpsgd.DPSGDConfig(self.clip_norm, self.mechanism, per_layer=self.per_layer,
                                 **dict(self.mechanism_parameters))

    def run_config(self) -> dict:
        """The run config (nested as in pyproject.toml; Flower flattens it with dots)."""
        values = {name.replace("_", "-"): value for name, value in self._asdict().items()
                  if name != "mechanism_parameters" and value is not None}
        if isinstance(self.clip_norm, tuple):  # run configs hold scalars only
            values["clip-norm"] = " ".join(repr(c) for c in self.clip_norm)
        values["mechanism-parameters"] = dict(self.mechanism_parameters)
        return values

    @classmethod
    def from_run_config(cls, run_config: dict) -> "Settings":
        """The settings in a (flattened) run config; every value is checked, errors name its key."""
        def key(name: str) -> str:
            return f"run_config[{name.replace('_', '-')!r}]"

        known = {name.replace("_", "-") for name in cls._fields}
        unknown = sorted(k for k in run_config if k not in known and not k.startswith("mechanism-parameters."))
        if unknown:
            raise ValueError(f"run_config: unknown keys {unknown}; the App takes {sorted(known)}")
        values: dict[str, Any] = {}
        for name in cls._fields:
            if name.replace("_", "-") in run_config:
                values[name] = run_config[name.replace("_", "-")]
            elif name in cls._field_defaults:
                values[name] = cls._field_defaults[name]
            elif name != "mechanism_parameters":
                raise ValueError(f"{key(name)} is missing")
        values["mechanism_parameters"] = tuple(sorted(
            (k.partition(".")[2], v) for k, v in run_config.items() if k.startswith("mechanism-parameters.")))
        for name in ("rounds", "clients", "examples_per_client", "batch_size", "local_steps"):
            values[name] = validation.integer(values[name], key(name), low=1)
        for name in ("data_seed", "model_seed") + (("seed",) if values["seed"] is not None else ()):
            values[name] = validation.integer(values[name], key(name))
        for name in ("learning_rate", "server_learning_rate"):
            values[name] = validation.real(values[name], key(name))
        values["round_timeout"] = validation.positive(values["round_timeout"], key("round_timeout"))
        for name in ("per_layer", "secure_noise", "share_batches"):
            values[name] = validation.boolean(values[name], key(name))
        for name in ("mechanism", "dataset", "record", "privatize"):
            if not isinstance(values[name], str):
                raise validation.ArgumentTypeError(f"{key(name)} must be a string, got {values[name]!r}")
        if isinstance(values["clip_norm"], str):
            try:
                values["clip_norm"] = tuple(float(c) for c in values["clip_norm"].split())
            except ValueError:
                raise ValueError(f"{key('clip_norm')} must be a number or numbers separated by spaces, got "
                                 f"{values['clip_norm']!r}") from None
        settings = cls(**values)
        settings.config()  # the mechanism, its parameters and the clip norms, checked here
        return settings


def write_app(directory: Union[str, os.PathLike], settings: Settings, *, name: str = "privleak-app") -> Path:
    """Write the App's project folder (its ``pyproject.toml``) with ``settings`` as its run
    config; returns the folder. ``flwr run DIRECTORY CONNECTION`` submits it."""
    if not isinstance(settings, Settings):
        raise validation.ArgumentTypeError(f"settings must be a privleak.flower_app.Settings, got "
                                           f"{type(settings).__name__}")
    Settings.from_run_config(_flatten(settings.run_config()))  # refuse what the App would refuse
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    project = {
        "project": {"name": name, "version": "1.0.0", "license": "Apache-2.0",
                    "description": "privleak's federated DP-SGD with an honest-but-curious server",
                    # already installed on every machine: the SuperLink runs with runtime installs off
                    "dependencies": ["privleak[flower]"]},
        "tool": {"flwr": {"app": {"publisher": "privleak",
                                  "components": {"serverapp": "privleak.flower_app:serverapp",
                                                 "clientapp": "privleak.flower_app:clientapp"},
                                  "config": settings.run_config()}}},
    }
    (directory / "pyproject.toml").write_text(tomli_w.dumps(project), encoding="utf-8")
    return directory


def _flatten(nested: dict, prefix: str = "") -> dict:
    """A nested run config flattened as Flower does (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    flat = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def read_settings(directory: Union[str, os.PathLike]) -> Settings:
    """The settings of the App project in ``directory``."""
    with open(Path(directory) / "pyproject.toml", "rb") as stream:
        project = tomli.load(stream)
    return Settings.from_run_config(_flatten(project["tool"]["flwr"]["app"].get("config", {})))


@functools.lru_cache(maxsize=4)
def _dataset(name: str) -> datasets.ImageDataset:
    return datasets.load(name)


def client_data(settings: Settings, partition: int) -> fl.Client:
    """Client ``partition``'s shard: :func:`privleak.fl.split_among_clients` of the data set into
    ``clients`` shards of ``examples_per_client``, with ``torch.Generator().manual_seed(data_seed)``."""
    partition = validation.integer(partition, "partition", low=0, high=settings.clients - 1)
    data = _dataset(settings.dataset)
    shards = fl.split_among_clients(data.images, data.labels, settings.clients, settings.examples_per_client,
                                    torch.Generator().manual_seed(settings.data_seed))
    return shards[partition]


def model(settings: Settings) -> nn.Module:
    """The initial model: :class:`privleak.models.PaperNetwork` for the data set's images and
    classes, its weights drawn after ``torch.manual_seed(model_seed)`` (the global generator is
    left as it was)."""
    data = _dataset(settings.dataset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.model_seed)
        return PaperNetwork(data.image_shape, data.num_classes)


@functools.lru_cache(maxsize=4)
def _client_app(settings: Settings) -> ClientApp:
    return flower.client_app(model(settings), functools.partial(client_data, settings), settings.config(),
                             batch_size=settings.batch_size, local_steps=settings.local_steps,
                             privatize=settings.privatize, secure_noise=settings.secure_noise, seed=settings.seed,
                             share_batches=settings.share_batches)


def _check_partitions(settings: Settings, context: Context) -> None:
    partitions = context.node_config.get("num-partitions")
    if partitions is not None and int(partitions) != settings.clients:
        raise ValueError(f"the node was started with num-partitions={partitions}, the run has "
                         f"clients={settings.clients}")


clientapp = ClientApp()


@clientapp.train()
def _train(message: Message, context: Context) -> Message:
    settings = Settings.from_run_config(context.run_config)
    _check_partitions(settings, context)
    return _client_app(settings)(message, context)


serverapp = ServerApp()


@serverapp.main()
def _main(grid: Grid, context: Context) -> None:
    settings = Settings.from_run_config(context.run_config)
    federation = fl.Federation(model(settings))
    models = []
    strategy = flower.CuriousFedAvg(
        federation, settings.clients, settings.config(), batch_size=settings.batch_size,
        local_steps=settings.local_steps, secure_noise=settings.secure_noise, learning_rate=settings.learning_rate,
        server_learning_rate=settings.server_learning_rate, record=bool(settings.record),
        on_round=(lambda _, network: models.append(copy.deepcopy(network.state_dict()))) if settings.record else None)
    initial = copy.deepcopy(federation.model.state_dict())
    strategy.start(grid=grid, initial_arrays=ArrayRecord(federation.model.state_dict()), num_rounds=settings.rounds,
                   timeout=settings.round_timeout)
    if settings.record:
        save_record(settings.record, federation, initial, models)


def _plain_release(release: fl.Release) -> dict:
    config = release.config
    return {"mechanism": config.mechanism.name, "parameters": config.mechanism.parameters(),
            "clip_norm": list(config.clip_norm) if isinstance(config.clip_norm, tuple) else config.clip_norm,
            "per_layer": config.per_layer, "batch_size": release.batch_size, "dataset_size": release.dataset_size,
            "secure_noise": release.secure_noise}


def _release(plain: dict) -> fl.Release:
    config = dpsgd.DPSGDConfig(plain["clip_norm"], dpsgd.mechanism.create(plain["mechanism"], plain["parameters"]),
                               per_layer=plain["per_layer"])
    return fl.Release(config, plain["batch_size"], plain["dataset_size"], plain["secure_noise"])


def save_record(path: Union[str, os.PathLike], federation: fl.Federation, initial: dict, models: list) -> None:
    """Save what the server saw (plain tensors and numbers, readable with ``weights_only``):
    every recorded update, the initial model and the model after each round. Written to a
    temporary file and renamed, so a reader never sees half a record."""
    updates = [{"round": u.round, "client": u.client, "parameters": u.parameters, "update": u.update,
                "local_steps": u.local_steps, "private_batches": u.private_batches,
                "release": None if u.release is None else _plain_release(u.release)} for u in federation.leaked]
    record = {"format": RECORD_FORMAT, "rounds": federation.rounds, "initial": initial, "models": models,
              "updates": updates}
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    torch.save(record, partial)
    os.replace(partial, path)


def load_record(path: Union[str, os.PathLike], network: nn.Module, *,
                on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
                on_round: Optional[Callable[[int, nn.Module], None]] = None) -> fl.Federation:
    """The :class:`privleak.fl.Federation` a ServerApp saved to ``path``, with ``network`` (the
    model's architecture) holding the final weights. ``on_update`` and ``on_round`` are replayed in
    the order :func:`privleak.fl.run` calls them: each round's updates, then the model after it."""
    record = torch.load(path, weights_only=True)
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path} is not a privleak.flower_app record")
    federation = fl.Federation(network)
    network.load_state_dict(record["initial"])
    by_round: dict = {}
    for plain in record["updates"]:
        leaked = fl.LeakedUpdate(plain["round"], plain["client"], plain["parameters"], plain["update"],
                                 plain["local_steps"], plain["private_batches"],
                                 None if plain["release"] is None else _release(plain["release"]))
        federation.leaked.append(leaked)
        by_round.setdefault(leaked.round, []).append(leaked)
    for round_, state in enumerate(record["models"]):
        for leaked in by_round.get(round_, []):
            if on_update is not None:
                on_update(leaked)
        network.load_state_dict(state)
        federation.rounds = round_ + 1
        if on_round is not None:
            on_round(round_, network)
    return federation


def submit(directory: Union[str, os.PathLike], superlink: str, *, insecure: bool = False,
           root_certificates: Optional[str] = None, network: Optional[nn.Module] = None,
           on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
           on_round: Optional[Callable[[int, nn.Module], None]] = None,
           timeout: float = 3600.0) -> fl.Federation:
    """Run the App in ``directory`` on the SuperLink at ``superlink`` (``HOST:PORT``, its Control
    API) with ``flwr run DIRECTORY privleak --stream`` and return the ServerApp's record
    (:func:`load_record`; ``network`` defaults to :func:`model` of the settings). The record file
    must be readable here: the SuperLink runs on this machine or shares the file system.
    ``insecure`` turns TLS off (tests only); ``root_certificates``: the CA file for TLS. Waits at
    most ``timeout`` seconds; the Flower CLI's output is in the error if the run leaves no record."""
    settings = read_settings(directory)
    if not settings.record:
        raise ValueError(f"{directory}: the App's settings name no record file, so the run's record cannot be read")
    if not isinstance(superlink, str) or not superlink.rpartition(":")[2].isdigit():
        raise ValueError(f"superlink must be 'HOST:PORT', got {superlink!r}")
    insecure = validation.boolean(insecure, "insecure")
    timeout = validation.positive(timeout, "timeout")
    record = Path(settings.record)
    record.unlink(missing_ok=True)
    connection = {"address": superlink, "insecure": insecure}
    if root_certificates is not None:
        connection["root-certificates"] = str(root_certificates)
    with tempfile.TemporaryDirectory(prefix="privleak-flwr-") as home:
        Path(home, "config.toml").write_text(tomli_w.dumps({"superlink": {CONNECTION: connection}}), encoding="utf-8")
        command = [*flwr_command(), "run", str(Path(directory).resolve()), CONNECTION, "--stream"]
        env = {**os.environ, "FLWR_HOME": home, "FLWR_TELEMETRY_ENABLED": "0"}
        try:  # --stream returns when the run has ended, after the ServerApp saved its record
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise TimeoutError(f"{' '.join(command)} ran past {timeout} s; output:\n{error.stdout}\n{error.stderr}") \
                from None
    if not record.exists():
        raise RuntimeError(f"the run left no record at {record}: {' '.join(command)} exited with {done.returncode}; "
                           f"output:\n{done.stdout}\n{done.stderr}")
    return load_record(record, model(settings) if network is None else network, on_update=on_update,
                       on_round=on_round)


def flwr_command() -> list:
    """``flwr``, the Flower CLI of this Python environment (the one beside ``sys.executable``, else
    the one on PATH)."""
    beside = Path(sys.executable).parent / "flwr"
    return [str(beside)] if beside.exists() else ["flwr"]
