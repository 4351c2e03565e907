"""A user's map-style dataset: any object with ``__len__`` and ``__getitem__(i)`` returning
``(input, target)`` (tensors, arrays or numbers), e.g. a ``torch.utils.data.Dataset``.

The import path in ``dataset.name`` is called with ``dataset.options`` on the driver (to
learn its length and the first sample's shape) and again in each worker, which reads only
the samples it trains. It may return one dataset (a seeded ``test_fraction`` of it is held
out), a pair ``(train, test)`` or a dict with ``train`` and ``test``. Before each
``__getitem__`` the global RNGs are seeded from the sample's key (docs/spec.md,
"Augmentation").
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from dynabatch.actors.data.source import (
    DataError,
    Meta,
    Out,
    SampleError,
    Source,
    Subset,
    batch_arrays,
    split_ids,
)
from dynabatch.actors.data.structured import (
    collate_share,
    first_leaf,
    is_structured,
    load_collate,
)
from dynabatch.actors.errors import first_line

FIELD = "dataset.name"


def is_map_style(obj: Any) -> bool:
    return (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")
            and not isinstance(obj, np.ndarray | tuple | list | dict | str | bytes)
            and not hasattr(obj, "x_train"))


def split_result(result: Any) -> tuple[Any, Any] | None:
    """(train, test) map-style datasets from a user's return value (test None: split it),
    or None when it is not map-style."""
    if is_map_style(result):
        return result, None
    if isinstance(result, dict) and set(result) >= {"train", "test"} and all(
            is_map_style(result[k]) for k in ("train", "test")):
        return result["train"], result["test"]
    if isinstance(result, tuple | list) and len(result) == 2 and all(
            is_map_style(r) for r in result):
        return result[0], result[1]
    return None


def _as_array(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().cpu().numpy()
    return np.asarray(v)


class MapSource(Source):
    field = FIELD
    gil_bound = True  # the user's __getitem__, in Python
    def __init__(self, ds: Any, label: str, meta: Meta | None = None,
                 num_classes: int | None = None, targets: str | None = None,
                 collate: str | None = None):
        self.ds, self.label = ds, label
        # dataset.collate: the user's batch builder (None: default_collate when structured).
        self.collate_path, self._collate = collate, load_collate(collate)
        try:
            self.n = len(ds)
        except Exception as err:
            raise DataError(f"{FIELD}: {label!r}: len() raised {first_line(err)}") from err
        if self.n <= 0:
            raise DataError(f"{FIELD}: {label!r} returned an empty dataset")
        if meta is None:
            item = self._pair(0, None)
            structured = collate is not None or is_structured(item)
            x0, y0 = (self._arrays(0, (first_leaf(item[0]), first_leaf(item[1])))
                      if structured else self._arrays(0, item))
            if structured and x0.ndim == 0:  # one number per sample: a shape of one feature
                x0 = x0.reshape(1)
            kind = targets or ("tokens" if x0.dtype.kind in "iu" and y0.ndim == 1
                               and x0.ndim == 1 and y0.shape == x0.shape else
                               "values" if y0.dtype.kind == "f" else "classes")
            if kind == "classes" and y0.ndim != 0:
                raise SampleError(0, f"target has shape {y0.shape}; a class label is one "
                                  "integer (for regression targets set dataset.targets: "
                                  "values)")
            k = num_classes or getattr(ds, "num_classes", None) or (
                len(ds.classes) if hasattr(ds, "classes") else None)
            if kind == "values":
                k = k or (int(np.prod(y0.shape)) if y0.ndim else 1)
            if k is None:
                raise DataError(f"dataset.num_classes: {label!r} has no num_classes or "
                                "classes attribute; set dataset.num_classes")
            meta = Meta(label, tuple(x0.shape), int(k), kind, tuple(y0.shape), structured)
        self.meta = meta

    def __len__(self) -> int:
        return self.n

    def _pair(self, i: int, key: int | None) -> tuple[Any, Any]:
        """Sample ``i`` as ``__getitem__`` returns it (seeded by ``key``), checked to be an
        ``(input, target)`` pair."""
        if key is not None:
            import torch

            torch.manual_seed(key)
            np.random.seed(key % (2 ** 32))
            random.seed(key)
        try:
            item = self.ds[i]
        except Exception as err:
            raise SampleError(i, f"__getitem__ raised {first_line(err)}") from err
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise SampleError(i, f"__getitem__ returned {type(item).__name__}"
                              f"{f' of {len(item)}' if isinstance(item, tuple | list) else ''}"
                              "; expected (input, target)")
        return item[0], item[1]

    def _arrays(self, i: int, item: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
        try:
            return _as_array(item[0]), _as_array(item[1])
        except Exception as err:
            raise SampleError(i, f"(input, target) is not numeric ({first_line(err)}); a "
                              "sample's input may be a tensor, or a dict or tuple of "
                              "tensors") from err

    def read_samples(self, ids: np.ndarray, keys: np.ndarray | None = None) -> list[Any]:
        return [self._pair(int(i), None if keys is None else int(keys[j]))
                for j, i in enumerate(np.asarray(ids, dtype=np.int64))]

    def collate(self, samples: list[Any], ids: np.ndarray) -> tuple[Any, Any]:
        return collate_share(samples, ids, self._collate, self.collate_path, FIELD, self.meta)

    def read(self, ids: np.ndarray, keys: np.ndarray | None = None,
             out: Out | None = None) -> tuple[np.ndarray, np.ndarray]:
        m = self.meta
        if m.structured:  # tensors, collated as a share; no staging buffer
            return self.collate(self.read_samples(ids, keys), np.asarray(ids, dtype=np.int64))
        x, y = batch_arrays(m, len(ids), out)
        for j, i in enumerate(np.asarray(ids, dtype=np.int64)):
            ik = None if keys is None else int(keys[j])
            xi, yi = self._arrays(int(i), self._pair(int(i), ik))
            if tuple(xi.shape) != m.sample_shape:
                raise SampleError(int(i), f"input has shape {tuple(xi.shape)}, but the first "
                                  f"sample has {m.sample_shape} (samples of different "
                                  "lengths need a dataset.collate that pads them)")
            if tuple(yi.shape) != m.target_shape:
                raise SampleError(int(i), f"target has shape {tuple(yi.shape)}, but the "
                                  f"first sample has {m.target_shape}")
            if xi.dtype.kind not in "biuf" or yi.dtype.kind not in "biuf":
                raise SampleError(int(i), f"input dtype {xi.dtype} / target dtype {yi.dtype}"
                                  " is not numeric")
            if m.targets == "classes" and not 0 <= int(yi) < m.num_classes:
                raise SampleError(int(i), f"label {int(yi)} is outside 0..{m.num_classes - 1}")
            x[j], y[j] = xi, yi
        return x, y


def open_map(result: Any, label: str, split: str, seed: int, test_fraction: float,
             num_classes: int | None = None, targets: str | None = None,
             collate: str | None = None) -> Source:
    """The ``split`` ("train" or "test") of a user's map-style return value (``collate``:
    ``dataset.collate``)."""
    pair = split_result(result)
    if pair is None:
        raise DataError(f"{FIELD}: {label!r} returned {type(result).__name__}, not a dataset")
    train, test = pair
    src = MapSource(train, label, num_classes=num_classes, targets=targets, collate=collate)
    if test is not None:
        return src if split == "train" else MapSource(test, label, src.meta, collate=collate)
    tr, te = split_ids(len(src), test_fraction, seed)
    return Subset(src, tr if split == "train" else te)
