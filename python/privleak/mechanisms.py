"""Noise mechanisms as PyTorch ops: Gaussian, Laplace and von Mises-Fisher noise from a
counter-based generator.

DP-SGD's Gaussian mechanism (Abadi et al. 2016; Alg. 1 of Biswas et al.) releases
g + N(0, c^2 sigma^2 I) / L; the Laplace mechanism releases g + Lap(b)^p. privleak draws the noise
from Philox4x32-10 (Salmon et al., SC 2011), a counter-based generator: element i of a draw is a
pure function of (key, offset + i). The same key and offset give the same bits on CPU and CUDA,
for any thread count, launch shape or split of a draw into pieces, and the numpy reference
(:func:`privleak.reference.noise`) reproduces them exactly.

Unit noise z is made as follows (csrc/common/noise.h):

* Gaussian: Box-Muller, z = sqrt(-2 ln u1) cos(2 pi u2) (and the sine for the next element), with
  u1 in (0, 1] on a grid of 2^-32 (float) or 2^-53 (double) so the tail reaches 6.8 (float) or
  8.6 (double) standard deviations.
* Laplace: a random sign times -ln u, u in (0, 1].

bfloat16 and float16 outputs are float32 noise rounded to nearest even; adding noise to a half
tensor adds in float32 and rounds once. The ops are registered with ``torch.library`` (so they
work under ``torch.compile``), and adding noise out of place passes the gradient through unchanged.

**Secure mode.** With ``generator=SecureNoiseGenerator()`` the same functions draw from ChaCha20
(RFC 8439) keyed with 256 bits of operating-system entropy (no seed is accepted), and defend
against floating-point attacks on the noise's low bits (Mironov, CCS 2012; Jin et al., S&P 2022)
by discretisation (Canonne, Kamath and Steinke, NeurIPS 2020): the input is rounded to the grid
g Z, g = 2^k with k = floor(log2 scale) - 20, exact discrete Gaussian (variance parameter
ceil(sigma^2 / g^2)) or discrete Laplace (scale ceil(b / g)) integers are added in integer
arithmetic, and the sum is converted to floating point once, which is post-processing. The
discrete Gaussian gives rho-zCDP with rho = Delta^2 / (2 sigma^2) and the discrete Laplace
(Delta / b)-DP, for Delta the sensitivity on the grid: rounding moves each of n values by at
most g / 2, so two neighbours' values on the grid are up to the true L2 sensitivity plus
g sqrt(n) apart (L1: plus g n). :func:`secure_scale` gives the scale that covers that for a
release of n values (DP-SGD's mechanisms draw at it); rounding the scale up keeps both at least
as private as asked. Secure draws cost a few ChaCha20 blocks per
element (csrc/common/secure_noise.h).

:func:`vmf_sample` draws directions from the von Mises-Fisher distribution (Alg. 2 of Biswas et al.)
with Wood's rejection step and a Householder reflection, in O(n p) (csrc/common/vmf.h).

This module imports torch; ``import privleak`` does not.
"""
from __future__ import annotations

import itertools
import math
import numbers
import os
import secrets
import struct
import threading
import weakref
from fractions import Fraction
from typing import Optional, Sequence, Union

import torch
from numpy import bool_ as np_bool

from privleak import _arrays, _backend, _ops, validation

NOISE_DTYPES = ("float32", "float64", "bfloat16", "float16")
_U64 = 2**64
_MAX_ELEMENT = 2**63  # the counter space: element indices [0, 2^63), which travel through torch's int64 op schema


class NoiseGenerator:
    """State for counter-based noise, used like ``torch.Generator``.

    The state is (key, offset): a draw of n elements uses elements offset .. offset + n - 1 of the
    key's stream and advances the offset by n, so two draws of n and m elements give the same bits
    as one draw of n + m. ``NoiseGenerator()`` takes a random key from the operating system;
    ``NoiseGenerator(seed)`` or ``manual_seed(seed)`` makes it reproducible.

    **Counter space.** A key's stream has the elements 0 .. 2^63 - 1 (offsets are int64 in the op
    schema). Element e of a float32 draw (also bfloat16, float16) is value e mod 4 of Philox block
    e div 4, of a float64 draw value e mod 2 of block e div 2; the 64-bit block number fills the
    first two words of the Philox counter and a tag for the distribution and precision the third
    (csrc/common/noise.h, philox.h), so distinct (key, element) pairs never share a counter and no
    block number wraps. The state's offset is the next element to use and lies in [0, 2^63):
    :meth:`set_state` refuses anything else, and a draw that would move the offset to 2^63 or
    beyond is refused, so every state a generator reaches is one that :meth:`set_state` accepts and
    from which a draw can be made. (Element 2^63 - 1 is reachable with an explicit ``key`` and
    ``offset``.) Draws from several threads claim disjoint ranges.
    """

    def __init__(self, seed: Optional[int] = None):
        self._lock = threading.Lock()
        self._initial_seed = 0
        self.key = 0
        self.offset = 0
        if seed is None:
            self.seed()
        else:
            self.manual_seed(seed)

    def manual_seed(self, seed: int) -> "NoiseGenerator":
        """Use ``seed`` (any int; taken modulo 2^64) as the key and restart at offset 0."""
        seed = validation.integer(seed, "seed")
        self._initial_seed = seed % _U64
        self.key, self.offset = self._initial_seed, 0
        return self

    def seed(self) -> int:
        """Seed from the operating system's entropy and return the seed."""
        self.manual_seed(secrets.randbits(64))
        return self._initial_seed

    def initial_seed(self) -> int:
        return self._initial_seed

    def get_state(self) -> tuple[int, int]:
        return self.key, self.offset

    def set_state(self, state: tuple[int, int]) -> None:
        """Restore a state from :meth:`get_state`: key in [0, 2^64), offset in [0, 2^63)."""
        if isinstance(state, (str, bytes)) or not isinstance(state, Sequence) or len(state) != 2:
            raise validation.ArgumentTypeError(f"state must be a (key, offset) pair, got {state!r}")
        key = _check_key(state[0])
        offset = validation.integer(state[1], "offset")
        if not 0 <= offset < _MAX_ELEMENT:
            raise ValueError(f"offset must be in [0, 2**63) (the counter space), got {offset}")
        self.key, self.offset = key, offset

    def claim(self, n: int) -> tuple[int, int]:
        """The (key, offset) for a draw of ``n`` elements, advancing the offset past them."""
        with self._lock:
            offset = _check_offset(self.offset, n, generator=True)
            self.offset += n
            return self.key, offset

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NoiseGenerator(key={self.key:#x}, offset={self.offset})"


class SecureNoiseGenerator:
    """Secure-mode noise: ChaCha20 keyed with 256 bits from the operating system.

    It takes no seed and has no state to get or set: its draws cannot be replayed. Passing it
    as ``generator`` to the noise functions switches them to discretised noise (module docstring).

    Its stream never repeats: element e of the key's stream has its own ChaCha20 nonce (e, tag), e
    in [0, 2^63), and each draw claims a fresh range under a lock. It cannot be copied or pickled
    (``copy.copy``, ``copy.deepcopy`` and ``pickle`` raise TypeError: a copy would draw the same
    noise again), and a process made by ``os.fork`` gives every generator it inherits a new key
    from the operating system before its first draw.
    """

    _live: "weakref.WeakSet[SecureNoiseGenerator]" = weakref.WeakSet()

    def __init__(self):
        self._lock = threading.Lock()
        self._rekey()
        SecureNoiseGenerator._live.add(self)

    def _rekey(self) -> None:
        self._key_words = list(struct.unpack("<8I", secrets.token_bytes(32)))
        self._offset = 0
        self._pid = os.getpid()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork
        self._rekey()

    def claim(self, n: int) -> tuple[list[int], int]:
        """The key words and offset for a draw of ``n`` elements, advancing past them."""
        with self._lock:
            if self._pid != os.getpid():  # a fork the at-fork hook did not see (e.g. not through os.fork)
                self._rekey()
            offset = _check_offset(self._offset, n, generator=True)
            self._offset += n
            return self._key_words, offset

    def _refuse_copy(self, *args):
        raise TypeError("a SecureNoiseGenerator cannot be copied or pickled: the copy would draw the same noise "
                        "again; make a new SecureNoiseGenerator() instead")

    __copy__ = __deepcopy__ = __reduce__ = __reduce_ex__ = __getstate__ = _refuse_copy

    def __repr__(self) -> str:
        return f"SecureNoiseGenerator(offset={self._offset})"


def _rekey_secure_generators_in_child() -> None:
    for generator in list(SecureNoiseGenerator._live):
        generator._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_rekey_secure_generators_in_child)


default_generator = NoiseGenerator()


def manual_seed(seed: int) -> NoiseGenerator:
    """Seed privleak's default noise generator (``torch.manual_seed`` leaves it alone)."""
    return default_generator.manual_seed(seed)


def _check_key(key: int) -> int:
    key = validation.integer(key, "key")
    if not 0 <= key < _U64:
        raise ValueError(f"key must be in [0, 2**64), got {key}")
    return key


def _check_offset(offset: int, n: int, generator: bool = False) -> int:
    """An offset for a draw of n elements: the draw must stay inside the counter space [0, 2^63)
    (a generator's draw must also leave a valid state, offset + n < 2^63)."""
    offset = validation.integer(offset, "offset")
    end = _MAX_ELEMENT - 1 if generator else _MAX_ELEMENT
    if offset < 0 or offset + n > end:
        what = "the generator's stream is exhausted" if generator and offset >= 0 else "offset must satisfy"
        raise ValueError(f"{what}: 0 <= offset and offset + numel <= 2**63{' - 1' if generator else ''} "
                         f"(the counter space), got offset={offset}, numel={n}")
    return offset


# The noise scale's rule, under the name privleak.dpsgd calls it by.
_check_scale = validation.non_negative


# The largest |z| of unit noise (csrc/common/noise.h), by distribution and generation precision:
# Box-Muller's r = sqrt(-2 ln u1) with u1 >= 2^-33 (float) or 2^-54 (double), and -ln u with
# u >= 2^-32 (float, 31 bits and the sign) or 2^-54 (double); 1e-5 covers the rounding of log and sqrt.
_UNIT_MAX = {
    ("gaussian", torch.float32): math.sqrt(2 * 33 * math.log(2)) * (1 + 1e-5),  # 6.77
    ("gaussian", torch.float64): math.sqrt(2 * 54 * math.log(2)) * (1 + 1e-5),  # 8.65
    ("laplace", torch.float32): 32 * math.log(2) * (1 + 1e-5),  # 22.2
    ("laplace", torch.float64): 54 * math.log(2) * (1 + 1e-5),  # 37.4
}
# Secure noise is exact discrete noise, unbounded but for a cut at 2^40 grid steps (about 2^19
# scales): |z| beyond 20 sd (Gaussian, probability < 2 exp(-200)) or 100 scales (Laplace,
# exp(-100)) is taken as out of reach.
_SECURE_UNIT_MAX = {"gaussian": 20.0, "laplace": 100.0}
# Secure mode's grid 2^k, k = frexp(scale) - 21, must keep |k| <= 1000 (csrc/common/secure_noise.h).
_SECURE_MIN_SCALE = 2.0**-979


def _generation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision noise for ``dtype`` is made in: half types are float32 noise rounded."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rounded_down(x: float, digits: int = 6) -> float:
    """x > 0 rounded down to ``digits`` significant digits: a limit quoted in a message that the
    quoted number itself meets."""
    step = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    shown = float(f"{x:.{digits}g}")
    return shown if shown <= x else shown - step


def _check_noise_range(distribution: str, scale: float, name: str, dtype: torch.dtype, secure: bool) -> None:
    """Refuse a scale whose noise cannot be represented in ``dtype``: its largest value beyond the
    dtype's max (it would be inf), or a positive scale below the generation precision's smallest
    normal number (the noise would vanish or lose its precision)."""
    if scale == 0:
        return
    gen = _generation_dtype(dtype)
    if secure:
        if scale < _SECURE_MIN_SCALE:
            raise ValueError(f"{name} must be >= 2^-979 for secure noise (its grid 2^k needs k >= -1000), "
                             f"got {scale!r}")
        unit_max = _SECURE_UNIT_MAX[distribution]
    else:
        unit_max = _UNIT_MAX[(distribution, gen)]
        if scale < torch.finfo(gen).tiny:
            raise ValueError(f"{name} must be 0 or >= {torch.finfo(gen).tiny:.3g} (the smallest normal {gen} the noise "
                             f"is made in), got {scale!r}")
    largest = torch.finfo(dtype).max
    if scale * unit_max > largest:
        raise ValueError(f"{name} = {scale!r} is too large for {str(dtype).removeprefix('torch.')} noise: "
                         f"{distribution} noise reaches {unit_max:.3g} x {name}, beyond the dtype's max {largest:.4g}; "
                         f"{name} must be <= {_rounded_down(largest / unit_max):.6g}")


def generator_in_use(generator):
    """The generator a draw given ``generator`` takes its noise from: privleak's default one for None."""
    return default_generator if generator is None else generator


def _resolve_stream(n: int, generator, key: Optional[int], offset: Optional[int]) -> tuple[list[int], int]:
    """The noise stream of a draw of n elements, as (key as 32-bit words, offset)."""
    if key is None:
        if offset is not None:
            raise ValueError("offset needs an explicit key; with a generator the offset is the generator's")
        generator = generator_in_use(generator)
        if not isinstance(generator, (NoiseGenerator, SecureNoiseGenerator)):
            raise TypeError("generator must be a NoiseGenerator or SecureNoiseGenerator, "
                            f"got {type(generator).__name__}")
        key, offset = generator.claim(n)
        return (key if isinstance(generator, SecureNoiseGenerator) else _philox_words(key)), offset
    if generator is not None:
        raise ValueError("pass either generator or key (and offset), not both")
    return _philox_words(_check_key(key)), _check_offset(0 if offset is None else offset, n)


def _philox_words(key: int) -> list[int]:
    return [key & 0xFFFFFFFF, key >> 32]


def _grid(scale: float) -> int:
    """k of the secure grid 2^k: 2^20 <= scale / 2^k < 2^21 (about 1e-6 of the noise scale)."""
    return math.frexp(scale)[1] - 21


def _discrete_parameters(distribution: str, scale: float) -> tuple[float, int]:
    """The integer scale of the discrete noise (rounded up: never less private) and the grid exponent."""
    if scale == 0:
        raise ValueError("secure noise needs a scale > 0")
    k = _grid(scale)
    in_units = Fraction(scale) / Fraction(2) ** k
    integer_scale = math.ceil(in_units**2 if distribution == "gaussian" else in_units)
    return float(integer_scale), k


def secure_scale(distribution: str, scale: float, sensitivity: float, count: int) -> float:
    """The scale at which secure noise (``distribution`` "gaussian" or "laplace") added to
    ``count`` values whose sensitivity is ``sensitivity`` (L2 for the Gaussian, L1 for Laplace)
    is as private as noise of ``scale`` on the exact values. Rounding to the grid g moves each
    value by at most g/2, so two neighbours' values on the grid are up to Delta + g sqrt(n) (L2)
    or Delta + g n (L1) apart (a review's worst case at n = 10^6: 1.0071 C for the Gaussian at
    sigma 10, 1.91 C_1 for Laplace at noise multiplier 1, the epsilon reported for the true
    sensitivity). The scale grows by that factor, with its own grid's g (the least such s', found
    by iterating from s, rounded up by 2^-40 of itself):

        s' >= s (1 + g(s') n^(1/2 or 1) / Delta),    g(s') = 2^k, 2^20 <= s' / g(s') < 2^21.

    The factor is about 1 + 2^-20 sigma sqrt(n) at most for the Gaussian (sigma = s / Delta: 1.01
    at sigma 1 and n = 10^8) and 1 + 2^-20 sigma n for Laplace. No s' exists where
    s n^(1/2 or 1) / Delta >= 2^21 (the grid grows with the scale): refused."""
    distribution = validation.choice(distribution, "distribution", ("gaussian", "laplace"))
    count = validation.integer(count, "count", low=0)
    sensitivity = validation.positive(sensitivity, "sensitivity")
    spread = (math.sqrt(count) if distribution == "gaussian" else float(count)) / sensitivity
    if scale * spread >= 2.0**21:
        norm = "L2" if distribution == "gaussian" else "L1"
        raise ValueError(f"secure {distribution} noise of scale {scale} on {count} values of {norm} sensitivity "
                         f"{sensitivity}: rounding them to a grid of about 2^-20 of any scale covering them moves "
                         "neighbours apart by more than that scale can hide; use fewer values, a smaller noise "
                         "multiplier, or noise that is not secure")
    raised = scale
    while (wanted := scale * (1.0 + 2.0 ** _grid(raised) * spread)) > raised:
        raised = wanted  # g is constant between powers of two: a few rounds up to the least s'
    return raised * (1.0 + 2.0**-40)  # the float products' rounding


def _apply(outs: list, distribution: str, scale: float, key: list[int], offset: int, grid_exponent: int,
           add: bool) -> None:
    """The kernel call: ``outs`` (contiguous, of one dtype, on one device), laid end to end, = or +=
    noise elements offset .. offset + their numel - 1. One call for a model's tensors: a call per
    tensor cost more than its noise on a small model."""
    v = _arrays.view(outs[0], "x", dtypes=NOISE_DTYPES)
    addresses, numels = [out.data_ptr() for out in outs], [out.numel() for out in outs]
    if distribution.startswith("discrete_"):
        name, args = "apply_secure_noise", (distribution.removeprefix("discrete_"), v.dtype, addresses, numels, key,
                                           offset, int(scale), grid_exponent, add)
    else:
        name, args = "apply_noise", (distribution, v.dtype, addresses, numels, key[0] | (key[1] << 32), offset, scale,
                                     add)
    _backend.call(name, v, *args)


# The ops' arguments: distribution ("gaussian", "laplace", or in secure mode "discrete_gaussian",
# "discrete_laplace"), scale (std or Laplace scale; for discrete noise the integer scale in grid
# units), key (32-bit words: 2 for Philox, 8 for ChaCha20), offset, grid exponent (discrete only).
@_ops.operator("noise")
def _noise_op(size: Sequence[int], distribution: str, scale: float, key: Sequence[int], offset: int,
              grid_exponent: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype, device=device)
    _apply([out], distribution, scale, list(key), offset, grid_exponent, add=False)
    return out


@_noise_op.register_fake
def _(size, distribution, scale, key, offset, grid_exponent, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


def _add_into(xs: list, distribution: str, scale: float, key: Sequence[int], offset: int,
              grid_exponent: int) -> None:
    """xs (one stream, laid end to end) += noise; a kernel call per run of tensors of one dtype and
    device (the op called directly, past the public functions' checks, may mix devices: one
    kernel on one device writing another's memory faults)."""
    # Noise element i goes to a strided x's i-th element in row-major order, as for a contiguous x.
    dense = [x if x.is_contiguous() else x.contiguous() for x in xs]
    for _, run in itertools.groupby(dense, key=lambda x: (x.dtype, x.device)):
        run = list(run)
        _apply(run, distribution, scale, list(key), offset, grid_exponent, add=True)
        offset += sum(x.numel() for x in run)
    for x, d in zip(xs, dense):
        if d is not x:
            x.copy_(d)


@_ops.operator("add_noise_", mutates_args={"x"})
def _add_noise_inplace_op(x: torch.Tensor, distribution: str, scale: float, key: Sequence[int], offset: int,
                          grid_exponent: int) -> None:
    _add_into([x], distribution, scale, key, offset, grid_exponent)


@_add_noise_inplace_op.register_fake
def _(x, distribution, scale, key, offset, grid_exponent):
    return None


@_ops.operator("add_noise_many_", mutates_args={"xs"})
def _add_noise_many_inplace_op(xs: list[torch.Tensor], distribution: str, scale: float, key: Sequence[int],
                               offset: int, grid_exponent: int) -> None:
    """add_noise_ on tensors laid end to end: one stream, one op call (a model's tensors are many
    and often small, and each op call costs tens of microseconds)."""
    _add_into(xs, distribution, scale, key, offset, grid_exponent)


@_add_noise_many_inplace_op.register_fake
def _(xs, distribution, scale, key, offset, grid_exponent):
    return None


@_ops.operator("add_noise", differentiable=True)
def _add_noise_op(x: torch.Tensor, distribution: str, scale: float, key: Sequence[int], offset: int,
                  grid_exponent: int) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    _apply([out], distribution, scale, list(key), offset, grid_exponent, add=True)
    return out


@_add_noise_op.register_fake
def _(x, distribution, scale, key, offset, grid_exponent):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_noise_backward(ctx, grad):
    return grad, None, None, None, None, None


_add_noise_op.register_autograd(_add_noise_backward)


def _size(size: Union[int, Sequence[int]]) -> list[int]:
    if isinstance(size, (numbers.Integral, torch.Tensor)) and not isinstance(size, (bool, np_bool)):
        size = [size]
    if isinstance(size, (str, bytes)) or not isinstance(size, (Sequence, torch.Size)):
        raise validation.ArgumentTypeError(f"size must be a non-negative int or a sequence of them, got {size!r}")
    try:
        dims = [validation.integer(d, "size", low=0) for d in size]
    except (TypeError, ValueError):
        raise validation.ArgumentTypeError(f"size must be a non-negative int or a sequence of them, got {size!r}") \
            from None
    if math.prod(dims) >= _MAX_ELEMENT:
        raise ValueError(f"size {tuple(dims)} has {math.prod(dims)} elements, beyond the counter space of 2^63")
    return dims


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, (NoiseGenerator, SecureNoiseGenerator)):
        raise validation.ArgumentTypeError(
            f"generator must be a NoiseGenerator or SecureNoiseGenerator, got {type(generator).__name__}")


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") not in NOISE_DTYPES:
        raise validation.ArgumentTypeError(f"dtype must be one of torch.{', torch.'.join(NOISE_DTYPES)}, got {dtype!r}")
    return dtype


def _check_device(device) -> torch.device:
    """``device`` as a torch.device on cpu or cuda; CUDA must be usable by privleak and torch."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise validation.ArgumentTypeError(f"device must be a torch.device or a string such as 'cpu' or 'cuda', "
                                           f"got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"device must be cpu or cuda, got {device!r} ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if device.type == "cuda":
        _check_cuda(device, "device")
    return device


def _check_cuda(device: torch.device, name: str) -> None:
    """A RuntimeError (privleak's, saying what is missing) unless privleak and torch can run on ``device``."""
    try:
        _backend.cuda()
    except RuntimeError as exc:
        raise RuntimeError(f"{name} is {device}, but CUDA cannot run here: {exc}") from None
    if not torch.cuda.is_available():
        raise RuntimeError(f"{name} is {device}, but this torch ({torch.__version__}) cannot use CUDA here")
    if device.index is not None and not 0 <= device.index < torch.cuda.device_count():
        raise ValueError(f"{name} is {device}, but there are {torch.cuda.device_count()} CUDA devices")


def _op_parameters(distribution: str, scale: float, generator) -> tuple[str, float, int]:
    """(op distribution, op scale, grid exponent) for the generator's kind."""
    if isinstance(generator, SecureNoiseGenerator):
        return ("discrete_" + distribution, *_discrete_parameters(distribution, scale))
    return distribution, scale, 0


def _draw(distribution: str, size, scale: float, scale_name: str, generator, key, offset, dtype,
          device) -> torch.Tensor:
    dims = _size(size)
    scale = validation.non_negative(scale, scale_name)
    _check_generator(generator)
    dtype = _check_dtype(dtype)
    device = _check_device(device)
    _check_noise_range(distribution, scale, scale_name, dtype, isinstance(generator, SecureNoiseGenerator))
    op_distribution, op_scale, grid = _op_parameters(distribution, scale, generator)
    words, offset = _resolve_stream(math.prod(dims), generator, key, offset)
    return torch.ops.privleak.noise(dims, op_distribution, op_scale, words, offset, grid, dtype, device)


def _check_inplace_target(x: torch.Tensor, name: str) -> None:
    """Refuse to modify x (named ``name``) in place where torch's own in-place ops (``x.add_``)
    refuse, with the same RuntimeError: an inference tensor outside inference mode, or (with grad
    mode on) a leaf that requires grad or a view of one."""
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name} is an inference tensor: an in-place update to it outside torch.inference_mode() "
                           "is not allowed (torch's own in-place ops refuse it too); clone it first, or use the "
                           "out-of-place add_*_noise")
    if torch.is_grad_enabled() and x.requires_grad:
        if x.is_leaf:
            raise RuntimeError(f"{name} is a leaf tensor that requires grad: it cannot be used in an in-place "
                               "operation (torch's own in-place ops refuse it too); use the out-of-place add_*_noise, "
                               "or wrap the call in torch.no_grad()")
        base = x._base
        if base is not None and base.is_leaf and base.requires_grad:
            raise RuntimeError(f"{name} is a view of a leaf tensor that requires grad: it cannot be used in an "
                               "in-place operation (torch's own in-place ops refuse it too); use the out-of-place "
                               "add_*_noise, or wrap the call in torch.no_grad()")


def _add(distribution: str, x, scale: float, scale_name: str, generator, key, offset, inplace: bool):
    """x + noise for a tensor x, or for a list or tuple of tensors laid end to end (one stream:
    tensor j's element i gets noise element offset + numel(x_0 .. x_{j-1}) + i)."""
    many = isinstance(x, (list, tuple))
    tensors = list(x) if many else [x]
    names = [f"x[{j}]" for j in range(len(tensors))] if many else ["x"]
    if tensors:
        if validation.tensors(tensors, names, dtypes=NOISE_DTYPES).is_cuda:  # one device for all
            _check_cuda(tensors[0].device, f"{names[0]}'s device")
        if inplace:
            for t, name in zip(tensors, names):
                _check_inplace_target(t, name)
    scale = validation.non_negative(scale, scale_name)
    _check_generator(generator)
    secure = isinstance(generator, SecureNoiseGenerator)
    # The noise itself must fit x's dtype; x + noise may still overflow where x is near the max, as x + y does.
    for dtype in {t.dtype for t in tensors}:
        _check_noise_range(distribution, scale, scale_name, dtype, secure)
    op_distribution, op_scale, grid = _op_parameters(distribution, scale, generator)
    sized = [(t, name) for t, name in zip(tensors, names) if t.numel()] if grid else []
    if sized:  # secure mode computes round(x / 2^grid) in int64; one host sync for all the tensors
        largest = torch.stack([t.detach().abs().amax().double() for t, _ in sized]).tolist()
        for value, (_, name) in zip(largest, sized):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite for secure noise")
            if value >= 2.0 ** (grid + 61):
                raise ValueError(f"{name} is too large for secure noise of scale {scale}: |{name}| must stay below "
                                 "2^61 grid steps")
    words, offset = _resolve_stream(sum(t.numel() for t in tensors), generator, key, offset)
    if inplace and many:
        if tensors:  # the op needs a tensor to dispatch on
            torch.ops.privleak.add_noise_many_(tensors, op_distribution, op_scale, words, offset, grid)
        return x
    if inplace:
        torch.ops.privleak.add_noise_(x, op_distribution, op_scale, words, offset, grid)
        return x
    out = []
    for t in tensors:
        out.append(torch.ops.privleak.add_noise(t, op_distribution, op_scale, words, offset, grid))
        offset += t.numel()
    return (tuple(out) if isinstance(x, tuple) else out) if many else out[0]


@_ops.operator("vmf_sample")
def _vmf_op(mu: torch.Tensor, kappa: float, n: int, key: Sequence[int], offset: int) -> torch.Tensor:
    p = mu.shape[0]
    out = torch.empty(n, p, dtype=mu.dtype, device=mu.device)
    v = _arrays.view(mu, "mu", ndim=1)
    _backend.call("vmf_sample", v, v.dtype, v.address, p, kappa, n, key[0] | (key[1] << 32), offset, out.data_ptr(),
                  workspace=lambda cuda: cuda.vmf_workspace_bytes(p, n))
    return out


@_vmf_op.register_fake
def _(mu, kappa, n, key, offset):
    return mu.new_empty(n, mu.shape[0])


def vmf_sample(mu: torch.Tensor, kappa: float, n: int = 1, *, generator: Optional[NoiseGenerator] = None,
               key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """n directions from the von Mises-Fisher distribution on the sphere S^{p-1}.

    Density f(y) = C_p(kappa) exp(kappa mu.y) with C_p(kappa) = kappa^{p/2-1} / ((2 pi)^{p/2}
    I_{p/2-1}(kappa)) (Biswas et al., Sec. IV and Appendix A; Wood 1994). ``mu`` (shape (p,),
    float32 or float64, CPU or CUDA, p >= 2) is normalised to unit length, as Alg. 2 normalises the
    clipped average: a zero or non-finite ``mu`` is rejected. The norm is the same bits on every
    device (:func:`privleak.special.scaled_norm`: exact squares, a fixed-order compensated sum;
    a library norm sums in a device-dependent order, and a one-ulp change of the norm changes every
    sample), and huge or subnormal ``mu`` are scaled by a power of two first. ``kappa`` must be
    finite and > 0; for every such kappa the call returns (as kappa -> inf the samples tend to mu,
    and from kappa ~ 1e32 on they equal it to working precision).

    Returns an (n, p) tensor of unit vectors, sample s a pure function of (key, offset + s); a
    generator advances by n. Counter space (csrc/common/vmf.h): sample S = offset + s reads the
    Philox counters (block, block >> 32, 2^31 | S >> 32, 0) for block = (S mod 2^32) 2^30 + j,
    j < ceil((p - 1) / k) (its tangent Gaussians, k = 4 values per block in float32, 2 in float64),
    and (r, S mod 2^32, 18, S >> 32) for r < 2^32 (Wood's rejection loop). So offset + n must be
    <= 2^63 and p - 1 <= 2^31 (ValueError naming ``offset`` or ``mu`` otherwise); no two samples
    share a counter with each other or with any other privleak draw, and a sample's float32 and
    float64 versions read the same counters (one draw at two precisions). A rejection loop that
    used up its 2^32 blocks (probability below 2^-(2^29)) raises on CPU and gives NaN on CUDA.
    Works for p up to 10^7 and kappa from 1e-6 to 1e200 (tested), in O(n p) time and no memory
    beyond the output.
    """
    from privleak import special

    validation.tensor(mu, "mu", ndim=1)
    if mu.shape[0] < 2:
        raise ValueError(f"mu must have p >= 2 coordinates (a direction on S^(p-1)), got p = {mu.shape[0]}")
    if mu.shape[0] - 1 > 2**31:
        raise ValueError(f"mu must have p - 1 <= 2^31 coordinates (VMF's counter space), got p = {mu.shape[0]}")
    kappa = validation.positive(kappa, "kappa")
    n = validation.integer(n, "n", low=0)
    scaled, norm = special.scaled_norm(mu.detach().double())
    if not math.isfinite(norm) or norm == 0:
        raise ValueError(f"mu must be finite and non-zero, got norm {norm}")
    unit = _arrays.quotient(scaled, norm).to(mu.dtype).contiguous()
    if isinstance(generator, SecureNoiseGenerator):
        raise ValueError("vmf_sample has no secure mode yet: pass a NoiseGenerator or a key")
    words, offset = _resolve_stream(n, generator, key, offset)
    return torch.ops.privleak.vmf_sample(unit, kappa, n, words, offset)


def vmf_log_density(y: torch.Tensor, mu: torch.Tensor, kappa: float) -> torch.Tensor:
    """log f(y) = log C_p(kappa) + kappa mu.y for directions y (..., p) under VMF(mu, kappa).

    C_p(kappa) = kappa^{p/2-1} / ((2 pi)^{p/2} I_{p/2-1}(kappa)) (Biswas et al., Appendix A; Wood
    1994). Evaluated as kappa (mu.y - 1) + (log C_p(kappa) + kappa), with no cancellation: the
    second term from the scaled Bessel function (:func:`privleak.special.vmf_log_scaled_normaliser`),
    and mu.y - 1 from exact products and a compensated sum (:func:`privleak.special.two_product`,
    :func:`privleak.special.compensated_sum`), so it keeps full relative accuracy as y -> mu.
    (log C_p(kappa) + kappa mu.y lost kappa eps: 40 ulp at p = 2, kappa = 800.) The result is
    within a few ulp of the exact log density at the float64 points y and mu (of the value, or
    absolutely where the value is near 0: see tests/test_vmf.py), for p up to 10^9 and kappa up
    to 1e300.

    ``y`` must be finite and on the unit sphere: | |y| - 1 | <= eps (8 + sqrt(p)), eps that of
    y's dtype (rounding a unit vector to the dtype and normalising it there stay well inside);
    a point off the sphere has no density and raises ValueError naming ``y``. ``mu`` (shape (p,),
    p >= 2) is normalised as in :func:`vmf_sample`, to the float64 direction fl(mu / |mu|) that the
    sampler uses (a mu already unit to rounding is left as it is). Returns float64 of shape y.shape[:-1] on y's
    device, without gradient.
    """
    from privleak import special

    if not isinstance(y, torch.Tensor) or not isinstance(mu, torch.Tensor):
        raise TypeError("y and mu must be torch tensors")
    if mu.ndim != 1 or y.ndim < 1 or y.shape[-1:] != mu.shape:
        raise ValueError("y must have shape (..., p) with mu of shape (p,), "
                         f"got {tuple(y.shape)} and {tuple(mu.shape)}")
    p = mu.shape[0]
    if p < 2:
        raise ValueError(f"mu must have p >= 2 coordinates (a direction on S^(p-1)), got p = {p}")
    kappa = validation.positive(kappa, "kappa")
    if y.is_complex() or mu.is_complex():
        raise TypeError("y and mu must be real tensors")
    scaled_mu, mu_norm = special.scaled_norm(mu.detach().to(device=y.device, dtype=torch.float64))
    if not math.isfinite(mu_norm) or mu_norm == 0:
        raise ValueError(f"mu must be finite and non-zero, got norm {mu_norm}")
    y64 = y.detach().double()
    if not bool(torch.isfinite(y64).all()):
        raise ValueError("y must be finite")
    eps = torch.finfo(y.dtype).eps if y.dtype.is_floating_point else torch.finfo(torch.float64).eps
    tolerance = eps * (8.0 + math.sqrt(p))
    squares, errors = special.sum_of_squares(y64)
    off_sphere = ((squares - 1.0) + errors).abs()  # | |y|^2 - 1 | = 2 | |y| - 1 | to first order
    bad = ~(off_sphere <= 2.0 * tolerance)  # NaN (a square beyond the split's range) is bad too
    if bool(bad.any()):
        norms = torch.sqrt((squares + errors)[bad])
        worst = float((norms - 1.0).abs().max())
        raise ValueError(f"y must lie on the unit sphere S^(p-1): | |y| - 1 | <= {tolerance:.3g} for {y.dtype}, "
                         f"got {worst:.3g}")
    unit = _arrays.quotient(scaled_mu, mu_norm)
    dot, dot_error = special.compensated_sum(*special.two_product(y64, unit))
    head, low = special.two_sum(dot, -1.0)
    cos_minus_one = head + (low + dot_error)  # mu.y - 1 to about 1 ulp
    return float(special.vmf_log_scaled_normaliser(p, kappa)) + kappa * cos_minus_one


_STREAM_DOC = """
    Args:
        generator: a :class:`NoiseGenerator` whose offset the draw advances (default: the
            module's default generator), or a :class:`SecureNoiseGenerator` for secure mode
            (discretised noise from ChaCha20, see the module docstring). Or, instead:
        key, offset: an explicit position in the noise stream, key in [0, 2^64), offset >= 0 and
            offset + numel <= 2^63 (the counter space, see :class:`NoiseGenerator`); element i is
            then noise element offset + i of the key's stream.

    The scale must be finite and >= 0, and its noise representable in the output dtype: unit
    noise reaches 6.77 (Gaussian) or 22.2 (Laplace) in float32 generation, 8.65 or 37.4 in float64,
    so scale x that must not exceed the dtype's max (float16: std <= 9685); in secure mode 20 sd or
    100 scales. A positive scale below the generation precision's smallest normal (1.2e-38 in
    float32) is refused, as its noise would vanish. Adding noise checks the scale only: x + noise
    can still overflow where x itself is near the dtype's max, as x + y does."""


def gaussian_noise(size, std: float = 1.0, *, generator: Optional[NoiseGenerator] = None, key: Optional[int] = None,
                   offset: Optional[int] = None, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """A new tensor of N(0, std^2) noise of shape ``size`` (float32, float64, bfloat16, float16)."""
    return _draw("gaussian", size, std, "std", generator, key, offset, dtype, device)


def laplace_noise(size, scale: float = 1.0, *, generator: Optional[NoiseGenerator] = None, key: Optional[int] = None,
                  offset: Optional[int] = None, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """A new tensor of Laplace(0, scale) noise, density exp(-|z|/scale) / (2 scale)."""
    return _draw("laplace", size, scale, "scale", generator, key, offset, dtype, device)


def add_gaussian_noise(x: torch.Tensor, std: float, *, generator: Optional[NoiseGenerator] = None,
                       key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x + N(0, std^2 I), out of place; the gradient with respect to x passes through unchanged.
    ``x`` may be a list or tuple of tensors on one device: one stream over them laid end to end,
    as if concatenated."""
    return _add("gaussian", x, std, "std", generator, key, offset, inplace=False)


def add_gaussian_noise_(x: torch.Tensor, std: float, *, generator: Optional[NoiseGenerator] = None,
                        key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x += std * z in place (in float32 for half types, rounded once); returns x. ``x`` may be a
    list or tuple of tensors on one device: one stream over them laid end to end, as if
    concatenated, in one op call (a model's tensors are many and often small)."""
    return _add("gaussian", x, std, "std", generator, key, offset, inplace=True)


def add_laplace_noise(x: torch.Tensor, scale: float, *, generator: Optional[NoiseGenerator] = None,
                      key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x + Laplace(0, scale)^n, out of place; the gradient passes through unchanged. ``x`` may be
    a list or tuple of tensors, as for :func:`add_gaussian_noise`."""
    return _add("laplace", x, scale, "scale", generator, key, offset, inplace=False)


def add_laplace_noise_(x: torch.Tensor, scale: float, *, generator: Optional[NoiseGenerator] = None,
                       key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x += Laplace(0, scale) noise in place; returns x. ``x`` may be a list or tuple of tensors,
    as for :func:`add_gaussian_noise_`."""
    return _add("laplace", x, scale, "scale", generator, key, offset, inplace=True)


for _op in (gaussian_noise, laplace_noise, add_gaussian_noise, add_gaussian_noise_, add_laplace_noise,
            add_laplace_noise_, vmf_sample):
    _op.__doc__ += _STREAM_DOC
