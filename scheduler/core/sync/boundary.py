"""Decisions the synchronous driver takes at a step boundary when something is missing.

Pure (no clock, no I/O: the driver passes in its clock readings and what it loaded):

* too few workers: how long the job has waited and whether it gives up
  (:func:`wait_for_minimum`);
* an epoch's evaluation lost a shard: whether the holders score it again
  (:func:`evaluate_again`).

(Whether a regroup rolls back and when a checkpoint is due are the step loop's reducer's:
``dynabatch.scheduler.core.sync.loop``.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MinimumWait:
    """Where a wait for enough workers stands."""

    since: float  # when the job first found too few workers
    waited: float
    limit: float  # how long it may wait
    first: bool  # this boundary began the wait (the driver says why, once)
    give_up: bool  # waited its limit: the job fails


def wait_for_minimum(*, since: float | None, now: float, started: bool,
                     start_timeout_s: float, worker_wait_timeout_s: float) -> MinimumWait:
    """Too few workers at this boundary (``since``: when that began, None if just now).

    A job that never formed a group (``started`` false) may be queued behind others'
    workers, so it waits ``start_timeout_s``; a running one that lost workers waits
    ``worker_wait_timeout_s``. It fails once it has waited that long."""
    first = since is None
    since = now if since is None else since
    waited = now - since
    limit = worker_wait_timeout_s if started else start_timeout_s
    return MinimumWait(since=since, waited=waited, limit=limit, first=first,
                       give_up=waited >= limit)



@dataclass(frozen=True, slots=True)
class Reevaluation:
    """Score an epoch's weights again on ``workers``; the time already lost waiting for
    the failed round (``waited_s``) stays charged to the epoch."""

    workers: tuple[str, ...]
    waited_s: float


def evaluate_again(*, complete: bool, shard_failed: bool, last_queued: bool,
                   holders: tuple[str, ...], waited_s: float,
                   cancel_requested: bool = False) -> Reevaluation | None:
    """An epoch's evaluation is in. When it is incomplete because a shard failed, and it
    was the last evaluation queued (``last_queued``: no segment was sent behind it, so the
    holders still have the epoch's weights), the holders left score the set again, so no
    scores are lost. Otherwise (or with no holder left) the record goes without scores; so
    it does when a cancel is pending, which takes effect within one evaluation. How often
    a failing evaluation is run again is the
    :class:`~dynabatch.scheduler.core.failures.FailurePolicy`'s."""
    if complete or not shard_failed or not last_queued or not holders or cancel_requested:
        return None
    return Reevaluation(workers=holders, waited_s=waited_s)
