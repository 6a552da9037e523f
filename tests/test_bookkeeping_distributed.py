"""dpsgd.BookKeeping on a model wrapped in DistributedDataParallel: two real processes (gloo, CPU),
each taking its share of every logical batch, against one process running the materialised path
(torch.func per-sample gradients through dpsgd.privatize) on the whole batch with the first
process's noise stream.

This file is also the worker: ``python test_bookkeeping_distributed.py RANK FOLDER`` joins the
group by a file in FOLDER, runs every config's steps and saves what each step returned or raised.
"""
import gc
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda, run_processes
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import distributed
from torch import nn

WORLD, SEED, EXPECTED_BATCH, LEARNING_RATE, TIMEOUT = 2, 11, 6.0, 0.5, 120
CONFIGS = {
    "gaussian-flat": lambda: dpsgd.DPSGDConfig(0.4, noise_multiplier=0.7),
    "vmf-per-layer": lambda: dpsgd.DPSGDConfig([0.3, 0.1, 0.2, 0.05], "vmf", per_layer=True, kappa=500.0),
    "laplace-flat": lambda: dpsgd.DPSGDConfig(1.5, "laplace", noise_multiplier=0.5),
    # secure noise is added to the undivided sum, which is divided after it: that path, without the
    # noise (which no seed reproduces)
    "secure-noiseless": lambda: dpsgd.DPSGDConfig(0.4, noise_multiplier=0.0),
}
SECURE = ("secure-noiseless",)
# Each step's physical batches on process 0 and on process 1 (sample counts), in the order the
# logical batch is split. Process 0's first share is empty and it runs no forward pass (DDP would
# broadcast the buffers at process 1's first one); process 1's second is an empty batch run
# through the model; then accumulation on one side only, and three steps that fail on one
# process, every process raising and none stepping: a non-finite sample on process 1, losses of
# the wrong shape on process 0, and the first process failing to privatise (out of memory, say).
STEPS = [((0,), (3,)), ((2,), (0,)), ((2, 1), (2,)), ((2,), (2,)), ((1,), (3,)), ((2,), (1,)), ((1,), (2,)),
         ((2,), (2,))]
NON_FINITE_STEP, BAD_LOSSES_STEP, PRIVATISE_FAILS_STEP = 3, 5, 6
FAILING = {NON_FINITE_STEP: 1, BAD_LOSSES_STEP: 0, PRIVATISE_FAILS_STEP: 0}  # step: the process whose error it is


class Shift(nn.Module):
    """Adds a buffer: a model with buffers, which DDP broadcasts at a forward pass while its
    all-reduce is on."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, width))

    def forward(self, x):
        return x + self.shift


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4), Shift(4))


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


class PrivatiseFails(RuntimeError):
    pass


def run_steps(bk: dpsgd.BookKeeping, replicated: nn.Module, rank: int) -> list:
    """Each step's update, or its error's type and message."""
    steps = []
    for step in range(len(STEPS)):
        batches = share(step, rank)
        if step == PRIVATISE_FAILS_STEP and rank == 0:
            def fail(*_, **__):
                raise PrivatiseFails("out of memory (simulated)")
            bk._privatised = fail
        try:
            for x, y in batches[:-1]:
                bk.accumulate(losses(replicated, x, y))
            if step == 0 and rank == 0:
                steps.append(bk.step())  # its share is empty: no forward pass
            elif step == BAD_LOSSES_STEP and rank == 0:
                steps.append(bk.step(losses(replicated, *batches[-1]).unsqueeze(1)))
            else:
                steps.append(bk.step(losses(replicated, *batches[-1])))
        except (ValueError, PrivatiseFails) as error:
            steps.append((type(error).__name__, str(error)))
        finally:
            bk.__dict__.pop("_privatised", None)
    return steps


def worker(rank: int, folder: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT))
    default_bucket = distributed.BUCKET_ELEMENTS
    try:
        results = {}
        model = network()
        replicated = nn.parallel.DistributedDataParallel(model)
        try:  # process 1 expects another batch size: refused on both
            dpsgd.BookKeeping(replicated, torch.optim.SGD(model.parameters()), CONFIGS["gaussian-flat"](),
                              expected_batch_size=EXPECTED_BATCH + rank)
        except ValueError as error:
            results["settings differ"] = (str(error), replicated.require_backward_grad_sync,
                                          sum(len(m._forward_hooks) for m in model.modules()))
        for name, config in CONFIGS.items():
            # VMF's run sends its sums in four collectives each way: [flags and samples, conv weight],
            # [conv bias], [linear weight] and [linear bias]; the others' in one
            distributed.BUCKET_ELEMENTS = 60 if name == "vmf-per-layer" else default_bucket
            model = network()
            if rank == 1:  # DDP starts every replica from the first process's parameters
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
            replicated = nn.parallel.DistributedDataParallel(model)
            generator = M.SecureNoiseGenerator() if name in SECURE else M.NoiseGenerator(SEED + rank)
            bk = dpsgd.BookKeeping(replicated, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), config(),
                                   expected_batch_size=EXPECTED_BATCH, generator=generator)
            steps = run_steps(bk, replicated, rank)
            results[name] = {"steps": steps, "parameters": [p.detach().clone() for p in model.parameters()],
                             "taken": bk.steps}
            bk.remove()
            assert replicated.require_backward_grad_sync
        distributed.BUCKET_ELEMENTS = default_bucket
        results["fixed"] = fixed_size_steps(rank)
        torch.save(results, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def fixed_size_steps(rank: int) -> tuple:
    """Fixed-size batches of 4 across the processes: shares of 2 and 2, then of 2 and 1 (3 in
    all): each step's outcome, and the steps taken."""
    model = network()
    replicated = nn.parallel.DistributedDataParallel(model)
    bk = dpsgd.BookKeeping(replicated, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
                           CONFIGS["gaussian-flat"](), expected_batch_size=4, generator=M.NoiseGenerator(SEED),
                           sampling="fixed")
    x, y = logical_batch(2)
    outcomes = []
    for sizes in ((2, 2), (2, 1)):
        start = sum(sizes[:rank])
        try:
            bk.step(losses(replicated, x[start:start + sizes[rank]], y[start:start + sizes[rank]]))
            outcomes.append("stepped")
        except ValueError as error:
            outcomes.append(str(error))
    return outcomes, bk.steps


@pytest.fixture
def group_of_one(tmp_path):
    """Joins this process alone to a process group (gloo, or NCCL on a GPU); destroys it after the
    test, whose DDP models are gone by then. A DDP model freed after destroy_process_group()
    destroyed its group from its dealloc, holding the GIL that gloo's worker thread, still letting
    go of its last collective, waited for: a hang of the suite (torch's)."""
    import torch.distributed as dist

    def join(backend: str = "gloo") -> None:
        dist.init_process_group(backend, init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)

    yield join
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """What each of the two processes saved."""
    return run_processes(__file__, tmp_path_factory.mktemp("ddp"), WORLD, TIMEOUT + 60)


def materialised_run(config: dpsgd.DPSGDConfig) -> tuple:
    """One process, the whole logical batches: each step's update (None for a step that
    raises), and the parameters at the end."""
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    generator = M.NoiseGenerator(SEED)
    updates = []
    for step in range(len(STEPS)):
        if step in FAILING:
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


#: a failing step's error on the process whose error it is, and on the other
OWN_ERRORS = {NON_FINITE_STEP: ("ValueError", r"per-sample gradients of samples \[0\] \(of the 2 whose losses were "
                                               r"given\) are not finite \(or their (L1 )?norm beyond .*\); .*"),
              BAD_LOSSES_STEP: ("ValueError", r"per_sample_losses must be a 1-D tensor .*"),
              PRIVATISE_FAILS_STEP: ("PrivatiseFails", r"out of memory \(simulated\)")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_processes_release_what_one_process_releases_on_the_whole_batch(replicas, name):
    """Both processes get the same update bits each step, the update of one process clipping the
    whole logical batch with the first process's noise (float32 rounding of the sums' order aside;
    the secure path's sums, which are divided after the noise, without the noise), whether a share
    is empty (with or without a forward pass) or accumulated. A step that fails on one process (a
    non-finite sample, bad losses, the noise itself) raises on both, the error's own on its
    process, and is taken on neither; the next steps pair up as before. Both replicas end equal,
    and equal to the one-process run."""
    runs = [r[name] for r in replicas]
    want, want_parameters = materialised_run(CONFIGS[name]())
    scale = max(float(u.abs().max()) for update in want if update is not None for u in update)
    for step, expected in enumerate(want):
        got = [run["steps"][step] for run in runs]
        if expected is None:
            failing = FAILING[step]
            kind, message = OWN_ERRORS[step]
            assert got[failing][0] == kind and re.fullmatch(message, got[failing][1]), got[failing]
            other = got[1 - failing]
            cause = "releasing the sums: its error says why" if step == PRIVATISE_FAILS_STEP else "its batch"
            assert other[0] == "ValueError" and other[1] == (
                f"the step failed on process(es) [{failing}] of the group, each raising its own error ({cause}); "
                "the step is taken on no process"), other
            continue
        assert all(torch.equal(a, b) for a, b in zip(*got)), f"step {step}: the processes' updates differ"
        for g, w in zip(got[0], expected):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-6 * scale)
    assert runs[0]["taken"] == runs[1]["taken"] == len(STEPS) - len(FAILING)
    for a, b, w in zip(runs[0]["parameters"], runs[1]["parameters"], want_parameters):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


def test_processes_with_different_settings_are_refused(replicas):
    """Process 1 built its book-keeping for another expected batch size (the first process would
    calibrate the noise to its own): both refuse, naming it and each process's value, before
    turning DDP's all-reduce off or hooking a layer."""
    for rank, result in enumerate(r["settings differ"] for r in replicas):
        message, synced, hooks = result
        assert message == ("the processes' book-keeping differs in expected_batch_size (process 0: 6.0; process 1: "
                           "7.0): every process must build it with the same settings, for the first process's noise "
                           "to fit every process's sums"), (rank, message)
        assert synced and hooks == 0


def test_fixed_size_batches_are_checked_on_the_processes_batch(replicas):
    """sampling="fixed" across processes: each process has a share of the batch, and the first
    process checks their sum, expected_batch_size, in the release (unchecked before: a logical
    batch of another size was released and accounted as one of L). A batch of 3 for 4 raises on
    both processes, and the step is taken on neither."""
    (first, taken), (second, taken_too) = (r["fixed"] for r in replicas)
    assert first[0] == second[0] == "stepped"
    assert first[1].startswith("sampling='fixed' draws batches of expected_batch_size=4 examples, got a batch of 3")
    assert second[1] == ("the step failed on process(es) [0] of the group, each raising its own error (releasing "
                         "the sums: its error says why); the step is taken on no process")
    assert taken == taken_too == 1


def test_small_tensors_travel_together(monkeypatch):
    """The collectives' buckets: consecutive tensors up to the limit, a larger one alone (the VMF
    run's four above: the flags and samples and the network's four sums, at 60 elements)."""
    monkeypatch.setattr(distributed, "BUCKET_ELEMENTS", 60)
    sums = [torch.zeros(WORLD + 2)] + [torch.zeros(p.shape) for p in network().parameters()]
    assert [[t.numel() for t in bucket] for bucket in distributed._buckets(sums)] == [[4, 54], [3], [192], [4]]
    monkeypatch.setattr(distributed, "BUCKET_ELEMENTS", 1)
    assert [[t.numel() for t in bucket] for bucket in distributed._buckets(sums)] == [[4], [54], [3], [192], [4]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("name", ["gaussian-flat", "vmf-per-layer"])
def test_one_process_releases_the_bits_it_releases_without_ddp(group_of_one, device, name):
    """A group of one (gloo on the CPU, NCCL on a GPU): the reduce and the broadcast change no bit,
    so the DDP model's updates are those of the same model unwrapped, step for step."""
    group_of_one("gloo" if device == "cpu" else "nccl")
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_a_model_sharded_over_processes_is_refused(group_of_one, device):
    """FSDP's fully_shard (its parameters DTensors: the step failed inside torch, on a DTensor added
    to a tensor) and, on a GPU, FullyShardedDataParallel (its FlatParameter, which no layer rule
    reads) are refused naming the sharding; the model's hooks are left as they were."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    group_of_one("gloo" if device == "cpu" else "nccl")
    models = {"held as DTensors": fully_shard(network().to(device))}
    if device == "cuda":
        models["wrapped in FullyShardedDataParallel"] = FullyShardedDataParallel(network().to(device))
    for sharding, model in models.items():
        hooks = [len(m._forward_hooks) for m in model.modules()]  # FSDP's own
        with pytest.raises(ValueError, match=f"model's parameters are {sharding}.*DistributedDataParallel"):
            dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters()), dpsgd.DPSGDConfig(1.0),
                              expected_batch_size=2)
        assert [len(m._forward_hooks) for m in model.modules()] == hooks


def test_what_a_distributed_model_cannot_take_is_refused(group_of_one):
    """One process: a DDP with static_graph=True (its first backward runs DDP's delayed all-reduce,
    where torch failed an internal assert); graphed() (DDP's forward was never checked under CUDA
    graph capture). DDP's own all-reduce is off while the book-keeping is in place."""
    group_of_one()
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


if __name__ == "__main__":
    worker(int(sys.argv[1]), Path(sys.argv[2]))
