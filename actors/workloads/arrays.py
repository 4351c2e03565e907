"""The in-memory arrays a dataset loads into, validated when built.

:class:`DatasetArrays` is what a user loader may return (importable from
``dynabatch.actors.workloads.datasets`` too, as the error hints say); building one checks
shapes, finiteness and the target kind, so a bad loader fails with the array it got wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from dynabatch.actors.data.source import TARGET_KINDS
from dynabatch.actors.workloads import WorkloadError


class InvalidArrays(WorkloadError):
    """Raised by DatasetArrays validation; ``problem`` is the message without a prefix."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"invalid DatasetArrays: {problem}")


def _array(x: Any, what: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except Exception as err:  # a user object numpy cannot read: name the field, not numpy
        raise InvalidArrays(f"{what} is not an array ({err})") from err


def _as_features(x: Any, what: str) -> np.ndarray:
    arr = _array(x, what)
    if arr.dtype.kind not in "biuf":
        raise InvalidArrays(f"{what} must be numeric, got dtype {arr.dtype}")
    # No copy when the data is already float32 and C-contiguous (all the built-ins).
    return np.ascontiguousarray(arr, dtype=np.float32)


def as_labels(y: Any, what: str) -> np.ndarray:
    arr = _array(y, what)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise InvalidArrays(f"{what} must hold integer class labels")
    elif arr.dtype.kind not in "biu":
        raise InvalidArrays(f"{what} must hold integer class labels, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArrays(f"{what} must be 1-dimensional, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _all_finite(x: np.ndarray) -> bool:
    # In slices: a full-size boolean temporary would be ~180 MB for CIFAR-10.
    step = max(1, (1 << 22) // max(1, math.prod(x.shape[1:])))
    return all(np.isfinite(x[i : i + step]).all() for i in range(0, len(x), step))


def _as_tokens(a: Any, what: str) -> np.ndarray:
    arr = _array(a, what)
    if arr.dtype.kind not in "iu":
        raise InvalidArrays(f"{what} must hold integer token ids (int64), got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise InvalidArrays(f"{what} must have shape (N, T) of token ids, got {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_values(y: Any, what: str) -> np.ndarray:
    arr = _array(y, what)
    if arr.dtype.kind not in "biuf":
        raise InvalidArrays(f"{what} must hold numeric regression targets, got dtype {arr.dtype}")
    if arr.ndim not in (1, 2):
        raise InvalidArrays(f"{what} must have shape (N,) or (N, k), got {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


@dataclass(frozen=True, eq=False, repr=False)
class DatasetArrays:
    """A dataset in memory. ``targets`` says what the samples hold:

    * ``classes`` (default): float32 features (N, *input_shape) and int64 labels (N,) in
      ``0..num_classes-1``;
    * ``tokens``: int64 token sequences x (N, T) and next tokens y (N, T), ids in
      ``0..num_classes-1`` (``num_classes`` is the vocabulary size);
    * ``values``: float32 features and float32 regression targets (N,) or (N, k);
      ``num_classes`` is the model's output width.

    Construction converts dtypes (C-contiguous) and validates shapes, ranges and
    finiteness, raising :class:`WorkloadError` on a problem.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    targets: str = "classes"

    def __post_init__(self) -> None:
        kind = self.targets
        if kind not in TARGET_KINDS:
            raise InvalidArrays(f"targets must be one of {', '.join(TARGET_KINDS)}, got {kind!r}")
        fields: dict[str, np.ndarray] = {}
        for split in ("train", "test"):
            if kind == "tokens":
                x = _as_tokens(getattr(self, f"x_{split}"), f"x_{split}")
                y = _as_tokens(getattr(self, f"y_{split}"), f"y_{split}")
                if x.shape != y.shape:
                    raise InvalidArrays(
                        f"x_{split} has shape {x.shape} but y_{split} has {y.shape}"
                    )
            else:
                x = _as_features(getattr(self, f"x_{split}"), f"x_{split}")
                y = (as_labels if kind == "classes" else _as_values)(
                    getattr(self, f"y_{split}"), f"y_{split}"
                )
            if x.ndim < 2:
                raise InvalidArrays(f"x_{split} must have shape (N, *input_shape), got {x.shape}")
            if len(x) != len(y):
                raise InvalidArrays(f"x_{split} has {len(x)} samples but y_{split} has {len(y)}")
            if len(x) == 0:
                raise InvalidArrays(f"x_{split} is empty")
            if kind != "tokens" and not _all_finite(x):
                raise InvalidArrays(f"x_{split} contains NaN or infinite values")
            if kind == "values" and not np.isfinite(y).all():
                raise InvalidArrays(f"y_{split} contains NaN or infinite values")
            fields[f"x_{split}"], fields[f"y_{split}"] = x, y
        if fields["x_test"].shape[1:] != fields["x_train"].shape[1:]:
            raise InvalidArrays(
                f"x_test samples have shape {fields['x_test'].shape[1:]} but x_train samples "
                f"have {fields['x_train'].shape[1:]}"
            )
        k = self.num_classes
        least = 1 if kind == "values" else 2
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < least:
            raise InvalidArrays(f"num_classes must be an int >= {least}, got {k!r}")
        ranged = {"classes": ("y",), "tokens": ("x", "y"), "values": ()}[kind]
        for split in ("train", "test"):
            for a in ranged:
                y = fields[f"{a}_{split}"]
                lo, hi = int(y.min()), int(y.max())
                if lo < 0 or hi >= k:
                    what = "label" if kind == "classes" else "token id"
                    raise InvalidArrays(
                        f"{a}_{split} has {what} {lo if lo < 0 else hi}, outside 0..{k - 1} "
                        f"(num_classes={k})"
                    )
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "num_classes", int(k))

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample, e.g. ``(1, 28, 28)`` or ``(64,)``."""
        return tuple(int(n) for n in self.x_train.shape[1:])

    def __repr__(self) -> str:
        # Shapes, not contents: this ends up in logs.
        return (
            f"DatasetArrays(name={self.name!r}, train={len(self.y_train)}, "
            f"test={len(self.y_test)}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes}, targets={self.targets!r})"
        )
