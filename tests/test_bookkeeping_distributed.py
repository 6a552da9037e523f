"""dpsgd.BookKeeping on a model wrapped in DistributedDataParallel: two real processes (gloo, CPU),
each taking its share of every logical batch, against one process running the materialised path
(torch.func per-sample gradients through dpsgd.privatize) on the whole batch with the first
process's noise stream.

This file is also the worker: ``python test_bookkeeping_distributed.py RANK FOLDER`` joins the
group by a file in FOLDER, runs every config's steps and saves what each step returned or raised.
"""
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import distributed
from torch import nn

WORLD, SEED, EXPECTED_BATCH, LEARNING_RATE, TIMEOUT = 2, 11, 6.0, 0.5, 120
CONFIGS = {
    "gaussian-flat": lambda: dpsgd.DPSGDConfig(0.4, noise_multiplier=0.7),
    "vmf-per-layer": lambda: dpsgd.DPSGDConfig([0.3, 0.1, 0.2, 0.05], "vmf", per_layer=True, kappa=500.0),
    "laplace-flat": lambda: dpsgd.DPSGDConfig(1.5, "laplace", noise_multiplier=0.5),
}
# Each step's physical batches on process 0 and on process 1 (sample counts), in the order the
# logical batch is split: an empty share, accumulation on one side only, a step whose process 1
# has a non-finite sample (every process raises, none steps), then a step as usual.
STEPS = [((3,), (2,)), ((0,), (4,)), ((2, 1), (2,)), ((2,), (2,)), ((1,), (3,))]
NON_FINITE_STEP = 3


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))


def logical_batch(step: int) -> tuple:
    sizes = [n for shares in STEPS[step] for n in shares]
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(sizes), 2, 6, 6, generator=generator)
    y = torch.randint(0, 4, (sum(sizes),), generator=generator)
    if step == NON_FINITE_STEP:
        x[sum(STEPS[step][0])] = float("nan")  # process 1's first sample
    return x, y


def share(step: int, rank: int) -> list:
    """This process's physical batches of the step: slices of the logical batch."""
    x, y = logical_batch(step)
    start = sum(sum(shares) for shares in STEPS[step][:rank])
    batches = []
    for n in STEPS[step][rank]:
        batches.append((x[start:start + n], y[start:start + n]))
        start += n
    return batches


def losses(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def worker(rank: int, folder: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT))
    default_bucket = distributed.BUCKET_ELEMENTS
    try:
        results = {}
        for name, config in CONFIGS.items():
            # VMF's run sends its sums in three collectives each way: [flags, conv weight, conv bias],
            # [linear weight] and [linear bias]; the others' in one
            distributed.BUCKET_ELEMENTS = 60 if name == "vmf-per-layer" else default_bucket
            model = network()
            if rank == 1:  # DDP starts every replica from the first process's parameters
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
            replicated = nn.parallel.DistributedDataParallel(model)
            bk = dpsgd.BookKeeping(replicated, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), config(),
                                   expected_batch_size=EXPECTED_BATCH, generator=M.NoiseGenerator(SEED + rank))
            steps = []
            for step in range(len(STEPS)):
                batches = share(step, rank)
                try:
                    for x, y in batches[:-1]:
                        bk.accumulate(losses(replicated, x, y))
                    steps.append(bk.step(losses(replicated, *batches[-1])))
                except ValueError as error:
                    steps.append(str(error))
            results[name] = {"steps": steps, "parameters": [p.detach().clone() for p in model.parameters()],
                             "taken": bk.steps}
            bk.remove()
            assert replicated.require_backward_grad_sync
        torch.save(results, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """What each of the two processes saved."""
    folder = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    processes = [subprocess.Popen([sys.executable, __file__, str(rank), str(folder)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(WORLD)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT + 60)[0].decode(errors="replace"))
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD)]


def materialised_run(config: dpsgd.DPSGDConfig) -> tuple:
    """One process, the whole logical batches: each step's update (None for the step that
    raises), and the parameters at the end."""
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    generator = M.NoiseGenerator(SEED)
    updates = []
    for step in range(len(STEPS)):
        if step == NON_FINITE_STEP:
            updates.append(None)
            continue
        x, y = logical_batch(step)
        grads = dpsgd.per_sample_gradients(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
        update = dpsgd.privatize(grads, config, EXPECTED_BATCH, generator=generator)
        for p, u in zip(model.parameters(), update):
            p.grad = u
        optimizer.step()
        updates.append(update)
    return updates, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_processes_release_what_one_process_releases_on_the_whole_batch(replicas, name):
    """Both processes get the same update bits each step, the update of one process clipping the
    whole logical batch with the first process's noise (float32 rounding of the sums' order aside);
    the step with a non-finite sample on process 1 raises on both and is taken on neither; both
    replicas end equal, and equal to the one-process run."""
    first, second = (r[name] for r in replicas)
    want, want_parameters = materialised_run(CONFIGS[name]())
    scale = max(float(u.abs().max()) for update in want if update is not None for u in update)
    for step, (got, other, expected) in enumerate(zip(first["steps"], second["steps"], want)):
        if expected is None:
            assert re.fullmatch(r"per-sample gradients are not finite on process\(es\) \[1\] .*taken on no process.*",
                                got), got
            assert re.fullmatch(r"process 1 of the group: per-sample gradients of samples \[0\] are not finite; .*"
                                "the step is taken on no process", other), other
            continue
        assert all(torch.equal(a, b) for a, b in zip(got, other)), f"step {step}: the processes' updates differ"
        for g, w in zip(got, expected):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-6 * scale)
    assert first["taken"] == second["taken"] == len(STEPS) - 1
    for a, b, w in zip(first["parameters"], second["parameters"], want_parameters):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


def test_small_tensors_travel_together(monkeypatch):
    """The collectives' buckets: consecutive tensors up to the limit, a larger one alone (the VMF
    run's three above: the flags and the network's four sums, at 60 elements)."""
    monkeypatch.setattr(distributed, "BUCKET_ELEMENTS", 60)
    sums = [torch.zeros(2)] + [torch.zeros(p.shape) for p in network().parameters()]
    assert [[t.numel() for t in bucket] for bucket in distributed._buckets(sums)] == [[2, 54, 3], [192], [4]]
    monkeypatch.setattr(distributed, "BUCKET_ELEMENTS", 1)
    assert [[t.numel() for t in bucket] for bucket in distributed._buckets(sums)] == [[2], [54], [3], [192], [4]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("name", ["gaussian-flat", "vmf-per-layer"])
def test_one_process_releases_the_bits_it_releases_without_ddp(tmp_path, device, name):
    """A group of one (gloo on the CPU, NCCL on a GPU): the reduce and the broadcast change no bit,
    so the DDP model's updates are those of the same model unwrapped, step for step."""
    import torch.distributed as dist

    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        updates = []
        for wrap in (False, True):
            model = network().to(device)
            forward = nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None) \
                if wrap else model
            bk = dpsgd.BookKeeping(forward, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), CONFIGS[name](),
                                   expected_batch_size=EXPECTED_BATCH, generator=M.NoiseGenerator(SEED))
            updates.append([[u.clone() for u in bk.step(losses(forward, x.to(device), y.to(device)))]
                            for x, y in (logical_batch(step) for step in (0, 1, 4))])
        for plain, replicated in zip(*updates):
            assert all(torch.equal(a, b) for a, b in zip(plain, replicated))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_a_model_sharded_over_processes_is_refused(tmp_path, device):
    """FSDP's fully_shard (its parameters DTensors: the step failed inside torch, on a DTensor added
    to a tensor) and, on a GPU, FullyShardedDataParallel (its FlatParameter, which no layer rule
    reads) are refused naming the sharding; the model's hooks are left as they were."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        models = {"held as DTensors": fully_shard(network().to(device))}
        if device == "cuda":
            models["wrapped in FullyShardedDataParallel"] = FullyShardedDataParallel(network().to(device))
        for sharding, model in models.items():
            hooks = [len(m._forward_hooks) for m in model.modules()]  # FSDP's own
            with pytest.raises(ValueError, match=f"model's parameters are {sharding}.*DistributedDataParallel"):
                dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters()), dpsgd.DPSGDConfig(1.0),
                                  expected_batch_size=2)
            assert [len(m._forward_hooks) for m in model.modules()] == hooks
    finally:
        dist.destroy_process_group()


def test_what_a_distributed_model_cannot_take_is_refused(tmp_path):
    """One process: a DDP with static_graph=True (its first backward runs DDP's delayed all-reduce,
    where torch failed an internal assert); graphed() (DDP's forward was never checked under CUDA
    graph capture). DDP's own all-reduce is off while the book-keeping is in place."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        static = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), static_graph=True)
        with pytest.raises(ValueError, match="model is a DistributedDataParallel built with static_graph=True"):
            dpsgd.BookKeeping(static, torch.optim.SGD(static.parameters()), dpsgd.DPSGDConfig(1.0),
                              expected_batch_size=2)
        assert static.require_backward_grad_sync
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters()), dpsgd.DPSGDConfig(1.0),
                               expected_batch_size=2)
        assert not model.require_backward_grad_sync
        with pytest.raises(ValueError, match=r"graphed\(\): the model is a DistributedDataParallel.*step\(\)"):
            bk.graphed(lambda x: model(x).sum(1), torch.randn(2, 2))
        bk.remove()
        assert model.require_backward_grad_sync
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(int(sys.argv[1]), Path(sys.argv[2]))
