"""Federated DP-SGD on Flower (``flwr``): :mod:`privleak.fl`'s clients, noise and server as a
ClientApp/ServerApp pair, for runs across machines.

The split follows the data flow of paper 004's threat model (Sec. II) with one local step (FedSGD):

* The **ClientApp**'s train handler runs :meth:`privleak.fl.Client.local_update` for one step
  without noise: it draws a batch, computes per-sample gradients and returns their clipped average,
  the deterministic lines of Alg. 1 and 2.
* A **client mod** privatises exactly the arrays the reply carries before they leave the client:
  :class:`NoiseMod` applies the configured mechanism's noise (for Alg. 2, a draw of VMF(that
  direction, kappa), :func:`privleak.dpsgd.vmf_release`; for Alg. 1, N(0, (sigma c / L)^2)). The
  mod marks the reply, and the server refuses unmarked ones.
* The **ServerApp** runs :class:`CuriousFedAvg`: every client every round, FedAvg weighted by data
  size, the step of :func:`privleak.fl.server_step`, and it is honest but curious: it records every
  update it receives in a :class:`privleak.fl.Federation` and hands each to an ``on_update`` hook.

Only one local step fits this split: with several, DP-SGD adds noise inside the local loop, which
a mod (it sees only the outgoing message) cannot reach. With ``seed`` set, a client's batches and
noise in a round come from :func:`privleak.fl.client_streams`, as in :func:`privleak.fl.run`, so
the Flower run leaks the same updates as the in-process loop. A seed the server knows lets it
subtract the noise: seeds are for reproducible experiments; deployments leave ``seed=None`` (fresh
operating-system entropy for every release).

Flower is an optional dependency: ``pip install 'privleak[flower]'``.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from privleak import dpsgd, fl, validation
from privleak.dpsgd.config import check_config
from privleak.mechanisms import NoiseGenerator

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
except ImportError as error:
    raise ImportError("privleak.flower needs Flower: pip install 'privleak[flower]'") from error

__all__ = ["NoiseMod", "CuriousFedAvg", "client_app", "server_app", "simulate"]

#: keys of the records in a client's reply (the server's message uses FedAvg's "arrays" and "config")
UPDATE, METRICS, PRIVLEAK = "update", "metrics", "privleak"


def _round_and_client(message: Message, context: Context) -> tuple[int, int]:
    """(round, client index) of a train message: privleak.fl's 0-based round, and the node's
    ``partition-id`` (set by Flower's simulation, or ``flower-supernode --node-config``)."""
    config = message.content.config_records.get("config", {})
    if "server-round" not in config:
        raise ValueError("the message carries no config['server-round']: send it with a Flower strategy such as FedAvg")
    if "partition-id" not in context.node_config:
        raise ValueError("the node has no partition-id: start it with --node-config 'partition-id=K'")
    return int(config["server-round"]) - 1, int(context.node_config["partition-id"])


def _streams(seed: Optional[int], round_: int, client: int) -> tuple[torch.Generator, NoiseGenerator]:
    if seed is not None:
        return fl.client_streams(seed, round_, client)
    generator = torch.Generator()
    generator.seed()
    return generator, NoiseGenerator()


def _check_seed(seed) -> Optional[int]:
    return None if seed is None else validation.integer(seed, "seed")


class NoiseMod:
    """A Flower client mod that privatises the one ArrayRecord of the reply, the clipped average
    of ``batch_size`` samples clipped as ``clipping`` says (all its arrays, as one vector), with
    ``mechanism``'s noise (:meth:`privleak.dpsgd.DPSGDMechanism.noise`: N(0, (sigma c / L)^2) for
    Alg. 1, a VMF draw around the direction for Alg. 2, ...), and marks the reply with
    ``privleak["noise"]`` = the mechanism's name; replies without arrays pass unchanged.
    ``seed``: see the module docstring."""

    def __init__(self, mechanism: dpsgd.DPSGDMechanism, clipping: dpsgd.Clipping, batch_size: int, *,
                 seed: Optional[int] = None):
        if not isinstance(mechanism, dpsgd.DPSGDMechanism):
            raise validation.ArgumentTypeError(f"mechanism must be a privleak.dpsgd mechanism, got "
                                               f"{type(mechanism).__name__}")
        if not isinstance(clipping, dpsgd.Clipping):
            raise validation.ArgumentTypeError(f"clipping must be a privleak.dpsgd.Clipping, got "
                                               f"{type(clipping).__name__}")
        self.mechanism, self.clipping = mechanism, clipping
        self.batch_size = validation.integer(batch_size, "batch_size", low=1)
        self.seed = _check_seed(seed)

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
        noise = _streams(self.seed, round_, client)[1]
        released = self.mechanism.noise(list(state.values()), self.clipping, self.batch_size, noise)
        reply.content[key] = ArrayRecord(dict(zip(state.keys(), released)))
        if PRIVLEAK not in reply.content.config_records:
            reply.content[PRIVLEAK] = ConfigRecord()
        reply.content.config_records[PRIVLEAK]["noise"] = self.mechanism.name
        return reply


def _trainable(model: nn.Module) -> tuple[list, list]:
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return list(names), list(params)


def _check_batch_size(batch_size) -> int:
    return validation.integer(batch_size, "batch_size", low=1)


def client_app(model: nn.Module, data_fn: Callable[[int], fl.Client], config: dpsgd.DPSGDConfig, *,
               batch_size: int = 1, seed: Optional[int] = None, share_batches: bool = False,
               loss_fn: Callable = F.cross_entropy) -> ClientApp:
    """A ClientApp that takes one DP-SGD step per round on its node's data, noise by a client mod.

    Args:
        model: the architecture (copied; each round's weights come from the server).
        data_fn: ``data_fn(partition_id)`` returns the node's :class:`privleak.fl.Client`. It runs
            every round: cache it if loading is slow. For a simulation, ``shards.__getitem__`` of a
            list of clients works.
        config: the DP-SGD configuration; its mechanism's noise is added by a :class:`NoiseMod`.
        batch_size: L, examples per step, drawn without replacement as in :mod:`privleak.fl`.
        seed: None (fresh entropy) or the seed of :func:`privleak.fl.client_streams`.
        share_batches: also send the batch's indices (``privleak["batches"]``), the ground truth a
            reconstruction is scored against. For experiments only: a real client keeps them.
    """
    _check_batch_size(batch_size)
    config = check_config(config, len(_trainable(model)[0]))
    mod = NoiseMod(config.mechanism, config.clipping(len(_trainable(model)[0])), batch_size, seed=seed)
    if not callable(data_fn):
        raise ValueError("data_fn must be callable: data_fn(partition_id) -> privleak.fl.Client")
    template = copy.deepcopy(model)
    # the clipped average every mechanism starts from; the mod adds the noise
    clipped_average = config.replace(mechanism=dpsgd.mechanism.ClipOnly(config.mechanism.clip_norm_type))
    app = ClientApp(mods=[mod])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        round_, index = _round_and_client(message, context)
        client = data_fn(index)
        if batch_size > len(client):
            raise ValueError(f"batch_size {batch_size} exceeds client {index}'s {len(client)} examples")
        local = copy.deepcopy(template)
        local.load_state_dict(message.content["arrays"].to_torch_state_dict())
        generator, noise = _streams(seed, round_, index)
        # draws no noise (noise_multiplier 0); learning_rate 0: the local model is dropped after the step
        average, batches = client.local_update(local, clipped_average, batch_size=batch_size, local_steps=1,
                                               learning_rate=0.0, generator=generator, noise=noise, loss_fn=loss_fn)
        content = RecordDict({UPDATE: ArrayRecord(dict(zip(_trainable(local)[0], average))),
                              METRICS: MetricRecord({"num-examples": len(client), "partition-id": index})})
        if share_batches:
            content[PRIVLEAK] = ConfigRecord({"batches": batches[0].tolist()})
        return Message(content, reply_to=message)

    return app


class CuriousFedAvg(FedAvg):
    """FedAvg as :func:`privleak.fl.run`'s server: all ``clients`` nodes every round, no federated
    evaluation, the step of :func:`privleak.fl.server_step` on the clients' updates (weighted by
    their ``num-examples``), and every update kept in ``federation`` (if ``record``) and passed to
    ``on_update`` as a :class:`privleak.fl.LeakedUpdate` (``private_batches`` is None unless the
    clients share them). ``on_round(round, model)`` runs after each step. A failed client, or an
    update that no privleak noise mod privatised, raises."""

    def __init__(self, federation: fl.Federation, clients: int, *, learning_rate: float = 0.1,
                 server_learning_rate: float = 1.0, record: bool = True,
                 on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
                 on_round: Optional[Callable[[int, nn.Module], None]] = None):
        if not isinstance(federation, fl.Federation):
            raise ValueError(f"federation must be a privleak.fl.Federation, got {type(federation).__name__}")
        clients = validation.integer(clients, "clients", low=1)
        learning_rate = validation.real(learning_rate, "learning_rate")
        server_learning_rate = validation.real(server_learning_rate, "server_learning_rate")
        super().__init__(fraction_train=1.0, min_train_nodes=clients, min_available_nodes=clients)
        self.federation = federation
        self.learning_rate, self.server_learning_rate = learning_rate, server_learning_rate
        self.record, self.on_update, self.on_round = record, on_update, on_round

    def _leaked(self, round_: int, content: RecordDict, names: list, start: list) -> tuple[fl.LeakedUpdate, int]:
        privleak = content.config_records.get(PRIVLEAK, {})
        if "noise" not in privleak:
            raise ValueError("a client's update was not privatised: its ClientApp needs a privleak NoiseMod")
        update = content.array_records.get(UPDATE)
        if update is None or list(update.keys()) != names:
            raise ValueError(f"a client's reply must carry {UPDATE!r} with the model's trainable parameters {names}")
        metrics = content.metric_records.get(METRICS, {})
        if "num-examples" not in metrics or "partition-id" not in metrics:
            raise ValueError(f"a client's reply must carry {METRICS!r} with num-examples and partition-id")
        batches = [torch.tensor(privleak["batches"], dtype=torch.int64)] if "batches" in privleak else None
        tensors = list(update.to_torch_state_dict().values())
        leaked = fl.LeakedUpdate(round_, int(metrics["partition-id"]), start, tensors, 1, batches)
        return leaked, int(metrics["num-examples"])

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list:
        """No federated evaluation (the ClientApp has no evaluate handler)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies) -> None:
        """No federated evaluation."""
        return None

    def aggregate_train(self, server_round: int, replies):
        """Record the round's updates (in client order) and take the server step; returns the new
        model's arrays (and no metrics)."""
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


def server_app(federation: fl.Federation, *, clients: int, rounds: int, learning_rate: float = 0.1,
               server_learning_rate: float = 1.0, record: bool = True,
               on_update: Optional[Callable[[fl.LeakedUpdate], None]] = None,
               on_round: Optional[Callable[[int, nn.Module], None]] = None) -> ServerApp:
    """A ServerApp that trains ``federation.model`` in place for ``rounds`` rounds of
    :class:`CuriousFedAvg` on ``clients`` nodes and fills ``federation`` with what it sees."""
    rounds = validation.integer(rounds, "rounds", low=1)
    strategy = CuriousFedAvg(federation, clients, learning_rate=learning_rate,
                             server_learning_rate=server_learning_rate, record=record, on_update=on_update,
                             on_round=on_round)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(federation.model.state_dict()), num_rounds=rounds)

    return app


def simulate(model: nn.Module, data_fn: Callable[[int], fl.Client], config: dpsgd.DPSGDConfig, *, clients: int,
             rounds: int, batch_size: int = 1, learning_rate: float = 0.1, server_learning_rate: float = 1.0,
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
    server = server_app(federation, clients=clients, rounds=rounds, learning_rate=learning_rate,
                        server_learning_rate=server_learning_rate, record=record, on_update=on_update,
                        on_round=on_round)
    client = client_app(model, data_fn, config, batch_size=batch_size, seed=seed, share_batches=share_batches,
                        loss_fn=loss_fn)
    run_simulation(server_app=server, client_app=client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1}} if backend_config is None else backend_config)
    return federation
