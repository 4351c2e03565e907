"""Where the synchronous driver's control loop stands: an explicit phase with enforced moves.

:class:`~dynabatch.scheduler.core.lifecycle.JobState` is what the service shows (PENDING,
RUNNING, a terminal state); :class:`Phase` is finer, what the driver is doing at a step
boundary. It used to hide in nine fields of the coordinator; now it is one value, and a
move the loop does not make (training after the job ended, rolling back outside a regroup)
is an error instead of a silent muddle.

The loop's moves (``scheduler/sync/``):

* ``STARTING``: the data loads and the first workers start; the first group forms next.
* ``WAITING_FOR_WORKERS``: fewer workers than the job's minimum; it waits for nodes, then
  fails after ``worker_wait_timeout_s`` (:func:`~dynabatch.scheduler.core.sync.boundary.
  wait_for_minimum`).
* ``REGROUPING``: membership changed (a join, a loss, a failed segment, a scale or drain):
  a new generation is formed at this boundary, again at the next one if it failed.
* ``ROLLING_BACK``: the regroup found no member holding the committed state: the last
  checkpoint is loaded (or the job fails); the regroup then goes on with its weights.
* ``TRAINING``: segments run, one sent ahead of the other when the pipeline may.
* ``ENDING_EPOCH``: the epoch is verified and recorded, its evaluation queued, a checkpoint
  written when due. It returns to the phase it interrupted (training, or a cancellation
  whose last segment completed the epoch) unless the job finished in it.
* ``FINISHING``: every epoch is trained: the last evaluations are awaited before success
  (a cancel that comes meanwhile stops any evaluation from running again, and the next
  boundary cancels the job).
* ``CANCELLING``: a cancellation is honoured: the segment in flight is committed, the
  evaluations awaited (none is run again) and a checkpoint written. A cancel takes effect
  within one step or one evaluation in every phase.
* ``DONE``: the job is terminal (its :class:`JobState` says how it ended).

A failed segment has no phase of its own: its retry is the next regroup and segment, and
whether a retry is under way is the :class:`~dynabatch.scheduler.core.failures.RetryBudget`'s
(failures counted since the last success), because it outlives the regroups and waits
between the failure and the retry.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    STARTING = "STARTING"
    WAITING_FOR_WORKERS = "WAITING_FOR_WORKERS"
    REGROUPING = "REGROUPING"
    ROLLING_BACK = "ROLLING_BACK"
    TRAINING = "TRAINING"
    ENDING_EPOCH = "ENDING_EPOCH"
    FINISHING = "FINISHING"
    CANCELLING = "CANCELLING"
    DONE = "DONE"

    @property
    def is_terminal(self) -> bool:
        return self is Phase.DONE

    def can_become(self, new: Phase) -> bool:
        """Staying in a phase is always allowed (a regroup that failed is tried again)."""
        return new is self or new in _TRANSITIONS[self]


P = Phase
_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    # Every live phase may end the job (a failure, an internal error) and, at a step
    # boundary, start cancelling; ROLLING_BACK and ENDING_EPOCH run inside one step and
    # are left before the next boundary, so they cannot be cancelled into.
    P.STARTING: frozenset({P.WAITING_FOR_WORKERS, P.REGROUPING, P.TRAINING, P.CANCELLING,
                           P.DONE}),
    P.WAITING_FOR_WORKERS: frozenset({P.REGROUPING, P.TRAINING, P.CANCELLING, P.DONE}),
    # A regroup that lost workers can leave too few: the job waits for nodes.
    P.REGROUPING: frozenset({P.ROLLING_BACK, P.WAITING_FOR_WORKERS, P.TRAINING, P.CANCELLING,
                             P.DONE}),
    P.ROLLING_BACK: frozenset({P.REGROUPING, P.DONE}),
    # Training reaches the group's changes at the next boundary (REGROUPING, or WAITING
    # when the losses left too few), and the job's end through ENDING_EPOCH or, when a
    # resumed or rolled-back job has nothing left to train, FINISHING directly.
    P.TRAINING: frozenset({P.ENDING_EPOCH, P.FINISHING, P.REGROUPING, P.WAITING_FOR_WORKERS,
                           P.CANCELLING, P.DONE}),
    P.ENDING_EPOCH: frozenset({P.TRAINING, P.CANCELLING, P.FINISHING, P.DONE}),
    # The last holder can be lost while the final evaluations are awaited: the next
    # boundary regroups (and rolls back) or waits, then trains again.
    P.FINISHING: frozenset({P.REGROUPING, P.WAITING_FOR_WORKERS, P.TRAINING, P.CANCELLING,
                            P.DONE}),
    # Committing the segment in flight can complete an epoch (ENDING_EPOCH), the last one
    # included (FINISHING: the job succeeds rather than being cancelled).
    P.CANCELLING: frozenset({P.ENDING_EPOCH, P.FINISHING, P.DONE}),
    P.DONE: frozenset(),
}
del P


class InvalidPhase(RuntimeError):
    """A move the loop does not make: a bug in the driver, never a user's error."""

    def __init__(self, old: Phase, new: Phase):
        super().__init__(f"the driver is {old.value}; it cannot become {new.value}")
        self.old, self.new = old, new

    def __reduce__(self):  # so it crosses Ray process boundaries intact
        return (InvalidPhase, (self.old, self.new))


def moves() -> dict[Phase, frozenset[Phase]]:
    """The transition table (a copy), for reports and tests."""
    return dict(_TRANSITIONS)
