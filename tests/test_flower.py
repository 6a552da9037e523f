"""privleak.flower: the Flower path of the federated loop (issues 7 and 18).

Two simulations (Flower's Ray runtime, 2 virtual SuperNodes, 2 rounds), run once each (module
fixture): Gaussian noise added by the client mod (FedSGD, the paper's setting) and VMF DP-SGD with
2 local steps inside the ClientApp (privleak.flower.run). The other tests call the ClientApp and
the strategy directly. tests/test_flower_deployment.py runs the App on Flower's real processes.
"""
import copy
import functools
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no telemetry POSTs from Flower, no usage stats from Ray
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, Metadata, RecordDict
from privleak import dpsgd, fl, flower, flower_app
from privleak.models import PaperNetwork

SEED, BATCH, LEARNING_RATE, SIGMA, CLIP = 5, 3, 0.5, 1.0, 1.0
CONFIGS = {"vmf": dpsgd.DPSGDConfig(CLIP, "vmf", kappa=1000.0),
           "gaussian": dpsgd.DPSGDConfig(CLIP, "gaussian", noise_multiplier=SIGMA),
           "laplace": dpsgd.DPSGDConfig(CLIP, "laplace", noise_multiplier=SIGMA),
           "gaussian-per-layer": dpsgd.DPSGDConfig([0.5, 1.0, 1.0, 2.0, 1.0, 1.0, 0.5, 1.0], "gaussian",
                                                   noise_multiplier=0.7, per_layer=True)}
#: the two simulations: (mechanism, privatize, local steps)
SIMULATIONS = {"gaussian-mod": ("gaussian", "mod", 1), "vmf-client": ("vmf", "client", 2)}


def _model() -> PaperNetwork:
    torch.manual_seed(0)
    return PaperNetwork((1, 8, 8), 10)


def _shards() -> list:
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.rand(40, 1, 8, 8, generator=generator), torch.randint(0, 10, (40,), generator=generator)
    return fl.split_among_clients(images, labels, 2, 20, generator)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _train_message(model, server_round: int = 1, learning_rate=LEARNING_RATE) -> Message:
    config = {"server-round": server_round}
    if learning_rate is not None:
        config["learning-rate"] = learning_rate
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(config)})
    return Message(content=content, metadata=Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=1,
                                                      reply_to_message_id="", group_id="", created_at=time.time(),
                                                      ttl=3600.0, message_type=MessageType.TRAIN))


def _context(partition_id: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": partition_id}, state=RecordDict(), run_config={})


def _hand_written_steps(model, client: fl.Client, config, steps: int, generator, noise, learning_rate=LEARNING_RATE):
    """``steps`` DP-SGD steps from the primitives (fixed-size batch, per-sample gradients,
    privatize, SGD): the summed update and the batches."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    total, batches = [torch.zeros_like(p) for p in params], []
    for _ in range(steps):
        batch = dpsgd.sample_batch(len(client), BATCH, "fixed", generator)
        grads = dpsgd.per_sample_gradients(model, F.cross_entropy, client.images[batch], client.labels[batch])
        update = dpsgd.privatize(grads, config, BATCH, noise)
        with torch.no_grad():
            for p, u, t in zip(params, update, total):
                p.sub_(learning_rate * u)
                t.add_(u)
        batches.append(batch)
    return total, batches


@pytest.fixture(scope="module", params=sorted(SIMULATIONS))
def runs(request):
    """(simulation, initial model, the Flower run's Federation, fl.run's Federation)."""
    mechanism, privatize, steps = SIMULATIONS[request.param]
    shards, start, config = _shards(), _model(), CONFIGS[mechanism]
    in_process = fl.run(copy.deepcopy(start), shards, config, rounds=2, batch_size=BATCH, local_steps=steps,
                        learning_rate=LEARNING_RATE, seed=SEED)
    if privatize == "client":
        federation = flower.run(copy.deepcopy(start), shards, config, rounds=2, batch_size=BATCH, local_steps=steps,
                                learning_rate=LEARNING_RATE, seed=SEED)
    else:
        federation = flower.simulate(copy.deepcopy(start), shards.__getitem__, config, clients=2, rounds=2,
                                     batch_size=BATCH, learning_rate=LEARNING_RATE, privatize="mod", seed=SEED,
                                     share_batches=True)
    return request.param, start, federation, in_process


def test_flower_runs_two_rounds_on_two_clients(runs):
    simulation, _, federation, _ = runs
    steps = SIMULATIONS[simulation][2]
    assert federation.rounds == 2
    assert [(u.round, u.client) for u in federation.leaked] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(u.local_steps == steps and len(u.private_batches) == steps
               and all(len(b) == BATCH for b in u.private_batches) for u in federation.leaked)
    assert all(u.release == fl.Release(CONFIGS[SIMULATIONS[simulation][0]], BATCH, 20) for u in federation.leaked)


def test_model_moved_as_the_recorded_updates_say(runs):
    """theta_{r+1} = theta_r - lr sum_k (n_k / n) u_k, recomputed in float64 from the records: each
    round's updates were taken at the model the previous round's updates lead to (float32 rounding)."""
    _, start, federation, _ = runs
    models = [_flat(u.parameters) for u in federation.leaked[::2]] + [_flat(federation.model.parameters()).detach()]
    assert torch.equal(models[0], _flat(start.parameters()).detach())
    for round_ in range(2):
        updates = federation.updates_of_round(round_)
        assert all(torch.equal(_flat(u.parameters), models[round_]) for u in updates)
        step = LEARNING_RATE * sum(0.5 * _flat(u.update).double() for u in updates)  # equal shards: n_k / n = 1/2
        # float32 rounding of one computation, not a trajectory's outcome: the gap was <= 5e-8.
        torch.testing.assert_close(models[round_ + 1].double(), models[round_].double() - step, rtol=0, atol=1e-6)
    assert not torch.allclose(models[2], models[0])


def test_updates_carry_the_noise(runs):
    """Gaussian by the mod: the update minus the batch's clipped average (recomputed here from the
    recorded batch) has mean 0 and standard deviation sigma c / L over 8,026 coordinates (the
    sample std's own relative error is 1 / sqrt(2 n) < 1%; 5% leaves room). VMF in the client's
    loop: the update is the sum of the hand-written steps' VMF releases on the recorded batches,
    with the noise stream of (seed, round, client), bit for bit."""
    simulation, _, federation, _ = runs
    mechanism, _, steps = SIMULATIONS[simulation]
    shards = _shards()
    for leaked in federation.leaked:
        update = _flat(leaked.update)
        model = _model()
        with torch.no_grad():
            for p, value in zip(model.parameters(), leaked.parameters):
                p.copy_(value)
        client = shards[leaked.client]
        if mechanism == "vmf":
            generator, noise = fl.client_streams(SEED, leaked.round, leaked.client)
            expected, batches = _hand_written_steps(model, client, CONFIGS["vmf"], steps, generator, noise)
            assert all(torch.equal(a, b) for a, b in zip(batches, leaked.private_batches))
            assert torch.equal(update, _flat(expected))
            continue
        batch = leaked.private_batches[0]
        grads = dpsgd.per_sample_gradients(model, F.cross_entropy, client.images[batch], client.labels[batch])
        residual = (update - _flat(dpsgd.clip_and_accumulate(grads, CLIP, batch_size=BATCH).grads)).double()
        expected_std = SIGMA * CLIP / BATCH
        assert abs(float(residual.std()) / expected_std - 1) < 0.05
        assert abs(float(residual.mean())) < 5 * expected_std / math.sqrt(residual.numel())


def test_flower_leaks_what_the_in_process_loop_leaks(runs):
    """Same seed, same (round, client) streams: the same batches, updates and release metadata.
    Local DP-SGD in the ClientApp is fl's loop itself: bit for bit. The Gaussian mod differs by
    float32 rounding, since fl's fused kernel adds the noise before dividing by L and the mod after."""
    simulation, _, federation, in_process = runs
    assert [(u.round, u.client) for u in federation.leaked] == [(u.round, u.client) for u in in_process.leaked]
    exact = SIMULATIONS[simulation][1] == "client"
    for ours, theirs in zip(federation.leaked, in_process.leaked):
        assert len(ours.private_batches) == len(theirs.private_batches)
        assert all(torch.equal(a, b) for a, b in zip(ours.private_batches, theirs.private_batches))
        assert ours.release == theirs.release
        if exact:
            assert all(torch.equal(a, b) for a, b in zip(ours.update, theirs.update))
        else:  # two roundings of the same numbers: the gap was 1.2e-7 (one float32 ulp at 1)
            torch.testing.assert_close(_flat(ours.update), _flat(theirs.update), rtol=0, atol=1e-6)
    for a, b in zip(federation.model.parameters(), in_process.model.parameters()):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=0, atol=1e-6)


def test_client_privacy_composes_each_clients_steps(runs):
    """fl.client_privacy: per client, dpsgd.privacy_report over its rounds x local steps on batches
    of L = 3 of its n = 20 examples (fixed-size sampling), and the bound k x (one step's bits) on
    one round's release (the releases equal fl.run's: test_flower_leaks_what_the_in_process_loop_leaks)."""
    simulation, _, federation, _ = runs
    mechanism, _, steps = SIMULATIONS[simulation]
    shapes = [tuple(p.shape) for p in federation.model.parameters()]
    expected = dpsgd.privacy_report(CONFIGS[mechanism], shapes, expected_batch_size=BATCH, dataset_size=20,
                                    steps=2 * steps, delta=1e-5, sampling="fixed")
    privacy = fl.client_privacy(federation, 1e-5)
    assert sorted(privacy) == [0, 1]
    for client, entry in privacy.items():
        assert entry.client == client and entry.rounds == 2 and entry.report == expected
        assert entry.release_capacity_bits == steps * expected.capacity_bits


def test_client_privacy_is_per_client():
    """Clients of 20 and 10 examples: the smaller one's batches sample it at twice the rate, so
    its epsilon is larger (Laplace, subsampled pure DP), and each is its own privacy_report."""
    shards, config = _shards(), CONFIGS["laplace"]
    clients = [shards[0], fl.Client(shards[1].images[:10], shards[1].labels[:10])]
    federation = fl.run(_model(), clients, config, rounds=2, batch_size=BATCH, local_steps=2, seed=SEED)
    privacy = fl.client_privacy(federation, 1e-5)
    shapes = [tuple(p.shape) for p in federation.model.parameters()]
    for client, size in ((0, 20), (1, 10)):
        assert privacy[client].report == dpsgd.privacy_report(config, shapes, expected_batch_size=BATCH,
                                                              dataset_size=size, steps=4, delta=1e-5,
                                                              sampling="fixed")
    assert privacy[1].report.epsilon > privacy[0].report.epsilon
    federation.leaked[1] = federation.leaked[1]._replace(release=None)
    with pytest.raises(ValueError, match="client 1: an update carries no release metadata"):
        fl.client_privacy(federation, 1e-5)
    federation.leaked[1] = federation.leaked[3]._replace(release=fl.Release(CONFIGS["vmf"], BATCH, 10))
    with pytest.raises(ValueError, match="client 1 released updates under 2 configurations"):
        fl.client_privacy(federation, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        fl.client_privacy(federation, 1.0)


@pytest.mark.parametrize("privatize", ["client", "mod"])
@pytest.mark.parametrize("name", ["vmf", "gaussian", "gaussian-per-layer", "laplace"])
def test_client_app_sends_what_the_in_process_client_leaks(name, privatize):
    """One message straight to the ClientApp (no runtime): its update is fl's for the same (seed,
    round, client), per-layer clipping and L1 clipping (Laplace) included; through the mod, VMF is
    exact (the very average, normalised) and the additive noises differ by float32 rounding."""
    config, model, shards = CONFIGS[name], _model(), _shards()
    reply = flower.client_app(model, shards.__getitem__, config, batch_size=BATCH, privatize=privatize, seed=SEED)(
        _train_message(model, server_round=2), _context(1))
    ours = list(reply.content["update"].to_torch_state_dict().values())
    generator, noise = fl.client_streams(SEED, 1, 1)
    theirs, _ = shards[1].local_update(copy.deepcopy(model), config, batch_size=BATCH, local_steps=1,
                                       learning_rate=LEARNING_RATE, generator=generator, noise=noise)
    exact = privatize == "client" or config.mechanism.releases_direction
    torch.testing.assert_close(_flat(ours), _flat(theirs), rtol=0, atol=0 if exact else 1e-6)
    metadata = reply.content["privleak"]
    assert metadata["privatized-by"] == privatize and metadata["mechanism"] == config.mechanism.name
    assert {k.partition(".")[2]: v for k, v in metadata.items() if k.startswith("mechanism.")} == \
        config.mechanism.parameters()
    assert metadata["clip-norms"] == list(config.clipping(8).norms) and metadata["per-layer"] == config.per_layer
    assert (metadata["local-steps"], metadata["batch-size"], metadata["dataset-size"]) == (1, BATCH, 20)
    assert metadata["sampling-rate"] == BATCH / 20 and metadata["secure-noise"] is False


@pytest.mark.parametrize("name", ["vmf", "gaussian", "gaussian-per-layer", "laplace"])
def test_three_local_steps_equal_three_hand_written_dpsgd_steps(name):
    """A ClientApp with 3 local DP-SGD steps replies with the sum of 3 hand-written steps (fixed
    batch, per-sample gradients, privatize, SGD at the server's learning rate) on the same keys,
    bit for bit, and says so in its metadata."""
    config, model, shards = CONFIGS[name], _model(), _shards()
    app = flower.client_app(model, shards.__getitem__, config, batch_size=BATCH, local_steps=3, seed=SEED,
                            share_batches=True)
    reply = app(_train_message(model, server_round=2), _context(1))
    generator, noise = fl.client_streams(SEED, 1, 1)
    expected, batches = _hand_written_steps(model, shards[1], config, 3, generator, noise)
    assert torch.equal(_flat(reply.content["update"].to_torch_state_dict().values()), _flat(expected))
    assert reply.content["privleak"]["batches"] == torch.cat(batches).tolist()
    assert reply.content["privleak"]["local-steps"] == 3 and reply.content["privleak"]["privatized-by"] == "client"
    # the local learning rate is the server's: another one moves steps 2 and 3 elsewhere
    other = app(_train_message(model, server_round=2, learning_rate=0.1), _context(1))
    assert not torch.equal(_flat(other.content["update"].to_torch_state_dict().values()), _flat(expected))


def test_secure_gaussian_noise_in_every_local_step():
    """Secure noise (ChaCha20, no seed): with learning rate 0 every step is taken at the server's
    model, so the update minus the 3 steps' clipped averages (on the seeded batches) is the sum
    of 3 independent noises, std sqrt(3) sigma c / L, mean 0; two replies draw different noise."""
    model, shards = _model(), _shards()
    app = flower.client_app(model, shards.__getitem__, CONFIGS["gaussian"], batch_size=BATCH, local_steps=3,
                            secure_noise=True, seed=SEED, share_batches=True)
    first, second = (app(_train_message(model, learning_rate=0.0), _context(0)) for _ in range(2))
    assert first.content["privleak"]["secure-noise"] is True
    batches = torch.tensor(first.content["privleak"]["batches"]).reshape(3, BATCH)
    assert torch.equal(batches, torch.tensor(second.content["privleak"]["batches"]).reshape(3, BATCH))
    clipped = [dpsgd.clip_and_accumulate(dpsgd.per_sample_gradients(model, F.cross_entropy, shards[0].images[b],
                                                                    shards[0].labels[b]), CLIP, batch_size=BATCH).grads
               for b in batches]
    residual = (_flat(first.content["update"].to_torch_state_dict().values())
                - sum(_flat(c) for c in clipped)).double()
    expected_std = math.sqrt(3) * SIGMA * CLIP / BATCH
    assert abs(float(residual.std()) / expected_std - 1) < 0.05
    assert abs(float(residual.mean())) < 5 * expected_std / math.sqrt(residual.numel())
    assert not torch.equal(_flat(first.content["update"].to_torch_state_dict().values()),
                           _flat(second.content["update"].to_torch_state_dict().values()))


def test_client_app_without_seed_draws_fresh_noise():
    model = _model()
    app = flower.client_app(model, _shards().__getitem__, CONFIGS["vmf"], batch_size=BATCH)
    first, second = (_flat(app(_train_message(model), _context(0)).content["update"].to_torch_state_dict().values())
                     for _ in range(2))
    assert not torch.equal(first, second)
    assert abs(float(first.double().norm()) - 1) < 1e-5 and abs(float(second.double().norm()) - 1) < 1e-5


def test_mod_privatises_the_reply_or_refuses():
    model = _model()

    def two_records(message, context):
        arrays = ArrayRecord([torch.ones(3).numpy()])
        return Message(RecordDict({"a": arrays, "b": copy.deepcopy(arrays)}), reply_to=message)

    def no_arrays(message, context):
        return Message(RecordDict({"metrics": ConfigRecord({"loss": 1.0})}), reply_to=message)

    mod = flower.NoiseMod(dpsgd.VMF(10.0), dpsgd.Clipping((1.0,), False), 1, seed=0)
    with pytest.raises(ValueError, match="one ArrayRecord"):
        mod(_train_message(model), _context(0), two_records)
    reply = mod(_train_message(model), _context(0), no_arrays)
    assert list(reply.content.keys()) == ["metrics"]


@functools.lru_cache(maxsize=None)
def _genuine(name: str, local_steps: int, partition: int, privatize: str) -> RecordDict:
    """The content of a seeded ClientApp's reply to round 1 at _model() (computed once)."""
    model = _model()
    app = flower.client_app(model, _shards().__getitem__, CONFIGS[name], batch_size=BATCH, local_steps=local_steps,
                            privatize=privatize, seed=SEED)
    return app(_train_message(model), _context(partition)).content


def _reply(message, name="vmf", *, local_steps=1, partition=0, privatize="client", change=None, drop=()):
    """A genuine ClientApp reply to ``message`` (round 1 at _model()), its privacy metadata then
    edited: ``change`` sets keys, ``drop`` removes them."""
    content = copy.deepcopy(_genuine(name, local_steps, partition, privatize))
    metadata = dict(content["privleak"])
    metadata.update(change or {})
    for key in drop:
        del metadata[key]
    content["privleak"] = ConfigRecord(metadata)
    return Message(content, reply_to=message)


def _strategy(**kwargs) -> flower.CuriousFedAvg:
    kwargs.setdefault("batch_size", BATCH)
    return flower.CuriousFedAvg(fl.Federation(_model()), 2, kwargs.pop("config", CONFIGS["vmf"]), **kwargs)


@pytest.mark.parametrize("change, drop, match", [
    ({}, ("privatized-by",), "not privatised by privleak"),
    ({"privatized-by": "nobody"}, (), "not privatised by privleak"),
    ({"mechanism.kappa": 500.0}, (), r"mechanism.kappa = 500.0 \(expected 1000.0\)"),
    ({"mechanism": "gaussian", "mechanism.noise_multiplier": 1.0}, ("mechanism.kappa",),
     r"mechanism = 'gaussian' \(expected 'vmf'\); mechanism.kappa missing .*mechanism.noise_multiplier = 1.0"),
    ({"batch-size": 2}, (), r"batch-size = 2 \(expected 3\)"),
    ({"local-steps": 2, "privatized-by": "client"}, (), r"local-steps = 2 \(expected 1\)"),
    ({"local-steps": 2, "privatized-by": "mod"}, (), "a NoiseMod privatised 2 local steps"),
    ({"clip-norms": [2.0]}, (), r"clip-norms = \[2.0\] \(expected \[1.0\]\)"),
    ({"per-layer": True}, (), "per-layer = True"),
    ({"dataset-size": 40}, (), r"dataset-size = 40 \(expected 20\)"),
    ({"sampling-rate": 0.5}, (), r"sampling-rate = 0.5 \(expected 0.15\)"),
    ({"secure-noise": True}, (), "secure-noise = True"),
    ({}, ("sampling-rate",), r"sampling-rate missing \(expected 0.15\)"),
])
@pytest.mark.parametrize("privatize", ["client", "mod"])
def test_server_refuses_metadata_that_contradicts_its_configuration(change, drop, match, privatize):
    """One genuine reply and one whose metadata lacks a key or says something else than the
    server's configuration: the round raises, naming the client and the key, and records and
    aggregates nothing (the model is untouched, the genuine update is not recorded either)."""
    strategy = _strategy()
    before = _flat(strategy.federation.model.parameters()).detach().clone()
    message = _train_message(strategy.federation.model)
    good = _reply(message, partition=0, privatize=privatize)  # the mod's: metadata added by the NoiseMod
    bad = _reply(message, partition=1, change={"privatized-by": privatize, **change}, drop=drop)
    with pytest.raises(ValueError, match=f"round 1, client 1: .*{match}"):
        strategy.aggregate_train(1, [good, bad])
    assert strategy.federation.leaked == [] and strategy.federation.rounds == 0
    assert torch.equal(_flat(strategy.federation.model.parameters()), before)


def test_server_accepts_and_records_matching_metadata():
    """Replies that say what the server expects (here 2 local steps, Laplace) are recorded with
    their Release; a reply with no privleak record at all is refused."""
    config = CONFIGS["laplace"]
    strategy = _strategy(config=config, local_steps=2)
    message = _train_message(strategy.federation.model)
    seen = []
    strategy.on_update = seen.append
    strategy.aggregate_train(1, [_reply(message, "laplace", local_steps=2, partition=k) for k in (1, 0)])
    assert [u.client for u in strategy.federation.leaked] == [0, 1] and seen == strategy.federation.leaked
    assert all(u.release == fl.Release(config, BATCH, 20) and u.local_steps == 2 for u in strategy.federation.leaked)
    naked = _reply(message, "laplace", local_steps=2)
    del naked.content["privleak"]
    with pytest.raises(ValueError, match="round 2, client 0: the update was not privatised"):
        strategy.aggregate_train(2, [naked])
    assert strategy.federation.rounds == 1


def test_server_sends_the_local_learning_rate():
    """Each train message's config carries the server's learning rate (and FedAvg's round)."""
    strategy = _strategy(learning_rate=0.25)

    class Grid:  # what FedAvg's node sampling asks
        def get_node_ids(self):
            return [7, 8]

    # the payloads, not Messages (those need a running Flower task to be built)
    strategy._construct_messages = lambda record, node_ids, message_type: [record for _ in node_ids]
    records = strategy.configure_train(3, ArrayRecord(_model().state_dict()), ConfigRecord(), Grid())
    assert [dict(r["config"]) for r in records] == [{"learning-rate": 0.25, "server-round": 3}] * 2


def test_server_raises_on_failed_or_duplicate_clients():
    strategy = _strategy()
    message = _train_message(strategy.federation.model)
    with pytest.raises(RuntimeError, match="1 client.* failed: .*out of memory"):
        strategy.aggregate_train(1, [_reply(message), Message(Error(0, "out of memory"), reply_to=message)])
    with pytest.raises(ValueError, match="duplicate partition ids"):
        strategy.aggregate_train(1, [_reply(message), _reply(message)])
    assert strategy.federation.leaked == []


def test_client_errors_name_the_problem():
    model = _model()
    app = flower.client_app(model, _shards().__getitem__, CONFIGS["gaussian"], batch_size=21, seed=0)
    with pytest.raises(ValueError, match="batch_size 21 exceeds client 1's 20"):
        app(_train_message(model), _context(1))
    app = flower.client_app(model, _shards().__getitem__, CONFIGS["gaussian"], seed=0)
    with pytest.raises(ValueError, match="partition-id"):
        app(_train_message(model), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    with pytest.raises(ValueError, match="learning-rate"):
        app(_train_message(model, learning_rate=None), _context(0))


@pytest.mark.parametrize("call, match", [
    (lambda m: flower.client_app(m, list.__getitem__, dpsgd.DPSGDConfig(1.0, "vmf")), "kappa"),
    (lambda m: flower.client_app(m, list.__getitem__, dpsgd.DPSGDConfig(1.0, "exponential")), "config.mechanism"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], batch_size=0), "batch_size"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], local_steps=0), "local_steps"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], privatize="server"), "privatize"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], privatize="mod", local_steps=2),
     "privatize='mod' takes local_steps=1"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], secure_noise=True), "secure_noise: the vmf"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["gaussian"], secure_noise=1), "secure_noise"),
    (lambda m: flower.client_app(m, [], CONFIGS["vmf"]), "data_fn"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], seed=1.5), "seed"),
    (lambda m: flower.NoiseMod("vmf", dpsgd.Clipping((1.0,), False), 1), "mechanism"),
    (lambda m: flower.NoiseMod(dpsgd.VMF(1.0), (1.0,), 1), "clipping"),
    (lambda m: flower.NoiseMod(dpsgd.VMF(1.0), dpsgd.Clipping((1.0,), False), 0), "batch_size"),
    (lambda m: flower.server_app(fl.Federation(m), CONFIGS["vmf"], clients=2, rounds=0), "rounds"),
    (lambda m: flower.server_app(fl.Federation(m), CONFIGS["vmf"], clients=0, rounds=1), "clients"),
    (lambda m: flower.server_app(m, CONFIGS["vmf"], clients=2, rounds=1), "federation"),
    (lambda m: flower.server_app(fl.Federation(m), "vmf", clients=2, rounds=1), "config"),
    (lambda m: flower.server_app(fl.Federation(m), CONFIGS["vmf"], clients=2, rounds=1, local_steps=0), "local_steps"),
    (lambda m: flower.server_app(fl.Federation(m), CONFIGS["vmf"], clients=2, rounds=1, learning_rate=math.inf),
     "learning_rate"),
    (lambda m: flower.server_app(fl.Federation(m), CONFIGS["vmf"], clients=2, rounds=1, round_timeout=0),
     "round_timeout"),
    (lambda m: flower.run(m, [], CONFIGS["vmf"], rounds=1), "clients must not be empty"),
    (lambda m: flower.run(m, _shards(), CONFIGS["vmf"], rounds=1, batch_size=21), "batch_size 21 exceeds"),
])
def test_bad_input_raises_value_error_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call(_model())


def test_app_settings_round_trip_and_refuse_bad_run_configs(tmp_path):
    """flower_app: the settings written to pyproject.toml read back equal; a run config with a
    bad or unknown key is refused naming it; shard K is fl.split_among_clients' K-th shard."""
    settings = flower_app.Settings(rounds=2, clients=2, examples_per_client=20, mechanism="gaussian",
                                   mechanism_parameters=(("noise_multiplier", 0.7),), clip_norm=(0.5, 1.0) * 4,
                                   per_layer=True, batch_size=BATCH, local_steps=2, seed=SEED, record="r.pt")
    assert flower_app.read_settings(flower_app.write_app(tmp_path, settings)) == settings
    assert settings.config() == dpsgd.DPSGDConfig([0.5, 1.0] * 4, "gaussian", noise_multiplier=0.7, per_layer=True)
    flat = {"rounds": 2, "clients": 2, "examples-per-client": 20, "mechanism": "vmf", "mechanism-parameters.kappa": 9.0}
    assert flower_app.Settings.from_run_config(flat).seed is None
    for bad, match in (({"batch-size": 0}, r"run_config\['batch-size'\]"), ({"bogus": 1}, "unknown keys"),
                       ({"mechanism-parameters.kappa": -1.0}, "kappa"), ({"clip-norm": "a b"}, "clip-norm"),
                       ({"per-layer": "yes"}, "per-layer")):
        with pytest.raises(ValueError, match=match):
            flower_app.Settings.from_run_config({**flat, **bad})
    with pytest.raises(ValueError, match=r"run_config\['rounds'\] is missing"):
        flower_app.Settings.from_run_config({k: v for k, v in flat.items() if k != "rounds"})


def test_flower_stays_optional():
    """Without flwr, privleak and privleak.fl import, and privleak.flower and privleak.flower_app
    say what to install."""
    code = ("import sys; sys.modules['flwr'] = None\n"
            "import privleak, privleak.fl\n"
            "for name in ('privleak.flower', 'privleak.flower_app'):\n"
            "    try:\n        __import__(name)\n    except ImportError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pip install 'privleak[flower]'") == 2
