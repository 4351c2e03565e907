"""Evaluation off the critical path: the held-out set split across the state holders.

At an epoch's end the holders score contiguous shards of the held-out set in proportion to
their measured throughput (:func:`split`), each queued ahead of its next segment; the
shards' sums add up exactly to the whole set's (:func:`combine`), and a shard that never
arrives leaves the epoch without scores, never with scores of part of the set. Why and how
(exactness, what it costs the critical path): ``docs/architecture.md``, "Evaluation is off
the critical path".

Splits. Each epoch scores the judged split: ``dataset.validation``'s when the job has one,
else the test set. With a validation split the test set is scored by a round of its own,
queued right behind the epoch's validation round on the same holders (so it scores the same
weights) where :func:`due_for_test` says: the last epoch, every epoch when
``evaluation.test_every_epoch``, and the epoch an early stop ends the training after.

:func:`split`, :func:`combine` and :func:`due_for_test` are pure; :class:`Evaluations` is driver
bookkeeping over a runtime and a clock (``dynabatch.scheduler.runtime.seam``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.actors.workloads.metric_states import STATES, merge_states
from dynabatch.scheduler.runtime.seam import Clock, ShardResult


def split(n: int, weights: Mapping[str, float]) -> dict[str, tuple[int, int]]:
    """Contiguous shards ``[lo, hi)`` of ``range(n)``, one per worker in the mapping's
    order, sized in proportion to ``weights`` (largest remainder, so each size is within
    one of its exact share); a non-positive or non-finite weight counts as the mean of the
    others. Empty shards are left out."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    names = list(weights)
    if not names or n == 0:
        return {}
    good = [w for w in weights.values() if w > 0 and w != float("inf")]
    fill = sum(good) / len(good) if good else 1.0
    w = [x if x > 0 and x != float("inf") else fill for x in weights.values()]
    total = sum(w)
    exact = [n * x / total for x in w]
    sizes = [int(e) for e in exact]
    order = sorted(range(len(names)), key=lambda i: (sizes[i] - exact[i], i))
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    out: dict[str, tuple[int, int]] = {}
    lo = 0
    for name, size in zip(names, sizes, strict=True):
        if size:
            out[name] = (lo, lo + size)
        lo += size
    return out


def combine(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The sums of the union of disjoint shards: each key added up; the stateful metrics'
    states (``metrics.STATES``) gathered for ``finish_evaluation`` to merge."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if k == STATES:
                out[k] = merge_states([out.get(k, {}), v])
            else:
                out[k] = out.get(k, 0.0) + float(v)
    return out


def due_for_test(*, validation: bool, every_epoch: bool, last: bool, stopped: bool) -> bool:
    """Whether an epoch's weights are scored on the test set in a round of their own: only
    in a job with a validation split (without one, the test set is the judged split, scored
    every epoch), after the last epoch, after the epoch an early stop ends the training
    with, or every epoch when asked."""
    return validation and (every_epoch or last or stopped)


@dataclass
class EvalRound:
    """One evaluation of the weights at the end of ``epoch``, split over ``shards``.

    ``record`` and ``extra`` are what the coordinator publishes once every shard answered:
    the epoch's record without its scores, and what it needs to finish it."""

    epoch: int
    shards: dict[str, tuple[int, int]]
    ticket: Any
    submitted: float
    deadline: float
    results: dict[str, ShardResult] = field(default_factory=dict)
    record: Any = None
    extra: Any = None
    waited_s: float = 0.0  # the coordinator's time blocked on it (at the job's end, say)
    split: str = "test"  # the held-out split it scores (test, validation)

    @property
    def attached(self) -> bool:
        return self.record is not None

    @property
    def done(self) -> bool:
        return all(w in self.results for w in self.shards)

    @property
    def failures(self) -> dict[str, ShardResult]:
        return {w: r for w, r in self.results.items() if r.sums is None}

    @property
    def complete(self) -> bool:
        """Every test sample was scored (the shards' counts add up to the set)."""
        want = sum(hi - lo for lo, hi in self.shards.values())
        got = sum(r.sums.get("n", 0.0) for r in self.results.values() if r.sums is not None)
        return self.done and bool(self.shards) and round(got) == want

    def sums(self) -> dict[str, float] | None:
        if not self.complete:
            return None
        return combine(r.sums for r in self.results.values() if r.sums is not None)

    @property
    def critical_s(self) -> float:
        """What it cost the critical path: the slowest shard, or the coordinator's wait."""
        slowest = max((r.seconds for r in self.results.values()), default=0.0)
        return max(slowest, self.waited_s)

    @property
    def hidden_s(self) -> float:
        """Evaluation work the split took off the critical path: Σ shards − the slowest."""
        work = sum(r.seconds for r in self.results.values())
        slowest = max((r.seconds for r in self.results.values()), default=0.0)
        return max(0.0, work - slowest)


class Evaluations:
    """The evaluations in flight, oldest first (epochs end in order, and so do they).

    ``runtime`` implements ``submit_evaluation``, ``poll_evaluation`` and
    ``finish_evaluation`` (see :class:`dynabatch.scheduler.runtime.seam.Runtime`). Every
    round has a deadline ``timeout_s`` after it was sent: a shard not in by then is
    counted as failed (not lost: the worker may only be slow)."""

    def __init__(self, runtime: Any, clock: Clock, timeout_s: float):
        self.runtime = runtime
        self.clock = clock
        self.timeout_s = timeout_s
        self.rounds: list[EvalRound] = []
        # The judged split each epoch scores (validation, when the data has one), the
        # held-out splits' sizes, and which epochs' weights are also scored on the test set
        # (due_for_test).
        self.split = "test"
        self.n_validation = self.n_test = 0
        self.test_after: Callable[[int], bool] | None = None  # None: never
        # The round queued for the next segment sent (its workers score first: the
        # segment's time is not charged with it). A regroup drops it: it ran before.
        self.behind: EvalRound | None = None

    def loaded(self, n_validation: int, n_test: int, test_after: Callable[[int], bool]
               ) -> None:
        """The data's held-out splits: each epoch is judged on the validation split when the
        data has one, and the test set then scores the weights of the epochs ``test_after``
        names; else each is judged on the test set."""
        self.n_validation, self.n_test = n_validation, n_test
        if n_validation:
            self.split, self.test_after = "validation", test_after

    def shards(self, workers: list[str], speeds: Mapping[str, float], which: str | None = None
               ) -> dict[str, tuple[int, int]]:
        """The held-out split ``which`` (default: the judged one) over ``workers``, in
        proportion to their measured throughput (``speeds``: the tracker's)."""
        n = self.n_test if (which or self.split) == "test" else self.n_validation
        return split(n, {w: speeds.get(w, 0.0) for w in workers})

    def submit(self, epoch: int, shards: dict[str, tuple[int, int]],
               split: str | None = None, *, behind: bool = False, **given: Any) -> EvalRound:
        """Queue a round of ``split`` (default: the judged split, followed by a test round
        on the same holders, split in proportion to their shares, when :attr:`test_after`
        says so for ``epoch``). ``behind``: the one queued for the next segment
        (:attr:`behind`). ``given``: the record it is published into when it already has
        one (a test round after an early stop, a round scored again) and ``waited_s``,
        what an earlier try cost the critical path."""
        which = split or self.split
        now = self.clock.now()
        ticket = None
        if shards:  # a runtime with no validation split need not know about splits
            ticket = (self.runtime.submit_evaluation(shards) if which == "test"
                      else self.runtime.submit_evaluation(shards, split=which))
        r = EvalRound(epoch, dict(shards), ticket, now, now + self.timeout_s, split=which,
                      **given)
        self.rounds.append(r)
        if behind:
            self.behind = r
        if split is None and which != "test" and self.test_after is not None \
                and self.test_after(epoch):
            self.submit(epoch, self.shards(list(shards), {w: hi - lo for w, (lo, hi)
                                                          in shards.items()}, "test"), "test")
        return r

    def take_behind(self) -> EvalRound | None:
        """The round queued for the segment being sent now (or that a regroup ran), which
        no longer waits."""
        r, self.behind = self.behind, None
        return r

    def unattached(self, epoch: int) -> EvalRound | None:
        """The round sent ahead for ``epoch``'s end, before its last segment was in."""
        return next((r for r in self.rounds if r.epoch == epoch and not r.attached), None)

    def attach(self, epoch: int, record: Any, extra: Any) -> None:
        """Give ``epoch``'s rounds not yet attached (its judged round and the test round
        behind it) the epoch's record, to publish it with once they are in."""
        for r in self.rounds:
            if r.epoch == epoch and not r.attached:
                r.record, r.extra = record, extra

    def discard(self, epoch: int) -> None:
        """Drop a round sent ahead for ``epoch``'s end: the segment before it failed, so it
        scores weights that are not the epoch's (the epoch ends later, and is scored then)."""
        self.rounds = [r for r in self.rounds if r.attached or r.epoch != epoch]

    def poll(self, timeout_s: float = 0.0) -> None:
        """Take in what arrived; waits up to ``timeout_s`` for the oldest open round."""
        now = self.clock.now()
        for r in self.rounds:
            if r.done:
                continue
            for res in self.runtime.poll_evaluation(r.ticket, timeout_s):
                r.results.setdefault(res.worker, res)
            timeout_s = 0.0
            if not r.done and now >= r.deadline:
                for w in r.shards:
                    r.results.setdefault(w, ShardResult(
                        w, error=f"evaluation timed out after {self.timeout_s:g}s"))

    def ready(self) -> list[EvalRound]:
        """Rounds to publish, in epoch order: attached to their epoch and done."""
        out = []
        while self.rounds and self.rounds[0].attached and self.rounds[0].done:
            out.append(self.rounds.pop(0))
        return out

    def settle(self) -> list[EvalRound]:
        """Wait (each round up to its deadline) until every attached round is done; then
        :meth:`ready`. The wait is charged to the rounds it waited for."""
        while True:
            open_ = [r for r in self.rounds if r.attached and not r.done]
            if not open_:
                return self.ready()
            t0 = self.clock.now()
            self.poll(timeout_s=min(0.5, max(0.0, open_[0].deadline - t0)))
            if self.clock.now() == t0 and not open_[0].done and t0 < open_[0].deadline:
                self.clock.sleep(min(0.05, open_[0].deadline - t0))  # nothing came: wait
            waited = self.clock.now() - t0
            for r in open_:
                r.waited_s += waited

    def close(self, why: str) -> list[EvalRound]:
        """The job ends: shards not in yet are counted as failed (``why``). Returns the
        rounds attached to their epochs, in order; the others are dropped."""
        out = [r for r in self.rounds if r.attached]
        for r in out:
            for w in r.shards:
                r.results.setdefault(w, ShardResult(w, error=why))
        self.rounds, self.behind = [], None
        return out

    @property
    def busy(self) -> bool:
        return any(r.attached for r in self.rounds)
