"""CIFAR-10 python batches: a safe unpickler (arrays and lists only) and readers.

``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` are pickled dicts with bytes keys:
``b"data"``, uint8 (N, 3072), each 32x32 image's R, G and B planes; ``b"labels"``, ints.
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any

import numpy as np
from dynabatch.actors.workloads.formats import FormatError

CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_META = "batches.meta"
_CIFAR_PIXELS = 3 * 32 * 32

def _pickle_allowlist() -> dict[tuple[str, str], Any]:
    # Only what numpy arrays and bytes need, under both numpy 1 and numpy 2 module names.
    # Taking the callables from numpy's own reductions avoids importing the deprecated
    # numpy.core aliases (and their warnings) and follows whatever numpy version is installed.
    reconstruct = np.zeros(0).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.float64(0).__reduce__()[0]
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,
        # Protocol 2 writes an empty bytes object as a call to bytes().
        ("__builtin__", "bytes"): bytes,
        ("builtins", "bytes"): bytes,
    }
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{mod}.multiarray", "scalar")] = scalar
        allowed[(f"{mod}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that only builds numpy arrays and plain containers.

    ``spec.path`` comes from users, and a plain ``pickle.load`` of a crafted file runs any
    code it names; the CIFAR batches need nothing beyond arrays, bytes and builtins.
    """

    _allowed = _pickle_allowlist()

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return obj


def _load_pickle(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            return _ArrayUnpickler(f, encoding="bytes").load()
    except OSError as err:
        raise FormatError(f"{path}: cannot read ({err.strerror or err})") from err
    except Exception as err:
        raise FormatError(f"{path}: not a CIFAR-10 python batch (cannot unpickle: {err})") from err


def _get(d: dict[Any, Any], key: str, path: Path) -> Any:
    # The published files have bytes keys; ones re-pickled under Python 3 may have str keys.
    for k in (key.encode(), key):
        if k in d:
            return d[k]
    raise FormatError(f"{path}: missing key b{key!r}")


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch: uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    p = Path(path)
    d = _load_pickle(p)
    if not isinstance(d, dict):
        raise FormatError(f"{p}: not a CIFAR-10 python batch (a {type(d).__name__}, not a dict)")
    data = np.asarray(_get(d, "data", p))
    labels_raw = _get(d, "labels", p)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        raise FormatError(
            f"{p}: b'data' must be uint8 of shape (N, {_CIFAR_PIXELS}), "
            f"got {data.dtype} {data.shape}"
        )
    try:
        labels = np.asarray(labels_raw, dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise FormatError(f"{p}: b'labels' must be a list of ints ({err})") from err
    if labels.ndim != 1 or len(labels) != len(data):
        raise FormatError(f"{p}: {labels.size} labels but {len(data)} images in b'data'")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        bad = int(labels.min() if labels.min() < 0 else labels.max())
        raise FormatError(f"{p}: label {bad} is out of range 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def cifar10_dir(path: str | Path) -> Path:
    """``path/cifar-10-batches-py`` when it exists (the extracted archive), else ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise FormatError(f"{root}: not a directory")
    nested = root / CIFAR10_DIRNAME
    return nested if nested.is_dir() else root


def read_cifar10_meta(directory: str | Path) -> list[str] | None:
    """The class names from ``batches.meta``; None when the file is absent."""
    p = cifar10_dir(directory) / CIFAR10_META
    if not p.is_file():
        return None
    d = _load_pickle(p)
    if not isinstance(d, dict):
        raise FormatError(f"{p}: not a CIFAR-10 meta file (a {type(d).__name__}, not a dict)")
    names = _get(d, "label_names", p)
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def read_cifar10(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All of CIFAR-10: uint8 images (N, 3, 32, 32) and int64 labels, train then test."""
    d = cifar10_dir(path)
    missing = [n for n in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH) if not (d / n).is_file()]
    if missing:
        raise FormatError(f"{d}: missing CIFAR-10 batch file(s): {', '.join(missing)}")
    names = read_cifar10_meta(d)
    if names is not None and len(names) != 10:
        raise FormatError(f"{d / CIFAR10_META}: {len(names)} label names, CIFAR-10 has 10")
    train = [read_cifar_batch(d / n) for n in CIFAR10_TRAIN_BATCHES]
    x_test, y_test = read_cifar_batch(d / CIFAR10_TEST_BATCH)
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    if len(x_train) == 0 or len(x_test) == 0:
        raise FormatError(f"{d}: the {'training' if len(x_train) == 0 else 'test'} set is empty")
    return x_train, y_train, x_test, y_test


