"""Small CPU-friendly networks: ``mlp``, ``lenet``, ``resnet``, ``charlm``, a Hugging Face
model from its config (``hf``: :mod:`dynabatch.actors.workloads.hf`), or a user
``"pkg.mod:function"``.

Every built-in takes any ``input_shape`` its kind can make sense of: the MLP flattens, and the
CNNs view flat square inputs (e.g. digits' 64 features) as one-channel images. Construction
draws only from torch's global RNG, so ``torch.manual_seed(s)`` before ``build_model`` gives the
same weights on every worker.

None of the built-ins has buffers (the ResNet uses GroupNorm by default, not BatchNorm), so
averaging gradients is all data-parallel training needs to keep replicas identical; a worker
batch of a single sample also works.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from dynabatch.actors.spec import ModelSpec
from dynabatch.actors.workloads import WorkloadError, check_option_names, int_option
from dynabatch.actors.workloads.imports import call_user, check_user_options, resolve_callable
from torch import nn

NORMS = ("group", "batch", "none")


# --------------------------------------------------------------------------------------------
# Option checking


# The built-ins' option names.
OPTIONS: dict[str, tuple[str, ...]] = {
    "mlp": ("layers",),
    "lenet": (),
    "resnet": ("blocks", "norm", "widths"),
    "charlm": ("layers", "heads"),
}
# What a user builder is always called with, beside its options.
PASSED = ("input_shape", "num_classes")


def check_model_options(spec: ModelSpec) -> None:
    """Check ``model.options`` before anything is built: a built-in's names, a user
    builder's against its signature (WorkloadError naming the option)."""
    if spec.name in OPTIONS:
        check_option_names("model.options", spec.name, spec.options, OPTIONS[spec.name])
        return
    if spec.name == "hf":
        from dynabatch.actors.workloads.hf import check_hf_options

        check_hf_options(spec)
        return
    _user_builder(spec)


def _user_builder(spec: ModelSpec) -> Callable[..., Any]:
    """The user's ``pkg.mod:build``, checked to take ``model.options`` beside ``PASSED``."""
    reserved = sorted(set(PASSED) & set(spec.options))
    if reserved:
        raise WorkloadError(
            f"model.options: {reserved[0]!r} is passed by the service and cannot be an option"
        )
    fn = resolve_callable(spec.name, "model.name")
    check_user_options(fn, spec.name, "model.options", spec.options, passed=PASSED)
    return fn


def _int(value: Any, key: str, lo: int, hi: int) -> int:
    return int_option(value, f"model.options.{key}", lo, hi)


def _int_list(value: Any, key: str, lo: int, hi: int, length: int | None = None) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool) and length is not None:
        value = [value] * length
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= 8:
        raise WorkloadError(
            f"model.options.{key}: must be a list of 1 to 8 integers, got {value!r}"
        )
    if length is not None and len(value) != length:
        raise WorkloadError(
            f"model.options.{key}: needs {length} entries (one per stage), got {len(value)}"
        )
    return [_int(v, key, lo, hi) for v in value]


# --------------------------------------------------------------------------------------------
# Shapes


def _image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """(C, H, W) for a CNN: images as they are, (H, W) as one channel, n*n flat as 1 x n x n."""
    if len(input_shape) == 3:
        c, h, w = input_shape
        return c, h, w
    if len(input_shape) == 2:
        h, w = input_shape
        return 1, h, w
    if len(input_shape) == 1:
        side = math.isqrt(input_shape[0])
        if side * side == input_shape[0]:
            return 1, side, side
    raise WorkloadError(
        f"model.name: {model} needs image input (C, H, W), (H, W) or a square number of "
        f"features; got input shape {input_shape}"
    )


def _as_image(
    input_shape: tuple[int, ...], model: str
) -> tuple[tuple[int, int, int], list[nn.Module]]:
    chw = _image_shape(input_shape, model)
    if tuple(input_shape) == chw:
        return chw, []
    # The sample's first dimension unflattened: n = s² features into 1 x s x s, H into 1 x H.
    return chw, [nn.Unflatten(1, chw[:4 - len(input_shape)])]


# --------------------------------------------------------------------------------------------
# MLP


def mlp(in_features: int, hidden: int, num_classes: int, layers: int = 2) -> nn.Sequential:
    """``layers`` hidden ReLU layers of width ``hidden``; input of any shape is flattened."""
    mods: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, num_classes))
    return nn.Sequential(*mods)


def _build_mlp(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    layers = _int(spec.options.get("layers", 2), "layers", 1, 32)
    return mlp(math.prod(input_shape), spec.hidden, num_classes, layers)


# --------------------------------------------------------------------------------------------
# LeNet


class LeNet(nn.Module):
    """LeNet-5 with ReLU and max pooling: conv(6, 5x5)-pool-conv(16, 5x5)-pool-120-84-classes.

    Padding follows the classic variants: none on 32x32 (CIFAR), 2 on 28x28 (MNIST); smaller
    inputs keep "same" padding in both convolutions so that e.g. 8x8 still leaves a 2x2 map.
    Inputs larger than 32x32 are average-pooled to 5x5 so the classifier stays small.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        (c, h, w), prefix = _as_image(input_shape, "lenet")
        pad1 = tuple(0 if s >= 32 else 2 for s in (h, w))
        # Size after conv1 and a ceil-mode pool, per dimension; conv2 pads when it would
        # otherwise shrink the map below the classic 5x5 (or to nothing).
        after1 = [math.ceil((s + 2 * p - 4) / 2) for s, p in zip((h, w), pad1, strict=True)]
        pad2 = tuple(0 if s >= 10 else 2 for s in after1)
        self.features = nn.Sequential(
            *prefix,
            nn.Conv2d(c, 6, 5, padding=pad1),
            nn.ReLU(),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(6, 16, 5, padding=pad2),
            nn.ReLU(),
            nn.MaxPool2d(2, ceil_mode=True),
        )
        after2 = [math.ceil((s + 2 * p - 4) / 2) for s, p in zip(after1, pad2, strict=True)]
        pooled = (min(after2[0], 5), min(after2[1], 5))
        self.pool = nn.AdaptiveAvgPool2d(pooled)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * pooled[0] * pooled[1], 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))


def _build_lenet(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return LeNet(input_shape, num_classes)


# --------------------------------------------------------------------------------------------
# ResNet


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(math.gcd(channels, 8), channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias)
        self.norm1 = _norm(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=bias)
        self.norm2 = _norm(norm, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=bias), _norm(norm, c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: 3x3 stem, stages of BasicBlocks (stride 2 from the second stage on),
    global average pooling and a linear classifier. Works on any image size, even 1x1."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        widths: Sequence[int] = (16, 32, 64),
        blocks: Sequence[int] = (1, 1, 1),
        norm: str = "group",
    ):
        super().__init__()
        (c, _, _), prefix = _as_image(input_shape, "resnet")
        bias = norm == "none"
        layers: list[nn.Module] = [
            *prefix,
            nn.Conv2d(c, widths[0], 3, padding=1, bias=bias),
            _norm(norm, widths[0]),
            nn.ReLU(),
        ]
        c_in = widths[0]
        for stage, (width, n_blocks) in enumerate(zip(widths, blocks, strict=True)):
            for i in range(n_blocks):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(c_in, width, stride, norm))
                c_in = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _build_resnet(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    widths = _int_list(spec.options.get("widths", [16, 32, 64]), "widths", 1, 4096)
    blocks = _int_list(spec.options.get("blocks", 1), "blocks", 1, 16, length=len(widths))
    norm = spec.options.get("norm", "group")
    if norm not in NORMS:
        raise WorkloadError(f"model.options.norm: must be one of {', '.join(NORMS)}, got {norm!r}")
    return ResNet(input_shape, num_classes, widths, blocks, norm)


# --------------------------------------------------------------------------------------------
# User models and the entry point


def _build_user(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    field = "model.name"
    fn = _user_builder(spec)
    model = call_user(
        fn, spec.name, field, input_shape=input_shape, num_classes=num_classes, **spec.options
    )
    if not isinstance(model, nn.Module):
        raise WorkloadError(
            f"{field}: {spec.name!r} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _build_charlm(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from dynabatch.actors.workloads.charlm import CharLM

    if len(input_shape) != 1:
        raise WorkloadError(
            f"model.name: charlm needs token sequences (N, T), got samples of shape {input_shape}"
        )
    layers = _int(spec.options.get("layers", 2), "layers", 1, 24)
    heads = _int(spec.options.get("heads", 4), "heads", 1, 64)
    if spec.hidden % heads:
        raise WorkloadError(f"model.hidden: {spec.hidden} is not a multiple of heads ({heads})")
    return CharLM(input_shape[0], num_classes, spec.hidden, layers, heads)


def _build_hf(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from dynabatch.actors.workloads.hf import build_hf

    return build_hf(spec, input_shape, num_classes)


_BUILDERS: dict[str, Callable[[ModelSpec, tuple[int, ...], int], nn.Module]] = {
    "charlm": _build_charlm,
    "hf": _build_hf,
    "mlp": _build_mlp,
    "lenet": _build_lenet,
    "resnet": _build_resnet,
}


def build_model(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the network for samples of ``input_shape`` and ``num_classes`` output logits.

    Raises :class:`WorkloadError` naming the spec field at fault.
    """
    try:
        # operator.index accepts numpy and torch integers (torch.Size, arr.shape) but not floats.
        shape = tuple(operator.index(n) for n in input_shape)
    except TypeError:
        shape = ()
    if not shape or min(shape) < 1:
        raise WorkloadError(f"model: input_shape must be positive integers, got {input_shape!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise WorkloadError(f"model: num_classes must be a positive integer, got {num_classes!r}")
    if spec.name in OPTIONS:
        check_option_names("model.options", spec.name, spec.options, OPTIONS[spec.name])
    builder = _BUILDERS.get(spec.name, _build_user)
    return builder(spec, shape, num_classes)
