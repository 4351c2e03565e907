"""Which epoch is the best by a held-out metric, and how long ago it was, for
``early_stopping`` and ``checkpoint.keep_best``. Pure. Recomputed from the epoch records each
time, so a job resumed or rolled back judges exactly as the one that wrote them. An epoch
without the value (a lost shard, a NaN) neither improves nor counts against the patience.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Judgement:
    best: int | None  # index of the best value (None: nothing scored yet)
    value: float | None  # the best value
    stale: int  # scored values after the best one


def judge(values: Sequence[float | None], mode: str, min_delta: float = 0.0) -> Judgement:
    """The best of ``values`` (one per epoch, in order) under ``mode`` (min or max)."""
    best: int | None = None
    value: float | None = None
    stale = 0
    for i, v in enumerate(values):
        if v is None or math.isnan(v):
            continue
        if value is None or (v < value - min_delta if mode == "min" else v > value + min_delta):
            best, value, stale = i, v, 0
        else:
            stale += 1
    return Judgement(best, value, stale)


def should_stop(j: Judgement, patience: int) -> bool:
    """Whether ``patience`` scored epochs in a row went by without an improvement."""
    return j.best is not None and j.stale >= patience
