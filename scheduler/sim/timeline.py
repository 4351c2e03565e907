"""Virtual time and what happened on it, for both simulators: the :class:`SimClock`, the
cluster events as they happened and the recoveries from failed steps. Pure: no ray, no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class SimClock:
    """Virtual time: ``now()`` advances only when the runtime (or a waiting driver) says."""

    def __init__(self, start_time: float | None = None) -> None:
        self.t = 0.0
        self.start_time = time.time() if start_time is None else start_time

    def now(self) -> float:
        return self.t

    def time(self) -> float:
        return self.start_time + self.t

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclass(frozen=True)
class ClusterHappening:
    """A cluster event as it happened: when, what, and to which nodes."""

    time: float
    kind: str
    nodes: tuple[str, ...]
    detail: str = ""


@dataclass(frozen=True)
class Recovery:
    """A step failed at ``failed_at`` (simulated seconds) because ``lost`` went; training
    went on with the first step that completed after it, started at ``resumed_at``."""

    failed_at: float
    lost: tuple[str, ...]
    resumed_at: float

    @property
    def seconds(self) -> float:
        return self.resumed_at - self.failed_at
