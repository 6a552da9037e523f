"""Turn numpy arrays and torch tensors into what the native core takes.

The core links no libtorch (DESIGN.md): it receives an address, a shape, strides in elements, a
dtype name and a device (on CUDA, :func:`privleak._backend.call` adds the caller's current
stream). Every op builds an :class:`ArrayView` here, so argument checking and its error messages
live in one place. torch is imported only when the caller hands in a tensor (or a DLPack array
that lives on a GPU).
"""
from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple, Sequence

import numpy as np

from privleak.validation import ArgumentTypeError

FLOAT_DTYPES = ("float32", "float64")
_DLPACK_CPU = 1
_DTYPE_NAMES: dict = {}  # torch dtype: its name, as the core takes it


class ArrayView(NamedTuple):
    """A checked array, ready to hand to a kernel. ``array`` keeps the memory alive."""

    array: Any
    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, not bytes
    dtype: str
    device: str  # "cpu" or "cuda"
    device_index: int  # -1 on the CPU

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"


def _loaded_torch():
    return sys.modules.get("torch")


def is_tensor(x: Any) -> bool:
    torch = _loaded_torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _as_array(x: Any, name: str) -> Any:
    if isinstance(x, np.ndarray) or is_tensor(x):
        return x
    if hasattr(x, "__dlpack__"):
        if x.__dlpack_device__()[0] == _DLPACK_CPU:
            return np.from_dlpack(x)
        try:
            import torch
        except ImportError as exc:
            raise TypeError(f"{name} lives on a GPU; passing it needs torch, which is not installed") from exc
        return torch.from_dlpack(x)
    if isinstance(x, (list, tuple, int, float)):
        return np.asarray(x)
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def view(x: Any, name: str, *, ndim: int | None = None, dtypes: Sequence[str] = FLOAT_DTYPES) -> ArrayView:
    """Check ``x`` and describe it for the core. Raises TypeError/ValueError naming ``name``.

    Refused (the kernels read raw memory through a typed pointer): tensors that are not dense and
    strided (sparse COO/CSR/CSC/BSR/BSC, mkldnn, nested), quantized tensors and meta tensors, all
    with a TypeError (:class:`privleak.validation.ArgumentTypeError`, also a ValueError); and arrays
    whose data address or strides are not a multiple of the element size, e.g. a numpy view at an
    odd byte offset or ``torch.frombuffer(..., offset=1)``: ValueError. privleak never copies such
    an array silently, not even for out-of-place ops: the caller passes a copy (``np.array(x)``,
    ``x.clone()``), which is aligned, so the cost of the copy stays visible.
    """
    torch = _loaded_torch()
    if torch is None or not isinstance(x, torch.Tensor):
        x = _as_array(x, name)  # a GPU array through DLPack becomes a tensor
    if is_tensor(x):
        return _tensor_view(x, name, ndim, dtypes)
    if not x.dtype.isnative:
        raise TypeError(f"{name} has non-native byte order ({x.dtype.str}); convert it with .astype(native dtype)")
    itemsize = x.dtype.itemsize
    if any(s % itemsize for s in x.strides):
        raise ValueError(f"{name} has strides {x.strides} that are not a multiple of its item size {itemsize}; "
                         "pass a copy (np.array(x)), which is aligned")
    strides = tuple(s // itemsize for s in x.strides)
    return _checked(ArrayView(x, x.__array_interface__["data"][0], x.shape, strides, x.dtype.name, "cpu", -1),
                    name, ndim, dtypes, x.size, itemsize)


def dtype_name(x: Any) -> str:
    """A torch tensor's dtype as the core names it ("float32")."""
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        name = _DTYPE_NAMES[x.dtype] = str(x.dtype).removeprefix("torch.")
    return name


def _tensor_view(x: Any, name: str, ndim: int | None, dtypes: Sequence[str]) -> ArrayView:
    """:func:`view` of a torch tensor. Runs on every kernel call, so it asks the tensor only what
    it must (a kernel call on a small tensor costs a few microseconds, and a step makes many)."""
    torch = _loaded_torch()
    if x.layout != torch.strided:
        raise ArgumentTypeError(f"{name} has layout {x.layout}; privleak takes dense strided tensors only "
                                "(convert it with .to_dense())")
    if x.is_quantized:
        raise ArgumentTypeError(f"{name} is a quantized tensor ({x.dtype}); pass .dequantize() instead")
    if x.is_nested:
        raise ArgumentTypeError(f"{name} is a nested tensor; privleak takes dense strided tensors only")
    if x.is_cpu:
        device, index = "cpu", -1
    elif x.is_cuda:
        device, index = "cuda", x.device.index if x.device.index is not None else torch.cuda.current_device()
    elif x.is_meta:
        raise ArgumentTypeError(f"{name} is on device meta (a tensor without data); "
                                "privleak needs data on cpu or cuda")
    else:
        raise ValueError(f"{name} is on device {x.device}; privleak runs on cpu and cuda")
    # traced by torch.compile: no real address to check (the op itself runs on real data)
    size = 0 if torch.compiler.is_compiling() else x.numel()
    view = ArrayView(x, x.data_ptr(), tuple(x.shape), x.stride(), dtype_name(x), device, index)
    return _checked(view, name, ndim, dtypes, size, x.element_size())


def _checked(view: ArrayView, name: str, ndim: int | None, dtypes: Sequence[str], size: int,
             itemsize: int) -> ArrayView:
    if view.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(dtypes)}, got {view.dtype}")
    if ndim is not None and len(view.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(view.shape)}")
    if size and itemsize and view.address % itemsize:
        raise ValueError(f"{name} is not aligned: its data address {view.address:#x} is not a multiple of its element "
                         f"size {itemsize} bytes (a view at an odd byte offset); pass a copy "
                         "(np.array(x) or x.clone()), which is aligned")
    return view


def require_contiguous_rows(v: ArrayView, name: str) -> None:
    """Kernels over matrices take any row stride but need each row contiguous."""
    if v.shape[-1] > 1 and v.strides[-1] != 1 and 0 not in v.shape:
        raise ValueError(
            f"{name} must have contiguous rows (stride 1 along its last axis), got strides {v.strides} "
            "in elements; pass np.ascontiguousarray(...) or tensor.contiguous()"
        )


def require_same_device(v: ArrayView, name: str, reference: ArrayView, reference_name: str) -> None:
    if (v.device, v.device_index) != (reference.device, reference.device_index):
        raise ValueError(f"{name} is on {v.device}:{v.device_index} but {reference_name} is on "
                         f"{reference.device}:{reference.device_index}")


def address(array: Any) -> int:
    """Data address of a numpy array or torch tensor that this module created or checked."""
    return array.data_ptr() if is_tensor(array) else array.__array_interface__["data"][0]


def empty(like: ArrayView, shape: tuple[int, ...], dtype: str) -> Any:
    """A new uninitialised array of the same kind (numpy or torch) and on the same device as ``like``."""
    if is_tensor(like.array):
        torch = _loaded_torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.array.device)
    return np.empty(shape, dtype=dtype)


def quotient(x: Any, divisor: float) -> Any:
    """x / divisor, each element rounded once, for an array of either kind on any device. CUDA
    divides a tensor by a Python number as a product with its reciprocal (two roundings), which
    would break the same bits on CPU and CUDA; a 0-dim divisor tensor on x's device is divided by."""
    if is_tensor(x):
        return x / _loaded_torch().tensor(divisor, dtype=x.dtype, device=x.device)
    return x / divisor


def convert_like(x: Any, name: str, like: ArrayView) -> ArrayView:
    """``x`` as a contiguous array of ``like``'s kind, dtype and device (a copy only if needed).

    For small side inputs (weights, priors) whose dtype a user should not have to match by hand.
    """
    x = _as_array(x, name)
    kind = x.dtype.kind if isinstance(x, np.ndarray) else ("b" if x.dtype == _loaded_torch().bool else
                                                           "f" if x.dtype.is_floating_point else
                                                           "c" if x.dtype.is_complex else "i")
    if kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if is_tensor(like.array):
        torch = _loaded_torch()
        x = torch.as_tensor(x).to(device=like.array.device, dtype=getattr(torch, like.dtype)).contiguous()
    else:
        if is_tensor(x):
            raise TypeError(f"{name} is a torch tensor but the other arguments are numpy arrays")
        x = np.ascontiguousarray(x, dtype=like.dtype)
    return view(x, name, dtypes=(like.dtype,))


_UNCHECKED_BYTES = 64 << 20


class AllocationTooLarge(MemoryError, ValueError):
    """An op's outputs or workspace would not fit in memory. Both a MemoryError and a ValueError."""


def available_bytes(like: ArrayView) -> int:
    """Memory an op on ``like``'s device can still allocate, in bytes.

    CUDA: free device memory plus what torch's caching allocator holds unused. CPU: the kernel's
    MemAvailable (Linux), capped by the cgroup's limit less its usage, else the free physical pages.
    """
    if like.is_cuda:
        torch = _loaded_torch()
        free, _ = torch.cuda.mem_get_info(like.device_index)
        cached = torch.cuda.memory_reserved(like.device_index) - torch.cuda.memory_allocated(like.device_index)
        return int(free) + max(int(cached), 0)
    return _cpu_available_bytes()


def _cpu_available_bytes() -> int:
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 1 << 62  # unknown: let the allocator decide
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file, open("/sys/fs/cgroup/memory.current") as usage_file:
            limit = limit_file.read().strip()
            if limit != "max":
                available = min(available, int(limit) - int(usage_file.read().strip()))
    except (OSError, ValueError):
        pass
    return available


def check_allocation(nbytes: int, like: ArrayView, what: str) -> None:
    """Raise :class:`AllocationTooLarge` (before allocating) if ``nbytes`` exceed :func:`available_bytes`.

    Below 64 MiB nothing is read: asking the system costs tens of microseconds, as much as a small
    op itself, and no machine privleak runs on lacks that much."""
    if nbytes < _UNCHECKED_BYTES:
        return
    available = available_bytes(like)
    if nbytes > available:
        raise AllocationTooLarge(
            f"{what} needs {nbytes} bytes ({nbytes / 2**30:.3g} GiB) of outputs and workspace on {like.device}, "
            f"but only {available} bytes ({available / 2**30:.3g} GiB) are available; check its arguments' shapes "
            "(a broadcast or stride-0 view can describe far more rows than it stores)"
        )
