"""Precision options of a training step (the spec's ``precision``), apart from the step.

What :class:`dynabatch.actors.step.StepMath` uses: the autocast dtype of bf16 and fp16, the
TF32 switch, and fp16's dynamic loss scale. Pure torch, nothing else of dynabatch, so the
prepared GPU check (``bench/gpu_check.py``) drives it on a bare machine too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype forward runs in under ``torch.autocast`` (None: no autocast)."""
    return _AUTOCAST.get(precision)


def set_matmul_precision(precision: str, device: torch.device) -> None:
    """TF32 for CUDA's matmuls and convolutions under ``tf32`` (process-wide flags: one
    worker per process); nothing on the CPU, which has no TF32."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {PRECISIONS}")
    if precision == "tf32" and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


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
