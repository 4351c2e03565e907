"""The synchronous driver's one job-state value, and the base of the parts that share it.

:class:`SyncJob` holds everything the driver's parts read and change: the pure machines
(protocol, policy, tracker, ledger, membership, regime, failure policy), the loop's data
(the segment in flight, the epoch's totals, weights restored from a checkpoint), and the
counters the snapshot reports. The parts
(``pipeline``, ``roster``, ``epochs``, ``checkpoints``, ``final_model``) are small objects over
it; the :class:`~dynabatch.scheduler.sync.coordinator.Coordinator` wires them, keeps the
public surface and carries the step loop's effects out on them.

No part calls another. What several need is either the job's own (:class:`Part`: remove a
worker, read the state from a holder, the evaluations in flight), or the coordinator passes
one part's answer to another (a re-plan's first step inside the segment in flight, a posted
plan update's outcome), or it is a command of its own (a drain waits for the evaluations
first: the loop's ``Settle`` before ``ApplyDrains``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynabatch.scheduler.core.failures import (
    Attempts,
    Evict,
    Fail,
    FailureDecision,
    FailureEvent,
    FailurePolicy,
    MemoryCaps,
)
from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.core.membership import Membership
from dynabatch.scheduler.core.regime.regime import Regime
from dynabatch.scheduler.core.sync.protocol import Position, SyncProtocol
from dynabatch.scheduler.core.sync.tracker import Tracker
from dynabatch.scheduler.runtime.seam import DataInfo, WorkerCallError
from dynabatch.scheduler.sync.epoch_report import EpochTotals
from dynabatch.scheduler.sync.evaluation import EvalRound, split

if TYPE_CHECKING:
    from dynabatch.actors.spec import JobSpec
    from dynabatch.scheduler.core.membership import Change
    from dynabatch.scheduler.runtime.seam import Clock, Runtime
    from dynabatch.scheduler.sync.coordinator import Coordinator
    from dynabatch.scheduler.sync.evaluation import Evaluations
    from dynabatch.scheduler.telemetry import EpochRecord


@dataclass
class SyncJob:
    """What the synchronous driver knows about its job, in one place."""

    job_id: str
    membership: Membership
    regime: Regime  # the global batch, LR, ISGD and goodput of every step
    policy: Any
    failures: FailurePolicy
    attempts: Attempts = field(default_factory=Attempts)  # the failures the policy counts
    tracker: Tracker = field(default_factory=Tracker)
    ledger: Ledger = field(default_factory=Ledger)
    # Memory caps learned from out-of-memory failures, per node and device.
    memory: MemoryCaps = field(default_factory=MemoryCaps)
    protocol: SyncProtocol | None = None  # once the data is loaded
    data: DataInfo | None = None
    position: Position = field(default_factory=lambda: Position(0, 0))  # where to start

    # The open epoch's totals; None between epochs (the next step boundary begins one).
    ep: EpochTotals | None = None
    # An evaluation queued for the next segment sent (its workers score first); dropped by
    # a regroup, before which it ran.
    next_behind: EvalRound | None = None
    # From a checkpoint (resuming, or rolling back): the weights stay here until a regroup
    # loads them into the group (one that fails must be able to load them again), and the
    # global batch trained there until the data is loaded.
    restored_weights: dict[str, Any] | None = None
    restored_batch: int | None = None
    # Workers taken out of the job whose processes the loop's next StopWorkers stops.
    leaving: list[str] = field(default_factory=list)
    # The failure policy decided to fail the job, why: the loop ends it (its ``Failed``).
    failure: str | None = None

    rebalances_total: int = 0
    regroup_seconds_total: float = 0.0
    retried_samples_total: int = 0

    @property
    def start_batch(self) -> int:
        """The global batch at :attr:`position`, where the protocol (re)starts: the one
        trained there when it was restored from a checkpoint, else the regime's for its
        epoch."""
        return self.restored_batch or self.regime.batch_for(self.position.epoch)

    @property
    def global_batch(self) -> int:
        """The global batch in force: the protocol's once the data is loaded, else
        :attr:`start_batch`. The snapshot, the checkpoint and the protocol read it here."""
        return self.protocol.global_batch if self.protocol is not None else self.start_batch

    def evaluation_shards(self, workers: list[str], which: str | None = None
                          ) -> dict[str, tuple[int, int]]:
        """The held-out split ``which`` (default: the judged one, validation when the data
        has it, else test) split over ``workers`` in proportion to their measured
        throughput (the tracker's: the one source of a worker's speed)."""
        speeds = self.tracker.speeds()
        d, n = self.data, 0
        if d is not None:
            which = which or ("validation" if d.n_validation else "test")
            n = d.n_validation if which == "validation" else d.n_test
        return split(n, {w: speeds.get(w, 0.0) for w in workers})


# How long reading the job's state from a holder may take (a checkpoint, the model's export).
STATE_TIMEOUT_S = 120.0


class Part:
    """One concern of the driver: shares the coordinator's :class:`SyncJob`, its job
    control (log, lifecycle, requests) and the operations on the job that several parts
    need (below). A part never calls a sibling part."""

    def __init__(self, coord: Coordinator):
        self.c = coord

    @property
    def job(self) -> SyncJob:
        return self.c.job

    @property
    def spec(self) -> JobSpec:
        return self.c.spec

    @property
    def clock(self) -> Clock:
        return self.c.clock

    @property
    def runtime(self) -> Runtime:
        return self.c.runtime

    def log(self, level: str, message: str) -> None:
        self.c.log(level, message)

    def failed(self, event: FailureEvent) -> FailureDecision:
        """A failure: the job's :class:`FailurePolicy` decides it (the only place one is
        decided), and what the decision does to the job is done here: the workers it evicts
        leave, and a :class:`Fail` is noted for the step loop, which ends the job FAILED
        once the effect returns (the caller returns at once). Retry and roll back are the
        caller's to carry out."""
        job = self.job
        job.attempts, decision = job.failures.decide(job.attempts, event)
        match decision:
            case Evict(workers):
                for w, why in workers.items():
                    self.remove_worker(w, "evict", why)
            case Fail(reason):
                job.failure = job.failure or reason
        return decision

    # The job control's state the parts read and change, named here once.
    @property
    def lock(self) -> threading.RLock:
        """Held while changing what snapshot readers in other threads copy."""
        return self.c.lock

    @property
    def history(self) -> list[EpochRecord]:
        """The epochs' records, in order (changed under :attr:`lock`)."""
        return self.c.records

    @property
    def cancel_requested(self) -> bool:
        return self.c.cancel_reason is not None

    def take_requests(self, assignments: bool = False) -> list[Any]:
        """The scale, drain and assign requests queued since the last call (``assignments``:
        only the assignments at the head of the queue)."""
        return self.c.take_requests(assignments)

    def scale_queued(self) -> bool:
        """A scale request is queued (not yet taken)."""
        return self.c.scale_queued()

    def transition(self, state: JobState, reason: str | None) -> None:
        """Move the job's lifecycle state (its moves are enforced there)."""
        self.c.transition(state, reason)

    def finish(self, state: JobState, reason: str | None) -> None:
        """End the job (without unwinding the step: see :meth:`fail`)."""
        self.c.finish(state, reason)

    @property
    def evals(self) -> Evaluations:
        """The evaluations in flight: queued by the pipeline (ahead of an epoch's end) and by
        the epochs (at its end), published by the epochs."""
        return self.c.evals

    # ---------------------------------------------------------------- the job's operations
    def remove_worker(self, worker: str, kind: str, reason: str) -> None:
        """Take ``worker`` out of the job (lost, or evicted as a straggler): out of the
        membership and the tracker, its event recorded; the loop's next batch stops it
        (``StopWorkers``). One taken out already (reported lost again by a later call) is
        neither stopped nor recorded twice."""
        with self.c.lock:
            change = self.job.membership.remove(worker, kind, reason)
        self.job.tracker.remove(worker)
        if change is not None:
            self.job.leaving.append(worker)
            self.changed(change)

    def stop(self, workers: tuple[str, ...]) -> None:
        """Stop the processes of these workers taken out of the job (the loop's
        ``StopWorkers``)."""
        self.job.leaving = [w for w in self.job.leaving if w not in workers]
        for worker in workers:
            self.runtime.kill(worker)

    def changed(self, change: Change) -> None:
        """Record a membership change as a worker event (the snapshot's counts, the log)."""
        self.c.record_event(change.kind, change.worker, change.node, change.reason,
                      self.job.membership.generation)

    def held_state(self, what: str) -> dict[str, Any] | None:
        """The job's state (model and optimizer): restored weights not yet loaded into a
        group, else read from the first holder that answers; None when none does. A holder
        lost on the way is removed; ``what`` (``checkpoint``, say) names the call in the
        log."""
        job = self.job
        weights = job.restored_weights  # restored but not yet loaded into a group
        for holder in [] if weights is not None else job.membership.holders():
            try:
                return self.runtime.fetch_state(holder.worker_id, STATE_TIMEOUT_S)
            except WorkerCallError as err:
                self.log("WARNING", f"{what}: {err}")
                if err.lost:
                    self.remove_worker(err.worker, "failure", f"lost during a {what}")
        return weights
