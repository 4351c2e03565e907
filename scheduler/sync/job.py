"""The synchronous job's pure machines, and where its training (re)starts.

:class:`SyncJob` holds the machines the driver's parts drive (membership, regime, policy,
tracker, ledger, and the protocol once the data is loaded) and where the protocol starts
(:class:`StartPoint`). How the parts share them, and what each owns, is in
``docs/architecture.md`` ("The step loop").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynabatch.scheduler.core.ledger import Ledger
from dynabatch.scheduler.core.membership import Membership
from dynabatch.scheduler.core.regime.regime import Regime
from dynabatch.scheduler.core.sync.protocol import Position, SyncProtocol
from dynabatch.scheduler.core.sync.tracker import Tracker
from dynabatch.scheduler.runtime.seam import DataInfo
from dynabatch.scheduler.sync.evaluation import split


@dataclass(frozen=True, slots=True)
class StartPoint:
    """Where the protocol (re)starts: a checkpoint's position and the global batch trained
    there (None: the regime's for that epoch), its weights until a regroup loads them
    into the group (one that fails must be able to load them again), and the rebalances
    its epoch made before that position (a checkpoint written inside an epoch)."""

    position: Position = field(default_factory=lambda: Position(0, 0))
    batch: int | None = None
    weights: dict[str, Any] | None = None
    rebalances: int = 0


@dataclass
class SyncJob:
    """A synchronous job's machines and where its training stands."""

    job_id: str
    membership: Membership
    regime: Regime  # the global batch, LR, ISGD and goodput of every step
    policy: Any
    tracker: Tracker = field(default_factory=Tracker)
    ledger: Ledger = field(default_factory=Ledger)
    protocol: SyncProtocol | None = None  # once the data is loaded
    data: DataInfo | None = None
    # Replaced whole: by a checkpoint restored, by the regroup that loads its weights.
    start: StartPoint = field(default_factory=StartPoint)

    @property
    def start_batch(self) -> int:
        """The global batch where the protocol (re)starts: the one trained there when it
        was restored from a checkpoint, else the regime's for its epoch."""
        return self.start.batch or self.regime.batch_for(self.start.position.epoch)

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
