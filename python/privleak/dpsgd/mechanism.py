"""What a DP-SGD mechanism is, and the registry that finds one by name.

A mechanism is one frozen dataclass (its fields are its parameters, checked at construction)
that knows every phase of a private step and of its analysis:

- ``clip_norm_type``: the norm per-sample gradients are clipped in (2, or 1 for Laplace);
- :meth:`release`: clip, sum and privatise a batch of per-sample gradients (the default clips
  with the fused kernel, then calls :meth:`noise`);
- :meth:`noise`: privatise a clipped average (what a Flower client mod or Opacus's ``add_noise``
  sees);
- :meth:`calibrate`: the mechanism whose one update is (epsilon, delta)-DP;
- :meth:`epsilon`: epsilon(delta) of a run of steps with subsampling;
- :meth:`log_capacity`: the Bayes capacity of the channel one update goes through.

Every other module asks the mechanism instead of comparing its name; the name is used only to
find the class (:func:`get`, :func:`create`) and to label output. A new mechanism is one file
with one class decorated by :func:`register`, imported by ``privleak.dpsgd``.

Neighbouring datasets: a step's "one update" epsilon (:meth:`update_epsilon`, the convention of
``privleak reproduce``) is for any two clipped gradients as neighbours (replace one sample),
the strongest reading of local DP for one client's update. Accounting over a run uses the
neighbour relation of the sampling: add/remove one example for Poisson, replace one for fixed
size batches.
"""
from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple, Sequence

import torch

from privleak import validation
from privleak.dpsgd.clip import _check_release_range, clip_and_accumulate


class Clipping(NamedTuple):
    """The clip norms of a step, resolved for its tensors: one norm (flat clipping) or one per
    tensor (``per_layer``)."""

    norms: tuple  #: floats > 0
    per_layer: bool

    def total(self, norm_type: float) -> float:
        """The clip norm of the concatenation, the sensitivity of the clipped sum to adding or
        removing one sample: c (flat), |(c_t)|_2 per layer in L2, sum_t c_t per layer in L1."""
        if not self.per_layer:
            return self.norms[0]
        if norm_type == 1:
            return math.fsum(self.norms)
        return math.sqrt(math.fsum(c * c for c in self.norms))


class Sampling(NamedTuple):
    """How a run's batches were drawn, for the accountant."""

    kind: str  #: "poisson" (add/remove neighbours) or "fixed" (replace-one neighbours)
    rate: float  #: q = expected batch size / dataset size
    dataset_size: int


class DPSGDMechanism(ABC):
    """The protocol every DP-SGD mechanism class implements (module docstring). Subclasses are
    frozen dataclasses decorated with :func:`register`."""

    name: ClassVar[str]  #: registry key, CLI choice and label in reports
    clip_norm_type: ClassVar[int] = 2  #: per-sample gradients are clipped in this L_p norm
    secure: ClassVar[bool] = False  #: whether it accepts a SecureNoiseGenerator
    releases_direction: ClassVar[bool] = False  #: the release is a unit vector (no 1/L scaling)

    def release(self, per_sample_grads: Sequence[torch.Tensor], clipping: Clipping, batch_size: float,
                generator, non_finite: str) -> list:
        """The update one batch leaks: clip each sample, average over ``batch_size``, privatise."""
        average = clip_and_accumulate(per_sample_grads, list(clipping.norms), per_layer=clipping.per_layer,
                                      batch_size=batch_size, non_finite=non_finite,
                                      norm_type=self.clip_norm_type).grads
        return self.noise(average, clipping, batch_size, generator, inplace=True)  # the average is ours

    def check_release_range(self, batch: int, clipping: Clipping, batch_size: float, generator) -> None:
        """Refuse a ``batch`` of samples whose release, as :meth:`release` forms it, could overflow
        float32 (the clipped sum over ``batch_size``, the noise): the materialised path's check
        (:func:`~privleak.dpsgd.clip.clip_and_accumulate`), for a caller that forms the clipped
        sum itself (book-keeping)."""
        _check_release_range(batch, list(clipping.norms), 0.0, batch_size, False, self.clip_norm_type)

    @abstractmethod
    def noise(self, average: Sequence[torch.Tensor], clipping: Clipping, batch_size: float, generator, *,
              inplace: bool = False) -> list:
        """Privatise a clipped average of ``batch_size`` samples (one tensor per parameter). With
        ``inplace`` the caller gives up ``average``: additive noise goes into its tensors, which
        are returned (a release that is not additive, such as VMF's direction, may be new
        tensors); a step over a large model then holds one copy of the gradient, not two."""

    @classmethod
    @abstractmethod
    def calibrate(cls, epsilon: float, delta: float) -> "DPSGDMechanism":
        """The mechanism whose one update is (epsilon, delta)-DP for any two clipped gradients."""

    @abstractmethod
    def update_epsilon(self, delta: float) -> float:
        """epsilon(delta) of one update for any two clipped gradients (inverse of :meth:`calibrate`)."""

    @abstractmethod
    def epsilon(self, steps: int, delta: float, sampling: Sampling) -> float:
        """epsilon(delta) of ``steps`` steps on batches drawn as ``sampling`` says."""

    @abstractmethod
    def log_capacity(self, sizes: Sequence[int], clipping: Clipping, batch_size: float):
        """:class:`privleak.capacity.LogCapacity` of one update's channel, for tensors of ``sizes``
        elements averaged over ``batch_size`` samples."""

    def check_generator(self, generator) -> None:
        """Refuse a noise generator this mechanism cannot draw from."""
        from privleak import mechanisms

        mechanisms._check_generator(generator)
        if not self.secure and isinstance(generator, mechanisms.SecureNoiseGenerator):
            raise ValueError(f"generator: the {self.name} mechanism has no secure mode yet; pass a NoiseGenerator")

    def check_privacy_report(self, delta: float) -> None:
        """Refuse a report that would be meaningless: no finite epsilon for one update at ``delta``
        (no noise, or delta = 0 for an approximate-DP mechanism)."""
        if math.isinf(self.update_epsilon(delta)):
            raise ValueError(f"the {self.name} mechanism {self} gives no finite epsilon at delta = {delta}: "
                             "there is no privacy to report")

    def parameters(self) -> dict:
        """The mechanism's parameters by field name, for reports and CSV columns."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` findable by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a mechanism named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> tuple:
    """The registered mechanisms' names, in registration order."""
    return tuple(_REGISTRY)


def get(name: Any, argument: str = "mechanism") -> type:
    """The class registered as ``name``."""
    return _REGISTRY[validation.choice(name, argument, names())]


def create(name: Any, parameters: dict, argument: str = "mechanism") -> DPSGDMechanism:
    """An instance of mechanism ``name`` from keyword ``parameters``; a missing or unknown
    parameter is an error naming it."""
    cls = get(name, argument)
    prefix = argument.rpartition(".")[0]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in parameters:
        if key not in fields:
            raise validation.ArgumentTypeError(
                f"{_named(prefix, key)}: the {cls.name} mechanism takes no parameter {key!r}; "
                f"its parameters are {', '.join(fields) or 'none'}")
    for key, field in fields.items():
        if key not in parameters and field.default is dataclasses.MISSING:
            raise ValueError(f"the {cls.name} mechanism needs {key}: {_named(prefix, key)} must be given")
    try:
        return cls(**parameters)
    except (TypeError, ValueError) as error:  # the checks name the parameter; say whose it is
        if not prefix:
            raise
        raise type(error)(f"{prefix}.{error}") from None


def _named(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


@dataclasses.dataclass(frozen=True)
class ClipOnly(DPSGDMechanism):
    """No noise: the clipped average every mechanism starts from, clipped in the L_``norm_type``
    norm (what a Flower client computes before its noise mod). Not registered: it is not private."""

    norm_type: int = 2

    name = "clip-only"

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm_type", validation.choice(self.norm_type, "norm_type", (1, 2)))

    @property
    def clip_norm_type(self) -> int:  # type: ignore[override]
        return self.norm_type

    def noise(self, average: Sequence[torch.Tensor], clipping: Clipping, batch_size: float, generator, *,
              inplace: bool = False) -> list:
        return list(average)

    @classmethod
    def calibrate(cls, epsilon: float, delta: float) -> "ClipOnly":
        raise ValueError("the clipped average adds no noise: no epsilon calibrates it")

    def update_epsilon(self, delta: float) -> float:
        return math.inf

    def epsilon(self, steps: int, delta: float, sampling: Sampling) -> float:
        return math.inf if steps else 0.0

    def log_capacity(self, sizes: Sequence[int], clipping: Clipping, batch_size: float):
        from privleak.capacity import LogCapacity

        return LogCapacity.from_log(math.inf)
