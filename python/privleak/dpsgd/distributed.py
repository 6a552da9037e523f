"""Book-keeping across processes: a model wrapped in DistributedDataParallel.

Each process takes its own share of the logical batch (with Poisson sampling, each process
samples its shard of the dataset at the same rate q, which is Poisson sampling of the whole
dataset at q) and clips and sums its samples as one process would: a sample's clip factor
depends on its own gradient alone. The processes' clipped sums are then reduced to the group's
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
``no_sync`` does) while the book-keeping is in place.
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

    def __init__(self, model: nn.parallel.DistributedDataParallel):
        if model.static_graph:
            raise ValueError("model is a DistributedDataParallel built with static_graph=True, whose first backward "
                             "pass runs DDP's delayed all-reduce of the .grad that book-keeping's backward does not "
                             "make (torch fails inside it): build it without static_graph")
        self.model = model
        self.group = model.process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.root = dist.get_global_rank(self.group, 0)  # collectives name their root by its global rank
        self._synced = model.require_backward_grad_sync
        model.require_backward_grad_sync = False

    def detach(self) -> None:
        """Give DDP its all-reduce back (:meth:`BookKeeping.remove`)."""
        self.model.require_backward_grad_sync = self._synced

    def release(self, sums: list, privatise: Callable[[list], list], failure: Optional[str]) -> list:
        """The update ``privatise`` makes of the processes' summed ``sums`` (float32, one per
        parameter, consumed), made on the group's first process and broadcast to all.

        ``failure``: this process's message if its batch had a non-finite sample. Each process's
        flag travels with the sums, so the first process learns of any, and its verdict with the
        update: then every process raises together (none waits in a collective for the others),
        nothing is privatised, and the step changes nothing anywhere."""
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=sums[0].device)
        flags[self.rank] = failure is not None
        for bucket in _buckets([flags, *sums]):
            _collective(bucket, lambda t: dist.reduce(t, self.root, group=self.group))
        if self.rank == 0 and not flags.any():
            sums = [u.to(torch.float32).contiguous() for u in privatise(sums)]
        for bucket in _buckets([flags, *sums]):
            _collective(bucket, lambda t: dist.broadcast(t, self.root, group=self.group))
        if failure is not None:
            raise ValueError(f"process {self.rank} of the group: {failure}; the step is taken on no process")
        if flags.any():
            raise ValueError(f"per-sample gradients are not finite on process(es) {flags.nonzero().flatten().tolist()}"
                             " of the group; the step is taken on no process (pass non_finite='drop' to leave such "
                             "samples out)")
        return sums


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
