"""Generated MNIST-format images, and the normalisations the image datasets share.

``generate_mnist`` draws seven-segment style digits with per-image handwriting variation
(slant, rotation, size, stroke width, missing and stray segments, noise): deterministic
from the seed, with train and test from separate streams. ``unit_images`` and
``standardise`` turn uint8 images into the float32 arrays the models take.
"""

from __future__ import annotations

import math

import numpy as np

_TAG_MNIST = 0x4D4E53


# Seven-segment glyph: segment endpoints (x0, y0, x1, y1) in a box x in [-0.5, 0.5],
# y in [-1, 1] (y grows downwards, as image rows do), in the order a b c d e f g.
_SEGMENTS = np.array(
    [
        [-0.5, -1.0, 0.5, -1.0],  # a: top
        [0.5, -1.0, 0.5, 0.0],  # b: top right
        [0.5, 0.0, 0.5, 1.0],  # c: bottom right
        [-0.5, 1.0, 0.5, 1.0],  # d: bottom
        [-0.5, 0.0, -0.5, 1.0],  # e: bottom left
        [-0.5, -1.0, -0.5, 0.0],  # f: top left
        [-0.5, 0.0, 0.5, 0.0],  # g: middle
    ]
)
_DIGIT_SEGMENTS = np.array(
    [
        [c == "1" for c in bits]
        for bits in (
            "1111110",
            "0110000",
            "1101101",
            "1111001",
            "0110011",
            "1011011",
            "1011111",
            "1110000",
            "1111111",
            "1111011",
        )
    ]
)
MNIST_SIZE = 28


def render_digits(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 images (N, 28, 28) of the digits ``labels``, each with its own random distortion."""
    n = len(labels)
    n_seg = len(_SEGMENTS)
    # Per-image handwriting variation: wobbly endpoints, slant, rotation, size, aspect,
    # position, stroke width, and segments that are missing or stray.
    pts = _SEGMENTS.reshape(1, n_seg, 2, 2) + rng.normal(0.0, 0.07, (n, n_seg, 2, 2))
    half_h = rng.uniform(7.0, 9.5, n)
    half_w = half_h * rng.uniform(0.8, 1.4, n)
    shear = rng.uniform(-0.35, 0.15, n)
    angle = rng.uniform(-0.15, 0.15, n)
    cos, sin = np.cos(angle), np.sin(angle)
    # M = rotation @ shear @ scale, applied to glyph coordinates.
    m = np.empty((n, 2, 2))
    m[:, 0, 0] = cos * half_w
    m[:, 0, 1] = (cos * shear - sin) * half_h
    m[:, 1, 0] = sin * half_w
    m[:, 1, 1] = (sin * shear + cos) * half_h
    centre = (MNIST_SIZE - 1) / 2 + rng.uniform(-2.5, 2.5, (n, 2))
    pix_pts = np.einsum("nij,nsej->nsei", m, pts) + centre[:, None, None, :]
    half_stroke = rng.uniform(0.6, 1.3, n)
    active = _DIGIT_SEGMENTS[labels]
    strength = np.where(active, rng.uniform(0.75, 1.0, (n, n_seg)), 0.0)
    dropped = active & (rng.random((n, n_seg)) < 0.06)
    stray = ~active & (rng.random((n, n_seg)) < 0.05)
    strength = np.where(dropped, rng.uniform(0.0, 0.25, (n, n_seg)), strength)
    strength = np.where(stray, rng.uniform(0.3, 0.7, (n, n_seg)), strength)
    noise = rng.normal(0.0, 0.06, (n, MNIST_SIZE * MNIST_SIZE))

    # float32 for the per-pixel work: it halves the time and the precision is ample for 8 bits.
    pix_pts = pix_pts.astype(np.float32)
    half_stroke = half_stroke.astype(np.float32)
    strength = strength.astype(np.float32)
    noise = noise.astype(np.float32)
    rows, cols = np.mgrid[0:MNIST_SIZE, 0:MNIST_SIZE]
    px = cols.ravel().astype(np.float32)
    py = rows.ravel().astype(np.float32)
    out = np.empty((n, MNIST_SIZE * MNIST_SIZE), dtype=np.uint8)
    chunk = 512  # bounds the (chunk, 7, 784) temporaries to a few tens of MB
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        ax, ay = pix_pts[s:e, :, 0, 0, None], pix_pts[s:e, :, 0, 1, None]
        vx = pix_pts[s:e, :, 1, 0, None] - ax
        vy = pix_pts[s:e, :, 1, 1, None] - ay
        wx, wy = px - ax, py - ay
        t = np.clip((wx * vx + wy * vy) / (vx * vx + vy * vy + np.float32(1e-9)), 0.0, 1.0)
        dist = np.hypot(wx - t * vx, wy - t * vy)
        # Anti-aliased stroke: full ink inside the stroke, fading over one pixel.
        ink = np.clip(half_stroke[s:e, None, None] + np.float32(0.5) - dist, 0.0, 1.0)
        img = (ink * strength[s:e, :, None]).max(axis=1) + noise[s:e]
        out[s:e] = np.round(np.clip(img, 0.0, 1.0) * np.float32(255.0)).astype(np.uint8)
    return out.reshape(n, MNIST_SIZE, MNIST_SIZE)


def generate_mnist(
    n_train: int = 12000, n_test: int = 2000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic MNIST-like data: uint8 images (N, 28, 28) and uint8 labels 0..9.

    Train and test come from separate seeded streams, so the test set does not depend on
    ``n_train``. Labels are balanced (each digit appears n/10 times, rounded) and shuffled.
    """
    parts: list[np.ndarray] = []
    for split, n in ((0, n_train), (1, n_test)):
        rng = np.random.default_rng([seed, _TAG_MNIST, split])
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        parts += [render_digits(labels, rng), labels]
    x_train, y_train, x_test, y_test = parts
    return x_train, y_train, x_test, y_test


def unit_images(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W) -> float32 (N, 1, H, W) in [0, 1]."""
    x = images.astype(np.float32)[:, None]
    x *= np.float32(1.0 / 255.0)
    return x


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (in 0..255 units) of uint8 images (N, C, H, W).

    Computed from a 256-bin histogram per channel: exact, and with no float copy of the data.
    """
    levels = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for c in range(images.shape[1]):
        hist = np.bincount(images[:, c].ravel(), minlength=256).astype(np.float64)
        total = hist.sum()
        mean = (hist * levels).sum() / total
        var = (hist * (levels - mean) ** 2).sum() / total
        means.append(mean)
        stds.append(math.sqrt(var))
    return np.array(means), np.array(stds)


def standardise(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    x = images.astype(np.float32)
    for c in range(x.shape[1]):
        # A constant channel (possible in tiny test files) is centred but not scaled.
        scale = std[c] if std[c] > 1e-6 else 1.0
        x[:, c] -= np.float32(mean[c])
        x[:, c] *= np.float32(1.0 / scale)
    return x
