"""The configuration of a DP-SGD step: clipping plus a mechanism, checked once, at construction."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from privleak import validation
from privleak.dpsgd import mechanism as _registry
from privleak.dpsgd.clip import _clip_norms
from privleak.dpsgd.mechanism import Clipping, DPSGDMechanism


class DPSGDConfig:
    """How one DP-SGD step privatises the gradient: clip each per-sample gradient to ``clip_norm``
    (in the mechanism's norm; flat, or per tensor with ``per_layer``), then the ``mechanism``.

    ``mechanism`` is a :class:`~privleak.dpsgd.mechanism.DPSGDMechanism` instance, e.g.
    ``Gaussian(noise_multiplier=1.1)``, ``VMF(kappa=50)``, ``Laplace(noise_multiplier=2)``, or a
    registered name with its parameters as keywords: ``DPSGDConfig(1.0, "vmf", kappa=50)``.
    ``non_finite`` ("raise" or "drop") says what a non-finite per-sample gradient does
    (:func:`privleak.dpsgd.clip_and_accumulate`). Every field is checked here; errors name it.
    """

    __slots__ = ("clip_norm", "mechanism", "per_layer", "non_finite")

    clip_norm: Union[float, tuple]
    mechanism: DPSGDMechanism
    per_layer: bool
    non_finite: str

    def __init__(self, clip_norm: Union[float, Sequence[float]], mechanism: Union[str, DPSGDMechanism] = "gaussian",
                 *, per_layer: bool = False, non_finite: str = "raise", **parameters: Any):
        per_layer = validation.boolean(per_layer, "config.per_layer")
        norms = _clip_norms(clip_norm, None, per_layer, "config.clip_norm")
        if isinstance(mechanism, DPSGDMechanism):
            if parameters:
                raise validation.ArgumentTypeError(f"config: parameters {sorted(parameters)} are given twice, in the "
                                                   f"{mechanism.name} mechanism instance and as keywords")
        else:
            mechanism = _registry.create(mechanism, parameters, "config.mechanism")
        set_field = object.__setattr__
        set_field(self, "clip_norm", tuple(norms) if isinstance(clip_norm, (list, tuple)) else norms[0])
        set_field(self, "mechanism", mechanism)
        set_field(self, "per_layer", per_layer)
        set_field(self, "non_finite", validation.choice(non_finite, "config.non_finite", ("raise", "drop")))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DPSGDConfig is immutable: use config.replace({name}=...)")

    def __reduce__(self):  # pickling (Flower ships the config to Ray workers) goes through __init__
        return _rebuild, tuple(getattr(self, name) for name in self.__slots__)

    def replace(self, **changes: Any) -> "DPSGDConfig":
        """A copy with some fields changed (``clip_norm``, ``mechanism``, ``per_layer``, ``non_finite``)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        unknown = set(changes) - set(fields)
        if unknown:
            raise validation.ArgumentTypeError(f"config.replace: no field {sorted(unknown)}; fields: {self.__slots__}")
        fields.update(changes)
        return DPSGDConfig(fields.pop("clip_norm"), fields.pop("mechanism"), **fields)

    def clipping(self, num_tensors: Optional[int]) -> Clipping:
        """The clip norms for ``num_tensors`` tensors: one per tensor with ``per_layer`` (a single
        clip_norm repeats), else the one flat norm."""
        if num_tensors is not None:
            num_tensors = validation.integer(num_tensors, "num_tensors", low=1)
        norms = _clip_norms(self.clip_norm, num_tensors, self.per_layer, "config.clip_norm")
        return Clipping(tuple(norms if self.per_layer else norms[:1]), self.per_layer)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DPSGDConfig):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in self.__slots__))

    def __repr__(self) -> str:
        return (f"DPSGDConfig(clip_norm={self.clip_norm!r}, mechanism={self.mechanism!r}, "
                f"per_layer={self.per_layer!r}, non_finite={self.non_finite!r})")


def _rebuild(clip_norm, mechanism, per_layer, non_finite) -> DPSGDConfig:
    return DPSGDConfig(clip_norm, mechanism, per_layer=per_layer, non_finite=non_finite)


def check_config(config: Any, num_tensors: Optional[int] = None) -> DPSGDConfig:
    """``config`` if it is a DPSGDConfig whose clip norms fit ``num_tensors`` tensors."""
    if not isinstance(config, DPSGDConfig):
        raise validation.ArgumentTypeError(f"config must be a DPSGDConfig, got {type(config).__name__}")
    if num_tensors is not None:
        config.clipping(num_tensors)
    return config
