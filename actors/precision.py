"""Precision and speed options of a training step (the spec's ``precision``,
``channels_last`` and ``compile``), apart from the step.

What :class:`dynabatch.actors.step.StepMath` uses: the autocast dtype of bf16 and fp16, the
TF32 switch, fp16's dynamic loss scale, and :class:`SpeedOptions`: the channels_last memory
format and ``torch.compile``. Pure torch, nothing else of dynabatch, so the prepared GPU
check (``bench/gpu_check.py``) drives it on a bare machine too.

Compiling a model whose batch changes (a share is re-sized, an accumulated share ends in a
shorter micro-batch): the batch dimension of every input is marked dynamic
(:func:`prepare_input`), so one graph serves every size instead of one graph per size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype forward runs in under ``torch.autocast`` (None: no autocast)."""
    return _AUTOCAST.get(precision)


def set_matmul_precision(precision: str, device: torch.device) -> None:
    """TF32 for CUDA's matmuls and convolutions under ``tf32`` and under no other precision
    (process-wide flags: one worker per process); nothing on the CPU, which has no TF32.

    Both flags are set either way: cuDNN's convolutions default to TF32 in PyTorch, so
    without this ``fp32`` would be TF32 for every convolution (docs/benchmarks.md, "GPU
    check: one H200"). Only the legacy ``allow_tf32`` setters are used: mixing them with
    ``fp32_precision`` makes torch refuse to read the flags."""
    if device.type == "cuda":
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


@dataclass
class LossScaler:
    """fp16's dynamic loss scale, as ``torch.amp.GradScaler``'s: the loss is multiplied by
    ``scale`` before backward (small gradients stay above fp16's smallest normal); a step
    whose gradient overflowed is skipped and the scale halved; after ``growth_interval``
    steps in a row without one it doubles. Its state travels with the model's (a newcomer
    takes the group's scale), so every worker holds the same scale at every step."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    good_steps: int = 0

    def overflowed(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether the (all-reduced, so every worker's same) gradient is not finite: one
        host synchronisation for all of them."""
        if not grads:
            return False
        return not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def unscale(self, grads: Sequence[torch.Tensor]) -> None:
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.good_steps = self.scale / 2.0, 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale, self.good_steps = self.scale * 2.0, 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


@dataclass(frozen=True)
class SpeedOptions:
    """How a replica runs its forward: ``channels_last`` (the model and its 4-D inputs in
    ``torch.channels_last``); ``compile_mode`` (None: not compiled) with ``dynamic`` (the
    batch dimension marked dynamic) and ``backend``, as ``torch.compile`` takes them."""

    channels_last: bool = False
    compile_mode: str | None = None
    dynamic: bool = True
    backend: str = "inductor"

    @property
    def compiled(self) -> bool:
        return self.compile_mode is not None


def channels_last_applies(input_shape: Sequence[int]) -> bool:
    """Whether channels_last changes anything for samples of ``input_shape``: batches of
    them are 4-D (N, C, H, W) only when a sample is 3-D."""
    return len(input_shape) == 3


def forward_of(model: torch.nn.Module, speed: SpeedOptions) -> Callable[[torch.Tensor], Any]:
    """The callable that runs ``model``'s forward under ``speed``: the model itself, in
    channels_last where asked (converted in place: its 4-D weights; others are unchanged),
    compiled where asked. The compiled module shares the model's parameters."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)
    if not speed.compiled:
        return model
    # mode is inductor's; the tracing backends take none.
    mode = speed.compile_mode if speed.backend == "inductor" else None
    return torch.compile(
        model, mode=mode, backend=speed.backend, dynamic=None if speed.dynamic else False
    )


def call_model(forward: Callable[..., Any], x: Any) -> Any:
    """``forward`` on a batch's inputs: ``forward(**x)`` for a dict (a model whose forward
    takes ``input_ids`` and ``attention_mask``), ``forward(*x)`` for a tuple or list,
    ``forward(x)`` for a tensor. The one place that decides how a model is called."""
    if isinstance(x, dict):
        return forward(**x)
    if isinstance(x, tuple | list):
        return forward(*x)
    return forward(x)


def prepare_input(x: Any, speed: SpeedOptions) -> Any:
    """``x`` (a tensor, or a dict or tuple of them) as the forward of :func:`forward_of`
    takes it: each 4-D tensor in channels_last, each tensor's batch dimension marked dynamic
    when compiled with ``dynamic`` (``maybe_mark_dynamic``: a batch of one, which torch
    specialises, compiles once more instead of failing)."""
    if not (speed.channels_last or (speed.compiled and speed.dynamic)):
        return x  # nothing to do: no walk over the batch on every micro-batch
    return tree_map(lambda t: _prepare(t, speed) if isinstance(t, torch.Tensor) else t, x)


def _prepare(x: torch.Tensor, speed: SpeedOptions) -> torch.Tensor:
    if speed.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if speed.compiled and speed.dynamic and x.dim() > 0:
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return x
