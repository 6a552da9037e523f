"""Federated learning with DP-SGD clients and an honest-but-curious server (paper 004, Sec. II).

K clients hold private data. Every round each client starts from the global model, takes
``local_steps`` DP-SGD steps on batches of its own data (Alg. 1 with Gaussian noise or Alg. 2
with VMF noise, :mod:`privleak.dpsgd`), and sends what it leaks: the sum of its privatised
updates, which after one local step is exactly the noisy gradient g~_t of the algorithms. The
server averages the clients' updates (weighted by their data sizes, FedAvg) and takes a step. It is
honest (it runs the protocol) but curious: it keeps every update it receives, with the model it
was computed at and the :class:`Release` that says how it was privatised, and hands each one to
the attack and metric hooks; :func:`client_privacy` turns the releases into each client's epsilon
and Bayes capacity.

This loop runs in one process; :mod:`privleak.flower` runs the same clients and noise on Flower.
"""
from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from privleak import dpsgd, validation
from privleak.mechanisms import NoiseGenerator


class Release(NamedTuple):
    """How a client privatised what it sent: the facts the accountant and the Bayes capacity of
    its updates need (:func:`client_privacy`)."""

    config: dpsgd.DPSGDConfig  #: clipping and mechanism of every local step
    batch_size: int  #: L, examples per local step, drawn without replacement (fixed-size batches)
    dataset_size: int  #: n, the client's examples: the sampling rate is q = L / n
    secure_noise: bool = False  #: noise from a SecureNoiseGenerator (else seeded Philox)

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.dataset_size


class LeakedUpdate(NamedTuple):
    """One client's message to the server in one round, and what the evaluation knows of it."""

    round: int
    client: int
    parameters: list  #: the global model the client started from, one tensor per trainable parameter
    update: list  #: what the client sent: the sum of its privatised updates, shaped like the parameters
    local_steps: int
    #: indices into the client's data of the examples in each local batch. The server does not see
    #: them; they are the ground truth that reconstruction scores compare against.
    private_batches: list
    #: how the client privatised it, as the server knows it (None: unknown)
    release: Optional[Release] = None


@dataclass
class Client:
    """A client's private data, and its local DP-SGD."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self):
        if self.images.shape[0] != self.labels.shape[0] or self.images.shape[0] == 0:
            raise ValueError(f"a client needs as many labels as images, at least one; got "
                             f"{self.images.shape[0]} images and {self.labels.shape[0]} labels")

    def __len__(self) -> int:
        return self.images.shape[0]

    def local_update(self, model: nn.Module, config: dpsgd.DPSGDConfig, *, batch_size: int, local_steps: int,
                     learning_rate: float, generator: torch.Generator,
                     noise: NoiseGenerator, loss_fn: Callable = F.cross_entropy,
                     extra_gradients: Optional[Callable[[int, nn.Module], Optional[list]]] = None
                     ) -> tuple[list, list]:
        """Run ``local_steps`` DP-SGD steps on ``model`` (in place); return the summed privatised
        update and the batches' indices. Batches are ``batch_size`` examples drawn without
        replacement, line 4 of Alg. 1 and 2.

        ``extra_gradients(step, model)``, if given, returns None or extra per-sample gradient rows
        for local step ``step`` (one (k, *p.shape) tensor per trainable parameter), appended after
        the batch's and clipped, summed and noised with them: e.g. an auditor's gradient canaries
        (:func:`privleak.audit.audit_fl`). The divisor stays ``batch_size``."""
        params = [p for p in model.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        batches = []
        for _ in range(local_steps):
            batch = dpsgd.sample_batch(len(self), batch_size, "fixed", generator)
            batches.append(batch)
            grads = dpsgd.per_sample_gradients(model, loss_fn, self.images[batch], self.labels[batch])
            extra = None if extra_gradients is None else extra_gradients(len(batches) - 1, model)
            if extra is not None:
                grads = [torch.cat([g.detach(), e.to(device=g.device, dtype=g.dtype)]) for g, e in zip(grads, extra)]
            update = dpsgd.privatize(grads, config, batch_size, noise)
            with torch.no_grad():
                for p, u, t in zip(params, update, total):
                    u = u.to(p.dtype).reshape(p.shape)
                    p.sub_(learning_rate * u)
                    t.add_(u)
        return total, batches


@dataclass
class Federation:
    """The server's view of a run: the model, and every update it has seen."""

    model: nn.Module
    leaked: list = field(default_factory=list)
    rounds: int = 0

    def updates_of_round(self, round_: int) -> list:
        return [u for u in self.leaked if u.round == round_]


class ClientPrivacy(NamedTuple):
    """One client's privacy over a run (:func:`client_privacy`)."""

    client: int
    rounds: int  #: rounds whose update the server recorded
    #: epsilon(delta) of all the client's local DP-SGD steps; the Bayes capacity of one step's update
    report: dpsgd.PrivacyReport
    #: log2 of a bound on the Bayes capacity of one round's release, the sum of its k privatised
    #: local updates: k x report.capacity_bits, with equality for k = 1 (FedSGD)
    release_capacity_bits: float


def client_privacy(federation: Federation, delta: float) -> dict:
    """Per client, what its recorded updates cost in privacy: ``{client: ClientPrivacy}``.

    The accountant composes all of the client's local steps, T = the sum of its updates' local
    steps, each a DP-SGD step on a fixed-size batch of L of its n examples, sampling rate q = L / n
    (:func:`privleak.dpsgd.privacy_report` with ``sampling="fixed"``). The Bayes capacity
    ML(C) = sum_y max_x C(x, y) is that of one step's channel from the clipped average to the
    update (the mechanism's ``log_capacity``, Biswas et al.). One round's release is a function of
    k steps whose channels each take an input in the same set whatever the earlier outputs were,
    and sum_{y1, y2} max_x A(x, y1) B_y1(x, y2) <= ML(A) sup_y1 ML(B_y1); with the
    data-processing inequality, the release's capacity is at most k times one step's in bits
    (privleak's bound; the papers treat one step). Needs every update's :class:`Release` (the
    server's record of the client's privacy metadata), the same for all of a client's updates.
    """
    delta = validation.probability(delta, "delta", open_high=True)
    by_client: dict = {}
    for leaked in federation.leaked:
        by_client.setdefault(leaked.client, []).append(leaked)
    privacy = {}
    for client, updates in sorted(by_client.items()):
        releases = {leaked.release for leaked in updates}
        if None in releases:
            raise ValueError(f"client {client}: an update carries no release metadata (LeakedUpdate.release), "
                             "so its privacy is unknown")
        if len(releases) > 1:
            raise ValueError(f"client {client} released updates under {len(releases)} configurations: "
                             f"{sorted(map(repr, releases))}; client_privacy composes one")
        release = releases.pop()
        report = dpsgd.privacy_report(release.config, [tuple(p.shape) for p in updates[0].parameters],
                                      expected_batch_size=release.batch_size, dataset_size=release.dataset_size,
                                      steps=sum(leaked.local_steps for leaked in updates), delta=delta,
                                      sampling="fixed")
        steps = max(leaked.local_steps for leaked in updates)
        privacy[client] = ClientPrivacy(client, len(updates), report, steps * report.capacity_bits)
    return privacy


def split_among_clients(images: torch.Tensor, labels: torch.Tensor, clients: int, per_client: int,
                        generator: Optional[torch.Generator] = None) -> list:
    """Disjoint random shards of ``per_client`` examples for each of ``clients`` clients."""
    if clients < 1 or per_client < 1 or clients * per_client > images.shape[0]:
        raise ValueError(f"cannot give {clients} clients {per_client} examples each out of {images.shape[0]}")
    order = torch.randperm(images.shape[0], generator=generator)[: clients * per_client].reshape(clients, per_client)
    return [Client(images[rows], labels[rows]) for rows in order]


def client_streams(seed: int, round_: int, client: int) -> tuple[torch.Generator, NoiseGenerator]:
    """The batch sampler (torch) and the noise stream (Philox) of ``client`` in round ``round_`` of a
    run seeded with ``seed``: a pure function of the three, so a client draws the same batches and
    noise whatever the other clients do, in this process or on another machine (:mod:`privleak.flower`)."""
    digest = hashlib.blake2b(f"privleak.fl/{seed}/{round_}/{client}".encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little")
    return torch.Generator().manual_seed(key), NoiseGenerator(key)


def server_step(model: nn.Module, updates: Sequence[list], sizes: Sequence[int], *, learning_rate: float,
                server_learning_rate: float = 1.0) -> None:
    """FedAvg's step on the clients' updates, in place: theta <- theta - eta_s lr sum_k (n_k / n) u_k,
    for client k's update u_k (one tensor per trainable parameter) and data size n_k."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.tensor(sizes, dtype=torch.float64)
    weights = (weights / weights.sum()).tolist()
    aggregate = [torch.zeros_like(p) for p in params]
    for weight, update in zip(weights, updates):
        for a, u in zip(aggregate, update):
            a.add_(weight * u)
    with torch.no_grad():
        for p, a in zip(params, aggregate):
            p.sub_(server_learning_rate * learning_rate * a)


def run(model: nn.Module, clients: Sequence[Client], config: dpsgd.DPSGDConfig, *, rounds: int,
        batch_size: int = 1, local_steps: int = 1, learning_rate: float = 0.1, server_learning_rate: float = 1.0,
        seed: int = 0, record: bool = True, loss_fn: Callable = F.cross_entropy,
        on_update: Optional[Callable[[LeakedUpdate], None]] = None,
        on_round: Optional[Callable[[int, nn.Module], None]] = None,
        extra_gradients: Optional[Callable[[int, int, int, nn.Module], Optional[list]]] = None) -> Federation:
    """Train ``model`` in place with federated DP-SGD for ``rounds`` rounds.

    Each round every client copies the global model, runs :meth:`Client.local_update` and sends
    its update u_k; the server steps theta <- theta - eta_s lr sum_k (n_k / n) u_k (:func:`server_step`),
    which for one local step and eta_s = 1 is FedSGD on the clients' noisy gradients. ``on_update`` sees
    every :class:`LeakedUpdate` as it arrives; ``on_round(round, model)`` runs after each aggregation.
    ``seed`` fixes each client's batches and noise in each round (:func:`client_streams`).
    ``extra_gradients(round, client, step, model)``, if given, may add per-sample gradient rows to
    a client's local step (the ``extra_gradients`` of :meth:`Client.local_update`; None adds none).
    """
    if not clients:
        raise ValueError("clients must not be empty")
    for name, value in (("rounds", rounds), ("batch_size", batch_size), ("local_steps", local_steps)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for client in clients:
        if batch_size > len(client):
            raise ValueError(f"batch_size {batch_size} exceeds a client's {len(client)} examples")
    federation = Federation(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for round_ in range(rounds):
        start = [p.detach().clone() for p in params]
        updates = []
        for index, client in enumerate(clients):
            local = copy.deepcopy(model)
            generator, noise = client_streams(seed, round_, index)
            update, batches = client.local_update(local, config, batch_size=batch_size, local_steps=local_steps,
                                                  learning_rate=learning_rate, generator=generator, noise=noise,
                                                  loss_fn=loss_fn, extra_gradients=None if extra_gradients is None
                                                  else functools.partial(extra_gradients, round_, index))
            leaked = LeakedUpdate(round_, index, start, update, local_steps, batches,
                                  Release(config, batch_size, len(client)))
            if record:
                federation.leaked.append(leaked)
            if on_update is not None:
                on_update(leaked)
            updates.append(update)
        server_step(model, updates, [len(c) for c in clients], learning_rate=learning_rate,
                    server_learning_rate=server_learning_rate)
        federation.rounds = round_ + 1
        if on_round is not None:
            on_round(round_, model)
    return federation
