"""Buffers that a forward call writes, and whether what it writes is a statistic of the batch.

A forward may write its module's buffers: a call counter, rotary frequencies made again for a
longer sequence (transformers' dynamic RoPE), Phi-3's longrope factors copied in at every call, a
cache made at the first call, or a statistic of the batch: a running standardiser's mean, a
quantization observer's range. A statistic is released with the model outside the noise, and a
forward that reads it couples the samples as BatchNorm in training mode does, so that a sample's
clipped gradient no longer bounds its effect on the update (a review's repro, a parameter-free
running standardiser before a Linear: one sample's removal moved the clipped sum by 1.21 C).

Book-keeping cannot read the forward, so it asks it (:meth:`Snapshot.check`): a call that changed
a buffer's values is run again, without grad, from the state the call found (the buffers, and the
modules' other attributes: a cached length that the forward compares with), on its first sample
alone, then on its last sample alone with its floating-point inputs moved by Gaussian noise (so
that a batch of one tells too, and a statistic that a shift leaves alone, an argmax, as well),
each first dim of its tensor arguments taken for the batch's in turn (a cut the forward cannot
take is passed over; a weight given as an argument is never cut). A
buffer that either run leaves otherwise than the call did depends on the batch, and the call is
refused; so is a forward that writes a parameter (a data-dependent initialisation through
``.data``, as Glow's ActNorm's, which flips a flag buffer the same way for any batch). A counter,
a cache of the positions, and the longrope switch at a sequence length leave the same values and
train. The runs touch nothing of the model: they run on copies of the module's small buffers and
parameters, its children's too (a parent's run had counted its child's calls again).
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from privleak.dpsgd.graph import capturing

#: buffers of at most this many elements are copied before each call that may write them, and parameters of at
#: most this many are copied for a run again; a larger buffer that the call writes in place cannot be run again
#: from the value it had, and is refused
COPIED_SIZE = 1 << 16


class Before(NamedTuple):
    """A buffer as a call found it: the tensor, its version then, and a copy of a small one."""

    tensor: torch.Tensor
    version: int
    copy: Optional[torch.Tensor]

    @classmethod
    def of(cls, tensor: torch.Tensor, known: Optional["Before"] = None) -> "Before":
        """``tensor`` now: ``known`` (the entry left by the module's last call) where the buffer is
        still that tensor at that version, so that a buffer no call writes is copied once, not at
        every call; else a new copy."""
        if known is not None and known.tensor is tensor and known.version == tensor._version:
            return known
        return cls(tensor, tensor._version, tensor.detach().clone() if tensor.numel() <= COPIED_SIZE else None)

    def value(self) -> Optional[torch.Tensor]:
        """The value the call found: the copy, or the tensor itself where the call did not write it
        (it rebound the buffer); None where neither is left."""
        if self.copy is not None:
            return self.copy
        return self.tensor if self.tensor._version == self.version else None

    def kept_by(self, now: Optional[torch.Tensor], by_value: bool = False) -> bool:
        """Whether the buffer holds ``now`` with the value the call found: the same tensor, not
        written (a write through ``.data`` keeps the version; ``by_value``: compared whatever the
        version), or other values compared equal. Not compared while a CUDA graph captures (a read
        would wait for the device)."""
        if now is self.tensor and now._version == self.version and not (by_value and self.copy is not None):
            return True
        found = self.value()
        return found is not None and now is not None and not capturing() and same(found, now)


class Snapshot:
    """The buffers of some modules ((prefix, module) pairs: a module and its children, or a module
    alone) as a call found them, by name under the first, and each module's other attributes.
    ``skip``: names left out (a parametrization's buffers, which their own rules handle);
    ``known``: the entries :meth:`left` gave after the last call, reused where still valid.
    ``by_value``: the buffers' values are compared whatever their versions: torch's fused
    fake-quantization op (quantization-aware training) writes its scale and zero point in place
    without moving their versions (a review's repro: its range of the batch went out unseen)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], skip: frozenset = frozenset(),
                 known: Optional[dict] = None, by_value: bool = False):
        self.modules, self.by_value = modules, by_value
        self.buffers: dict[str, Optional[Before]] = {}  # None: registered as None
        self._keys = []  # per module: (key, name) of its buffers then
        known = {} if known is None or by_value else known  # without versions to trust, copies are made anew
        for prefix, module in modules:
            keys = []
            for key, tensor in module._buffers.items():
                name = f"{prefix}.{key}" if prefix else key
                keys.append((key, name))
                if name not in skip:
                    self.buffers[name] = None if tensor is None else Before.of(tensor, known.get(name))
            self._keys.append(keys)
        self._attributes = [dict(vars(module)) for _, module in modules]  # each module's, shallow
        self._skip = skip

    def now(self) -> dict[str, Optional[torch.Tensor]]:
        """The buffers as they are now, by name (those made since included)."""
        named = ((f"{prefix}.{key}" if prefix else key, tensor) for prefix, module in self.modules
                 for key, tensor in module._buffers.items())
        return {name: tensor for name, tensor in named if name not in self._skip}

    def left(self) -> dict[str, Before]:
        """The buffers as the call left them, for the next call's snapshot (``known``)."""
        return {name: Before.of(tensor, None if self.by_value else self.buffers.get(name))
                for name, tensor in self.now().items() if tensor is not None}

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
            elif not before.kept_by(tensor, self.by_value):
                changed.append(name)
        return changed

    def check(self, module: nn.Module, args: tuple, kwargs: dict, what: str) -> None:
        """Raises, naming ``what`` (the module), where the call of ``module`` with ``args`` and
        ``kwargs`` changed a buffer in a way that may depend on the batch (the module docstring)."""
        if (changed := self.changed()) and (why := self._statistic_of_the_batch(module, args, kwargs, changed)):
            raise ValueError(f"{what} changed a buffer in its forward call that may depend on the batch: {why}; a "
                             "buffer written from the batch (a running mean, a quantization observer's range) is "
                             "released with the model outside the noise, and a forward that reads it couples the "
                             "samples, as BatchNorm in training mode does; fix its value before training (from "
                             "public data), or stop its writes while training (eval mode, where the module writes "
                             "only in training mode)")

    def _statistic_of_the_batch(self, module: nn.Module, args: tuple, kwargs: dict,
                                changed: list[str]) -> Optional[str]:
        """Why the buffers ``changed`` by a call of ``module`` are not shown to be independent of
        the batch, or None where both runs again leave each as the call did."""
        for name in changed:
            before = self.buffers.get(name)
            if before is not None and before.value() is None:
                return (f"its buffer '{name}' was written in place, and it is too large (over {COPIED_SIZE} "
                        "elements) to be kept and the forward run again from it")
        if capturing():  # the graph's warm-up ran the same forward eagerly, and was so checked
            return None
        left_by_call, failed, ran = self.now(), None, False
        # The batch is one of the arguments' first dims: each is cut in turn (a shared table of more
        # rows than the batch had been cut for it, and a running mean of the batch went out unseen)
        for batch in _first_dims(args, kwargs):
            for index, moved in ((0, False), (-1, True)):
                which = "the last sample alone, moved by noise" if moved else "the first sample alone"
                try:
                    left, written = self._run_again(module, *_one_sample(args, kwargs, batch, index, moved))
                except Exception as error:  # noqa: BLE001 (any error of the user's forward: another dim cut)
                    failed = failed or f"its forward, run again on {which}, raised {type(error).__name__}: {error}"
                    break
                if written:
                    return (f"its forward writes its parameter '{written[0]}' (run again on {which}, it wrote it "
                            "once more: a data-dependent initialisation, as Glow's ActNorm's through .data)")
                for name in changed:
                    if not same(left.get(name), left_by_call.get(name)):
                        return f"its buffer '{name}' is left otherwise by the forward run again on {which}"
            else:
                ran = True
        return None if ran else failed

    @contextlib.contextmanager
    def restored(self):
        """The modules as the call found them, their attributes, and their buffers as the tensors
        they held (which a replay's functional_call swaps out); put back as the call left them
        after."""
        left_by_call = [dict(vars(m)) for _, m in self.modules]
        try:
            for (_, m), attributes, keys, left in zip(self.modules, self._attributes, self._keys, left_by_call):
                vars(m).clear()
                vars(m).update(attributes)
                vars(m)["_buffers"] = {key: self._found(name, left, fresh=False) for key, name in keys}
            yield
        finally:
            for (_, m), attributes in zip(self.modules, left_by_call):
                vars(m).clear()
                vars(m).update(attributes)

    def _run_again(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[dict, list[str]]:
        """The buffers ``module.forward`` leaves when run on ``args`` from this state, on copies of
        the small buffers and parameters of ``module`` and its children (a child's as it is now
        where this holds none of its), and the parameters it wrote; the model is left as it was."""
        mine = {id(m): (attributes, keys) for (_, m), attributes, keys in zip(self.modules, self._attributes,
                                                                                 self._keys)}
        subtree = list(module.named_modules())
        as_left = [dict(vars(m)) for _, m in subtree]
        large = [(f"{prefix}.{key}" if prefix else key, p, _fingerprint(p)) for prefix, m in subtree
                 for key, p in m._parameters.items() if p is not None and p.numel() > COPIED_SIZE]
        devices = sorted({x.device.index or 0 for x in tree_flatten((args, kwargs))[0]
                          if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
        try:
            copies = []
            for (prefix, m), left in zip(subtree, as_left):
                if id(m) in mine:
                    attributes, keys = mine[id(m)]
                    vars(m).clear()
                    vars(m).update(attributes)
                    vars(m)["_buffers"] = {key: self._found(name, left, fresh=True) for key, name in keys}
                else:
                    vars(m)["_buffers"] = {key: _copied(b) for key, b in left["_buffers"].items()}
                parameters = {key: _copied(p) for key, p in left["_parameters"].items()}
                vars(m)["_parameters"] = parameters
                copies += [(f"{prefix}.{key}" if prefix else key, p, parameters[key])
                           for key, p in left["_parameters"].items() if parameters[key] is not p]
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                module.forward(*args, **kwargs)
                written = [name for name, p, copy in copies if not same(copy, p.detach())]
                # a large parameter is run on as it is, and told written by its sums (a write of the same values
                # aside): a data-dependent initialisation of a 300 x 256 weight had gone unseen
                return self.now(), written + [name for name, p, sums in large if not same(_fingerprint(p), sums)]
        finally:
            for (_, m), attributes in zip(subtree, as_left):
                vars(m).clear()
                vars(m).update(attributes)

    def _found(self, name: str, left: dict, fresh: bool) -> Optional[torch.Tensor]:
        """Buffer ``name`` as the call found it, a copy if ``fresh`` (a skipped one as the call left
        it, in ``left``, its module's attributes)."""
        if name in self._skip:
            return left["_buffers"][name.rpartition(".")[2]]
        before = self.buffers[name]
        if before is None:
            return None
        return before.value().clone() if fresh else before.tensor


def _copied(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A copy of a small buffer or parameter (a parameter's as a parameter), for a run again."""
    if tensor is None or tensor.numel() > COPIED_SIZE:
        return tensor
    copy = tensor.detach().clone()
    return nn.Parameter(copy, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copy


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


def _first_dims(args: tuple, kwargs: dict) -> list[Optional[int]]:
    """The first dims of the tensor arguments that are not parameters (a weight, a quantization
    observer's or a parametrization's argument, holds no batch), each once, in order; [None]
    where there is none (the forward is run again on its arguments as they are)."""
    return list(dict.fromkeys(x.shape[0] for x in tree_flatten((args, kwargs))[0] if _batched(x))) or [None]


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The sum and the sum of squares of a tensor's elements, in float64."""
    values = tensor.detach().double()
    return torch.stack([values.sum(), values.square().sum()])


def _one_sample(args: tuple, kwargs: dict, batch: Optional[int], index: int, moved: bool) -> tuple[tuple, dict]:
    """The call's arguments for sample ``index`` alone, taking ``batch`` for the batch's size: of
    every tensor but a parameter whose first dim it is, that sample's slice (its floating-point
    values plus standard Gaussian noise if ``moved``, from a generator of its own); the others
    whole. An empty batch is run again empty."""
    flat, spec = tree_flatten((args, kwargs))

    def sample(x: Any) -> Any:
        if not (_batched(x) and x.shape[0] == batch):
            return x
        if batch:
            x = x.narrow(0, index % batch, 1)
        if moved and x.is_floating_point():
            noise = torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(0), device=x.device)
            x = x + noise.to(x.dtype)
        return x

    return tree_unflatten([sample(x) for x in flat], spec)


def _batched(x: Any) -> bool:
    """Whether ``x`` may hold the batch: a tensor with dims, not a parameter."""
    return isinstance(x, torch.Tensor) and x.ndim > 0 and not isinstance(x, nn.Parameter)
