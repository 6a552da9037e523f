"""Argument checks shared by every public function: one rule per kind of argument.

Each check returns the value in its canonical Python type (``float`` or ``int``) or raises an
exception whose message names the argument. A value of the wrong type (a string, ``None``, a bool
where a number is meant) raises :class:`ArgumentTypeError`; a value of the right type outside its
range raises ``ValueError``. ``ArgumentTypeError`` is both a ``TypeError`` and a ``ValueError``,
so callers that catch either keep working.

Numbers are accepted as any ``numbers.Real`` or ``numbers.Integral`` (Python, numpy scalars) and
as one-element torch tensors or numpy arrays; bools and strings are refused, as are NaN and (unless
asked for) infinities. Plain ``float`` and ``int`` take a short path with no type analysis, which
is also what ``torch.compile`` traces through the noise ops.

Arrays and tensors handed to a kernel are checked by :func:`tensor` (torch tensors only) and
:func:`privleak._arrays.view` (numpy arrays too), which also describe them for the core.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. Subclasses both TypeError and ValueError."""


#: Dimensions, sample counts and batch sizes are ints in [1, MAX_DIM]: beyond, nothing fits in
#: memory, and float64 stops telling p from p + 1 long before.
MAX_DIM = 2**62


def _scalar(value: Any, name: str) -> Any:
    """A 0-d numpy array or one-element torch tensor as its Python scalar; anything else unchanged.
    A tensor of several elements is refused here, where its shape can still be named."""
    if isinstance(value, np.ndarray) and value.shape == ():
        return value.item()
    if type(value).__module__.startswith("torch") and hasattr(value, "numel") and hasattr(value, "item"):
        if value.numel() != 1:
            raise ArgumentTypeError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.item()
    return value


def real(value: Any, name: str, *, low: Optional[float] = None, high: Optional[float] = None,
         low_open: bool = False, high_open: bool = False, allow_inf: bool = False) -> float:
    """``value`` as a float in [low, high] (open ends where asked); NaN never passes."""
    if type(value) is not float and type(value) is not int:
        value = _scalar(value, name)
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


def confidence_level(value: Any, name: str) -> float:
    """A confidence level, or a failure probability: strictly between 0 and 1."""
    return probability(value, name, open_low=True, open_high=True)


def epsilon(value: Any, name: str) -> float:
    """A privacy loss bound epsilon (DP, LDP, LIP, MBP): >= 0, with inf meaning no bound."""
    return non_negative(value, name, allow_inf=True)


def integer(value: Any, name: str, *, low: Optional[int] = None, high: Optional[int] = None,
            integral_float: bool = False) -> int:
    """``value`` as an int in [low, high]; bools and floats (even 3.0) are refused.

    With ``integral_float`` a float with an integer value (3.0, 1e9, a float batch size that
    happens to be whole) is accepted too; 2.5, NaN and infinities still raise ValueError.
    """
    if type(value) is int:
        return _in_range(value, name, low, high)
    value = _scalar(value, name)
    if integral_float and not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Real) \
            and not isinstance(value, numbers.Integral):
        number = float(value)
        if not (math.isfinite(number) and number.is_integer()):
            raise ValueError(f"{name} must be a whole number, got {number!r}")
        value = int(number)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return _in_range(int(value), name, low, high)


def _in_range(number: int, name: str, low: Optional[int], high: Optional[int]) -> int:
    if low is not None and number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    if high is not None and number > high:
        raise ValueError(f"{name} must be <= {high}, got {number}")
    return number


def boolean(value: Any, name: str) -> bool:
    """``value`` as a bool: True or False (numpy's too); 0, 1 and strings are refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def dimension(value: Any, name: str) -> int:
    """A dimension, sample count or batch size: an int in [1, MAX_DIM]. A whole float such as 1e9
    or a batch size of 64.0 is accepted (bools, strings and 2.5 are not)."""
    return integer(value, name, low=1, high=MAX_DIM, integral_float=True)



def reals(values: Any, name: str, *, low: Optional[float] = None, low_open: bool = False,
          whole: bool = False) -> np.ndarray:
    """The elementwise :func:`real` for vectorised functions: ``values`` (a number or anything
    numpy takes as an array of them) as a float64 array whose entries are finite, >= ``low``
    (> with ``low_open``) and, with ``whole``, integers."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{name} must hold real numbers, got {values!r}") from None
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite, got {values!r}")
    if low is not None and np.any(array <= low if low_open else array < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {values!r}")
    if whole and np.any(array != np.floor(array)):
        raise ValueError(f"{name} must hold whole numbers, got {values!r}")
    return array

def choice(value: Any, name: str, options) -> Any:
    """``value`` if it is one of ``options``."""
    options = tuple(options)
    if isinstance(value, (str, int)) and not isinstance(value, bool) and value in options:
        return value
    raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")


def tensor(value: Any, name: str, *, dtypes: Sequence[str] = ("float32", "float64"),
           ndim: Optional[int] = None) -> Any:
    """A torch tensor that privleak's kernels can read, as a :class:`privleak._arrays.ArrayView`:
    dense, strided and aligned, on cpu or cuda, with one of ``dtypes`` (names such as "float32")
    and, where given, ``ndim`` dimensions (:func:`privleak._arrays.view` checks all but the type)."""
    from privleak import _arrays  # _arrays imports this module

    if not _arrays.is_tensor(value):
        raise ArgumentTypeError(f"{name} must be a torch tensor, got {type(value).__name__}")
    return _arrays.view(value, name, ndim=ndim, dtypes=dtypes)


def tensors(values: Sequence[Any], names: Sequence[str], *, dtypes: Sequence[str] = ("float32", "float64")) -> Any:
    """:func:`tensor`'s checks on each of ``values`` (one name each, at least one), all on one
    device; the first one's :class:`privleak._arrays.ArrayView`. A tensor that passes a quick test
    of the usual case (dense and strided, of one of ``dtypes``, on the first one's device,
    aligned) is not described: a model's tensors are many and often small, and describing each
    cost more than its noise (the noise of a small transformer's 26 tensors, checks included: 95
    -> 61 us). Any other gets :func:`tensor`'s checks, which name what is wrong."""
    import torch  # loaded: values[0] is a tensor

    from privleak import _arrays

    first = tensor(values[0], names[0], dtypes=dtypes)
    quick = not torch.compiler.is_compiling()  # traced by torch.compile: no real address to check
    device, strided = values[0].device, torch.strided
    for value, name in zip(values[1:], names[1:]):
        if not (quick and isinstance(value, torch.Tensor) and value.layout is strided and not value.is_quantized
                and not value.is_nested and value.device == device and _arrays.dtype_name(value) in dtypes
                and value.data_ptr() % value.element_size() == 0):
            _arrays.require_same_device(tensor(value, name, dtypes=dtypes), name, first, names[0])
    return first
