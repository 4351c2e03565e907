"""A user's own map-style Dataset with a random transform, and its model.

    dataset: {name: "noisy_digits:load", options: {noise: 0.1}}
    model: {name: "noisy_digits:build"}
    working_dir: examples/user-dataset

``load`` returns ``(train, test)`` torch Datasets; each ``__getitem__`` returns
``(input, target)``. The transform draws from torch's global RNG, which dynabatch seeds
from (job seed, epoch, order position) before every ``__getitem__``: a sample gets the
same noise whichever worker reads it, and new noise each epoch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class AddNoise:
    def __init__(self, std: float):
        self.std = std

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.std * torch.randn_like(x)


class Digits(torch.utils.data.Dataset):
    """scikit-learn's 8x8 digits as (1, 8, 8) float tensors in [0, 1], with a transform."""

    num_classes = 10

    def __init__(self, x: np.ndarray, y: np.ndarray, transform=None):
        self.x = torch.from_numpy((x / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
        self.y = torch.from_numpy(y.astype(np.int64))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.y[i])


def load(noise: float = 0.1, test: int = 297) -> tuple[Digits, Digits]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    return Digits(x[test:], y[test:], AddNoise(noise)), Digits(x[:test], y[:test])


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(width * (input_shape[1] // 2) * (input_shape[2] // 2), 64),
        nn.ReLU(), nn.Linear(64, num_classes))
