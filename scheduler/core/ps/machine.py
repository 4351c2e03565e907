"""One parameter-server job's brain: the PS protocol, the async ledger and the batch policy,
driven by the same events from the Ray server actor (:mod:`dynabatch.actors.ps`) and the
simulator. Pure: no ray, no torch, no clock.

A learner asks for work (:meth:`PSCore.request`): a chunk of an epoch's order positions and
the version to pull, or wait, or finished. Its push (:meth:`PSCore.push`) goes to the
protocol, whose every decision is reflected in the ledger at once (applied, or re-queued
when refused); a lost learner's in-flight chunk is re-queued. Each epoch, once its every
position is applied, is verified exactly-once and ends (:class:`EpochEnd`), in order.

Epochs overlap in async and softsync (two open at most): with an epoch barrier every learner
would pull the same version at each epoch start, a burst whose α0/τ factors add up to
(1 + H_{λ−1})·α0 (docs/parameter-server.md, "Epochs overlap"). hardsync keeps the barrier:
its update is one SGD step on one epoch's summed batch. A softsync update still gathering
when nothing more can arrive is flushed as a partial update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dynabatch.scheduler.core.ledger import Verification
from dynabatch.scheduler.core.ps.async_ledger import AsyncLedger, Chunk
from dynabatch.scheduler.core.ps.batch_policy import PerfAwareBatches
from dynabatch.scheduler.core.ps.rudra import (
    Apply,
    PSConfig,
    PSProtocol,
    Pulled,
    PushOutcome,
    Refuse,
)


@dataclass(frozen=True, slots=True)
class Work:
    worker: str
    ticket: int
    epoch: int
    seed: int
    dataset_size: int
    version: int
    chunk: Chunk


@dataclass(frozen=True, slots=True)
class Idle:
    worker: str
    reason: str  # "wait" (protocol) | "epoch_end" (the epoch's last chunks are in flight)


@dataclass(frozen=True, slots=True)
class Finished:
    worker: str


@dataclass(frozen=True, slots=True)
class EpochEnd:
    epoch: int
    verification: Verification
    version: int

    def dispatch(self, handler: EventHandler) -> None:
        handler.on_epoch_end(self)


CoreEvent = PushOutcome | EpochEnd


class EventHandler(Protocol):
    """What interprets the core's events (``event.dispatch(handler)`` calls the method of its
    class): the one interpreter, :class:`dynabatch.actors.ps_events.CoreEventInterpreter`,
    used by the Ray server actor and the simulator alike. Typed double dispatch, so the
    actors layer needs no import of these classes."""

    def on_apply(self, e: Apply) -> None: ...

    def on_refuse(self, e: Refuse) -> None: ...

    def on_epoch_end(self, e: EpochEnd) -> None: ...


@dataclass(slots=True)
class _Ticket:
    worker: str
    chunk: Chunk
    version: int


OPEN_EPOCHS = 2  # the epoch being completed and the next one


class PSCore:
    def __init__(self, config: PSConfig, *, dataset_size: int, epochs: int, seed: int,
                 batches: PerfAwareBatches):
        self.protocol = PSProtocol(config)
        self.batches = batches
        self.dataset_size = dataset_size
        self.epochs = epochs
        self.seed = seed
        self.epoch = 0  # the oldest open epoch: the one being completed
        # The next epoch opens before this one completes, except in hardsync (its barrier).
        self.overlap = config.mode != "hardsync"
        self.pushes = 0
        self.lost_inflight_samples = 0  # re-queued from lost learners' chunks
        self.ledgers: dict[int, AsyncLedger] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._inflight: dict[str, int] = {}  # worker → ticket it is computing
        self._next_ticket = 0
        self._open(0)

    @property
    def finished(self) -> bool:
        """Every epoch ended: none is open (the oldest open one is always kept until then)."""
        return not self.ledgers

    def _open(self, epoch: int) -> AsyncLedger:
        led = AsyncLedger()
        led.begin_epoch(epoch, self.dataset_size)
        self.ledgers[epoch] = led
        return led

    def _can_open(self) -> bool:
        nxt = max(self.ledgers) + 1
        return self.overlap and len(self.ledgers) < OPEN_EPOCHS and nxt < self.epochs

    def _take(self, worker: str, k: int) -> Chunk | None:
        """The next chunk: the oldest open epoch with queued samples first, then a new one."""
        for e in sorted(self.ledgers):
            if self.ledgers[e].queued_samples:
                return self.ledgers[e].take(worker, k)
        if self._can_open():
            return self._open(max(self.ledgers) + 1).take(worker, k)
        return None

    # --- membership -------------------------------------------------------------------
    def join(self, worker: str) -> None:
        self.protocol.join(worker)

    def leave(self, worker: str) -> list[CoreEvent]:
        """``worker`` is lost: its in-flight chunk is re-queued, no regroup."""
        if worker not in self.protocol.members:
            return []
        t = self._inflight.pop(worker, None)
        if t is not None:
            ticket = self._tickets.pop(t)
            self.ledgers[ticket.chunk.epoch].requeue(ticket.chunk.id)
            self.lost_inflight_samples += ticket.chunk.samples
        self.batches.forget(worker)
        return self._after(self.protocol.leave(worker))

    # --- events -----------------------------------------------------------------------
    def request(self, worker: str) -> tuple[Work | Idle | Finished, list[CoreEvent]]:
        if self.finished:
            return Finished(worker), []
        if worker not in self.protocol.members:
            raise ValueError(f"{worker} is not a member")
        if worker in self._inflight:
            raise ValueError(f"{worker} asks for work with ticket {self._inflight[worker]} open")
        if self.protocol.waiting(worker):
            return Idle(worker, "wait"), []
        chunk = self._take(worker, self.batches.batch(worker))
        if chunk is None:
            # Nothing left to hand out: flush a partial update once nobody computes.
            return Idle(worker, "epoch_end"), self._after([])
        pulled = self.protocol.pull(worker)
        assert isinstance(pulled, Pulled)  # not waiting, checked above
        self._next_ticket += 1
        self._tickets[self._next_ticket] = _Ticket(worker, chunk, pulled.version)
        self._inflight[worker] = self._next_ticket
        return Work(worker, self._next_ticket, chunk.epoch, self.seed, self.dataset_size,
                    pulled.version, chunk), []

    def push(self, worker: str, ticket: int, version_pulled: int, compute_s: float
             ) -> list[CoreEvent]:
        if self._inflight.get(worker) != ticket:
            raise ValueError(f"{worker} pushes ticket {ticket}, which it does not hold")
        t = self._tickets[ticket]
        if t.version != version_pulled:
            raise ValueError(f"ticket {ticket} pulled version {t.version}, not {version_pulled}")
        del self._inflight[worker]
        self.pushes += 1
        # This gradient's own batch sets its α scale: read before observe() may re-plan.
        scale = self.batches.lr_scale(t.chunk.samples)
        self.batches.observe(worker, t.chunk.samples, compute_s, self.protocol.members)
        return self._after(self.protocol.push(worker, ticket, t.version, t.chunk.samples,
                                              scale))

    def ticket_of(self, worker: str) -> int | None:
        """The ticket ``worker`` is computing, if any (a learner holds at most one)."""
        return self._inflight.get(worker)

    # --- bookkeeping --------------------------------------------------------------------
    def _after(self, decisions: list[PushOutcome]) -> list[CoreEvent]:
        out: list[CoreEvent] = []
        for d in decisions:
            self._record(d)
            out.append(d)
        # A partial update: flush it once nothing else can arrive for it.
        if (not any(led.queued_samples for led in self.ledgers.values())
                and not self._can_open() and not self.protocol.inflight
                and self.protocol.queued):
            for d in self.protocol.flush():
                self._record(d)
                out.append(d)
        # Epochs end in order; a later one may have completed first.
        while not self.finished and self.ledgers[self.epoch].complete:
            e = self.epoch
            out.append(EpochEnd(e, self.ledgers.pop(e).verify(), self.protocol.version))
            if e + 1 >= self.epochs:
                break
            self.epoch = e + 1
            if self.epoch not in self.ledgers:
                self._open(self.epoch)
            self.batches.replan(self.protocol.members)
        return out

    def _record(self, d: PushOutcome) -> None:
        if isinstance(d, Apply):
            for g in d.gradients:
                c = self._tickets.pop(g.push_id).chunk
                self.ledgers[c.epoch].applied(c.id)
        elif isinstance(d, Refuse):
            c = self._tickets.pop(d.push_id).chunk
            self.ledgers[c.epoch].requeue(c.id)

    def ticket_chunk(self, ticket: int) -> Chunk | None:
        t = self._tickets.get(ticket)
        return None if t is None else t.chunk

    def snapshot(self) -> dict:
        """Plain data for REST, metrics and the CLI."""
        p = self.protocol
        return {
            "version": p.version,
            "epoch": self.epoch,
            "finished": self.finished,
            "applied": p.applied,
            "refused": p.refused,
            "deferred": p.deferred,
            "pushes": self.pushes,
            "inflight": {w: self._tickets[t].chunk.samples for w, t in self._inflight.items()},
            "workers": {
                w: {"pushes": s.pushes, "applied": s.applied, "refused": s.refused,
                    "staleness_mean": s.staleness_mean, "staleness_max": s.staleness_max,
                    "staleness_counts": dict(s.staleness_counts),
                    "batch": self.batches.batch(w), "member": w in p.members}
                for w, s in p.stats.items()
            },
        }
