"""Loads the native modules and reports what this installation can run.

``privleak._core`` (C++) is always built. ``privleak._cuda`` exists when nvcc was found at build
time, and is usable only where a CUDA driver and a GPU are present; ``import privleak`` never
depends on either.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Sequence

from privleak import _arrays, _core

_NOT_BUILT = (
    "privleak was built without CUDA (CMake found no nvcc at build time). Reinstall with the CUDA "
    "toolkit on PATH; add -Ccmake.define.PRIVLEAK_CUDA=ON to make a missing nvcc a build error."
)

try:
    _cuda = importlib.import_module("privleak._cuda")
    _cuda_unavailable: str | None = None
except ModuleNotFoundError:
    _cuda, _cuda_unavailable = None, _NOT_BUILT
except ImportError as exc:  # built, but a library it needs is missing or broken
    _cuda, _cuda_unavailable = None, f"privleak's CUDA module failed to load: {exc}"

core = _core

# More OpenMP threads than this is a mistake (and past 2^31 - 1 the core's int cannot hold it).
MAX_THREADS = 1 << 16


@functools.lru_cache(maxsize=None)
def _cuda_devices() -> tuple[int, str | None]:
    if _cuda is None:
        return 0, None
    return _cuda.device_count()


def cuda() -> Any:
    """The CUDA module, or a RuntimeError that says why CUDA cannot run here."""
    if _cuda is None:
        raise RuntimeError(_cuda_unavailable)
    count, error = _cuda_devices()
    if count == 0:
        raise RuntimeError(f"privleak's CUDA module is built, but no GPU is usable here: {error}")
    return _cuda


def call(name: str, on: Any, *args: Any, cuda_args: Sequence[Any] = (),
         workspace: Callable[[Any], int] | None = None) -> Any:
    """Run kernel ``name`` where the data ``on`` lives: ``core.name(*args)`` on the CPU, else
    ``cuda().name(*args, *cuda_args, [workspace address,] device index, stream)``.

    ``on`` is an :class:`privleak._arrays.ArrayView` or a torch tensor; CUDA kernels run on its
    device and on the caller's current stream there, as torch's own ops do. ``cuda_args`` are
    arguments only the CUDA kernel takes. ``workspace``, for CUDA kernels that need scratch
    memory, maps the CUDA module to the bytes needed (its ``*_workspace_bytes`` function); they are
    allocated on the device (address 0 for none) and freed when the call returns.
    """
    if not on.is_cuda:
        return getattr(core, name)(*args)
    module = cuda()
    import torch  # data on a GPU came through torch

    if isinstance(on, _arrays.ArrayView):
        device, index = on.array.device, on.device_index
    else:
        device = on.device
        index = torch.cuda.current_device() if device.index is None else device.index
    stream = torch.cuda.current_stream(device).cuda_stream
    scratch = ()
    if workspace is not None:
        nbytes = workspace(module)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)  # alive until the call returns
        scratch = (buffer.data_ptr() if nbytes else 0,)
    # The device made current by torch's guard, whose restore makes no context on a device that had
    # none (a fresh thread's cudaGetDevice answers 0: the kernel's own guard would restore GPU 0
    # and so make its context, for a call on GPU 1).
    with torch.cuda.device(index):
        return getattr(module, name)(*args, *cuda_args, *scratch, index, stream)


def set_num_threads(threads: int) -> None:
    """Set the number of CPU threads privleak's kernels use (OpenMP). Results do not depend on it."""
    from privleak.validation import integer

    _core.set_num_threads(integer(threads, "threads", low=1, high=MAX_THREADS))


def num_threads() -> int:
    """The number of CPU threads privleak's kernels use."""
    return _core.num_threads()


def info() -> dict[str, Any]:
    """What this installation of privleak can run.

    Keys: ``version``, ``backends`` (compiled: "cpu" and, if built, "cuda"), ``compiler``,
    ``openmp``, ``openmp_threads``, ``cpu_capability`` (which of privleak's hand-written CPU paths
    run, chosen at load time: "avx512" where the CPU has AVX-512 F/BW/DQ/VL (nearest's and
    ghost_norm's AVX-512 tiles; the other kernels' AVX2 paths), "avx2" where it has AVX2, FMA and
    F16C (nearest's and ghost_norm's AVX2 tiles, the noise's Philox and interleave, the DP-SGD
    kernel's fp16 widening), else "default" (portable loops); PRIVLEAK_CPU_CAPABILITY=default,
    avx2 or avx512 lowers it, never above what the CPU has; every path gives the same bits),
    ``sanitizers``, ``cuda_compiled``, ``cuda_architectures``, ``cuda_version``, ``cuda_usable``,
    ``cuda_devices``, ``gpu_name`` and ``cuda_error`` (why CUDA is not usable, or None).
    """
    from privleak import __version__

    build = _core.build_info()
    count, error = _cuda_devices()
    cuda_build = _cuda.build_info() if _cuda is not None else {}
    return {
        "version": __version__,
        "backends": ["cpu"] + (["cuda"] if _cuda is not None else []),
        "compiler": build["compiler"],
        "openmp": build["openmp"],
        "openmp_threads": build["openmp_threads"],
        "cpu_capability": build["cpu_capability"],
        "sanitizers": build["sanitizers"],
        "cuda_compiled": _cuda is not None,
        "cuda_architectures": cuda_build.get("architectures"),
        "cuda_version": cuda_build.get("cuda_version"),
        "cuda_usable": count > 0,
        "cuda_devices": count,
        "gpu_name": _cuda.device_name(0) if count > 0 else None,
        "cuda_error": error if _cuda is not None else _cuda_unavailable,
    }
