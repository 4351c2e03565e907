"""Generated image sets for the paper benchmarks (issue 21), as user loaders. Benchmark-only,
so it lives in bench/, not in the product: a spec names it by import path
(``bench.hard_mnist:load``, with the repository root on ``sys.path``, as the bench scripts
put it), as any user dataset.

* :func:`load` (``dataset: {name: "bench.hard_mnist:load"}``):
  MNIST-format data where batches really differ, with ISGD's three causes (Wang et al.,
  arXiv 1603.05544) built in:

  - *intrinsic image difference*: the ``hard_classes`` are drawn with noisier, thinner,
    broken strokes (heavier pixel noise, more dropped and stray segments);
  - *sampling bias*: the ``rare_classes`` make up only ``rare_per_mille``/1000 of the
    training set each (the test set stays balanced, so they count fully in accuracy);
  - *label noise in a fixed subset*: ``noise_per_mille``/1000 of the training labels are
    replaced by a random other class, the same samples every epoch.

  With ``dataset.shuffle: once`` the order is drawn once, so the same batches recur in a
  fixed cycle (the paper's third cause): a batch that holds more hard, rare or mislabelled
  samples stays harder than the others epoch after epoch.

* :func:`cifar_like` (``dataset: {name: "bench.hard_mnist:cifar_like"}``):
  CIFAR-format data (3×32×32, 10 classes) for the ResNet runs when no CIFAR-10 files are
  given: each class is a smooth random colour texture (a few low-frequency sinusoids per
  channel), drawn with random shifts, contrast, colour cast, a blended distractor from
  another class and pixel noise, then standardised per channel as the ``cifar10`` loader
  does.

Deterministic from ``seed``; train and test come from separate streams.
"""

from __future__ import annotations

import numpy as np
from dynabatch.actors.workloads.datasets import DatasetArrays
from dynabatch.actors.workloads.images import render_digits, unit_images

_TAG = 2101  # issue 21


def _classes(text: str) -> list[int]:
    return [int(c) for c in str(text).split(",") if str(c).strip() != ""]


def _labels(n: int, rare: list[int], per_mille: int, rng: np.random.Generator) -> np.ndarray:
    """n labels, each rare class at per_mille/1000 of them, the others equal."""
    n_rare = round(n * per_mille / 1000)
    common = [c for c in range(10) if c not in rare]
    rest = n - n_rare * len(rare)
    labels = np.concatenate([np.repeat(rare, n_rare),
                             np.array(common)[np.arange(rest) % len(common)]])
    return rng.permutation(labels).astype(np.uint8)


def _harden(images: np.ndarray, labels: np.ndarray, hard: list[int],
            rng: np.random.Generator) -> np.ndarray:
    """The hard classes' images: broken strokes (random pixel drop-out), faint ink and
    heavy noise."""
    out = images.astype(np.float32) / 255.0
    idx = np.flatnonzero(np.isin(labels, hard))
    if len(idx):
        x = out[idx]
        keep = rng.random(x.shape) > 0.35
        faint = rng.uniform(0.35, 0.7, (len(idx), 1, 1)).astype(np.float32)
        x = x * keep * faint + rng.normal(0.0, 0.25, x.shape).astype(np.float32)
        out[idx] = np.clip(x, 0.0, 1.0)
    return np.round(out * 255.0).astype(np.uint8)


def load(n_train: int = 6000, n_test: int = 2000, seed: int = 0, hard_classes: str = "3,8",
         rare_classes: str = "5,9", rare_per_mille: int = 20, noise_per_mille: int = 50
         ) -> DatasetArrays:
    """MNIST-format arrays with hard, rare and mislabelled training samples (see module)."""
    hard, rare = _classes(hard_classes), _classes(rare_classes)
    parts = []
    for split, n in ((0, n_train), (1, n_test)):
        rng = np.random.default_rng([seed, _TAG, split])
        labels = (_labels(n, rare, rare_per_mille, rng) if split == 0
                  else rng.permutation(np.arange(n) % 10).astype(np.uint8))
        images = _harden(render_digits(labels, rng), labels, hard, rng)
        if split == 0 and noise_per_mille:
            flip = rng.random(n) < noise_per_mille / 1000
            labels = labels.copy()
            labels[flip] = (labels[flip] + rng.integers(1, 10, int(flip.sum()))) % 10
        parts += [unit_images(images), labels]
    return DatasetArrays("hard_mnist", parts[0], parts[1], parts[2], parts[3], num_classes=10)


def _textures(rng: np.random.Generator, k: int = 10, waves: int = 4) -> np.ndarray:
    """Per class and channel, ``waves`` sinusoids: (k, 3, waves, 4) = (fx, fy, phase, amp)."""
    f = rng.uniform(0.5, 3.5, (k, 3, waves, 2))
    ph = rng.uniform(0, 2 * np.pi, (k, 3, waves, 1))
    amp = rng.uniform(0.3, 1.0, (k, 3, waves, 1))
    return np.concatenate([f, ph, amp], axis=-1)


def _paint(tex: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Images (n, 3, 32, 32) of textures tex (n, 3, w, 4) shifted by shift (n, 2)."""
    g = np.arange(32, dtype=np.float32) / 32.0 * 2 * np.pi
    xx = g[None, None, None, None, :] + shift[:, 0, None, None, None, None]
    yy = g[None, None, None, :, None] + shift[:, 1, None, None, None, None]
    fx, fy, ph, amp = (tex[..., j, None, None] for j in range(4))
    return (amp * np.sin(fx * xx + fy * yy + ph)).sum(axis=2).astype(np.float32)


def cifar_like(n_train: int = 4000, n_test: int = 1000, seed: int = 0,
               distractor: float = 0.4, noise: float = 0.5) -> DatasetArrays:
    """CIFAR-format arrays (float32 (N, 3, 32, 32), standardised; labels 0..9)."""
    tex = _textures(np.random.default_rng([_TAG, 7]))  # the classes: the same for every seed
    parts = []
    for split, n in ((0, n_train), (1, n_test)):
        rng = np.random.default_rng([seed, _TAG, 10 + split])
        labels = rng.permutation(np.arange(n) % 10)
        other = (labels + rng.integers(1, 10, n)) % 10
        x = np.empty((n, 3, 32, 32), np.float32)
        for s in range(0, n, 500):
            e = min(s + 500, n)
            m = e - s
            shift = rng.uniform(0, 2 * np.pi, (m, 2)).astype(np.float32)
            img = _paint(tex[labels[s:e]], shift)
            img += distractor * rng.uniform(0.3, 1.0, (m, 1, 1, 1)).astype(np.float32) \
                * _paint(tex[other[s:e]], rng.uniform(0, 2 * np.pi, (m, 2)).astype(np.float32))
            img *= rng.uniform(0.5, 1.5, (m, 1, 1, 1)).astype(np.float32)
            img += rng.normal(0, 0.5, (m, 3, 1, 1)).astype(np.float32)
            img += rng.normal(0, noise, img.shape).astype(np.float32)
            x[s:e] = img
        parts += [x, labels.astype(np.int64)]
    x_tr, y_tr, x_te, y_te = parts
    mean = x_tr.mean(axis=(0, 2, 3), keepdims=True)
    std = x_tr.std(axis=(0, 2, 3), keepdims=True)
    return DatasetArrays("cifar_like", (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te,
                         num_classes=10)
