"""Structured samples: a map-style dataset whose inputs are dicts or tuples of tensors, or
whose samples a user's ``dataset.collate`` builds into a batch (docs/spec.md, "Structured
samples"). A share is read as a list of ``(input, target)`` samples and collated once, as a
whole (so padding is to the share's own longest), into a pytree with one row per sample.

Problems are one-line :class:`DataError` s naming the field and the samples (the indices the
dataset's ``__getitem__`` was called with).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from dynabatch.actors.batch import Tree
from dynabatch.actors.data.source import DataError, SampleError
from dynabatch.actors.errors import UserError, first_line
from torch.utils._pytree import keystr, tree_flatten_with_path
from torch.utils.data import default_collate

COLLATE = "dataset.collate"
Collate = Callable[[list[tuple[Any, Any]]], Any]


def is_leaf(value: Any) -> bool:
    """A tensor, an array or a number: what today's unstructured samples are made of."""
    return isinstance(value, torch.Tensor | np.ndarray | numbers.Number | np.generic)


def is_structured(item: tuple[Any, Any]) -> bool:
    """Whether a sample's input or target is a dict, tuple or list (not one tensor)."""
    return not (is_leaf(item[0]) and is_leaf(item[1]))


def first_leaf(value: Any) -> Any:
    """The first tensor, array or number of a (possibly nested) input, in the order a dict's
    keys were inserted; None when there is none."""
    if is_leaf(value):
        return value
    items = (
        value.values()
        if isinstance(value, dict)
        else (value if isinstance(value, tuple | list) else ())
    )
    for v in items:
        leaf = first_leaf(v)
        if leaf is not None:
            return leaf
    return None


def load_collate(path: str | None) -> Collate | None:
    """The user's collate function named by ``dataset.collate`` (None when unset)."""
    if path is None:
        return None
    from dynabatch.actors.workloads.imports import resolve_callable

    return resolve_callable(path, COLLATE)


def name_samples(ids: Sequence[int], most: int = 6) -> str:
    """``samples 3, 17, 5`` (the first ``most`` of them, then how many in all)."""
    shown = ", ".join(str(int(i)) for i in list(ids)[:most])
    more = f", ... ({len(ids)} samples)" if len(ids) > most else ""
    return f"sample{'s' if len(ids) != 1 else ''} {shown}{more}"


def _form(value: Any) -> str:
    if isinstance(value, dict):
        return f"keys {sorted(map(str, value))}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return "one tensor"


class FormError(DataError, UserError):
    """Samples whose inputs differ in form (dict keys, tuple length): an error in the
    dataset itself, the same on every node, so the job fails at once (not retried)."""


def check_same_form(samples: Sequence[tuple[Any, Any]], ids: Sequence[int], field: str) -> None:
    """Every sample's input has the first one's form (the same dict keys, the same tuple
    length), or a DataError naming both samples and both forms."""
    first = _form(samples[0][0])
    for j in range(1, len(samples)):
        form = _form(samples[j][0])
        if form != first:
            raise FormError(
                f"{field}: sample {int(ids[j])}'s input has {form}, but sample "
                f"{int(ids[0])}'s has {first}"
            )


def collate_share(samples: list[tuple[Any, Any]], ids: Sequence[int], fn: Collate | None,
                  path: str | None, field: str, meta: Any) -> tuple[Tree, Tree]:
    """A share's batch ``(inputs, targets)`` from its ``samples`` (read from the dataset's
    ``ids``): the user's ``fn`` (``dataset.collate: path``), else ``default_collate``; every
    tensor of it must have one row per sample, and class labels fit ``meta``. What every
    structured source's ``collate`` is."""
    if fn is None:
        check_same_form(samples, ids, field)
        try:
            out = default_collate(samples)
        except Exception as err:
            raise DataError(
                f"{field}: {name_samples(ids)} cannot be batched together "
                f"({first_line(err)}); set {COLLATE} to pad them"
            ) from err
        where = field
    else:
        try:
            out = fn(samples)
        except Exception as err:
            raise DataError(
                f"{COLLATE}: {path!r} raised on {name_samples(ids)}: {first_line(err)}"
            ) from err
        where = f"{COLLATE}: {path!r}"
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise DataError(
            f"{where} returned a {type(out).__name__} for {name_samples(ids)}; "
            "expected (inputs, targets)"
        )
    x, y = out
    for part, tree in (("inputs", x), ("targets", y)):
        for key, leaf in tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or len(leaf) != len(ids)):
                rows = "no rows" if leaf.dim() == 0 else f"{len(leaf)} rows"
                raise DataError(
                    f"{where} returned {part}{keystr(key)} with {rows} for "
                    f"{len(ids)} samples; every tensor needs one row per sample"
                )
    if meta.targets == "classes":
        check_labels(y, ids, meta.num_classes)
    return x, y


def check_labels(y: Tree, ids: Sequence[int], num_classes: int) -> None:
    """Class labels (a tensor target) within ``0..num_classes-1``, or a SampleError naming
    the first sample outside."""
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.dim() != 1:
        return
    bad = torch.nonzero((y < 0) | (y >= num_classes))
    if len(bad):
        row = int(bad[0, 0])
        raise SampleError(int(ids[row]), f"label {int(y[row])} is outside 0..{num_classes - 1}")
