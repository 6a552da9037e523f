"""The whole DP-SGD training step across processes (DistributedDataParallel): privleak's
book-keeping against the non-private DDP step and Opacus's distributed DP-SGD, in one run.

    python bench/bench_distributed_step.py [--models cifar-cnn transformer] [--world 2] [--threads 1]
                                           [--batches 64 128] [--rounds 5] [--steps 3]

W processes on this machine (gloo, CPU; --threads torch threads each) train the models of
bench_training_step.py; each batch size is the logical batch of all processes together, each
process taking an equal share. Sides: "non-private" is torch's DDP step (mean loss, backward,
whose hooks all-reduce the gradients, SGD step: the floor); "book-keeping" is
privleak.dpsgd.BookKeeping on the DDP model (each process clips its share, the clipped sums are
reduced to the first process, noised there once and broadcast); "opacus hooks" and "opacus
ghost" are Opacus's make_private on its DifferentiallyPrivateDistributedDataParallel, grad_sample_mode
"hooks" and "ghost" (its distributed optimizers: noise on the first process, an all-reduce of
the noisy gradients); "+ privleak" is the same engine with privleak's optimizer swapped in
(opacus_interop.PrivleakDPOptimizer.from_opacus: privleak's clipping for hooks, and the clipped
sums reduced to the first process, noised there once and broadcast). Clip norm 1, noise
multiplier 1, flat clipping.

Every process runs the same steps in the same order (each step holds collectives, so they keep in
step); the sides run in turns, --rounds rounds of --steps steps each, in reverse order every other
round, a barrier before each; the first process's wall time is reported: each side's median step,
and its ratio to non-private as the median over rounds of the two sides' times in the same round.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import privleak
import torch
import torch.distributed as dist
from _measure import cpu_name, table
from bench_training_step import CLIP, LR, MODELS, SIGMA, opacus_step, setting
from privleak import dpsgd
from torch import nn

SIDES = ("non-private", "book-keeping", "opacus hooks", "opacus ghost", "opacus hooks + privleak",
         "opacus ghost + privleak")


def make_side(side: str, model: nn.Module, criterion_class, batch: int, world: int, x: torch.Tensor):
    """One training step of ``side`` on this process's share ``x`` (and targets) of a logical batch
    of ``batch`` samples; ``model`` is the side's own copy."""
    criterion = criterion_class()
    if side == "non-private":
        replicated = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        def step(x, y):
            optimizer.zero_grad(set_to_none=True)
            criterion(replicated(x), y).backward()
            optimizer.step()
        return step
    if side == "book-keeping":
        replicated = nn.parallel.DistributedDataParallel(model)
        bk = dpsgd.BookKeeping(replicated, torch.optim.SGD(model.parameters(), lr=LR),
                               dpsgd.DPSGDConfig(CLIP, noise_multiplier=SIGMA), expected_batch_size=batch)
        per_sample = criterion_class(reduction="none")
        return lambda x, y: bk.step(per_sample(replicated(x), y))
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel

    replicated = DifferentiallyPrivateDistributedDataParallel(model)
    return opacus_step(side, replicated, torch.optim.SGD(replicated.parameters(), lr=LR), criterion, x,
                       batch // world)


def timed_rounds(steps: dict, x, y, rounds: int, count: int) -> dict:
    """Each side's seconds a step in each round, the sides in turns, a barrier before each."""
    times = {side: [] for side in steps}
    for r in range(rounds):
        for side in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                steps[side](x, y)
            times[side].append((time.perf_counter() - start) / count)
    return times


def worker(rank: int, args, rendezvous: str) -> None:
    torch.set_num_threads(args.threads)
    privleak.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.world,
                            timeout=timedelta(minutes=10))
    try:
        if rank == 0:
            print(f"torch {torch.__version__}, {cpu_name()}, {args.world} processes (gloo) of {args.threads} torch "
                  f"thread(s); clip {CLIP}, noise multiplier {SIGMA}, flat clipping\n", flush=True)
        rows = []
        for name in args.models:
            for batch in args.batches or MODELS[name][3]:
                model, x, y, criterion_class = setting(name, batch, "cpu")
                share = batch // args.world
                x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
                steps, failed = {}, {}
                for side in SIDES:  # every process fails alike: the sides are the same on all
                    try:
                        steps[side] = make_side(side, copy.deepcopy(model), criterion_class, batch, args.world, x)
                        steps[side](x, y)
                    except Exception as error:  # the row shows what the library raised
                        failed[side] = f"fails: {type(error).__name__}: {str(error).splitlines()[0][:70]}"
                        steps.pop(side, None)
                times = timed_rounds(steps, x, y, args.rounds, args.steps)
                params = sum(p.numel() for p in model.parameters() if p.requires_grad)
                for side in SIDES:
                    row = {"model": name, "params": f"{params / 1e6:.2f}M", "batch": f"{batch} ({share} a process)",
                           "side": side}
                    if side in failed:
                        row["ms"] = failed[side]
                    else:
                        row["ms"] = f"{statistics.median(times[side]) * 1e3:.1f}"
                        ratios = [t / base for t, base in zip(times[side], times["non-private"])]
                        row["x non-private"] = f"{statistics.median(ratios):.2f}x"
                    rows.append(row)
                if rank == 0:
                    print(table(rows[-len(SIDES):], ["model", "params", "batch", "side", "ms", "x non-private"]),
                          flush=True)
                    print()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cifar-cnn", "transformer"], choices=list(MODELS))
    parser.add_argument("--world", type=int, default=2, help="processes")
    parser.add_argument("--threads", type=int, default=1, help="torch's and privleak's CPU threads a process")
    parser.add_argument("--batches", type=int, nargs="+", help="logical batch sizes instead of each model's own")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of timing, the sides in turns")
    parser.add_argument("--steps", type=int, default=3, help="steps a side takes in a round")
    args = parser.parse_args()
    for batch in args.batches or ():
        if batch % args.world:
            parser.error(f"--batches: {batch} does not split into {args.world} equal shares")
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(worker, args=(args, os.path.join(folder, "rendezvous")), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
