"""privleak.flower: the Flower path of the federated loop (issue 7).

Two simulations (Flower's Ray runtime, 2 virtual SuperNodes, 2 rounds), one per noise mod, run
once each (module fixture); the other tests call the ClientApp and the strategy directly.
"""
import copy
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
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from privleak import dpsgd, fl, flower
from privleak.models import PaperNetwork

SEED, BATCH, LEARNING_RATE, SIGMA, CLIP = 5, 3, 0.5, 1.0, 1.0
CONFIGS = {"vmf": dpsgd.DPSGDConfig(CLIP, "vmf", kappa=1000.0),
           "gaussian": dpsgd.DPSGDConfig(CLIP, "gaussian", noise_multiplier=SIGMA)}


def _model() -> PaperNetwork:
    torch.manual_seed(0)
    return PaperNetwork((1, 8, 8), 10)


def _shards() -> list:
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.rand(40, 1, 8, 8, generator=generator), torch.randint(0, 10, (40,), generator=generator)
    return fl.split_among_clients(images, labels, 2, 20, generator)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _train_message(model, server_round: int = 1) -> Message:
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "config": ConfigRecord({"server-round": server_round})})
    return Message(content=content, metadata=Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=1,
                                                      reply_to_message_id="", group_id="", created_at=time.time(),
                                                      ttl=3600.0, message_type=MessageType.TRAIN))


def _context(partition_id: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": partition_id}, state=RecordDict(), run_config={})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def runs(request):
    """(mechanism, initial model, the Flower run's Federation, fl.run's Federation)."""
    shards, start = _shards(), _model()
    in_process = fl.run(copy.deepcopy(start), shards, CONFIGS[request.param], rounds=2, batch_size=BATCH,
                        learning_rate=LEARNING_RATE, seed=SEED)
    federation = flower.simulate(copy.deepcopy(start), shards.__getitem__, CONFIGS[request.param], clients=2, rounds=2,
                                 batch_size=BATCH, learning_rate=LEARNING_RATE, seed=SEED, share_batches=True)
    return request.param, start, federation, in_process


def test_flower_runs_two_rounds_on_two_clients(runs):
    _, _, federation, _ = runs
    assert federation.rounds == 2
    assert [(u.round, u.client) for u in federation.leaked] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(u.local_steps == 1 and len(u.private_batches) == 1 and len(u.private_batches[0]) == BATCH
               for u in federation.leaked)


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


def test_updates_carry_the_mods_noise(runs):
    """VMF: unit vectors. Gaussian: the update minus the batch's clipped average (recomputed here
    from the recorded batch) has mean 0 and standard deviation sigma c / L, over 8,026 coordinates
    (the sample std's own relative error is 1 / sqrt(2 n) < 1%; 5% leaves room)."""
    mechanism, _, federation, _ = runs
    shards = _shards()
    for leaked in federation.leaked:
        update = _flat(leaked.update)
        if mechanism == "vmf":
            assert abs(float(update.double().norm()) - 1.0) < 1e-5
            continue
        model = _model()
        with torch.no_grad():
            for p, value in zip(model.parameters(), leaked.parameters):
                p.copy_(value)
        batch = leaked.private_batches[0]
        grads = dpsgd.per_sample_gradients(model, F.cross_entropy, shards[leaked.client].images[batch],
                                           shards[leaked.client].labels[batch])
        residual = (update - _flat(dpsgd.clip_and_accumulate(grads, CLIP, batch_size=BATCH).grads)).double()
        expected = SIGMA * CLIP / BATCH
        assert abs(float(residual.std()) / expected - 1) < 0.05
        assert abs(float(residual.mean())) < 5 * expected / math.sqrt(residual.numel())


def test_flower_leaks_what_the_in_process_loop_leaks(runs):
    """Same seed, same (round, client) streams: the same batches and updates. VMF is bit for bit
    (the mod applies dpsgd.vmf_release to the very average fl computes); Gaussian differs by
    float32 rounding, since fl's fused kernel adds the noise before dividing by L and the mod after."""
    mechanism, _, federation, in_process = runs
    assert [(u.round, u.client) for u in federation.leaked] == [(u.round, u.client) for u in in_process.leaked]
    for ours, theirs in zip(federation.leaked, in_process.leaked):
        assert torch.equal(ours.private_batches[0], theirs.private_batches[0])
        if mechanism == "vmf":
            assert all(torch.equal(a, b) for a, b in zip(ours.update, theirs.update))
        else:  # two roundings of the same numbers: the gap was 1.2e-7 (one float32 ulp at 1)
            torch.testing.assert_close(_flat(ours.update), _flat(theirs.update), rtol=0, atol=1e-6)
    exact = mechanism == "vmf"
    for a, b in zip(federation.model.parameters(), in_process.model.parameters()):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", [CONFIGS["vmf"], CONFIGS["gaussian"],
                                    dpsgd.DPSGDConfig([0.5, 1.0, 1.0, 2.0, 1.0, 1.0, 0.5, 1.0], "gaussian",
                                                      noise_multiplier=0.7, per_layer=True)],
                         ids=["vmf", "gaussian", "gaussian-per-layer"])
def test_client_app_sends_what_the_in_process_client_leaks(config):
    """One message straight to the ClientApp (no runtime): the mod's output is fl's update for the
    same (seed, round, client), per-layer clipping included."""
    model, shards = _model(), _shards()
    reply = flower.client_app(model, shards.__getitem__, config, batch_size=BATCH, seed=SEED)(
        _train_message(model, server_round=2), _context(1))
    ours = list(reply.content["update"].to_torch_state_dict().values())
    generator, noise = fl.client_streams(SEED, 1, 1)
    theirs, _ = shards[1].local_update(copy.deepcopy(model), config, batch_size=BATCH, local_steps=1,
                                       learning_rate=LEARNING_RATE, generator=generator, noise=noise)
    exact = config.mechanism.releases_direction  # VMF: the very average, normalised; Gaussian: two roundings
    torch.testing.assert_close(_flat(ours), _flat(theirs), rtol=0, atol=0 if exact else 1e-6)


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
        return Message(RecordDict({"metrics": MetricRecord({"loss": 1.0})}), reply_to=message)

    mod = flower.NoiseMod(dpsgd.VMF(10.0), dpsgd.Clipping((1.0,), False), 1, seed=0)
    with pytest.raises(ValueError, match="one ArrayRecord"):
        mod(_train_message(model), _context(0), two_records)
    reply = mod(_train_message(model), _context(0), no_arrays)
    assert list(reply.content.keys()) == ["metrics"]


def _reply(message, noise: bool):
    content = RecordDict({"update": ArrayRecord({n: p.detach() for n, p in _model().named_parameters()}),
                          "metrics": MetricRecord({"num-examples": 20, "partition-id": 0})})
    if noise:
        content["privleak"] = ConfigRecord({"noise": "vmf"})
    return Message(content, reply_to=message)


def test_server_refuses_updates_no_mod_privatised():
    federation = fl.Federation(_model())
    strategy = flower.CuriousFedAvg(federation, 1)
    message = _train_message(federation.model)
    with pytest.raises(ValueError, match="not privatised"):
        strategy.aggregate_train(1, [_reply(message, noise=False)])
    assert federation.leaked == []
    strategy.aggregate_train(1, [_reply(message, noise=True)])
    assert len(federation.leaked) == 1 and federation.rounds == 1


def test_server_raises_on_failed_or_duplicate_clients():
    strategy = flower.CuriousFedAvg(fl.Federation(_model()), 2)
    message = _train_message(strategy.federation.model)
    with pytest.raises(RuntimeError, match="1 client.* failed: .*out of memory"):
        strategy.aggregate_train(1, [_reply(message, noise=True), Message(Error(0, "out of memory"), reply_to=message)])
    with pytest.raises(ValueError, match="duplicate partition ids"):
        strategy.aggregate_train(1, [_reply(message, noise=True), _reply(message, noise=True)])
    assert strategy.federation.leaked == []


def test_client_errors_name_the_problem():
    model = _model()
    app = flower.client_app(model, _shards().__getitem__, CONFIGS["gaussian"], batch_size=21, seed=0)
    with pytest.raises(ValueError, match="batch_size 21 exceeds client 1's 20"):
        app(_train_message(model), _context(1))
    app = flower.client_app(model, _shards().__getitem__, CONFIGS["gaussian"], seed=0)
    with pytest.raises(ValueError, match="partition-id"):
        app(_train_message(model), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))


@pytest.mark.parametrize("call, match", [
    (lambda m: flower.client_app(m, list.__getitem__, dpsgd.DPSGDConfig(1.0, "vmf")), "kappa"),
    (lambda m: flower.client_app(m, list.__getitem__, dpsgd.DPSGDConfig(1.0, "exponential")), "config.mechanism"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], batch_size=0), "batch_size"),
    (lambda m: flower.client_app(m, [], CONFIGS["vmf"]), "data_fn"),
    (lambda m: flower.client_app(m, list.__getitem__, CONFIGS["vmf"], seed=1.5), "seed"),
    (lambda m: flower.NoiseMod("vmf", dpsgd.Clipping((1.0,), False), 1), "mechanism"),
    (lambda m: flower.NoiseMod(dpsgd.VMF(1.0), (1.0,), 1), "clipping"),
    (lambda m: flower.NoiseMod(dpsgd.VMF(1.0), dpsgd.Clipping((1.0,), False), 0), "batch_size"),
    (lambda m: flower.server_app(fl.Federation(m), clients=2, rounds=0), "rounds"),
    (lambda m: flower.server_app(fl.Federation(m), clients=0, rounds=1), "clients"),
    (lambda m: flower.server_app(m, clients=2, rounds=1), "federation"),
    (lambda m: flower.server_app(fl.Federation(m), clients=2, rounds=1, learning_rate=math.inf), "learning_rate"),
])
def test_bad_input_raises_value_error_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call(_model())


def test_flower_stays_optional():
    """Without flwr, privleak and privleak.fl import, and privleak.flower says what to install."""
    code = ("import sys; sys.modules['flwr'] = None\n"
            "import privleak, privleak.fl\n"
            "try:\n    import privleak.flower\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'privleak[flower]'" in out.stdout
