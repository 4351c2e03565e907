"""Decisions the synchronous driver takes at a step boundary when something is missing:
how long a job with too few workers waits (:func:`wait_for_minimum`), and whether an
evaluation that lost a shard is scored again (:func:`evaluate_again`). Pure: no clock, no
I/O (the driver passes its readings in).
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
    """Too few workers at this boundary (``since``: when that began, None if just now). A
    job that never formed a group may be queued behind others' workers, so it waits
    ``start_timeout_s``; a running one ``worker_wait_timeout_s``. Then it fails."""
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
    """An epoch's evaluation is in. When a shard failed and it was the last evaluation
    queued (the holders still have the epoch's weights), the holders left score the set
    again; otherwise, with no holder left or a cancel pending, the record goes without
    scores. (How often: :class:`~dynabatch.scheduler.core.failures.FailurePolicy`.)"""
    if complete or not shard_failed or not last_queued or not holders or cancel_requested:
        return None
    return Reevaluation(workers=holders, waited_s=waited_s)
