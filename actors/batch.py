"""A batch's inputs and targets as pytrees: a tensor, or a dict or tuple of tensors.

Most sources give one input tensor and one target tensor per batch; a user's map-style
dataset may give a dict (``{"input_ids": ..., "attention_mask": ...}``) or a tuple
(``(x_num, x_cat)``) per sample, collated into the same structure of batched tensors
(:mod:`dynabatch.actors.data.structured`). Whatever handles a batch row-wise (slicing a
share into micro-batches, moving it to the device) does it through these helpers, which
treat a bare tensor as the one-leaf case: one code path for both. Pure torch and numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

Tree = Any  # a tensor (or numpy array), or a dict / tuple / list of them


def rows(tree: Tree, lo: int, hi: int) -> Tree:
    """Rows ``[lo, hi)`` of every tensor (or array) in ``tree``: views, no copy."""
    if isinstance(tree, torch.Tensor | np.ndarray):  # the common case, once per micro-batch
        return tree[lo:hi]
    return tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor | np.ndarray) else t, tree)


def to_device(tree: Tree, device: torch.device, non_blocking: bool = False) -> Tree:
    """``tree`` with numpy arrays made tensors (a read-only array, as the object store
    gives, is copied first) and every tensor on ``device``."""

    def move(t: Any) -> Any:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t if t.flags.writeable else t.copy())
        return t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t

    if isinstance(tree, torch.Tensor | np.ndarray):  # the common case: no tree walk
        return move(tree)
    return tree_map(move, tree)
