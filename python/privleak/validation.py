"""Argument checks shared by every public function: one rule per kind of argument.

Each check returns the value in its canonical Python type (``float`` or ``int``) or raises an
exception whose message names the argument. A value of the wrong type (a string, ``None``, a bool
where a number is meant) raises :class:`ArgumentTypeError`; a value of the right type outside its
range raises ``ValueError``. ``ArgumentTypeError`` is both a ``TypeError`` and a ``ValueError``,
so callers that catch either keep working.

Numbers are accepted as any ``numbers.Real`` or ``numbers.Integral`` (Python, numpy scalars) and
as one-element torch tensors or numpy arrays; bools and strings are refused, as are NaN and (unless
asked for) infinities.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. Subclasses both TypeError and ValueError."""


def _scalar(value: Any) -> Any:
    """A one-element numpy array or torch tensor as its Python scalar; anything else unchanged."""
    if isinstance(value, np.ndarray) and value.shape == ():
        return value.item()
    if type(value).__module__.startswith("torch") and hasattr(value, "numel") and hasattr(value, "item"):
        if value.numel() != 1:
            return value
        return value.item()
    return value


def real(value: Any, name: str, *, low: Optional[float] = None, high: Optional[float] = None,
         low_open: bool = False, high_open: bool = False, allow_inf: bool = False) -> float:
    """``value`` as a float in [low, high] (open ends where asked); NaN never passes."""
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        raise ValueError(f"{name} must be {'a number' if allow_inf else 'finite'}, got {value!r}") from None
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be {'a number' if allow_inf else 'finite'}, got {number!r}")
    if low is not None and (number < low or (low_open and number == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {number!r}")
    if high is not None and (number > high or (high_open and number == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high:g}, got {number!r}")
    return number


def positive(value: Any, name: str, *, allow_inf: bool = False) -> float:
    """A real number > 0 (finite unless ``allow_inf``)."""
    return real(value, name, low=0.0, low_open=True, allow_inf=allow_inf)


def non_negative(value: Any, name: str, *, allow_inf: bool = False) -> float:
    """A real number >= 0 (finite unless ``allow_inf``)."""
    return real(value, name, low=0.0, allow_inf=allow_inf)


def probability(value: Any, name: str, *, open_low: bool = False, open_high: bool = False) -> float:
    """A real number in [0, 1], with either end excluded where asked."""
    return real(value, name, low=0.0, high=1.0, low_open=open_low, high_open=open_high)


def integer(value: Any, name: str, *, low: Optional[int] = None, high: Optional[int] = None,
            integral_float: bool = False) -> int:
    """``value`` as an int in [low, high]; bools and floats (even 3.0) are refused.

    With ``integral_float`` a float with an integer value (3.0, 1e9, a float batch size that
    happens to be whole) is accepted too; 2.5, NaN and infinities still raise ValueError.
    """
    value = _scalar(value)
    if integral_float and not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Real) \
            and not isinstance(value, numbers.Integral):
        number = float(value)
        if not (math.isfinite(number) and number.is_integer()):
            raise ValueError(f"{name} must be a whole number, got {number!r}")
        value = int(number)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    number = int(value)
    if low is not None and number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    if high is not None and number > high:
        raise ValueError(f"{name} must be <= {high}, got {number}")
    return number


def choice(value: Any, name: str, options) -> Any:
    """``value`` if it is one of ``options``."""
    options = tuple(options)
    if isinstance(value, (str, int)) and not isinstance(value, bool) and value in options:
        return value
    raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
