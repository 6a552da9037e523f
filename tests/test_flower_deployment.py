"""privleak.flower_app on Flower's Deployment Runtime: real processes on 127.0.0.1 (issue 18).

One federation for the module: a SuperLink and two SuperNodes, each its own process group with
its own FLWR_HOME, on free ports, started with the commands of docs/federated.md:

    flower-superlink --insecure --host 127.0.0.1 --port LINK --disable-runtime-dependency-installation
    flower-supernode --insecure --superlink 127.0.0.1:LINK --host 127.0.0.1 --port NODE_K \
        --node-config "partition-id=K num-partitions=2"          # K = 0, 1

Each test writes an App (flower_app.write_app) and submits it with flower_app.submit, which runs
``flwr run APP privleak --stream`` with a Flower configuration naming the SuperLink ``privleak``.
Every wait is bounded; the processes are stopped by process group in the fixture's finally, and
their logs are printed when a test fails.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no telemetry POSTs from Flower

import pytest
import torch
from privleak import datasets, dpsgd, fl, flower_app
from privleak.models import PaperNetwork

ROUNDS, CLIENTS, PER_CLIENT, BATCH, LOCAL_STEPS, LEARNING_RATE, SEED, DATA_SEED = 2, 2, 20, 3, 2, 0.5, 5, 1
MECHANISMS = {"vmf": (("kappa", 1000.0),), "gaussian": (("noise_multiplier", 1.0),)}
START_TIMEOUT, RUN_TIMEOUT, STOP_TIMEOUT = 30.0, 90.0, 10.0


def _free_ports(count: int) -> list:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _executable(name: str) -> str:
    """The Flower command of this Python environment (beside sys.executable)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


class _Processes:
    """Processes started here, each the leader of its own process group, with its log file."""

    def __init__(self, directory: Path):
        self.directory, self.started = directory, []

    def start(self, name: str, argv: list) -> subprocess.Popen:
        home = self.directory / f"home-{name}"
        home.mkdir()
        env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        log = self.directory / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                       cwd=self.directory)
        self.started.append((name, process, log))
        return process

    def check_alive(self) -> None:
        for name, process, _ in self.started:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}\n{self.logs()}")

    def stop(self) -> None:
        """SIGTERM to every group, SIGKILL to what is left after STOP_TIMEOUT seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for _, process, _ in self.started:
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_TIMEOUT
            for _, process, _ in self.started:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def logs(self) -> str:
        return "\n".join(f"----- {name} ({' '.join(process.args)}):\n{log.read_text(errors='replace')[-6000:]}"
                         for name, process, log in self.started)


def _wait_for_port(port: int, processes: _Processes) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        processes.check_alive()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {START_TIMEOUT} s\n{processes.logs()}")


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """(SuperLink address, processes, folder): a SuperLink and two SuperNodes, stopped afterwards."""
    directory = tmp_path_factory.mktemp("flower-deployment")
    link, *nodes = _free_ports(1 + CLIENTS)
    processes = _Processes(directory)
    try:
        processes.start("superlink", [_executable("flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                      "--port", str(link), "--disable-runtime-dependency-installation"])
        for k, port in enumerate(nodes):
            processes.start(f"supernode-{k}", [
                _executable("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link}", "--host",
                "127.0.0.1", "--port", str(port), "--node-config", f"partition-id={k} num-partitions={CLIENTS}"])
        _wait_for_port(link, processes)
        yield f"127.0.0.1:{link}", processes, directory
    finally:
        processes.stop()


def _in_process(mechanism: str, on_update) -> fl.Federation:
    """fl.run on the same shards of scikit-learn's digits, from the same initial network."""
    data = datasets.sklearn_digits()
    clients = fl.split_among_clients(data.images, data.labels, CLIENTS, PER_CLIENT,
                                     torch.Generator().manual_seed(DATA_SEED))
    torch.manual_seed(0)
    model = PaperNetwork((1, 8, 8), 10)
    config = dpsgd.DPSGDConfig(1.0, mechanism, **dict(MECHANISMS[mechanism]))
    return fl.run(model, clients, config, rounds=ROUNDS, batch_size=BATCH, local_steps=LOCAL_STEPS,
                  learning_rate=LEARNING_RATE, seed=SEED, on_update=on_update)


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_deployment_records_what_the_in_process_loop_leaks(federation, mechanism):
    """2 rounds of 2 local DP-SGD steps on each of 2 SuperNodes: the ServerApp records exactly
    fl.run's updates for the same seed (bit for bit: the clients run the same local loop on the
    same streams, and arrays cross Flower's wire losslessly), with their privacy metadata, and ends
    at the same model; the hooks replayed on the record see what fl.run's hooks saw."""
    address, processes, directory = federation
    settings = flower_app.Settings(
        rounds=ROUNDS, clients=CLIENTS, examples_per_client=PER_CLIENT, mechanism=mechanism,
        mechanism_parameters=MECHANISMS[mechanism], batch_size=BATCH, local_steps=LOCAL_STEPS,
        learning_rate=LEARNING_RATE, seed=SEED, dataset="sklearn-digits", data_seed=DATA_SEED, model_seed=0,
        share_batches=True, record=str(directory / f"record-{mechanism}.pt"), round_timeout=RUN_TIMEOUT)
    app = flower_app.write_app(directory / f"app-{mechanism}", settings)
    seen, expected_seen = [], []
    try:
        deployed = flower_app.submit(app, address, insecure=True, timeout=RUN_TIMEOUT,
                                     on_update=lambda u: seen.append((u.round, u.client)))
        in_process = _in_process(mechanism, lambda u: expected_seen.append((u.round, u.client)))
        assert [(u.round, u.client) for u in deployed.leaked] == [(r, k) for r in range(ROUNDS) for k in range(CLIENTS)]
        assert seen == expected_seen == [(u.round, u.client) for u in deployed.leaked]
        assert deployed.rounds == in_process.rounds == ROUNDS
        assert len(deployed.leaked) == len(in_process.leaked)
        for ours, theirs in zip(deployed.leaked, in_process.leaked):
            assert ours.local_steps == theirs.local_steps == LOCAL_STEPS
            assert all(torch.equal(a, b) for a, b in zip(ours.parameters, theirs.parameters))
            assert all(torch.equal(a, b) for a, b in zip(ours.update, theirs.update))
            assert all(torch.equal(a, b) for a, b in zip(ours.private_batches, theirs.private_batches))
            assert ours.release == theirs.release
            assert ours.release.sampling_rate == BATCH / PER_CLIENT
        for a, b in zip(deployed.model.parameters(), in_process.model.parameters()):
            assert torch.equal(a, b)
        assert fl.client_privacy(deployed, 1e-5) == fl.client_privacy(in_process, 1e-5)
    except BaseException:
        print(processes.logs())
        raise

