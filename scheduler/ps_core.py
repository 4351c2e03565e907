"""One parameter-server job's brain: the PS protocol, the async ledger and the batch policy,
driven by the same events from the Ray server actor (:mod:`actors.ps`) and the simulator
(:mod:`scheduler.ps_sim`). Pure: no ray, no torch, no clock.

A learner asks for work (:meth:`PSCore.request`): it gets the weights' version to pull and a
chunk of the epoch's order positions sized by the batch policy, or is told to wait (hardsync,
bounded staleness ``wait``, or the epoch's last chunks are still in flight), or that the job is
finished. It pushes its mean gradient with the ticket (:meth:`PSCore.push`). Every decision
the protocol makes is reflected in the ledger at once: an applied gradient's chunk is applied,
a refused one's is re-queued. A lost learner (:meth:`PSCore.leave`) has its in-flight chunk
re-queued; its gradients already pushed stay. When the epoch's every position is applied the
core verifies exactly-once and emits :class:`EpochEnd`; at the end of an epoch a partial
softsync update is flushed (no more gradients can come for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.ledger import Verification
from scheduler.policy_ji import PerfAwareBatches
from scheduler.protocols.ps import Apply, Decision, PSConfig, PSProtocol, Pulled, Refuse
from scheduler.ps_ledger import AsyncLedger, Chunk


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


Event = Decision | EpochEnd


@dataclass(slots=True)
class _Ticket:
    worker: str
    chunk: Chunk
    version: int


@dataclass(slots=True)
class CoreCounters:
    pushes: int = 0
    lost_inflight_samples: int = 0
    verifications: list[Verification] = field(default_factory=list)


class PSCore:
    def __init__(self, config: PSConfig, *, dataset_size: int, epochs: int, seed: int,
                 batches: PerfAwareBatches, workers: Iterable[str] = ()):
        self.protocol = PSProtocol(config)
        self.ledger = AsyncLedger()
        self.batches = batches
        self.dataset_size = dataset_size
        self.epochs = epochs
        self.seed = seed
        self.epoch = 0
        self.finished = False
        self.counters = CoreCounters()
        self._tickets: dict[int, _Ticket] = {}
        self._inflight: dict[str, int] = {}  # worker → ticket it is computing
        self._next_ticket = 0
        self.ledger.begin_epoch(0, dataset_size)
        for w in workers:
            self.join(w)

    # --- membership -------------------------------------------------------------------
    @property
    def members(self) -> frozenset[str]:
        return self.protocol.members

    def join(self, worker: str) -> None:
        self.protocol.join(worker)

    def leave(self, worker: str) -> list[Event]:
        """``worker`` is lost: its in-flight chunk is re-queued, no regroup."""
        if worker not in self.protocol.members:
            return []
        t = self._inflight.pop(worker, None)
        if t is not None:
            ticket = self._tickets.pop(t)
            self.ledger.requeue(ticket.chunk.id)
            self.counters.lost_inflight_samples += ticket.chunk.samples
        self.batches.forget(worker)
        return self._after(self.protocol.leave(worker))

    # --- events -----------------------------------------------------------------------
    def request(self, worker: str) -> tuple[Work | Idle | Finished, list[Event]]:
        if self.finished:
            return Finished(worker), []
        if worker not in self.protocol.members:
            raise ValueError(f"{worker} is not a member")
        if worker in self._inflight:
            raise ValueError(f"{worker} asks for work with ticket {self._inflight[worker]} open")
        if self.protocol.waiting(worker):
            return Idle(worker, "wait"), []
        chunk = self.ledger.take(worker, self.batches.batch(worker))
        if chunk is None:
            # Nothing left to hand out: flush a partial update once nobody computes.
            return Idle(worker, "epoch_end"), self._after([])
        pulled = self.protocol.pull(worker)
        assert isinstance(pulled, Pulled)  # not waiting, checked above
        self._next_ticket += 1
        self._tickets[self._next_ticket] = _Ticket(worker, chunk, pulled.version)
        self._inflight[worker] = self._next_ticket
        return Work(worker, self._next_ticket, self.epoch, self.seed, self.dataset_size,
                    pulled.version, chunk), []

    def push(self, worker: str, ticket: int, version_pulled: int, compute_s: float
             ) -> list[Event]:
        if self._inflight.get(worker) != ticket:
            raise ValueError(f"{worker} pushes ticket {ticket}, which it does not hold")
        t = self._tickets[ticket]
        if t.version != version_pulled:
            raise ValueError(f"ticket {ticket} pulled version {t.version}, not {version_pulled}")
        del self._inflight[worker]
        self.counters.pushes += 1
        self.batches.observe(worker, t.chunk.samples, compute_s)
        return self._after(self.protocol.push(worker, ticket, t.version, t.chunk.samples,
                                              self.batches.lr_scale(worker)))

    # --- bookkeeping --------------------------------------------------------------------
    def _after(self, decisions: list[Decision]) -> list[Event]:
        out: list[Event] = []
        for d in decisions:
            self._record(d)
            out.append(d)
        # The epoch's last update may be partial: flush it once nothing else can arrive.
        if (not self.ledger.queued_samples and not self.protocol.inflight
                and self.protocol.queued):
            for d in self.protocol.flush():
                self._record(d)
                out.append(d)
        if self.ledger.complete and not self.finished:
            v = self.ledger.verify()
            self.counters.verifications.append(v)
            out.append(EpochEnd(self.epoch, v, self.protocol.version))
            if self.epoch + 1 >= self.epochs:
                self.finished = True
            else:
                self.epoch += 1
                self.ledger.begin_epoch(self.epoch, self.dataset_size)
                self.batches.replan(self.protocol.members)
        return out

    def _record(self, d: Decision) -> None:
        if isinstance(d, Apply):
            for g in d.gradients:
                self.ledger.applied(self._tickets.pop(g.push_id).chunk.id)
        elif isinstance(d, Refuse):
            self.ledger.requeue(self._tickets.pop(d.push_id).chunk.id)

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
            "pushes": self.counters.pushes,
            "workers": {
                w: {"pushes": s.pushes, "applied": s.applied, "refused": s.refused,
                    "staleness_mean": s.staleness_mean, "staleness_max": s.staleness_max,
                    "staleness_counts": dict(s.staleness_counts),
                    "batch": self.batches.batch(w), "member": w in p.members}
                for w, s in p.stats.items()
            },
        }
