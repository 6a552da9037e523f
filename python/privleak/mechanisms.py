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
(Delta / b)-DP, for Delta the sensitivity on the grid (at most the true one plus g); rounding the
scale up keeps both at least as private as asked. Secure draws cost a few ChaCha20 blocks per
element (csrc/common/secure_noise.h).

:func:`vmf_sample` draws directions from the von Mises-Fisher distribution (Alg. 2 of Biswas et al.)
with Wood's rejection step and a Householder reflection, in O(n p) (csrc/common/vmf.h).

This module imports torch; ``import privleak`` does not.
"""
from __future__ import annotations

import math
import secrets
import struct
from fractions import Fraction
from typing import Optional, Sequence, Union

import torch

from privleak import _arrays, _backend

NOISE_DTYPES = ("float32", "float64", "bfloat16", "float16")
_U64 = 2**64
_MAX_ELEMENT = 2**63  # offsets travel through torch's int64 op schema


class NoiseGenerator:
    """State for counter-based noise, used like ``torch.Generator``.

    The state is (key, offset): a draw of n elements uses elements offset .. offset + n - 1 of the
    key's stream and advances the offset by n, so two draws of n and m elements give the same bits
    as one draw of n + m. ``NoiseGenerator()`` takes a random key from the operating system;
    ``NoiseGenerator(seed)`` or ``manual_seed(seed)`` makes it reproducible.
    """

    def __init__(self, seed: Optional[int] = None):
        self._initial_seed = 0
        self.key = 0
        self.offset = 0
        if seed is None:
            self.seed()
        else:
            self.manual_seed(seed)

    def manual_seed(self, seed: int) -> "NoiseGenerator":
        """Use ``seed`` (any int; taken modulo 2^64) as the key and restart at offset 0."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
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
        key, offset = state
        self.key, self.offset = _check_key(key), _check_offset(offset, 0)

    def claim(self, n: int) -> tuple[int, int]:
        """The (key, offset) for a draw of ``n`` elements, advancing the offset past them."""
        offset = _check_offset(self.offset, n)
        self.offset += n
        return self.key, offset

    def __repr__(self) -> str:
        return f"NoiseGenerator(key={self.key:#x}, offset={self.offset})"


class SecureNoiseGenerator:
    """Secure-mode noise: ChaCha20 keyed with 256 bits from the operating system.

    It takes no seed and has no state to get or set: its draws cannot be replayed. Passing it
    as ``generator`` to the noise functions switches them to discretised noise (module docstring).
    """

    def __init__(self):
        self._key_words = list(struct.unpack("<8I", secrets.token_bytes(32)))
        self._offset = 0

    def claim(self, n: int) -> tuple[list[int], int]:
        """The key words and offset for a draw of ``n`` elements, advancing past them."""
        offset = _check_offset(self._offset, n)
        self._offset += n
        return self._key_words, offset

    def __repr__(self) -> str:
        return f"SecureNoiseGenerator(offset={self._offset})"


default_generator = NoiseGenerator()


def manual_seed(seed: int) -> NoiseGenerator:
    """Seed privleak's default noise generator (``torch.manual_seed`` leaves it alone)."""
    return default_generator.manual_seed(seed)


def _check_key(key: int) -> int:
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"key must be an int, got {type(key).__name__}")
    if not 0 <= key < _U64:
        raise ValueError(f"key must be in [0, 2**64), got {key}")
    return key


def _check_offset(offset: int, n: int) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0 or offset + n > _MAX_ELEMENT:
        raise ValueError(f"offset must satisfy 0 <= offset and offset + numel <= 2**63, got offset={offset}, numel={n}")
    return offset


def _check_scale(scale: float, name: str) -> float:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {scale}")
    return float(scale)


def _resolve_stream(n: int, generator, key: Optional[int], offset: Optional[int]) -> tuple[list[int], int]:
    """The noise stream of a draw of n elements, as (key as 32-bit words, offset)."""
    if key is None:
        if offset is not None:
            raise ValueError("offset needs an explicit key; with a generator the offset is the generator's")
        generator = default_generator if generator is None else generator
        if not isinstance(generator, (NoiseGenerator, SecureNoiseGenerator)):
            raise TypeError(f"generator must be a NoiseGenerator or SecureNoiseGenerator, got {type(generator).__name__}")
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


def _apply(out: torch.Tensor, distribution: str, scale: float, key: list[int], offset: int, grid_exponent: int,
           add: bool) -> None:
    """The kernel call: ``out`` (contiguous) = or += noise elements offset .. offset + numel - 1."""
    v = _arrays.view(out, "x", dtypes=NOISE_DTYPES)
    if distribution.startswith("discrete_"):
        name, args = "apply_secure_noise", (distribution.removeprefix("discrete_"), v.dtype, v.address, out.numel(),
                                           key, offset, int(scale), grid_exponent, add)
    else:
        name, args = "apply_noise", (distribution, v.dtype, v.address, out.numel(), key[0] | (key[1] << 32), offset,
                                     scale, add)
    if v.is_cuda:
        getattr(_backend.cuda(), name)(*args, v.device_index, v.stream)
    else:
        getattr(_backend.core, name)(*args)


# The ops' arguments: distribution ("gaussian", "laplace", or in secure mode "discrete_gaussian",
# "discrete_laplace"), scale (std or Laplace scale; for discrete noise the integer scale in grid
# units), key (32-bit words: 2 for Philox, 8 for ChaCha20), offset, grid exponent (discrete only).
@torch.library.custom_op("privleak::noise", mutates_args=())
def _noise_op(size: Sequence[int], distribution: str, scale: float, key: Sequence[int], offset: int,
              grid_exponent: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype, device=device)
    _apply(out, distribution, scale, list(key), offset, grid_exponent, add=False)
    return out


@_noise_op.register_fake
def _(size, distribution, scale, key, offset, grid_exponent, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.custom_op("privleak::add_noise_", mutates_args={"x"})
def _add_noise_inplace_op(x: torch.Tensor, distribution: str, scale: float, key: Sequence[int], offset: int,
                          grid_exponent: int) -> None:
    if x.is_contiguous():
        _apply(x, distribution, scale, list(key), offset, grid_exponent, add=True)
    else:  # noise element i goes to x's i-th element in row-major order, as for contiguous x
        dense = x.contiguous()
        _apply(dense, distribution, scale, list(key), offset, grid_exponent, add=True)
        x.copy_(dense)


@_add_noise_inplace_op.register_fake
def _(x, distribution, scale, key, offset, grid_exponent):
    return None


@torch.library.custom_op("privleak::add_noise", mutates_args=())
def _add_noise_op(x: torch.Tensor, distribution: str, scale: float, key: Sequence[int], offset: int,
                  grid_exponent: int) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    _apply(out, distribution, scale, list(key), offset, grid_exponent, add=True)
    return out


@_add_noise_op.register_fake
def _(x, distribution, scale, key, offset, grid_exponent):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_noise_backward(ctx, grad):
    return grad, None, None, None, None, None


_add_noise_op.register_autograd(_add_noise_backward)


def _size(size: Union[int, Sequence[int]]) -> list[int]:
    dims = [size] if isinstance(size, int) else list(size)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"size must be a non-negative int or a sequence of them, got {size!r}")
    return dims


def _op_parameters(distribution: str, scale: float, generator) -> tuple[str, float, int]:
    """(op distribution, op scale, grid exponent) for the generator's kind."""
    if isinstance(generator, SecureNoiseGenerator):
        return ("discrete_" + distribution, *_discrete_parameters(distribution, scale))
    return distribution, scale, 0


def _draw(distribution: str, size, scale: float, scale_name: str, generator, key, offset, dtype, device) -> torch.Tensor:
    dims = _size(size)
    scale = _check_scale(scale, scale_name)
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in NOISE_DTYPES:
        raise TypeError(f"dtype must be one of {NOISE_DTYPES}, got {dtype}")
    device = torch.device("cpu" if device is None else device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    op_distribution, op_scale, grid = _op_parameters(distribution, scale, generator)
    words, offset = _resolve_stream(math.prod(dims), generator, key, offset)
    return torch.ops.privleak.noise(dims, op_distribution, op_scale, words, offset, grid, dtype, device)


def _add(distribution: str, x: torch.Tensor, scale: float, scale_name: str, generator, key, offset, inplace: bool):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch tensor, got {type(x).__name__}")
    _arrays.view(x, "x", dtypes=NOISE_DTYPES)  # dtype and device checks
    scale = _check_scale(scale, scale_name)
    op_distribution, op_scale, grid = _op_parameters(distribution, scale, generator)
    if grid and x.numel():  # secure mode computes round(x / 2^grid) in int64
        largest = float(x.detach().abs().max())
        if not math.isfinite(largest):
            raise ValueError("x must be finite for secure noise")
        if largest >= 2.0 ** (grid + 61):
            raise ValueError(f"x is too large for secure noise of scale {scale}: |x| must stay below 2^61 grid steps")
    words, offset = _resolve_stream(x.numel(), generator, key, offset)
    if inplace:
        torch.ops.privleak.add_noise_(x, op_distribution, op_scale, words, offset, grid)
        return x
    return torch.ops.privleak.add_noise(x, op_distribution, op_scale, words, offset, grid)


@torch.library.custom_op("privleak::vmf_sample", mutates_args=())
def _vmf_op(mu: torch.Tensor, kappa: float, n: int, key: Sequence[int], offset: int) -> torch.Tensor:
    p = mu.shape[0]
    out = torch.empty(n, p, dtype=mu.dtype, device=mu.device)
    v = _arrays.view(mu, "mu", ndim=1)
    args = (v.dtype, v.address, p, kappa, n, key[0] | (key[1] << 32), offset, out.data_ptr())
    if v.is_cuda:
        cuda = _backend.cuda()
        workspace = torch.empty(cuda.vmf_workspace_bytes(p, n), dtype=torch.uint8, device=mu.device)
        cuda.vmf_sample(*args, workspace.data_ptr(), v.device_index, v.stream)
    else:
        _backend.core.vmf_sample(*args)
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
    clipped average: a zero or non-finite ``mu`` is rejected. ``kappa`` must be finite and > 0.
    Returns an (n, p) tensor of unit vectors, sample s a pure function of (key, offset + s); a
    generator advances by n. Works for p up to 10^7 and kappa from 1e-6 to 1e9 (tested), in
    O(n p) time and no memory beyond the output.
    """
    if not isinstance(mu, torch.Tensor):
        raise TypeError(f"mu must be a torch tensor, got {type(mu).__name__}")
    _arrays.view(mu, "mu", ndim=1)
    if mu.shape[0] < 2:
        raise ValueError(f"mu must have p >= 2 coordinates (a direction on S^(p-1)), got p = {mu.shape[0]}")
    kappa = _check_scale(kappa, "kappa")
    if kappa == 0:
        raise ValueError("kappa must be > 0")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    norm = torch.linalg.vector_norm(mu.double())
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError(f"mu must be finite and non-zero, got norm {float(norm)}")
    unit = (mu.double() / norm).to(mu.dtype).contiguous()
    if isinstance(generator, SecureNoiseGenerator):
        raise ValueError("vmf_sample has no secure mode yet: pass a NoiseGenerator or a key")
    words, offset = _resolve_stream(n, generator, key, offset)
    return torch.ops.privleak.vmf_sample(unit, kappa, n, words, offset)


def vmf_log_density(y: torch.Tensor, mu: torch.Tensor, kappa: float) -> torch.Tensor:
    """log f(y) = log C_p(kappa) + kappa mu.y for directions y (..., p) under VMF(mu, kappa).

    C_p(kappa) = kappa^{p/2-1} / ((2 pi)^{p/2} I_{p/2-1}(kappa)) (Biswas et al., Appendix A),
    evaluated by :func:`privleak.special.vmf_log_normaliser`, stable for p up to 10^9 and kappa
    from 1e-6 to 1e9 where the Bessel function over- or underflows. ``mu`` is normalised as in
    :func:`vmf_sample`. Returns float64.
    """
    from privleak.special import vmf_log_normaliser

    if not isinstance(y, torch.Tensor) or not isinstance(mu, torch.Tensor):
        raise TypeError("y and mu must be torch tensors")
    if mu.ndim != 1 or y.shape[-1:] != mu.shape:
        raise ValueError(f"y must have shape (..., p) with mu of shape (p,), got {tuple(y.shape)} and {tuple(mu.shape)}")
    kappa = _check_scale(kappa, "kappa")
    if kappa == 0:
        raise ValueError("kappa must be > 0")
    norm = torch.linalg.vector_norm(mu.double())
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError(f"mu must be finite and non-zero, got norm {float(norm)}")
    log_normaliser = float(vmf_log_normaliser(mu.shape[0], kappa))
    return log_normaliser + kappa * (y.double() @ (mu.double() / norm))


_STREAM_DOC = """
    Args:
        generator: a :class:`NoiseGenerator` whose offset the draw advances (default: the
            module's default generator), or a :class:`SecureNoiseGenerator` for secure mode
            (discretised noise from ChaCha20, see the module docstring). Or, instead:
        key, offset: an explicit position in the noise stream, key in [0, 2^64), offset >= 0;
            element i is then noise element offset + i of the key's stream."""


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
    """x + N(0, std^2 I), out of place; the gradient with respect to x passes through unchanged."""
    return _add("gaussian", x, std, "std", generator, key, offset, inplace=False)


def add_gaussian_noise_(x: torch.Tensor, std: float, *, generator: Optional[NoiseGenerator] = None,
                        key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x += std * z in place (in float32 for half types, rounded once); returns x."""
    return _add("gaussian", x, std, "std", generator, key, offset, inplace=True)


def add_laplace_noise(x: torch.Tensor, scale: float, *, generator: Optional[NoiseGenerator] = None,
                      key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x + Laplace(0, scale)^n, out of place; the gradient passes through unchanged."""
    return _add("laplace", x, scale, "scale", generator, key, offset, inplace=False)


def add_laplace_noise_(x: torch.Tensor, scale: float, *, generator: Optional[NoiseGenerator] = None,
                       key: Optional[int] = None, offset: Optional[int] = None) -> torch.Tensor:
    """x += Laplace(0, scale) noise in place; returns x."""
    return _add("laplace", x, scale, "scale", generator, key, offset, inplace=True)


for _op in (gaussian_noise, laplace_noise, add_gaussian_noise, add_gaussian_noise_, add_laplace_noise, add_laplace_noise_,
            vmf_sample):
    _op.__doc__ += _STREAM_DOC
