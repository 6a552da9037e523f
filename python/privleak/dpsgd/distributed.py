"""Book-keeping across processes: a model wrapped in DistributedDataParallel.

Each process takes its own share of the logical batch (with Poisson sampling, its share of one
Poisson sample of the whole dataset, drawn alike on every process from a generator seeded alike)
and clips and sums its samples as one process would: a sample's clip factor depends on its own
gradient alone. The processes' clipped sums are then reduced to the group's
first process, which privatises the whole batch's sum once, with its own noise generator, and
broadcasts the update; every process steps with that update, so the replicas stay equal. The
update is therefore the one a single process would release on the whole logical batch, float32
rounding of the sum's order aside, and so is its privacy.

Opacus's distributed optimizer adds the noise to the first process's sum before one all-reduce,
which suits additive noise only. Reducing first and broadcasting the release costs about as much
communication (a reduce and a broadcast against an all-reduce's reduce-scatter and all-gather),
and serves every mechanism as it is: VMF's release of the normalised direction and secure
noise on the sum's grid are not additive over the processes' sums.

DDP's own all-reduce runs on the ``.grad`` an ordinary backward pass accumulates; book-keeping's
backward makes none, so it is switched off (``require_backward_grad_sync``, as DDP's
``no_sync`` does) while the book-keeping is in place, with DDP's broadcast of the buffers at a
forward pass (:meth:`Replicas._attach`).

Every collective of a step is in :func:`release_across`, which every process calls once a step
whatever befell its batch: an error of one process's batch travels as a flag with the sums, and
all processes raise together. privleak's optimizers inside Opacus's distributed engines
(:mod:`privleak.opacus_interop`) release their processes' clipped sums through it too.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

BUCKET_ELEMENTS = 1 << 23  # 32 MiB of float32 a collective: small tensors travel together, big ones as they are


def refuse_sharded(model: nn.Module) -> None:
    """Refuse a model whose parameters are sharded over processes (FSDP, tensor parallelism):
    book-keeping's layer rules need each layer's whole weight and batch in one process. (The
    modules are looked up only if the program imported them, which it has if it sharded.)"""
    fsdp, tensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in model.modules()):
        sharded = "wrapped in FullyShardedDataParallel"
    elif tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters()):
        sharded = "held as DTensors (FSDP's fully_shard, or tensor parallelism)"
    else:
        return
    raise ValueError(f"model's parameters are {sharded}, sharded over processes: book-keeping needs each layer's "
                     "whole weight in every process; replicate the model with DistributedDataParallel instead")


class Replicas:
    """The processes of a DistributedDataParallel model, as book-keeping's step meets them: the
    clipped sums reduced, released once, broadcast."""

    def __init__(self, model: nn.parallel.DistributedDataParallel, agreed: dict):
        if model.static_graph:
            raise ValueError("model is a DistributedDataParallel built with static_graph=True, whose first backward "
                             "pass runs DDP's delayed all-reduce of the .grad that book-keeping's backward does not "
                             "make (torch fails inside it): build it without static_graph")
        self.model = model
        self.group = model.process_group
        check_agreed(agreed, self.group, "book-keeping")
        self._synced = model.require_backward_grad_sync, model.require_forward_param_sync
        self._attach()

    def _attach(self) -> None:
        """DDP's all-reduce off, and its broadcast of the buffers at a forward pass, which DDP
        makes while its all-reduce is on and at the first forward pass after it was: a collective
        there would meet the step's reduce on a process whose share is empty and runs no forward
        pass (DDP's constructor broadcast them already). Set again at each step, as a wrapper's
        own gradient accumulation may set DDP's flag back."""
        self.model.require_backward_grad_sync = self.model.require_forward_param_sync = False

    def detach(self) -> None:
        """Give DDP its all-reduce back (:meth:`BookKeeping.remove`)."""
        self.model.require_backward_grad_sync, self.model.require_forward_param_sync = self._synced

    def release(self, sums: list, privatise: Callable[[list, int], list], failure: Optional[BaseException],
                samples: int) -> list:
        """:func:`release_across` the replicas' processes."""
        self._attach()
        return release_across(self.group, sums, privatise, failure, samples)


def release_across(group, sums: list, privatise: Callable[[list, int], list], failure: Optional[BaseException],
                   samples: int = 0) -> list:
    """The update ``privatise(sums, samples)`` makes of the processes' summed ``sums`` (one per
    parameter, the same shapes and dtypes on every process, consumed) and their summed
    ``samples`` (this process's share of the batch: the whole batch's size, which no process
    alone knows, for fixed-size sampling's check), made on the group's first process and
    broadcast to all. Every process of ``group`` (None: the default group) calls it once a step.

    ``failure``: the error of this process's batch, if any. Each process's flag travels with
    the sums, so the first process learns of any, and its verdict (with a flag of its own if
    privatising failed) with the update: then every process raises together, its own error
    on a process that had one (none waits in a collective for the others, and the next step
    pairs up as before), nothing is released, and the step changes nothing anywhere."""
    group = group or dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    root = dist.get_global_rank(group, 0)  # collectives name their root by its global rank
    # the flags (a process's failure, then the release's) and the samples travel with the sums, in their
    # dtype (book-keeping's float32 counts up to 2^24 samples exactly)
    counts = torch.zeros(world_size + 2, dtype=sums[0].dtype, device=sums[0].device)
    flags = counts[:-1]
    flags[rank], counts[-1] = failure is not None, samples
    for bucket in _buckets([counts, *sums]):
        _collective(bucket, lambda t: dist.reduce(t, root, group=group))
    if rank == 0:
        if not flags.any():
            try:  # an out-of-memory error, or a batch of the wrong size: the others would wait in the broadcast
                sums = [u.to(s.dtype).contiguous() for u, s in zip(privatise(sums, round(counts[-1].item())), sums)]
            except Exception as error:
                failure, flags[world_size] = error, 1
        if flags.any():  # the sum without its noise stays here
            sums = [torch.zeros_like(s) for s in sums]
    for bucket in _buckets([counts, *sums]):
        _collective(bucket, lambda t: dist.broadcast(t, root, group=group))
    if failure is not None:
        raise failure
    if flags.any():
        ranks = flags[:world_size].nonzero().flatten().tolist()
        raise ValueError(f"the step failed on process(es) {ranks or [0]} of the group, each raising its own error "
                         f"({'its batch' if ranks else 'releasing the sums: its error says why'}); the step is taken "
                         "on no process")
    return sums


def check_agreed(agreed: dict, group, what: str) -> None:
    """Refuse, on every process of ``group`` (None: the default group), settings of ``what`` that
    differ between the processes: the first process calibrates the noise to its own, which would
    not bound another's clipped sums."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {key: repr(value) for key, value in agreed.items()}, group=group)
    differing = [key for key in agreed if len({settings[key] for settings in gathered}) > 1]
    if differing:
        values = "; ".join(f"process {rank}: " + ", ".join(settings[key] for key in differing)
                           for rank, settings in enumerate(gathered))
        raise ValueError(f"the processes' {what} differs in {', '.join(differing)} ({values}): every process "
                         "must build it with the same settings, for the first process's noise to fit every "
                         "process's sums")


def _buckets(tensors: list) -> list:
    """Consecutive tensors in groups of at most BUCKET_ELEMENTS elements (a larger tensor alone)."""
    buckets, current, size = [], [], 0
    for t in tensors:
        if current and size + t.numel() > BUCKET_ELEMENTS:
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += t.numel()
    return buckets + [current] if current else buckets


def _collective(bucket: list, run: Callable[[torch.Tensor], object]) -> None:
    """``run`` on the bucket's tensor, or on one flat copy of its tensors (or of a tensor that is not
    contiguous, which a collective refuses), copied back after."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        run(bucket[0])
        return
    flat = torch.cat([t.reshape(-1) for t in bucket])
    run(flat)
    for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
        t.copy_(part.view_as(t))
