"""User workload plugins for the unit tests, named by import path like real user code.

Each function stands for one kind of user loader or model builder, good or broken.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torchmetrics
from dynabatch.actors.workloads.datasets import DatasetArrays
from torch import nn

NOT_CALLABLE = 42


def arrays_loader(n: int = 40, classes: int = 3, features: int = 5) -> DatasetArrays:
    rng = np.random.default_rng(0)
    y = np.arange(n) % classes
    x = rng.standard_normal((n, features)) + y[:, None]
    return DatasetArrays("plugin", x[: n // 2], y[: n // 2], x[n // 2 :], y[n // 2 :], classes)


def tuple_loader(n: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # float64 features and int32 labels: the service must convert them.
    x = np.linspace(0.0, 1.0, n * 4).reshape(n, 2, 2)
    y = (np.arange(n) % 4).astype(np.int32)
    return x[:20], y[:20], x[20:], y[20:]


def dict_loader() -> dict[str, Any]:
    return {"x": [1, 2, 3]}


def short_tuple_loader() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((4, 2)), np.zeros(4)


def mismatched_loader() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros((5, 2)), np.zeros(4, dtype=int), np.zeros((3, 2)), np.array([0, 1, 1])


def invalid_arrays_loader() -> DatasetArrays:
    # Builds a DatasetArrays itself, with a label outside num_classes.
    x = np.zeros((3, 2))
    return DatasetArrays("bad", x, np.array([0, 1, 5]), x, np.array([0, 1, 1]), 2)


def failing_loader() -> None:
    raise RuntimeError("disk on fire")


def tiny_net(input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> nn.Module:
    n_in = int(np.prod(input_shape))
    return nn.Sequential(
        nn.Flatten(), nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, num_classes)
    )


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> str:
    return "a network, honestly"


def failing_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    raise ValueError("unsupported input")


def mean_loss(outputs, targets):
    # Wrong: a scalar (the batch mean) instead of one loss per sample.
    import torch.nn.functional as F

    return F.cross_entropy(outputs, targets)


def abs_loss(outputs, targets):
    # A per-sample L1 loss for regression targets.
    return (outputs.reshape(len(targets), -1) - targets.reshape(len(targets), -1)).abs().mean(1)


def top2_metric(outputs, targets):
    return (outputs.topk(2, -1).indices == targets[:, None]).any(-1).float()


def regression_loader(n: int = 48, features: int = 3, train: int = 32) -> DatasetArrays:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5][:features], dtype=np.float32)
    return DatasetArrays("regression", x[:train], y[:train], x[train:], y[train:], 1,
                         targets="values")


def float_tokens_loader() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # Token sequences whose inputs are float: the wrong dtype for a token dataset.
    y = np.zeros((4, 5), dtype=np.int64)
    return np.zeros((4, 5), dtype=np.float32), y, np.zeros((2, 5), dtype=np.float32), y[:2]


def chatty_ce(outputs, targets):
    # A user loss that prints: Ray's log API must find its output (tests/integration).
    import torch.nn.functional as F

    print(f"chatty batch of {len(targets)}")
    return F.cross_entropy(outputs, targets, reduction="none")


class MisclassifiedCount(torchmetrics.Metric):
    """A user torchmetrics.Metric by import path: the held-out samples whose argmax is wrong
    (its state a sum, so it merges across shards)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("wrong", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.wrong += (outputs.argmax(-1) != targets).sum().float()

    def compute(self) -> torch.Tensor:
        return self.wrong


class NeedsArguments(torchmetrics.Metric):
    """A torchmetrics.Metric that cannot be built without arguments."""

    def __init__(self, k: int) -> None:
        super().__init__()


def bce_loss(outputs, targets):
    """Binary cross-entropy per sample on one logit per sample."""
    return torch.nn.functional.binary_cross_entropy_with_logits(
        outputs.reshape(targets.shape), targets.float(), reduction="none")
