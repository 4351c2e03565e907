"""The job's workers as the synchronous driver changes them: who leaves, and what a failure
decides.

One object owns what several of the driver's parts do to the job's workers, so that none
of them reaches another: taking a worker out (lost, evicted, drained, given up), stopping
the processes of those taken out (the step loop's ``StopWorkers``, first thing in its next
batch), reading the job's state from a holder, and turning each failure into the failure
policy's one decision and applying it (:meth:`Workforce.failed`). Who is in, who holds the
state and what to spawn stay the pure :class:`~dynabatch.scheduler.core.membership.
Membership`'s; the counts of failures and the memory caps learned from them are the pure
:class:`~dynabatch.scheduler.core.failures.Attempts` and ``MemoryCaps``, kept here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dynabatch.scheduler.core.failures import (
    Attempts,
    Evict,
    Fail,
    FailureDecision,
    FailureEvent,
    FailurePolicy,
    MemoryCaps,
)
from dynabatch.scheduler.runtime.seam import WorkerCallError

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl
    from dynabatch.scheduler.core.membership import Change, Membership
    from dynabatch.scheduler.core.sync.tracker import Tracker
    from dynabatch.scheduler.runtime.seam import Runtime

# How long reading the job's state from a holder may take (a checkpoint, the model's export).
STATE_TIMEOUT_S = 120.0


class Workforce:
    def __init__(self, membership: Membership, tracker: Tracker, policy: FailurePolicy,
                 runtime: Runtime, control: JobControl):
        self.membership = membership
        self.tracker = tracker
        self.policy = policy
        self.runtime = runtime
        self.control = control
        self.attempts = Attempts()  # the failures the policy counts
        # Memory caps learned from out-of-memory failures, per node and device.
        self.memory = MemoryCaps()
        # Workers taken out of the job whose processes the loop's next StopWorkers stops.
        self.leaving: list[str] = []
        # The failure policy decided to fail the job, why: the loop ends it (its ``Failed``).
        self.failure: str | None = None

    def failed(self, event: FailureEvent) -> FailureDecision:
        """A failure: the job's :class:`FailurePolicy` decides it (the only place one is
        decided), and what the decision does to the job is done here: the workers it evicts
        leave, and a :class:`Fail` is noted for the step loop, which ends the job FAILED
        once the effect returns (the caller returns at once). Retry and roll back are the
        caller's to carry out."""
        self.attempts, decision = self.policy.decide(self.attempts, event)
        match decision:
            case Evict(workers):
                for w, why in workers.items():
                    self.remove(w, "evict", why)
            case Fail(reason):
                self.failure = self.failure or reason
        return decision

    def succeeded(self, what: Literal["segment", "regroup", "evaluation"]) -> None:
        """A segment all ran, a group formed, or an evaluation scored every shard: the
        failures the policy counts of that kind start over."""
        a = self.attempts
        self.attempts = {"segment": a.succeeded, "regroup": a.regrouped,
                         "evaluation": a.evaluated}[what]()

    def remove(self, worker: str, kind: str, reason: str) -> None:
        """Take ``worker`` out of the job (lost, or evicted as a straggler): out of the
        membership and the tracker, its event recorded; the loop's next batch stops it
        (``StopWorkers``). One taken out already (reported lost again by a later call) is
        neither stopped nor recorded twice."""
        with self.control.lock:
            change = self.membership.remove(worker, kind, reason)
        self.tracker.remove(worker)
        if change is not None:
            self.leaving.append(worker)
            self.changed(change)

    def left(self, worker: str) -> None:
        """``worker`` was taken out of the membership by the membership itself (drained,
        given up, started unwanted): the loop's next batch stops it."""
        self.leaving.append(worker)

    def stop(self, workers: tuple[str, ...]) -> None:
        """Stop the processes of these workers taken out of the job (the loop's
        ``StopWorkers``)."""
        self.leaving = [w for w in self.leaving if w not in workers]
        for worker in workers:
            self.runtime.kill(worker)

    def changed(self, change: Change) -> None:
        """Record a membership change as a worker event (the snapshot's counts, the log)."""
        self.control.record_event(change.kind, change.worker, change.node, change.reason,
                                  self.membership.generation)

    def held_state(self, what: str, restored: dict[str, Any] | None) -> dict[str, Any] | None:
        """The job's state (model and optimizer): ``restored`` weights not yet loaded into a
        group, else read from the first holder that answers; None when none does. A holder
        lost on the way is removed; ``what`` (``checkpoint``, say) names the call in the
        log."""
        for holder in [] if restored is not None else self.membership.holders():
            try:
                return self.runtime.fetch_state(holder.worker_id, STATE_TIMEOUT_S)
            except WorkerCallError as err:
                self.control.log("WARNING", f"{what}: {err}")
                if err.lost:
                    self.remove(err.worker, "failure", f"lost during a {what}")
        return restored
