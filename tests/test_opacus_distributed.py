"""privleak's optimizers inside Opacus's distributed training (DifferentiallyPrivateDistributedDataParallel,
Opacus's distributed optimizers from PrivacyEngine.make_private): two real processes (gloo, CPU), each
with its share of every logical batch, against one process privatising the whole batch's
per-sample gradients (torch.func, dpsgd.privatize) with the first process's noise stream, and
against Opacus's own distributed step without noise.

This file is also the worker: ``python test_opacus_distributed.py RANK FOLDER`` joins the group by
a file in FOLDER, trains each engine's steps and saves each step's update.
"""
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_processes
from privleak import dpsgd
from privleak import mechanisms as M
from torch import nn

WORLD, SEED, LEARNING_RATE, TIMEOUT = 2, 11, 0.5, 120
# Each logical batch's shares on process 0 and 1: uneven, as Poisson sampling makes them.
SHARES = [(3, 5), (6, 2), (4, 4)]
# Opacus's expected_batch_size is each process's share of the logical batch, 8 / 2 here.
EXPECTED_SHARE = 4
PER_LAYER_NORMS = [0.3, 0.1, 0.5, 0.05]
#: name -> (make_private's clipping keywords, from_opacus's keywords (None: Opacus's own optimizer),
#: noise_multiplier, the reference's config)
ENGINES = {
    "hooks-gaussian": ({}, {}, 0.7, lambda: dpsgd.DPSGDConfig(0.4, noise_multiplier=0.7)),
    "hooks-laplace": ({}, {"mechanism": "laplace"}, 0.5,
                      lambda: dpsgd.DPSGDConfig(0.4, "laplace", noise_multiplier=0.5)),
    "per-layer-vmf": ({"clipping": "per_layer"}, {"mechanism": "vmf", "kappa": 500.0}, 0.7,
                      lambda: dpsgd.DPSGDConfig(PER_LAYER_NORMS, "vmf", per_layer=True, kappa=500.0)),
    "ghost-gaussian": ({"grad_sample_mode": "ghost"}, {}, 0.7, lambda: dpsgd.DPSGDConfig(0.4, noise_multiplier=0.7)),
    "ghost-vmf": ({"grad_sample_mode": "ghost"}, {"mechanism": "vmf", "kappa": 500.0}, 0.7,
                  lambda: dpsgd.DPSGDConfig(0.4, "vmf", kappa=500.0)),
    "opacus-noiseless": ({}, None, 0.0, None),
    "privleak-noiseless": ({}, {}, 0.0, None),
}


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def logical_batch(step: int) -> tuple:
    generator = torch.Generator().manual_seed(100 + step)
    n = sum(SHARES[step])
    return torch.randn(n, 6, generator=generator) * 3, torch.randint(0, 3, (n,), generator=generator)


def share(step: int, rank: int) -> tuple:
    x, y = logical_batch(step)
    start = sum(SHARES[step][:rank])
    return x[start:start + SHARES[step][rank]], y[start:start + SHARES[step][rank]]


def engine(name: str, rank: int, convert: bool = True):
    """Opacus's engine of ``name`` on this process's replica: (model, optimizer, criterion), the
    optimizer privleak's counterpart if ``name`` has one and ``convert``."""
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from privleak.opacus_interop import PrivleakDPOptimizer

    clipping, ours, noise_multiplier, _ = ENGINES[name]
    model = network()
    if rank == 1:  # DPDDP starts every replica from the first process's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model = DPDDP(model)
    dataset = torch.utils.data.TensorDataset(*logical_batch(0))
    loader = torch.utils.data.DataLoader(dataset, batch_size=len(dataset))  # the logical batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes on its secure RNG and the accountant's defaults
        made = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), data_loader=loader,
            criterion=nn.CrossEntropyLoss(), noise_multiplier=noise_multiplier,
            max_grad_norm=PER_LAYER_NORMS if clipping.get("clipping") == "per_layer" else 0.4,
            poisson_sampling=False, **{"grad_sample_mode": "hooks", **clipping})
    # ghost clipping's loss runs its two backward passes: make_private gives it as a fourth item
    model, optimizer, criterion = made[:2] + (made[2] if len(made) == 4 else nn.CrossEntropyLoss(),)
    assert optimizer.expected_batch_size == EXPECTED_SHARE, optimizer.expected_batch_size
    if ours is not None and convert:
        optimizer = PrivleakDPOptimizer.from_opacus(optimizer, noise_generator=M.NoiseGenerator(SEED + rank), **ours)
    return model, optimizer, criterion


def worker(rank: int, folder: Path) -> None:
    import torch.distributed as dist
    from privleak.opacus_interop import PrivleakDPOptimizer

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook")  # Opacus's hooks on a model whose inputs need no grad
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT))
    try:
        results = {}
        for name in ENGINES:
            model, optimizer, criterion = engine(name, rank)
            steps = []
            for step in range(len(SHARES)):
                optimizer.zero_grad()
                criterion(model(share(step, rank)[0]), share(step, rank)[1]).backward()
                optimizer.step()
                steps.append([p.grad.clone() for p in model.parameters()])
            results[name] = {"type": type(optimizer).__name__, "steps": steps,
                             "parameters": [p.detach().clone() for p in model.parameters()]}
        _, optimizer, _ = engine("hooks-gaussian", rank, convert=False)
        try:  # process 1 asks for Laplace noise: refused on both
            PrivleakDPOptimizer.from_opacus(optimizer, mechanism="laplace" if rank else "gaussian")
        except ValueError as error:
            results["settings differ"] = str(error)
        torch.save(results, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """What each of the two processes saved."""
    return run_processes(__file__, tmp_path_factory.mktemp("opacus_ddp"), WORLD, TIMEOUT + 60)


def materialised_run(config: dpsgd.DPSGDConfig) -> tuple:
    """One process, the whole logical batches: each step's update and the parameters at the end."""
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    generator = M.NoiseGenerator(SEED)
    updates = []
    for step in range(len(SHARES)):
        grads = dpsgd.per_sample_gradients(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"),
                                           *logical_batch(step))
        update = dpsgd.privatize(grads, config, EXPECTED_SHARE * WORLD, generator=generator)
        for p, u in zip(model.parameters(), update):
            p.grad = u
        optimizer.step()
        updates.append(update)
    return updates, [p.detach() for p in model.parameters()]


def assert_replicas_agree(runs) -> None:
    for step, got in enumerate(zip(*(run["steps"] for run in runs))):
        assert all(torch.equal(a, b) for a, b in zip(*got)), f"step {step}: the processes' updates differ"
    assert all(torch.equal(a, b) for a, b in zip(*(run["parameters"] for run in runs)))


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("name", [name for name, engine in ENGINES.items() if engine[3] is not None])
def test_processes_release_what_one_process_releases_on_the_whole_batch(processes, name):
    """Both processes get the same update bits each step: the update of one process clipping the
    whole logical batch with the first process's noise (float32 rounding of the sums' order aside),
    VMF's direction included, which Opacus's noise-then-all-reduce cannot release. Both replicas
    end equal, and equal to the one-process run."""
    runs = [p[name] for p in processes]
    assert_replicas_agree(runs)
    want, want_parameters = materialised_run(ENGINES[name][3]())
    scale = max(float(u.abs().max()) for update in want for u in update)
    for got, expected in zip(runs[0]["steps"], want):
        for g, w in zip(got, expected):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-6 * scale)
    for a, w in zip(runs[0]["parameters"], want_parameters):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


def test_the_counterparts_of_opacus_distributed_optimizers_step_as_opacus_does(processes):
    """Without noise, privleak's distributed optimizer gives Opacus's own distributed update
    (Opacus clips to c / (norm + 1e-6), privleak to c / norm): the same scaling by the processes'
    shares. Each engine's optimizer is privleak's distributed counterpart."""
    ours, opacus = ([p[name] for p in processes] for name in ("privleak-noiseless", "opacus-noiseless"))
    assert_replicas_agree(ours)
    for got, want in zip(ours[0]["steps"], opacus[0]["steps"]):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    kinds = {name: processes[0][name]["type"] for name in ENGINES}
    assert kinds == {"hooks-gaussian": "PrivleakDistributedDPOptimizer",
                     "hooks-laplace": "PrivleakDistributedDPOptimizer",
                     "per-layer-vmf": "PrivleakDistributedPerLayerDPOptimizer",
                     "ghost-gaussian": "PrivleakDistributedGhostClippingDPOptimizer",
                     "ghost-vmf": "PrivleakDistributedGhostClippingDPOptimizer",
                     "opacus-noiseless": "DistributedDPOptimizer",
                     "privleak-noiseless": "PrivleakDistributedDPOptimizer"}


def test_processes_with_different_settings_are_refused(processes):
    """Process 1 asks for Laplace noise, process 0 for Gaussian: both refuse, naming the setting."""
    for result in (p["settings differ"] for p in processes):
        assert result.startswith("the processes' optimizer differs in mechanism (process 0: Gaussian("), result
        assert "; process 1: Laplace(" in result, result


if __name__ == "__main__":
    worker(int(sys.argv[1]), Path(sys.argv[2]))
