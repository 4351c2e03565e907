"""The parameter-server protocol (Rudra: hardsync, n-softsync, async): which gradients are
applied, when, and with what weight.

Pure: no ray, no torch, no clock. Events in (:meth:`PSProtocol.pull`, :meth:`push`,
:meth:`join`, :meth:`leave`), decisions out (:class:`Apply`, :class:`Refuse`, :class:`Wait`).
The machine never sees a gradient: it decides on push ids, and the server that holds the
tensors does what the decisions say.

Notation (Gupta et al., ICDM 2016). λ learners; the server's timestamp ``i`` (the
``version``) counts the updates applied so far. A gradient computed on weights of version
``j`` has *staleness* ``τ = i − j`` when it is applied.

Modes:

* ``hardsync``: an update needs one gradient from every learner (and none still computing),
  and a learner that pushed waits for that update before it pulls again, so τ = 0 always and
  ``θ ← θ − α·Σ_l (b_l/Σb)·g_l``: SGD on the summed batch (g_l is learner l's mean gradient
  over its b_l samples, so the weights give the mean over all Σb samples).
* ``softsync`` with ``n``: an update after any ``c = ⌊λ/n⌋`` gradients (λ = the learners now
  in the job, so c follows joins and losses), ``θ ← θ − α0·Σ_l w_l·f(τ_l)·g_l`` with
  ``w_l = b_l/Σb`` over the c gradients (= 1/c for equal batches, Rudra's 1/c). Learners
  never wait for the update: 1-softsync waits for λ gradients, λ-softsync updates on every
  gradient.
* ``async``: c = 1 (λ-softsync; with f ≡ 1 it is Downpour / plain ASGD).

Staleness-dependent learning rate ``f(τ)`` (a factor on α0):

* ``none``: 1.
* ``per_gradient``: ``1/τ`` for τ > 0, 1 for τ = 0 (α0/τ).
* ``average``: ``1/max(1, ⟨τ⟩)``, ⟨τ⟩ the mean staleness of every gradient applied so far,
  this update's included (α0/⟨τ⟩, about α0/n for n-softsync).

A push may also carry ``lr_scale`` (Ji et al.'s optional ``b_i/b0``), multiplied in.

Bounded staleness ``S`` (``max_staleness``; None: unbounded):

* ``refuse``: a gradient with τ > S is refused on arrival (the version cannot move while a
  softsync update is gathering, so τ at arrival is τ at the update). The learner pulls again.
* ``wait``: the server defers an update while it would make an outstanding gradient
  (a learner's in-flight computation, or a queued gradient not in this update) staler than
  S; pushed gradients queue oldest-pull first and their learners wait (pull answers
  :class:`Wait`) until theirs is applied. When only queued gradients block (every
  outstanding learner has pushed, so waiting cannot help) those are refused. Deferred
  updates and refusals are both counted. Either way an applied gradient has τ ≤ S.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from dynabatch.scheduler.core.ps.machine import EventHandler

Mode = Literal["async", "softsync", "hardsync"]
LrRule = Literal["none", "per_gradient", "average"]
OnStale = Literal["refuse", "wait"]


@dataclass(frozen=True, slots=True)
class PSConfig:
    """The ``protocol:`` section's Rudra knobs, checked there (``ProtocolSpec``), not here."""

    mode: Mode = "async"
    n: int = 1  # softsync's n; ignored by async and hardsync
    lr_staleness: LrRule = "none"
    max_staleness: int | None = None
    on_stale: OnStale = "refuse"

    def gradients_per_update(self, learners: int) -> int:
        """c: gradients averaged into one update with ``learners`` learners."""
        lam = max(1, learners)
        if self.mode == "hardsync":
            return lam
        if self.mode == "async":
            return 1
        return max(1, lam // self.n)


# --- decisions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Applied:
    """One gradient of an update: ``weight`` multiplies its mean gradient (α0 is the
    optimizer's learning rate)."""

    push_id: int
    worker: str
    staleness: int
    samples: int
    weight: float


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply ``Σ weight·g`` as one optimizer step; the server's version becomes ``version``."""

    version: int
    gradients: tuple[Applied, ...]

    def dispatch(self, handler: EventHandler) -> None:
        handler.on_apply(self)


@dataclass(frozen=True, slots=True)
class Refuse:
    push_id: int
    worker: str
    staleness: int
    samples: int

    def dispatch(self, handler: EventHandler) -> None:
        handler.on_refuse(self)


@dataclass(frozen=True, slots=True)
class Wait:
    """The learner may not pull yet (hardsync, or its gradient is queued under ``wait``)."""

    worker: str


@dataclass(frozen=True, slots=True)
class Pulled:
    worker: str
    version: int


PushOutcome = Apply | Refuse


@dataclass(frozen=True, slots=True)
class _Queued:
    push_id: int
    worker: str
    version_pulled: int
    samples: int
    lr_scale: float
    seq: int  # arrival order, the tie-break


@dataclass(slots=True)
class WorkerStats:
    pushes: int = 0
    applied: int = 0
    refused: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    staleness_counts: dict[int, int] = field(default_factory=dict)  # τ → applied gradients

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / self.applied if self.applied else 0.0


class PSProtocol:
    def __init__(self, config: PSConfig):
        self.config = config
        self.version = 0
        self._members: set[str] = set()
        self._inflight: dict[str, int] = {}  # worker → version it pulled (computing now)
        self._queue: list[_Queued] = []
        self._waiting: set[str] = set()  # pushed; may not pull until the queue releases them
        self._seq = 0
        self.stats: dict[str, WorkerStats] = {}
        self.applied = 0
        self.refused = 0
        self.deferred = 0  # updates put off because of ``wait``
        self._tau_sum = 0

    # --- membership -------------------------------------------------------------------
    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def join(self, worker: str) -> None:
        if worker in self._members:
            raise ValueError(f"{worker} is already a member")
        self._members.add(worker)
        self.stats.setdefault(worker, WorkerStats())

    def leave(self, worker: str) -> list[PushOutcome]:
        """``worker`` is gone: its in-flight gradient will never come (the caller re-queues
        its samples). Its queued gradients stay: they reached the server. With one learner
        fewer an update may now be due, or a waiting one unblocked."""
        if worker not in self._members:
            raise ValueError(f"{worker} is not a member")
        self._members.discard(worker)
        self._inflight.pop(worker, None)
        self._waiting.discard(worker)
        return self._drain()

    # --- events -----------------------------------------------------------------------
    def pull(self, worker: str) -> Pulled | Wait:
        if worker not in self._members:
            raise ValueError(f"{worker} is not a member")
        if worker in self._inflight:
            raise ValueError(f"{worker} pulled twice without pushing")
        if worker in self._waiting:
            return Wait(worker)
        self._inflight[worker] = self.version
        return Pulled(worker, self.version)

    def push(self, worker: str, push_id: int, version_pulled: int, samples: int,
             lr_scale: float = 1.0) -> list[PushOutcome]:
        if worker not in self._members:
            raise ValueError(f"{worker} is not a member")
        if self._inflight.get(worker) != version_pulled:
            raise ValueError(f"{worker} pushes a gradient of version {version_pulled} "
                             f"but pulled {self._inflight.get(worker)}")
        if samples < 1:
            raise ValueError(f"a gradient needs at least one sample, got {samples}")
        del self._inflight[worker]
        st = self.stats[worker]
        st.pushes += 1
        tau = self.version - version_pulled
        cfg = self.config
        if cfg.on_stale == "refuse" and cfg.max_staleness is not None and tau > cfg.max_staleness:
            self.refused += 1
            st.refused += 1
            return [Refuse(push_id, worker, tau, samples), *self._drain()]
        self._seq += 1
        self._queue.append(_Queued(push_id, worker, version_pulled, samples, lr_scale, self._seq))
        if cfg.mode == "hardsync" or (cfg.on_stale == "wait" and cfg.max_staleness is not None):
            self._waiting.add(worker)
        return self._drain()

    # --- updates ----------------------------------------------------------------------
    def _drain(self) -> list[PushOutcome]:
        out: list[PushOutcome] = []
        while True:
            c = self.config.gradients_per_update(len(self._members))
            if len(self._queue) < c:
                return out
            if self.config.mode == "hardsync" and self._inflight:
                # After a loss c shrinks; a learner still computing on this version must be
                # in the update, or its gradient would arrive stale.
                return out
            if self.config.mode == "hardsync":
                # Every queued gradient was computed on this version: one update takes all.
                c = len(self._queue)
            if self.config.on_stale == "wait" and self.config.max_staleness is not None:
                self._queue.sort(key=lambda q: (q.version_pulled, q.seq))
                batch, rest = self._queue[:c], self._queue[c:]
                limit = self.version + 1 - self.config.max_staleness  # oldest pull allowed
                if any(v < limit for v in self._inflight.values()):
                    self.deferred += 1
                    return out
                stale = [q for q in rest if q.version_pulled < limit]
                for q in stale:
                    self._refuse(q, out)
                rest = [q for q in rest if q.version_pulled >= limit]
            else:
                batch, rest = self._queue[:c], self._queue[c:]
            self._queue = rest
            out.append(self._apply(batch))

    def flush(self) -> list[PushOutcome]:
        """Apply what is queued as one (partial) update: the end of an epoch, when no more
        gradients can arrive for it. Queued gradients have τ ≤ S (see :meth:`_drain`)."""
        if not self._queue:
            return []
        batch, self._queue = sorted(self._queue, key=lambda q: (q.version_pulled, q.seq)), []
        return [self._apply(batch)]

    def _refuse(self, q: _Queued, out: list[PushOutcome]) -> None:
        tau = self.version + 1 - q.version_pulled
        self.refused += 1
        self.stats[q.worker].refused += 1
        self._waiting.discard(q.worker)
        out.append(Refuse(q.push_id, q.worker, tau, q.samples))

    def _apply(self, batch: list[_Queued]) -> Apply:
        taus = [self.version - q.version_pulled for q in batch]
        self._tau_sum += sum(taus)
        total_applied = self.applied + len(batch)
        total = sum(q.samples for q in batch)
        rule = self.config.lr_staleness
        grads = []
        for q, tau in zip(batch, taus, strict=True):
            if rule == "per_gradient":
                f = 1.0 / tau if tau > 0 else 1.0
            elif rule == "average":
                f = 1.0 / max(1.0, self._tau_sum / total_applied)
            else:
                f = 1.0
            grads.append(Applied(q.push_id, q.worker, tau, q.samples,
                                 f * q.lr_scale * q.samples / total))
            st = self.stats[q.worker]
            st.applied += 1
            st.staleness_sum += tau
            st.staleness_max = max(st.staleness_max, tau)
            st.staleness_counts[tau] = st.staleness_counts.get(tau, 0) + 1
            self._waiting.discard(q.worker)
        self.applied = total_applied
        self.version += 1
        return Apply(self.version, tuple(grads))

    # --- views ------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def inflight(self) -> dict[str, int]:
        return dict(self._inflight)

    def waiting(self, worker: str) -> bool:
        return worker in self._waiting
