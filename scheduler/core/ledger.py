"""The ledger: which samples each epoch trained, rebuilt from what the workers reported.

Pure: numpy only. A step is committed when a worker holding the surviving state reports it
complete. :meth:`Ledger.verify` rebuilds the per-sample count over ``[0, N)`` from the
committed steps' all-reduced coverage (:mod:`dynabatch.actors.contracts`) and checks that
every sample was trained exactly once and that each worker's positions lie inside its step's
coverage; samples of an attempt that is retried are counted apart as ``retried``. It never
trusts the plan: a step committed twice, a position missing or counted twice, or reports of
one step that disagree are problems, and the coordinator fails the job with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from dynabatch.actors.contracts import Coverage, StepTelemetry, decode_counts


@dataclass(frozen=True, slots=True)
class StepEntry:
    """A committed step: its positions, its all-reduced coverage and who reported what."""

    step: int
    start: int
    size: int
    coverage: Coverage
    shares: tuple[tuple[str, int, int], ...]  # (worker, first position, samples)


@dataclass(frozen=True, slots=True)
class Verification:
    epoch: int
    dataset_size: int
    samples_trained: int  # Σ coverage counts over committed steps: what the collectives saw
    retried_samples: int
    verified: bool
    problems: tuple[str, ...] = ()
    samples_by_worker: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_counts(cls, epoch: int | None, counts: np.ndarray, retried: int,
                    problems: list[str], by_worker: dict[str, int]) -> Verification:
        """The verdict on an epoch from its per-sample counts over [0, N) (each must be
        exactly 1) and the problems found on the way; both ledgers end this way."""
        problems = [*problems, *_count_problems(counts)]
        return cls(
            epoch=-1 if epoch is None else epoch,
            dataset_size=len(counts),
            samples_trained=int(counts.sum()),
            retried_samples=retried,
            verified=not problems,
            problems=tuple(problems),
            samples_by_worker=by_worker,
        )

    @property
    def reason(self) -> str:
        return "; ".join(self.problems[:5]) + (
            f" (+{len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        )


class Ledger:
    """Committed steps of the current epoch. ``begin_epoch`` starts a new one."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.dataset_size = 0
        self._steps: dict[int, StepEntry] = {}
        self._retried = 0
        # Every epoch's, since the job started: the job's total (a checkpoint keeps it).
        self.retried_total = 0
        self._problems: list[str] = []

    def begin_epoch(self, epoch: int, dataset_size: int) -> None:
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be non-negative, got {dataset_size}")
        self.epoch = epoch
        self.dataset_size = dataset_size
        self._steps = {}
        self._retried = 0
        self._problems = []

    def commit(self, reports: Sequence[StepTelemetry]) -> None:
        """Record one step from the reports of the workers that completed it."""
        if not reports:
            raise ValueError("a step needs at least one report")
        first = reports[0]
        if first.epoch != self.epoch:
            raise ValueError(f"report for epoch {first.epoch}, ledger is on epoch {self.epoch}")
        for r in reports[1:]:
            same = (r.epoch, r.step, r.step_start, r.step_size, r.coverage) == (
                first.epoch, first.step, first.step_start, first.step_size, first.coverage)
            if not same:
                self._problems.append(
                    f"step {first.step}: workers {first.worker} and {r.worker} report "
                    "different coverage for the same all-reduce"
                )
        if first.step in self._steps:
            self._problems.append(f"step {first.step} was committed twice")
            return
        self._steps[first.step] = StepEntry(
            step=first.step,
            start=first.step_start,
            size=first.step_size,
            coverage=first.coverage,
            shares=tuple((r.worker, r.start, r.samples) for r in reports),
        )

    def retry(self, samples: int) -> None:
        """Samples computed in an attempt that was not committed (the step is retried)."""
        self._retried += samples
        self.retried_total += samples

    def verify(self) -> Verification:
        n = self.dataset_size
        counts = np.zeros(n, dtype=np.int64)
        problems = list(self._problems)
        by_worker: dict[str, int] = {}
        for e in sorted(self._steps.values(), key=lambda e: e.step):
            cov = decode_counts(e.coverage)
            if cov.size != e.size or e.start < 0 or e.start + e.size > n:
                problems.append(
                    f"step {e.step}: coverage of {cov.size} positions for a step of {e.size} "
                    f"at [{e.start}, {e.start + e.size}) in an epoch of {n}"
                )
                continue
            counts[e.start:e.start + e.size] += cov
            for worker, start, samples in e.shares:
                by_worker[worker] = by_worker.get(worker, 0) + samples
                lo = start - e.start
                inside = lo >= 0 and lo + samples <= e.size
                if samples and (not inside or (cov[lo:lo + samples] < 1).any()):
                    problems.append(
                        f"step {e.step}: {worker} reports positions [{start}, {start + samples}) "
                        "that the step's all-reduce did not contain"
                    )
        return Verification.from_counts(self.epoch, counts, self._retried, problems, by_worker)

    # --- checkpoints: plain data, loadable with torch.load(weights_only=True) ---------
    def to_state(self) -> dict:
        return {
            "epoch": self.epoch,
            "dataset_size": self.dataset_size,
            "retried": self._retried,
            "retried_total": self.retried_total,
            "steps": [
                [e.step, e.start, e.size, [list(c) for c in e.coverage],
                 [list(s) for s in e.shares]]
                for e in self._steps.values()
            ],
        }

    def load_state(self, state: dict, retried_total: int | None = None) -> None:
        """Become the ledger ``state`` holds (:meth:`to_state`); ``retried_total``: the
        job's, where the state does not hold it."""
        Ledger.__init__(self)  # what was there before goes
        if state.get("epoch") is None:
            return
        self.begin_epoch(state["epoch"], state["dataset_size"])
        self._retried = state["retried"]
        self.retried_total = state.get("retried_total", retried_total or self._retried)
        for step, start, size, cov, shares in state["steps"]:
            self._steps[step] = StepEntry(
                step, start, size, tuple((int(c), int(n)) for c, n in cov),
                tuple((str(w), int(s), int(k)) for w, s, k in shares),
            )


def _count_problems(counts: np.ndarray) -> list[str]:
    """Describe the positions not trained exactly once, as a few ranges."""
    out = []
    for label, mask in (("never trained", counts == 0), ("trained more than once", counts > 1)):
        idx = np.flatnonzero(mask)
        if idx.size:
            out.append(f"{idx.size} samples {label} (positions {_ranges(idx)})")
    return out


def _ranges(idx: np.ndarray, most: int = 3) -> str:
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(idx, breaks)]
    text = ", ".join(f"[{a}, {b})" for a, b in runs[:most])
    return text + (", ..." if len(runs) > most else "")
