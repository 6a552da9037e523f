"""One-run auditing of one client of the in-process federated loop (:mod:`privleak.fl`) with
white-box gradient canaries.

The audited client's local DP-SGD steps get the canaries' gradient rows next to its batch's
per-sample gradients (the ``extra_gradients`` hook of :func:`privleak.fl.run`): m canaries, each
included with probability 1/2, a Dirac gradient (norm c on one of the m coordinates that the
client's clipped per-sample gradients touch least at the start, chosen before the membership is
drawn) or a random direction times c, as in :func:`privleak.audit.one_run.audit_dpsgd`. The
server records every update it receives (:class:`privleak.fl.Federation`), and the score of
canary i is sum over rounds of <u_r, d_i>, the audited client's update of round r as the server
saw it, projected on the canary's direction d_i: what an honest-but-curious server that knows the
canaries can compute. The bound is :func:`privleak.audit.one_run.audit_one_run`'s.

The audited client's local steps must be full-batch (``batch_size`` = its number of examples):
then every included canary is in every local batch, the client's run is rounds x local_steps
full-batch DP-SGD steps on its data plus the included canaries, and the accountant's epsilon for
that run (:func:`privleak.dpsgd.privacy_report`, sampling rate 1; the canaries' inclusion is
add/remove, and at rate 1 both of :func:`privleak.dpsgd.sample_batch`'s samplings take every
example) is exactly the claim the audit tests. Subsampled local batches would need the canaries
drawn into the client's fixed-size batches, which the loop's sampler does not do.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from privleak import validation
from privleak.audit.one_run import (
    OneRunAudit,
    _check_canary_run,
    _check_run,
    _data_mass,
    _white_box_canaries,
    audit_one_run,
)


def audit_fl(model, clients: Sequence, config, *, rounds: int, client: int = 0, canaries: int = 1000,
             local_steps: int = 1, learning_rate: float = 0.1, server_learning_rate: float = 1.0,
             loss_fn: Optional[Callable] = None, delta: float = 1e-5, confidence: float = 0.95, guesses=None,
             canary: str = "dirac", seed: int = 0) -> OneRunAudit:
    """One-run audit of client ``client`` of :func:`privleak.fl.run` with white-box gradient
    canaries (module docstring).

    Trains ``model`` in place: ``rounds`` rounds of the federated loop over ``clients``
    (:class:`privleak.fl.Client`), every client taking ``local_steps`` DP-SGD steps under
    ``config`` (any registered mechanism) with batches of the audited client's size (which must be the
    smallest client's: its local steps are full-batch), the server stepping at ``learning_rate``
    x ``server_learning_rate``. ``canary`` is "dirac" (needs as many parameters as canaries) or
    "random". ``seed`` seeds the loop's batches and noise (:func:`privleak.fl.client_streams`),
    the membership, the directions and the tie-break.

    Returns :class:`~privleak.audit.one_run.OneRunAudit` with the lower bound at (``delta``,
    ``confidence``) and, as ``epsilon_claimed``, the accountant's epsilon of the audited client's
    run: rounds x local_steps steps at sampling rate 1 on its data plus the included canaries.
    """
    import torch

    from privleak import dpsgd, fl

    if not isinstance(model, torch.nn.Module):
        raise validation.ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(clients, (str, bytes)) or not isinstance(clients, Sequence) or not clients:
        raise ValueError(f"clients must be a non-empty sequence of privleak.fl.Client, got {clients!r}")
    for j, c in enumerate(clients):
        if not isinstance(c, fl.Client):
            raise validation.ArgumentTypeError(f"clients[{j}] must be a privleak.fl.Client, got {type(c).__name__}")
    if loss_fn is None:
        loss_fn = torch.nn.functional.cross_entropy
    if not callable(loss_fn):
        raise validation.ArgumentTypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    rounds = validation.integer(rounds, "rounds", low=1)
    local_steps = validation.integer(local_steps, "local_steps", low=1)
    index = validation.integer(client, "client", low=0, high=len(clients) - 1)
    m = validation.integer(canaries, "canaries", low=1)
    delta = validation.probability(delta, "delta", open_high=True)
    confidence = validation.probability(confidence, "confidence", open_low=True, open_high=True)
    seed = validation.integer(seed, "seed", low=0)
    kind = validation.choice(canary, "canary", ("dirac", "random"))
    audited = clients[index]
    batch_size = len(audited)
    smaller = [j for j, c in enumerate(clients) if len(c) < batch_size]
    if smaller:
        raise ValueError(f"client: the audited client {index} runs full-batch local steps of {batch_size} examples, "
                         f"so no client may have fewer; clients {smaller[:10]} do")
    params, config, pairs = _check_run(model, config, delta, guesses, m)
    clip = _check_canary_run(config, m, params)

    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    mass = None
    if kind == "dirac":  # the coordinates the audited client's clipped gradients touch least at the start
        mass = _data_mass(dpsgd.per_sample_gradients(model, loss_fn, audited.images, audited.labels), clip,
                          config.per_layer)
    canary_gradients, project = _white_box_canaries(kind, m, params, clip, config.per_layer, rng, mass)
    members = np.flatnonzero(included)

    def extra_gradients(round_: int, client_: int, step: int, local) -> Optional[list]:
        # ``local`` is the client's copy of the model, whose parameters are in the same order
        return canary_gradients(members, params[0].dtype) if client_ == index else None

    federation = fl.run(model, clients, config, rounds=rounds, batch_size=batch_size, local_steps=local_steps,
                        learning_rate=learning_rate, server_learning_rate=server_learning_rate, seed=seed,
                        record=True, loss_fn=loss_fn, extra_gradients=extra_gradients)
    scores = np.zeros(m)
    for leaked in federation.leaked:
        if leaked.client == index:
            scores += project(leaked.update)
    dataset_size = batch_size + members.size
    claimed = dpsgd.privacy_report(config, [p.shape for p in params], expected_batch_size=dataset_size,
                                   dataset_size=dataset_size, steps=rounds * local_steps, delta=delta).epsilon
    return audit_one_run(scores, included, delta=delta, confidence=confidence, guesses=pairs, seed=seed,
                         epsilon_claimed=claimed)
