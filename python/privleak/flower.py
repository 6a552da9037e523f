"""Federated DP-SGD on Flower (``flwr``): :mod:`privleak.fl`'s clients, noise and server as a
ClientApp/ServerApp pair, in Flower's simulation or across machines (its Deployment Runtime).

The split follows the data flow of paper 004's threat model (Sec. II). A client privatises in one
of two ways (``privatize``):

* ``"client"`` (any number of local steps, FedAvg with local DP-SGD): the **ClientApp**'s train
  handler runs :meth:`privleak.fl.Client.local_update` with the noise of every step added inside
  the loop, as :func:`privleak.fl.run` does, and returns the summed update.
* ``"mod"`` (one local step, FedSGD, the paper's setting): the train handler returns the clipped
  average of one batch (the deterministic lines of Alg. 1 and 2), and a **client mod**,
  :class:`NoiseMod`, applies the mechanism's noise to exactly the arrays the reply carries before
  they leave the client (for Alg. 2 a draw of VMF(that direction, kappa); for Alg. 1
  N(0, (sigma c / L)^2)). A mod sees only the outgoing message: it cannot reach a local loop.

Either way the reply carries its **privacy metadata** (``privleak`` ConfigRecord): the mechanism's
name and :meth:`~privleak.dpsgd.DPSGDMechanism.parameters`, the clip norms, per-layer clipping,
local steps, batch size L, the client's data size n, the sampling rate L / n, whether the noise
was secure, and who added it. The **ServerApp** runs :class:`CuriousFedAvg`: every client every
round, FedAvg weighted by data size, the step of :func:`privleak.fl.server_step`. It refuses a
reply whose metadata is missing or contradicts the configuration it expects (nothing of that
round is aggregated), and it is honest but curious: it records every update with its
:class:`privleak.fl.Release` in a :class:`privleak.fl.Federation` and hands each to an
``on_update`` hook, so :func:`privleak.fl.client_privacy` reports each client's epsilon and Bayes
capacity after the run.

With ``seed`` set, a client's batches and noise in a round come from
:func:`privleak.fl.client_streams`, as in :func:`privleak.fl.run`, so the Flower run leaks the same
updates as the in-process loop. A seed the server knows lets it subtract the noise: seeds are for
reproducible experiments; deployments leave ``seed=None`` (fresh operating-system entropy for every
release) or ask for ``secure_noise`` (ChaCha20 keyed from the operating system).

:mod:`privleak.flower_app` is a Flower App built from these pieces, configured by its run config,
for Flower's Deployment Runtime (``flower-superlink``, ``flower-supernode``, ``flwr run``).

Flower is an optional dependency: ``pip install 'privleak[flower]'``.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from privleak import dpsgd, fl, validation
from privleak.dpsgd.config import check_config
from privleak.mechanisms import NoiseGenerator, SecureNoiseGenerator

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
except ImportError as error:
    raise ImportError("privleak.flower needs Flower: pip install 'privleak[flower]'") from error

__all__ = ["NoiseMod", "CuriousFedAvg", "client_app", "server_app", "simulate", "run"]

#: keys of the records in a client's reply (the server's message uses FedAvg's "arrays" and "config")
UPDATE, METRICS, PRIVLEAK = "update", "metrics", "privleak"
#: who adds the noise: the train handler inside its local loop, or a NoiseMod on the reply
PRIVATIZE = ("client", "mod")


def _round_and_client(message: Message, context: Context) -> tuple[int, int]:
    """(round, client index) of a train message: privleak.fl's 0-based round, and the node's
    ``partition-id`` (set by Flower's simulation, or ``flower-supernode --node-config``)."""
    config = message.content.config_records.get("config", {})
    if "server-round" not in config:
        raise ValueError("the message carries no config['server-round']: send it with a Flower strategy such as FedAvg")
    if "partition-id" not in context.node_config:
        raise ValueError("the node has no partition-id: start it with --node-config 'partition-id=K'")
    return int(config["server-round"]) - 1, int(context.node_config["partition-id"])


def _learning_rate(message: Message) -> float:
    config = message.content.config_records.get("config", {})
    if "learning-rate" not in config:
        raise ValueError("the message carries no config['learning-rate'], the local steps' learning rate: "
                         "send it from the ServerApp (CuriousFedAvg does)")
    return validation.real(config["learning-rate"], "config['learning-rate']")


def _streams(seed: Optional[int], round_: int, client: int, secure_noise: bool) -> tuple[torch.Generator, object]:
    """The batch sampler and the noise generator of ``client`` in ``round_``: privleak.fl's streams
    for a seed, fresh ones without; the noise from a SecureNoiseGenerator if ``secure_noise``."""
    if seed is not None:
        generator, noise = fl.client_streams(seed, round_, client)
    else:
        generator, noise = torch.Generator(), NoiseGenerator()
        generator.seed()
    return generator, SecureNoiseGenerator() if secure_noise else noise


def _check_seed(seed) -> Optional[int]:
    return None if seed is None else validation.integer(seed, "seed")


def _check_secure_noise(secure_noise, mechanism: dpsgd.DPSGDMechanism) -> bool:
    secure_noise = validation.boolean(secure_noise, "secure_noise")
    if secure_noise and not mechanism.secure:
        raise ValueError(f"secure_noise: the {mechanism.name} mechanism has no secure mode yet")
    return secure_noise


def _noise_metadata(mechanism: dpsgd.DPSGDMechanism, clipping: dpsgd.Clipping, batch_size: int,
                    secure_noise: bool, privatized_by: str) -> dict:
    """The privacy metadata of the noise: who added it, the mechanism's name and parameters
    (``mechanism.<field>``), the clip norms, per-layer clipping, L, and whether it was secure."""
    return {"privatized-by": privatized_by, "mechanism": mechanism.name,
            **{f"mechanism.{name}": value for name, value in mechanism.parameters().items()},
            "clip-norms": [float(c) for c in clipping.norms], "per-layer": clipping.per_layer,
            "batch-size": batch_size, "secure-noise": secure_noise}


def _data_metadata(local_steps: int, dataset_size: int, batch_size: int) -> dict:
    """The privacy metadata of the sampling: local steps on fixed-size batches of L of n examples."""
    return {"local-steps": local_steps, "dataset-size": dataset_size, "sampling": "fixed",
            "sampling-rate": batch_size / dataset_size}


class NoiseMod:
    """A Flower client mod that privatises the one ArrayRecord of the reply, the clipped average
    of ``batch_size`` samples clipped as ``clipping`` says (all its arrays, as one vector), with
    ``mechanism``'s noise (:meth:`privleak.dpsgd.DPSGDMechanism.noise`: N(0, (sigma c / L)^2) for
    Alg. 1, a VMF draw around the direction for Alg. 2, ...), and adds the noise's privacy metadata
    (``privatized-by = "mod"``) to the reply's ``privleak`` record; replies without arrays pass
    unchanged. ``seed``, ``secure_noise``: see the module docstring."""

    def __init__(self, mechanism: dpsgd.DPSGDMechanism, clipping: dpsgd.Clipping, batch_size: int, *,
                 seed: Optional[int] = None, secure_noise: bool = False):
        if not isinstance(mechanism, dpsgd.DPSGDMechanism):
            raise validation.ArgumentTypeError(f"mechanism must be a privleak.dpsgd mechanism, got "
                                               f"{type(mechanism).__name__}")
        if not isinstance(clipping, dpsgd.Clipping):
            raise validation.ArgumentTypeError(f"clipping must be a privleak.dpsgd.Clipping, got "
                                               f"{type(clipping).__name__}")
        self.mechanism, self.clipping = mechanism, clipping
        self.batch_size = validation.integer(batch_size, "batch_size", low=1)
        self.seed = _check_seed(seed)
        self.secure_noise = _check_secure_noise(secure_noise, mechanism)

    def __call__(self, message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        reply = call_next(message, context)
        if reply.has_error() or not reply.content.array_records:
            return reply
        if len(reply.content.array_records) != 1:
            raise ValueError(f"{type(self).__name__} privatises one ArrayRecord; the reply has "
                             f"{len(reply.content.array_records)}")
        key, record = next(iter(reply.content.array_records.items()))
        round_, client = _round_and_client(message, context)
        state = record.to_torch_state_dict()
        noise = _streams(self.seed, round_, client, self.secure_noise)[1]
        released = self.mechanism.noise(list(state.values()), self.clipping, self.batch_size, noise)
        reply.content[key] = ArrayRecord(dict(zip(state.keys(), released)))
        if PRIVLEAK not in reply.content.config_records:
            reply.content[PRIVLEAK] = ConfigRecord()
        reply.content.config_records[PRIVLEAK].update(
            _noise_metadata(self.mechanism, self.clipping, self.batch_size, self.secure_noise, "mod"))
        return reply


def _trainable(model: nn.Module) -> tuple[list, list]:
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return list(names), list(params)


def _check_batch_size(batch_size) -> int:
    return validation.integer(batch_size, "batch_size", low=1)


def _check_local_steps(local_steps) -> int:
    return validation.integer(local_steps, "local_steps", low=1)


def client_app(model: nn.Module, data_fn: Callable[[int], fl.Client], config: dpsgd.DPSGDConfig, *,
               batch_size: int = 1, local_steps: int = 1, privatize: str = "client", secure_noise: bool = False,
               seed: Optional[int] = None, share_batches: bool = False,
               loss_fn: Callable = F.cross_entropy) -> ClientApp:
    """A ClientApp that takes ``local_steps`` DP-SGD steps per round on its node's data and
    replies with their summed privatised update and its privacy metadata.

    Args:
        model: the architecture (copied; each round's weights come from the server).
        data_fn: ``data_fn(partition_id)`` returns the node's :class:`privleak.fl.Client`. It runs
            every round: cache it if loading is slow. For a simulation, ``shards.__getitem__`` of a
            list of clients works.
        config: the DP-SGD configuration of every local step.
        batch_size: L, examples per step, drawn without replacement as in :mod:`privleak.fl`.
        local_steps: k, DP-SGD steps per round, at the learning rate the server's message gives
            (``config["learning-rate"]``); the reply is their sum, as :func:`privleak.fl.run` sends.
        privatize: ``"client"``: the noise of every step is added inside the local loop
            (:meth:`privleak.fl.Client.local_update`); ``"mod"``: one step (FedSGD), its clipped
            average privatised by a :class:`NoiseMod`.
        secure_noise: draw the noise from a :class:`privleak.mechanisms.SecureNoiseGenerator`
            (mechanisms with a secure mode; ``seed`` then fixes the batches only).
        seed: None (fresh entropy) or the seed of :func:`privleak.fl.client_streams`.
        share_batches: also send the batches' indices (``privleak["batches"]``, k L of them), the
            ground truth a reconstruction is scored against. For experiments only: a real client
            keeps them.
    """
    batch_size = _check_batch_size(batch_size)
    local_steps = _check_local_steps(local_steps)
    privatize = validation.choice(privatize, "privatize", PRIVATIZE)
    names = _trainable(model)[0]
    config = check_config(config, len(names))
    secure_noise = _check_secure_noise(secure_noise, config.mechanism)
    seed = _check_seed(seed)
    share_batches = validation.boolean(share_batches, "share_batches")
    if privatize == "mod" and local_steps != 1:
        raise ValueError(f"privatize='mod' takes local_steps=1 (FedSGD), got local_steps={local_steps}: a mod sees "
                         "only the outgoing message, not the noise of every local step; use privatize='client'")
    if not callable(data_fn):
        raise ValueError("data_fn must be callable: data_fn(partition_id) -> privleak.fl.Client")
    clipping = config.clipping(len(names))
    template = copy.deepcopy(model)
    if privatize == "mod":
        # the handler computes the clipped average every mechanism starts from; the mod adds the noise
        mods = [NoiseMod(config.mechanism, clipping, batch_size, seed=seed, secure_noise=secure_noise)]
        local_config = config.replace(mechanism=dpsgd.ClipOnly(config.mechanism.clip_norm_type))
    else:
        mods, local_config = [], config
    app = ClientApp(mods=mods)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        round_, index = _round_and_client(message, context)
        learning_rate = _learning_rate(message)
        client = data_fn(index)
        if batch_size > len(client):
            raise ValueError(f"batch_size {batch_size} exceeds client {index}'s {len(client)} examples")
        local = copy.deepcopy(template)
        local.load_state_dict(message.content["arrays"].to_torch_state_dict())
        generator, noise = _streams(seed, round_, index, secure_noise and privatize == "client")
        update, batches = client.local_update(local, local_config, batch_size=batch_size, local_steps=local_steps,
                                              learning_rate=learning_rate, generator=generator, noise=noise,
                                              loss_fn=loss_fn)
        metadata = _data_metadata(local_steps, len(client), batch_size)
        if privatize == "client":
            metadata.update(_noise_metadata(config.mechanism, clipping, batch_size, secure_noise, "client"))
        if share_batches:
            metadata["batches"] = torch.cat(batches).tolist()
        content = RecordDict({UPDATE: ArrayRecord(dict(zip(names, update))),
                              METRICS: MetricRecord({"num-examples": len(client), "partition-id": index}),
                              PRIVLEAK: ConfigRecord(metadata)})
        return Message(content, reply_to=message)

    return app


class CuriousFedAvg(FedAvg):
    """FedAvg as :func:`privleak.fl.run`'s server: all ``clients`` nodes every round, no federated
    evaluation, the local learning rate sent in each train message (``config["learning-rate"]``),
    the step of :func:`privleak.fl.server_step` on the clients' updates (weighted by their
    ``num-examples``), and every update kept in ``federation`` (if ``record``) and passed to
    ``on_update`` as a :class:`privleak.fl.LeakedUpdate` with its :class:`privleak.fl.Release`
    (``private_batches`` is None unless the clients share them). ``on_round(round, model)`` runs
    after each step.

    Each reply's privacy metadata must say what the server expects: ``config``'s mechanism (name
    and parameters) and clipping, ``batch_size``, ``local_steps``, ``secure_noise``, a data size
    equal to the reply's ``num-examples`` and the sampling rate L / n, privatised by the client or
    (one local step) by its NoiseMod. A reply without it or contradicting it, a failed client or
    duplicate partition ids raise before anything of the round is recorded or aggregated."""

    def __init__(self, federation: fl.Federation, clients: int, config: dpsgd.DPSGDConfig, *, batch_size: int = 1,
                 local_steps: int = 1, secure_noise: bool = False, learning_rate: float = 0.1,
                 server_learning_rate: float = 1.0, record: bool = True,
                 on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
                 on_round: Optional[Callable[[int, nn.Module], None]] = None):
        if not isinstance(federation, fl.Federation):
            raise ValueError(f"federation must be a privleak.fl.Federation, got {type(federation).__name__}")
        clients = validation.integer(clients, "clients", low=1)
        self.config = check_config(config, len(_trainable(federation.model)[0]))
        self.batch_size, self.local_steps = _check_batch_size(batch_size), _check_local_steps(local_steps)
        self.secure_noise = _check_secure_noise(secure_noise, self.config.mechanism)
        learning_rate = validation.real(learning_rate, "learning_rate")
        server_learning_rate = validation.real(server_learning_rate, "server_learning_rate")
        super().__init__(fraction_train=1.0, min_train_nodes=clients, min_available_nodes=clients)
        self.federation = federation
        self.learning_rate, self.server_learning_rate = learning_rate, server_learning_rate
        self.record, self.on_update, self.on_round = record, on_update, on_round

    def _check_metadata(self, where: str, metadata, num_examples: int, num_tensors: int) -> None:
        if metadata.get("privatized-by") not in PRIVATIZE:
            raise ValueError(f"{where}: the update was not privatised by privleak (its privacy metadata's "
                             f"'privatized-by' is {metadata.get('privatized-by')!r}, not one of {PRIVATIZE}); refused, "
                             "nothing of the round aggregated")
        if metadata["privatized-by"] == "mod" and metadata.get("local-steps") != 1:
            raise ValueError(f"{where}: a NoiseMod privatised {metadata.get('local-steps')!r} local steps; a mod "
                             "reaches one (FedSGD); refused, nothing of the round aggregated")
        expected = {**_noise_metadata(self.config.mechanism, self.config.clipping(num_tensors), self.batch_size,
                                      self.secure_noise, metadata["privatized-by"]),
                    **_data_metadata(self.local_steps, num_examples, self.batch_size)}
        names = set(expected) | {key for key in metadata if key.startswith("mechanism.")}
        wrong = [f"{key} = {metadata[key]!r} (expected {expected.get(key)!r})" if key in metadata
                 else f"{key} missing (expected {expected[key]!r})" for key in sorted(names)
                 if key not in metadata or key not in expected or metadata[key] != expected[key]]
        if wrong:
            raise ValueError(f"{where}: the reply's privacy metadata contradicts the server's configuration: "
                             f"{'; '.join(wrong)}; refused, nothing of the round aggregated")

    def _leaked(self, round_: int, content: RecordDict, names: list, start: list) -> tuple[fl.LeakedUpdate, int]:
        metrics = content.metric_records.get(METRICS, {})
        if "num-examples" not in metrics or "partition-id" not in metrics:
            raise ValueError(f"round {round_ + 1}: a client's reply must carry {METRICS!r} with num-examples and "
                             "partition-id")
        client, num_examples = int(metrics["partition-id"]), int(metrics["num-examples"])
        where = f"round {round_ + 1}, client {client}"
        update = content.array_records.get(UPDATE)
        if update is None or list(update.keys()) != names:
            raise ValueError(f"{where}: the reply must carry {UPDATE!r} with the model's trainable parameters {names}")
        metadata = content.config_records.get(PRIVLEAK, {})
        self._check_metadata(where, metadata, num_examples, len(names))
        batches = None
        if "batches" in metadata:
            batches = list(torch.tensor(metadata["batches"], dtype=torch.int64).reshape(self.local_steps, -1))
        release = fl.Release(self.config, self.batch_size, num_examples, self.secure_noise)
        tensors = list(update.to_torch_state_dict().values())
        return fl.LeakedUpdate(round_, client, start, tensors, self.local_steps, batches, release), num_examples

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list:
        """FedAvg's train messages, with the local steps' learning rate in ``config["learning-rate"]``."""
        config["learning-rate"] = self.learning_rate
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list:
        """No federated evaluation (the ClientApp has no evaluate handler)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies) -> None:
        """No federated evaluation."""
        return None

    def aggregate_train(self, server_round: int, replies):
        """Check and record the round's updates (in client order) and take the server step;
        returns the new model's arrays (and no metrics)."""
        replies = list(replies)
        failed = [reply.error.reason for reply in replies if reply.has_error()]
        if failed:
            raise RuntimeError(f"round {server_round}: {len(failed)} client(s) failed: {failed}")
        model = self.federation.model
        names, params = _trainable(model)
        start = [p.detach().clone() for p in params]
        received = sorted((self._leaked(server_round - 1, reply.content, names, start) for reply in replies),
                          key=lambda pair: pair[0].client)
        indices = [leaked.client for leaked, _ in received]
        if len(set(indices)) != len(indices):
            raise ValueError(f"round {server_round}: nodes report duplicate partition ids {indices}")
        for leaked, _ in received:
            if self.record:
                self.federation.leaked.append(leaked)
            if self.on_update is not None:
                self.on_update(leaked)
        fl.server_step(model, [leaked.update for leaked, _ in received], [size for _, size in received],
                       learning_rate=self.learning_rate, server_learning_rate=self.server_learning_rate)
        self.federation.rounds = server_round
        if self.on_round is not None:
            self.on_round(server_round - 1, model)
        return ArrayRecord(model.state_dict()), None


def server_app(federation: fl.Federation, config: dpsgd.DPSGDConfig, *, clients: int, rounds: int,
               batch_size: int = 1, local_steps: int = 1, secure_noise: bool = False, learning_rate: float = 0.1,
               server_learning_rate: float = 1.0, record: bool = True,
               on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
               on_round: Optional[Callable[[int, nn.Module], None]] = None,
               round_timeout: float = 3600.0) -> ServerApp:
    """A ServerApp that trains ``federation.model`` in place for ``rounds`` rounds of
    :class:`CuriousFedAvg` on ``clients`` nodes, expecting updates privatised as ``config``,
    ``batch_size``, ``local_steps`` and ``secure_noise`` say, and fills ``federation`` with what it
    sees. ``round_timeout``: seconds a round waits for the clients' replies."""
    rounds = validation.integer(rounds, "rounds", low=1)
    round_timeout = validation.positive(round_timeout, "round_timeout")
    strategy = CuriousFedAvg(federation, clients, config, batch_size=batch_size, local_steps=local_steps,
                             secure_noise=secure_noise, learning_rate=learning_rate,
                             server_learning_rate=server_learning_rate, record=record, on_update=on_update,
                             on_round=on_round)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(federation.model.state_dict()), num_rounds=rounds,
                       timeout=round_timeout)

    return app


def simulate(model: nn.Module, data_fn: Callable[[int], fl.Client], config: dpsgd.DPSGDConfig, *, clients: int,
             rounds: int, batch_size: int = 1, local_steps: int = 1, learning_rate: float = 0.1,
             server_learning_rate: float = 1.0, privatize: str = "client", secure_noise: bool = False,
             seed: Optional[int] = None, share_batches: bool = False, record: bool = True,
             on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
             on_round: Optional[Callable[[int, nn.Module], None]] = None, loss_fn: Callable = F.cross_entropy,
             backend_config: Optional[dict] = None) -> fl.Federation:
    """:func:`privleak.fl.run` on Flower's simulation runtime (Ray): :func:`client_app` on
    ``clients`` virtual SuperNodes (partition ids 0 .. clients - 1) and :func:`server_app` in this
    process. Trains ``model`` in place and returns the server's :class:`privleak.fl.Federation`.
    ``backend_config`` goes to ``flwr.simulation.run_simulation``; by default each client gets one CPU."""
    from flwr.simulation import run_simulation

    federation = fl.Federation(model)
    server = server_app(federation, config, clients=clients, rounds=rounds, batch_size=batch_size,
                        local_steps=local_steps, secure_noise=secure_noise, learning_rate=learning_rate,
                        server_learning_rate=server_learning_rate, record=record, on_update=on_update,
                        on_round=on_round)
    client = client_app(model, data_fn, config, batch_size=batch_size, local_steps=local_steps, privatize=privatize,
                        secure_noise=secure_noise, seed=seed, share_batches=share_batches, loss_fn=loss_fn)
    run_simulation(server_app=server, client_app=client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1}} if backend_config is None else backend_config)
    return federation


def run(model: nn.Module, clients: Sequence[fl.Client], config: dpsgd.DPSGDConfig, *, rounds: int,
        batch_size: int = 1, local_steps: int = 1, learning_rate: float = 0.1, server_learning_rate: float = 1.0,
        seed: int = 0, record: bool = True, loss_fn: Callable = F.cross_entropy,
        on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
        on_round: Optional[Callable[[int, nn.Module], None]] = None, privatize: str = "client",
        secure_noise: bool = False, backend_config: Optional[dict] = None) -> fl.Federation:
    """:func:`privleak.fl.run` with its clients on Flower's simulation (:func:`simulate`): the same
    arguments and the same :class:`privleak.fl.Federation`, its updates' ``private_batches``
    included (the clients share them). With ``privatize="client"`` it leaks exactly the updates
    ``fl.run`` leaks for the same ``seed``, and ends at the same model, bit for bit. ``privatize``,
    ``secure_noise``, ``backend_config``: see :func:`client_app` and :func:`simulate`."""
    clients = list(clients)
    if not clients:
        raise ValueError("clients must not be empty")
    if not all(isinstance(client, fl.Client) for client in clients):
        raise validation.ArgumentTypeError("clients must be privleak.fl.Client objects")
    batch_size = _check_batch_size(batch_size)
    for client in clients:
        if batch_size > len(client):
            raise ValueError(f"batch_size {batch_size} exceeds a client's {len(client)} examples")
    return simulate(model, clients.__getitem__, config, clients=len(clients), rounds=rounds, batch_size=batch_size,
                    local_steps=local_steps, learning_rate=learning_rate, server_learning_rate=server_learning_rate,
                    privatize=privatize, secure_noise=secure_noise, seed=validation.integer(seed, "seed"),
                    share_batches=True, record=record, on_update=on_update, on_round=on_round, loss_fn=loss_fn,
                    backend_config=backend_config)
