"""Test helpers that write the dataset formats the product reads (IDX/MNIST and CIFAR-10
python batches) byte for byte as the published files, and read an IDX file back."""

from __future__ import annotations

import gzip
import pickle
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from dynabatch.actors.workloads.formats.cifar import (
    CIFAR10_META,
    CIFAR10_TEST_BATCH,
    CIFAR10_TRAIN_BATCHES,
)
from dynabatch.actors.workloads.formats.idx import (
    IDX_TYPES,
    MNIST_FILES,
    _read_maybe_gzip,
    decode_idx,
)

_CIFAR_PIXELS = 3 * 32 * 32
CIFAR10_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                  "ship", "truck")
_IDX_CODES = {(dt.kind, dt.itemsize): code for code, dt in IDX_TYPES.items()}


def idx_magic(dtype: np.dtype | type, ndim: int) -> int:
    """The magic number an IDX file of this element type and rank starts with."""
    dt = np.dtype(dtype)
    code = _IDX_CODES.get((dt.kind, dt.itemsize))
    if code is None:
        raise ValueError(
            f"IDX cannot store dtype {dt} (use uint8, int8, int16, int32, float32 or float64)"
        )
    if not 1 <= ndim <= 255:
        raise ValueError(f"IDX stores 1 to 255 dimensions, not {ndim}")
    return (code << 8) | ndim


def encode_idx(array: np.ndarray) -> bytes:
    """The IDX bytes of ``array`` (uncompressed)."""
    arr = np.asarray(array)
    magic = idx_magic(arr.dtype, arr.ndim)
    if any(n >= 2**32 for n in arr.shape):
        raise ValueError(f"IDX sizes are uint32; shape {arr.shape} does not fit")
    big = arr.astype(IDX_TYPES[magic >> 8], copy=False)
    header = struct.pack(f">I{arr.ndim}I", magic, *arr.shape)
    return header + np.ascontiguousarray(big).tobytes()


def encode_mnist(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
) -> dict[str, bytes]:
    """The four MNIST IDX blobs (keys as in ``MNIST_FILES``) for uint8 images and labels."""
    arrays = {
        "train_images": x_train,
        "train_labels": y_train,
        "test_images": x_test,
        "test_labels": y_test,
    }
    out = {}
    for key, arr in arrays.items():
        a = np.asarray(arr)
        if a.dtype != np.uint8:
            raise ValueError(f"{key} must be uint8 for MNIST, got {a.dtype}")
        want = 3 if key.endswith("images") else 1
        if a.ndim != want:
            raise ValueError(f"{key} must have {want} dimensions, got shape {a.shape}")
        out[key] = encode_idx(a)
    return out


def read_idx(path: str | Path, magic: int | None = None) -> np.ndarray:
    """Read an IDX file, plain or gzip-compressed (detected from its first bytes)."""
    p = Path(path)
    return decode_idx(_read_maybe_gzip(p), source=str(p), magic=magic)


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file; gzip-compressed when the name ends in ``.gz``."""
    p = Path(path)
    data = encode_idx(array)
    if p.suffix == ".gz":
        # mtime=0 keeps the bytes reproducible for a given array.
        data = gzip.compress(data, mtime=0)
    p.write_bytes(data)
    return p


def write_mnist(
    directory: str | Path,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    gz: bool = False,
) -> dict[str, Path]:
    """Write the four MNIST files (uint8 images (N, H, W), uint8 labels) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, data in encode_mnist(x_train, y_train, x_test, y_test).items():
        p = d / (MNIST_FILES[key] + (".gz" if gz else ""))
        p.write_bytes(gzip.compress(data, mtime=0) if gz else data)
        paths[key] = p
    return paths


def write_cifar_batch(
    path: str | Path, images: np.ndarray, labels: Sequence[int] | np.ndarray, batch_label: str = ""
) -> Path:
    """Write one batch exactly as the published files: a protocol-2 pickle with bytes keys."""
    x = np.asarray(images)
    if x.dtype != np.uint8:
        raise ValueError(f"CIFAR images must be uint8, got {x.dtype}")
    shaped = (x.ndim == 4 and x.shape[1:] == (3, 32, 32)) or (
        x.ndim == 2 and x.shape[1] == _CIFAR_PIXELS
    )
    if not shaped:
        raise ValueError(f"CIFAR images must be (N, 3, 32, 32) or (N, 3072), got {x.shape}")
    data = np.ascontiguousarray(x.reshape(len(x), _CIFAR_PIXELS))
    labs = [int(v) for v in np.asarray(labels).reshape(-1)]
    batch = {
        b"batch_label": batch_label.encode(),
        b"labels": labs,
        b"data": data,
        b"filenames": [f"image_{i:05d}.png".encode() for i in range(len(labs))],
    }
    p = Path(path)
    with p.open("wb") as f:
        pickle.dump(batch, f, protocol=2)
    return p


def write_cifar10(
    directory: str | Path,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    label_names: Sequence[str] = CIFAR10_LABELS,
) -> Path:
    """Write a CIFAR-10 directory (5 training batches, test batch, meta) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    x_parts = np.array_split(np.asarray(x_train), len(CIFAR10_TRAIN_BATCHES))
    y_parts = np.array_split(np.asarray(y_train), len(CIFAR10_TRAIN_BATCHES))
    for i, (name, xs, ys) in enumerate(zip(CIFAR10_TRAIN_BATCHES, x_parts, y_parts, strict=True)):
        write_cifar_batch(d / name, xs, ys, f"training batch {i + 1} of 5")
    write_cifar_batch(d / CIFAR10_TEST_BATCH, x_test, y_test, "testing batch 1 of 1")
    meta = {
        b"num_cases_per_batch": len(x_parts[0]),
        b"label_names": [n.encode() for n in label_names],
        b"num_vis": _CIFAR_PIXELS,
    }
    with (d / CIFAR10_META).open("wb") as f:
        pickle.dump(meta, f, protocol=2)
    return d
