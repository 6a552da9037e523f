"""The marshalling layer that every op uses to hand arrays to the core."""
import numpy as np
import pytest
import torch
from privleak import _arrays


class DLPackOnly:
    """An array that speaks only DLPack, as CuPy or JAX arrays do."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_numpy_view_reports_address_shape_and_element_strides():
    a = np.zeros((6, 10), dtype=np.float32)[::2, 3:]
    v = _arrays.view(a, "a")
    assert v.address == a.ctypes.data
    assert v.shape == (3, 7) and v.strides == (20, 1)
    assert (v.dtype, v.device, v.device_index) == ("float32", "cpu", -1)


def test_torch_view_matches_numpy_view_of_the_same_memory():
    t = torch.zeros(6, 10, dtype=torch.float64)[1:, ::1]
    v = _arrays.view(t, "t")
    w = _arrays.view(t.numpy(), "t")
    assert (v.address, v.shape, v.strides, v.dtype, v.device) == (w.address, w.shape, w.strides, w.dtype, w.device)


def test_dlpack_arrays_are_accepted():
    a = np.arange(6.0).reshape(2, 3)
    v = _arrays.view(DLPackOnly(a), "a")
    assert v.address == a.ctypes.data and v.shape == (2, 3)


def test_convert_like_matches_kind_dtype_and_device():
    like = _arrays.view(torch.zeros(2, 2, dtype=torch.float32), "m")
    w = _arrays.convert_like([1, 2], "w", like)
    assert isinstance(w.array, torch.Tensor) and w.dtype == "float32"
    like = _arrays.view(np.zeros((2, 2)), "m")
    assert _arrays.convert_like(np.array([1, 2], dtype=np.float32), "w", like).dtype == "float64"


def test_non_contiguous_rows_are_named_in_the_error():
    v = _arrays.view(np.zeros((4, 4))[:, ::2], "channel")
    with pytest.raises(ValueError, match="channel must have contiguous rows"):
        _arrays.require_contiguous_rows(v, "channel")


@pytest.mark.parametrize("bad", [object(), {"a": 1}, None])
def test_non_arrays_are_type_errors(bad):
    with pytest.raises(TypeError, match="x must be a numpy array or a torch tensor"):
        _arrays.view(bad, "x")


def _unaligned_float64(n):
    return np.zeros(8 * n + 8, dtype=np.uint8)[1:8 * n + 1].view(np.float64)


def test_unaligned_numpy_views_are_refused_with_a_fix():
    with pytest.raises(ValueError, match=r"x is not aligned.*element size 8.*np\.array\(x\)"):
        _arrays.view(_unaligned_float64(4), "x")


def test_unaligned_tensors_are_refused():
    t = torch.frombuffer(bytearray(65), dtype=torch.float32, offset=1, count=16)
    with pytest.raises(ValueError, match="x is not aligned"):
        _arrays.view(t, "x")
    _arrays.view(t.clone(), "x")  # the suggested fix


def test_empty_arrays_need_no_alignment():
    assert _arrays.view(_unaligned_float64(0), "x").shape == (0,)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make, words", [
    (lambda: torch.zeros(3, 3).to_sparse(), "x has layout torch.sparse_coo"),
    (lambda: torch.zeros(3, 3).to_sparse_csr(), "x has layout torch.sparse_csr"),
    (lambda: torch.zeros(3, 3).to_sparse_csc(), "x has layout torch.sparse_csc"),
    (lambda: torch.zeros(3, device="meta"), "x is on device meta"),
    (lambda: torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8), "x is a quantized tensor"),
])
def test_tensors_without_plain_strided_data_are_type_errors(make, words):
    with pytest.raises(TypeError, match=words):
        _arrays.view(make(), "x")


def test_check_allocation_refuses_more_than_is_available(monkeypatch):
    like = _arrays.view(np.zeros(2), "x")
    monkeypatch.setattr(_arrays, "_cpu_available_bytes", lambda: 1000)
    monkeypatch.setattr(_arrays, "_UNCHECKED_BYTES", 0)
    _arrays.check_allocation(1000, like, "op")
    with pytest.raises(MemoryError, match="op needs 1001 bytes"):
        _arrays.check_allocation(1001, like, "op")
    with pytest.raises(ValueError):
        _arrays.check_allocation(1001, like, "op")


def test_small_allocations_ask_the_system_nothing(monkeypatch):
    def unreachable():
        raise AssertionError("asked the system for the available memory")

    monkeypatch.setattr(_arrays, "_cpu_available_bytes", unreachable)
    _arrays.check_allocation(_arrays._UNCHECKED_BYTES - 1, _arrays.view(np.zeros(2), "x"), "op")


def test_cpu_available_bytes_is_positive_and_below_physical_memory():
    import os

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < _arrays._cpu_available_bytes() <= physical
