"""Map-style datasets named by import path in the data tests (a user's own Dataset)."""

from __future__ import annotations

import numpy as np
import torch


class Noisy(torch.utils.data.Dataset):
    """Digits-like samples with noise drawn from torch's global RNG in __getitem__ (an
    augmentation): seeded by the loader from (job seed, epoch, position)."""

    num_classes = 4

    def __init__(self, n: int = 64, bad_at: int = -1, odd_shape_at: int = -1):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 8)).astype(np.float32)
        self.y = (np.arange(n) % 4).astype(np.int64)
        self.x[:, 0] += self.y * 2.0
        self.bad_at, self.odd_shape_at = bad_at, odd_shape_at

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if i == self.bad_at:
            raise ValueError(f"cannot decode record {i}\nsecond line")
        x = torch.from_numpy(self.x[i]) + 0.1 * torch.randn(8)
        if i == self.odd_shape_at:
            x = torch.zeros(9)
        return x, int(self.y[i])


def noisy(n: int = 64, bad_at: int = -1, odd_shape_at: int = -1) -> Noisy:
    return Noisy(n, bad_at, odd_shape_at)


def noisy_split(n: int = 64) -> tuple[Noisy, Noisy]:
    return Noisy(n), Noisy(16)


class Regression(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return np.full(3, i / 40, np.float32), np.float32(i / 20)


def regression() -> Regression:
    return Regression()
