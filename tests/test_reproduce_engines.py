"""``privleak reproduce --engine``: the sweep on Flower leaks, and so reports, what the in-process
run does; the deployment engine gives its nodes the in-process run's shards and network."""
import dataclasses

import pytest
import torch
from privleak import attacks, cli, flower_app, reproduce
from test_reproduce import assert_refused

#: Two settings (noiseless, VMF) and three clients with two local images each: small enough for
#: Flower's simulation, which starts its Ray workers for every setting it trains.
TINY = reproduce.Experiment(dataset="sklearn-digits", epsilons=(1e6,), mechanisms=("vmf",), clients=3,
                            examples_per_client=2, rounds=2, attack=attacks.InvertingGradients(iterations=20),
                            grid_epsilons=(1e6,))


def test_the_flower_engine_leaks_what_the_in_process_engine_does():
    """The attack and every report column after it are a function of what train_and_collect
    returns, so the same Attacked means the same CSV."""
    data = reproduce.datasets.load(TINY.dataset)
    vmf = reproduce.settings(TINY, _dimension(data))[-1]
    local = reproduce.train_and_collect(TINY, data, vmf)
    on_flower = reproduce.train_and_collect(dataclasses.replace(TINY, engine=reproduce.FlowerSimulation()), data, vmf)
    for field in reproduce.Attacked._fields:
        a, b = getattr(local, field), getattr(on_flower, field)
        if isinstance(a, list):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), field
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field
        else:
            assert a == b, field
    assert float(local.updates[0].abs().sum()) > 0  # a VMF release, not an empty record


class _Spy(reproduce.InProcess):
    """The in-process engine, remembering the starting network and shards it was given."""

    seen: list = []

    def train(self, experiment, model, clients, config):
        self.seen.append((experiment, {k: v.clone() for k, v in model.state_dict().items()}, clients, config))
        return super().train(experiment, model, clients, config)


def test_the_deployment_engine_gives_the_nodes_the_in_process_shards_and_network(tmp_path):
    experiment = dataclasses.replace(TINY, engine=_Spy(), convention=reproduce.PaperConvention())
    data = reproduce.datasets.load(experiment.dataset)
    _Spy.seen.clear()
    grid = reproduce.settings(experiment, _dimension(data))
    reproduce.train_and_collect(experiment, data, grid[-1])
    (_, initial, clients, config), = _Spy.seen
    settings = reproduce.FlowerDeployment.settings(experiment, config, str(tmp_path / "record.pt"))
    # the App's run config, written and read back, is the same configuration
    flower_app.write_app(tmp_path / "app", settings)
    read = flower_app.read_settings(tmp_path / "app")
    assert read.config() == config and read.seed == experiment.seed and read.rounds == experiment.rounds
    for k, client in enumerate(clients):
        node = flower_app.client_data(read, k)
        assert torch.equal(node.images, client.images) and torch.equal(node.labels, client.labels)
    network = flower_app.model(read).state_dict()
    assert all(torch.equal(network[k], initial[k]) for k in initial)


def _dimension(data):
    return sum(p.numel() for p in reproduce.PaperNetwork(data.image_shape, data.num_classes).parameters())


def _parse(monkeypatch, argv):
    reached = []

    def stop(experiment, progress=None):
        reached.append(experiment)
        raise SystemExit(0)

    monkeypatch.setattr(reproduce, "run", stop)
    with pytest.raises(SystemExit):
        cli.main(["reproduce", "--quiet", *argv])
    return reached[0]


def test_the_command_line_picks_the_engine(monkeypatch, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert isinstance(_parse(monkeypatch, ["--out", out]).engine, reproduce.InProcess)
    assert isinstance(_parse(monkeypatch, ["--out", out, "--engine", "flower"]).engine, reproduce.FlowerSimulation)
    deployed = _parse(monkeypatch, ["--out", out, "--engine", "flower", "--superlink", "10.0.0.7:9093", "--insecure"])
    assert deployed.engine == reproduce.FlowerDeployment("10.0.0.7:9093", insecure=True)
    for argv, option in ((["--superlink", "127.0.0.1:9093"], "--superlink"), (["--insecure"], "--insecure"),
                         (["--engine", "flower", "--insecure"], "--insecure"),
                         (["--engine", "flower", "--superlink", "nohost"], "--superlink"),
                         (["--engine", "flower", "--superlink", "h:0"], "--superlink"),
                         (["--engine", "ray"], "--engine")):
        assert_refused(capsys, ["reproduce", "--out", out, *argv], option)
    assert not (tmp_path / "out").exists()


def test_an_engine_must_be_an_engine():
    with pytest.raises(ValueError, match="engine must be a privleak.reproduce.Engine"):
        dataclasses.replace(TINY, engine="flower")
