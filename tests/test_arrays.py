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
    assert (v.dtype, v.device, v.device_index, v.stream) == ("float32", "cpu", -1, 0)


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
