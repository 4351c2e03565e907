"""The one interpreter of a parameter-server core's events, used by the Ray server actor
(:class:`dynabatch.actors.ps.ParameterServer`) and the simulator
(:mod:`dynabatch.scheduler.sim.ps_runtime`) alike, so both keep the same books and write the
same epoch records. Each event dispatches itself (``event.dispatch(self)``: the event
classes live in ``dynabatch.scheduler.core.ps``, above this layer). No torch here: the store
is passed in (anything with ``apply([(grad, weight)])``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Closed:
    """An epoch the core closed: its ``EpochEnd`` and the mean training loss of the
    gradients applied in it."""

    event: Any  # dynabatch.scheduler.core.ps.machine.EpochEnd
    train_loss: float


@dataclass(slots=True)
class Effects:
    """What one batch of events did, in order, for the caller to finish: the updates for the
    other slices (``(version, ((ticket, weight), ...))``), the dropped tickets, the closed
    epochs to evaluate."""

    applied: list[tuple[int, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    closed: list[Closed] = field(default_factory=list)


class CoreEventInterpreter:
    """``keep_staleness``: keep every applied gradient's τ per learner (the simulator's
    figures); the server keeps only the core's summaries."""

    def __init__(self, store: Any, *, keep_staleness: bool = False):
        self.store = store
        self.keep_staleness = keep_staleness
        self.staleness: dict[str, list[int]] = {}
        self.samples_applied = 0
        self._grads: dict[int, Any] = {}
        self._losses: dict[int, float] = {}
        self._ep_loss = 0.0  # summed training loss of the epoch's applied gradients
        self._ep_samples = 0
        self._effects = Effects()

    def pushed(self, ticket: int, grad: Any, loss_sum: float = 0.0) -> None:
        """A gradient arrived for ``ticket`` (its summed training loss: telemetry)."""
        self._grads[ticket] = grad
        self._losses[ticket] = loss_sum

    def forget(self, ticket: int) -> None:
        """A gradient that will never be decided on (its learner was lost)."""
        self._grads.pop(ticket, None)
        self._losses.pop(ticket, None)

    def handle(self, events: Sequence[Any]) -> Effects:
        self._effects = Effects()
        for e in events:
            e.dispatch(self)
        out, self._effects = self._effects, Effects()
        return out

    # --- the core's events ----------------------------------------------------------------
    def on_apply(self, e: Any) -> None:
        weighted = tuple((g.push_id, g.weight) for g in e.gradients)
        self.store.apply([(self._grads.pop(t), w) for t, w in weighted])
        self._effects.applied.append((e.version, weighted))
        for g in e.gradients:
            self._ep_loss += self._losses.pop(g.push_id, 0.0)
            self._ep_samples += g.samples
            self.samples_applied += g.samples
            if self.keep_staleness:
                self.staleness.setdefault(g.worker, []).append(g.staleness)

    def on_refuse(self, e: Any) -> None:
        self.forget(e.push_id)
        self._effects.dropped.append(e.push_id)

    def on_epoch_end(self, e: Any) -> None:
        self._effects.closed.append(Closed(e, self._ep_loss / max(1, self._ep_samples)))
        self._ep_loss, self._ep_samples = 0.0, 0

    # --- the epoch record -------------------------------------------------------------------
    @staticmethod
    def record(closed: Closed, test_loss: float, test_accuracy: float, t: float
               ) -> dict[str, Any]:
        """The epoch record both drivers' runtimes report (``t``: seconds since the server
        started, wall or virtual)."""
        e, v = closed.event, closed.event.verification
        return {
            "epoch": e.epoch, "version": e.version, "test_loss": test_loss,
            "train_loss": closed.train_loss, "test_accuracy": test_accuracy,
            "verified": v.verified, "problems": list(v.problems),
            "samples_applied": v.samples_trained, "retried_samples": v.retried_samples,
            "samples_by_worker": dict(v.samples_by_worker), "t": t,
        }
