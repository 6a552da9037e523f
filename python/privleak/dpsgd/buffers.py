"""Buffers that a forward call writes, and whether what it writes is a statistic of the batch.

A forward may write its module's buffers: a call counter, rotary frequencies made again for a
longer sequence (transformers' dynamic RoPE), Phi-3's longrope factors copied in at every call, a
cache made at the first call, or a statistic of the batch: a running standardiser's mean, a
quantization observer's range. A statistic is released with the model outside the noise, and a
forward that reads it couples the samples as BatchNorm in training mode does, so that a sample's
clipped gradient no longer bounds its effect on the update (a review's repro, a parameter-free
running standardiser before a Linear: one sample's removal moved the clipped sum by 1.21 C).

Book-keeping cannot read the forward, so it asks it (:meth:`Snapshot.statistic_of_the_batch`): a
call that changed a buffer's values is run again, without grad, from the state the call found
(the buffers, and the modules' other attributes: a cached length that the forward compares
with), on its first sample alone, then on its last sample alone with that sample's floating-point
inputs shifted by 1 (so that a batch of one tells too). A buffer that either run leaves otherwise
than the call did depends on the batch, and the call is refused. A counter, a cache of the
positions, and the longrope switch at a sequence length leave the same values and train.
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from privleak.dpsgd.graph import capturing

#: buffers of at most this many elements are copied before each call; a larger one that the call writes in place
#: cannot be run again from the value it had, and is refused
COPIED_SIZE = 1 << 16



class Before(NamedTuple):
    """A buffer as a call found it: the tensor, its version then, and a copy of a small one."""

    tensor: torch.Tensor
    version: int
    copy: Optional[torch.Tensor]

    def value(self) -> Optional[torch.Tensor]:
        """The value the call found: the copy, or the tensor itself where the call did not write it
        (it rebound the buffer); None where neither is left."""
        if self.copy is not None:
            return self.copy
        return self.tensor if self.tensor._version == self.version else None

    def kept_by(self, now: Optional[torch.Tensor]) -> bool:
        """Whether the buffer holds ``now`` with the value the call found: the same tensor, not
        written (a write through ``.data`` keeps the version), or other values compared equal.
        Not compared while a CUDA graph captures (a read would wait for the device)."""
        if now is self.tensor and now._version == self.version:
            return True
        found = self.value()
        return found is not None and now is not None and not capturing() and same(found, now)


class Snapshot:
    """The buffers of some modules ((prefix, module) pairs: a module and its children, or a module
    alone) as a call found them, by name under the first, and each module's other attributes.
    ``skip``: names left out (a parametrization's buffers, which their own rules handle)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], skip: frozenset = frozenset()):
        self.modules = modules
        self.buffers: dict[str, Optional[Before]] = {}  # None: registered as None
        self._keys = []  # per module: (key, name) of its buffers then
        for prefix, module in modules:
            keys = []
            for key, tensor in module._buffers.items():
                name = f"{prefix}.{key}" if prefix else key
                keys.append((key, name))
                if name not in skip:
                    copy = tensor.detach().clone() if tensor is not None and tensor.numel() <= COPIED_SIZE else None
                    self.buffers[name] = None if tensor is None else Before(tensor, tensor._version, copy)
            self._keys.append(keys)
        self._attributes = [dict(vars(module)) for _, module in modules]  # each module's, shallow
        self._skip = skip

    def now(self) -> dict[str, Optional[torch.Tensor]]:
        """The buffers as they are now, by name (those made since included)."""
        return {f"{prefix}.{key}" if prefix else key: tensor for prefix, module in self.modules
                for key, tensor in module._buffers.items() if (f"{prefix}.{key}" if prefix else key) not in self._skip}

    def changed(self) -> list[str]:
        """The buffers the call changed: made (from None, or registered), set to None or removed,
        or holding other values (:meth:`Before.kept_by`)."""
        now = self.now()
        changed = []
        for name in {**self.buffers, **now}:
            before, tensor = self.buffers.get(name), now.get(name)
            if before is None:
                if tensor is not None:
                    changed.append(name)
            elif not before.kept_by(tensor):
                changed.append(name)
        return changed

    def statistic_of_the_batch(self, module: nn.Module, args: tuple, kwargs: dict, changed: list[str]) -> Optional[str]:
        """Why the buffers ``changed`` by a call of ``module`` (whose own buffers and children's
        this holds) are not shown to be independent of the batch: the forward run again from this
        state on one sample leaves one otherwise than the call did (the module docstring), or it
        cannot be run so. None where both runs leave every one as the call did."""
        for name in changed:
            before = self.buffers.get(name)
            if before is not None and before.value() is None:
                return (f"its buffer '{name}' was written in place, and it is too large (over {COPIED_SIZE} "
                        "elements) to be kept and the forward run again from it")
        if capturing():  # the graph's warm-up ran the same forward eagerly, and was so checked
            return None
        left_by_call = self.now()
        for index, shift in ((0, False), (-1, True)):
            try:
                left = self._run_again(module, *_one_sample(args, kwargs, index, shift))
            except Exception as error:  # noqa: BLE001 (any error of the user's forward says it cannot tell)
                return f"its forward, run again on one sample, raised {type(error).__name__}: {error}"
            for name in changed:
                if not same(left.get(name), left_by_call.get(name)):
                    return (f"its buffer '{name}' is left otherwise by the forward run again on "
                            f"{'the last sample alone, shifted by 1' if shift else 'the first sample alone'}")
        return None

    @contextlib.contextmanager
    def restored(self, fresh: bool):
        """The modules as the call found them, their attributes and buffers (fresh copies if
        ``fresh``, else the tensors they held, which a replay's functional_call swaps out); put back
        as the call left them after."""
        left_by_call = [dict(vars(m)) for _, m in self.modules]
        try:
            for (_, m), attributes, keys, left in zip(self.modules, self._attributes, self._keys, left_by_call):
                vars(m).clear()
                vars(m).update(attributes)
                vars(m)["_buffers"] = {key: self._found(name, left, fresh) for key, name in keys}
            yield
        finally:
            for (_, m), attributes in zip(self.modules, left_by_call):
                vars(m).clear()
                vars(m).update(attributes)

    def _run_again(self, module: nn.Module, args: tuple, kwargs: dict) -> dict:
        """The buffers ``module.forward`` leaves when run from this state on ``args``."""
        devices = sorted({x.device.index or 0 for x in tree_flatten((args, kwargs))[0]
                          if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
        with self.restored(fresh=True), torch.no_grad(), torch.random.fork_rng(devices=devices):
            module.forward(*args, **kwargs)
            return self.now()

    def _found(self, name: str, left: dict, fresh: bool) -> Optional[torch.Tensor]:
        """Buffer ``name`` as the call found it (a skipped one as the call left it, in ``left``, its
        module's attributes)."""
        if name in self._skip:
            return left["_buffers"][name.rpartition(".")[2]]
        before = self.buffers[name]
        if before is None:
            return None
        return before.value().clone() if fresh else before.tensor


def refusal(what: str, why: str) -> str:
    """The error for a call of ``what`` (a module) that wrote a buffer depending on the batch."""
    return (f"{what} changed a buffer in its forward call that may depend on the batch: {why}; a buffer written "
            "from the batch (a running mean, a quantization observer's range) is released with the model outside "
            "the noise, and a forward that reads it couples the samples, as BatchNorm in training mode does; fix "
            "its value before training (from public data), or stop its writes while training (eval mode, where "
            "the module writes only in training mode)")


def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether two buffer values are the same: both None, or of one shape and dtype with equal
    elements (NaN equal to NaN: an observer's range starts as NaN or infinity)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _one_sample(args: tuple, kwargs: dict, index: int, shift: bool) -> tuple[tuple, dict]:
    """The call's arguments for sample ``index`` alone: of every tensor whose first dim is the
    first tensor's (the batch), that sample's slice (its floating-point values plus 1 if
    ``shift``); the others whole."""
    flat, spec = tree_flatten((args, kwargs))
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.ndim), None)

    def sample(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch):
            return x
        if batch:  # an empty batch is run again empty
            x = x.narrow(0, index % batch, 1)
        return x + 1 if shift and x.is_floating_point() else x

    return tree_unflatten([sample(x) for x in flat], spec)
