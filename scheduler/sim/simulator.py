"""The simulator: the engine's own machines on a virtual clock.

:func:`simulate` builds the production :class:`~dynabatch.scheduler.sync.coordinator.Coordinator`
(so the
same :class:`~dynabatch.scheduler.core.sync.protocol.SyncProtocol`, policy, tracker, ledger,
membership and
failure classes, and the same driver code) over a :class:`SimRuntime` instead of Ray. The
runtime is the world: it answers the coordinator's calls from a
:class:`~dynabatch.scheduler.sim.cluster.ClusterModel` and moves the :class:`SimClock` by the time
each call would take. Nothing of the engine is copied here; a claim measured in the simulator
is a claim about the shipped code.

What each call costs (formulas in :mod:`dynabatch.scheduler.sim.cluster`):

* ``run_segment``: step by step, ``max_i t_i(b_i) + t_ar(n, m)``; each worker reports what a
  real worker reports (its order positions, its compute and wait, the step's coverage as the
  all-reduce would sum it). With ISGD, every step also all-reduces its loss, and each
  extra iteration is one more pass (every share's compute again and the all-reduces); the
  step's ``compute_s`` stays its own pass, as on Ray. A node that fails during a step takes
  the step down: the worker on it is lost, its peers answer with a peer error once they
  finished computing and the failure was detected (``detect_s`` after it). A worker
  computing past the collective timeout makes its peers time out (a straggler); the job
  spec's injected errors raise in compute.
* ``regroup``: ``regroup_s`` plus the state broadcast; a member whose node died fails it.
* ``spawn``/``poll_started``: a worker is up ``start_s`` after it was spawned.
* ``submit_evaluation``/``fetch_state``: free. Each holder's shard of the held-out set is
  scored at once (with real gradients, on the one model replica, which every holder's
  weights equal); a holder whose node died loses its shard, and the epoch its scores, as on
  Ray. Timing-only runs have no model: evaluation gives no loss and no accuracy (None), and
  the training loss of their records is 0.

Cluster events (failures, joins, slowdowns) happen at their simulated time, or when the job
reaches their (epoch, step). The job spec's ``emulation`` (slowdowns, disturbances, injected
errors) applies per worker ordinal, as on Ray, on top of the cluster's own speeds. The
simulator writes no checkpoints (the spec's ``checkpoint`` is dropped): a job that loses
every holder of its state fails, as a job without checkpoints does.

This module imports neither ray nor torch; the coordinator (whose checkpoint module imports
torch) is imported when :func:`simulate` runs, and real-gradient mode imports
:mod:`dynabatch.scheduler.sim.gradients` (torch) only when asked for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from dynabatch.actors.contracts import (
    Coverage,
    SegmentPlan,
    SegmentResult,
    StepPlan,
    StepTelemetry,
    encode_counts,
)
from dynabatch.actors.emulation import error_at, slowdown_at
from dynabatch.actors.spec import CheckpointSpec, JobSpec
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.membership import NodeInfo, Spawn
from dynabatch.scheduler.runtime.seam import (
    DataInfo,
    RegroupResult,
    ShardResult,
    Started,
    WorkerCallError,
)
from dynabatch.scheduler.sim.cluster import (
    ClusterError,
    ClusterModel,
    ClusterSpec,
    Event,
    Ideal,
    Node,
    NodeSelector,
    check_job,
    compute_time,
    jitter,
)

if TYPE_CHECKING:
    from dynabatch.scheduler.sim.gradients import GradientEngine
    from dynabatch.scheduler.sync.coordinator import Coordinator
    from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine, MembershipEvent

# The service caps a job at dynabatch.actors.spec.MAX_WORKERS (4096) workers, and the coordinator
# builds its Membership with that cap. It is a limit of the service, not of the engine's
# machines, so simulated clusters beyond it lift it (see _lift_worker_cap).
SIM_MAX_WORKERS = 1_000_000

_Steps = dict[str, list[StepTelemetry]]  # per worker, the steps it completed in a segment

LOST = "died: worker process died or node lost (simulated node failure)"
PEER_LOST = "DistBackendError: connection closed by peer (simulated: a peer's node failed)"
PEER_TIMEOUT = "DistBackendError: collective timed out (simulated)"
PEER_LEFT = "DistBackendError: a peer left the group after its own error (simulated)"


class SimClock:
    """Virtual time: ``now()`` advances only when the runtime (or a waiting driver) says."""

    def __init__(self, start_time: float | None = None) -> None:
        self.t = 0.0
        self.start_time = time.time() if start_time is None else start_time

    def now(self) -> float:
        return self.t

    def time(self) -> float:
        return self.start_time + self.t

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclass
class _SimWorker:
    worker_id: str
    ordinal: int
    node: Node
    ready_at: float


@dataclass(frozen=True)
class ClusterHappening:
    """A cluster event as it happened: when, what, and to which nodes."""

    time: float
    kind: str
    nodes: tuple[str, ...]
    detail: str = ""


@dataclass(frozen=True)
class Recovery:
    """A step failed at ``failed_at`` (simulated seconds) because ``lost`` went; training
    went on with the first step that completed after it, started at ``resumed_at``."""

    failed_at: float
    lost: tuple[str, ...]
    resumed_at: float

    @property
    def seconds(self) -> float:
        return self.resumed_at - self.failed_at


class SimRuntime:
    """A :class:`~dynabatch.scheduler.runtime.seam.Runtime` on a virtual clock (see the module
    docstring)."""

    def __init__(self, spec: JobSpec, cluster: ClusterModel, *, clock: SimClock,
                 data: DataInfo, gradients: GradientEngine | None = None):
        self.spec = spec
        self.cluster = cluster
        self.clock = clock
        self.data = data
        self.gradients = gradients
        self.workers: dict[str, _SimWorker] = {}
        self.ordinals: dict[str, int] = {}  # every worker ever spawned (kept after a kill)
        self._starting: dict[str, _SimWorker] = {}
        self._nodes = {n.node_id: n for n in cluster.nodes}
        self._died_at: dict[str, float] = {}
        self._hosted: dict[str, int] = {}  # node id -> workers on it
        self._timed = sorted((e for e in cluster.spec.events if e.at_s is not None),
                             key=lambda e: e.at_s)
        self._stepped = sorted((e for e in cluster.spec.events if e.epoch is not None),
                               key=lambda e: (e.epoch, e.step))
        self._node_infos: list[NodeInfo] | None = None
        self._version = 0  # bumped when a node's speed or life changes
        self.happened: list[ClusterHappening] = []
        self.recoveries: list[Recovery] = []
        self._failed: tuple[float, tuple[str, ...]] | None = None
        self.steps_completed = 0
        self.segment_calls = 0
        # The all-reduce moves the cluster's model_mb, or the real model's gradients when the
        # cluster gave no size and real-gradient mode knows it.
        self._model_bytes: float | None = None
        if cluster.spec.allreduce.model_mb == 0 and gradients is not None:
            self._model_bytes = float(gradients.model_bytes)

    # --- the cluster's events -------------------------------------------------------------
    def _advance(self, t: float, watch: Sequence[str] = ()) -> float | None:
        """Fire the timed events due by ``t``. With ``watch``, stop after the first event that
        takes one of those workers' nodes down, and return its time."""
        while self._timed and self._timed[0].at_s <= t:
            e = self._timed.pop(0)
            self._fire(e, e.at_s)
            if watch and any(self._dead(w) for w in watch):
                return e.at_s
        return None

    def _fire_step_events(self, epoch: int, step: int, t: float) -> None:
        while self._stepped and (self._stepped[0].epoch, self._stepped[0].step) <= (epoch, step):
            self._fire(self._stepped.pop(0), t)

    def _fire(self, e: Event, t: float) -> None:
        if e.kind == "join":
            added = [self.cluster.add_node(e.join.node_class) for _ in range(e.join.count)]
            for n in added:
                self._nodes[n.node_id] = n
            self._record(t, "join", added)
        elif e.kind == "slowdown":
            s = e.slowdown
            pool = self.cluster.by_class[s.node_class]
            nodes = pool if s.index is None else pool[s.index:s.index + 1]
            for n in nodes:
                n.factor = s.factor
            self._record(t, "slowdown", nodes, f"x{s.factor:g}")
        else:
            victims = self._victims(e.selector)
            for n in victims:
                n.alive = False
                self._died_at[n.node_id] = t
            self._record(t, "fail", victims)
        self._node_infos = None
        self._version += 1

    def _victims(self, sel: NodeSelector) -> list[Node]:
        """The nodes a failure takes: the selected one, else the class's (or the cluster's)
        alive nodes that host a worker, latest first, then idle ones."""
        if sel.node_class is not None and sel.index is not None:
            pool = self.cluster.by_class[sel.node_class][sel.index:sel.index + 1]
        else:
            pool = (self.cluster.by_class[sel.node_class] if sel.node_class is not None
                    else self.cluster.nodes)
        alive = [n for n in reversed(pool) if n.alive]
        busy = [n for n in alive if self._hosted.get(n.node_id)]
        idle = [n for n in alive if not self._hosted.get(n.node_id)]
        return (busy + idle)[:sel.count]

    def _record(self, t: float, kind: str, nodes: Sequence[Node], detail: str = "") -> None:
        self.happened.append(ClusterHappening(t, kind, tuple(n.node_id for n in nodes), detail))

    def _dead(self, worker: str) -> bool:
        w = self.workers.get(worker)
        return w is None or not w.node.alive

    def _death_time(self, worker: str) -> float:
        w = self.workers.get(worker)
        return self._died_at.get(w.node.node_id, self.clock.now()) if w else self.clock.now()

    # --- Runtime: data and workers ----------------------------------------------------------
    def load_data(self) -> DataInfo:
        return self.data

    def nodes(self) -> list[NodeInfo]:
        self._advance(self.clock.now())
        if self._node_infos is None:
            self._node_infos = [NodeInfo(n.node_id, cpus=n.cpus, gpus=n.gpus)
                                for n in self.cluster.nodes if n.alive]
        return self._node_infos

    def spawn(self, spawn: Spawn) -> None:
        node = self._nodes[spawn.node_id]
        w = _SimWorker(spawn.worker_id, spawn.ordinal, node,
                       self.clock.now() + self.cluster.spec.recovery.start_s)
        self._starting[spawn.worker_id] = w
        self.ordinals[spawn.worker_id] = spawn.ordinal
        self._hosted[node.node_id] = self._hosted.get(node.node_id, 0) + 1

    def poll_started(self, timeout_s: float) -> list[Started]:
        now = self.clock.now()
        self._advance(now)
        if not self._starting:
            return []
        first = min(w.ready_at for w in self._starting.values())
        if first > now:
            self._advance(min(first, now + timeout_s))
            self.clock.advance_to(min(first, now + timeout_s))
        out = []
        for wid, w in list(self._starting.items()):
            if w.ready_at > self.clock.now():
                continue
            del self._starting[wid]
            if not w.node.alive:
                self._unhost(w)
                out.append(Started(wid, "node lost while the worker started (simulated)"))
                continue
            self.workers[wid] = w
            out.append(Started(wid))
        return out

    def _unhost(self, w: _SimWorker) -> None:
        self._hosted[w.node.node_id] = max(0, self._hosted.get(w.node.node_id, 0) - 1)

    def kill(self, worker: str) -> None:
        w = self.workers.pop(worker, None) or self._starting.pop(worker, None)
        if w is not None:
            self._unhost(w)

    # --- Runtime: training --------------------------------------------------------------------
    def run_segment(self, plans: dict[str, SegmentPlan], grace_s: float) -> list[WorkerOutcome]:
        self.segment_calls += 1
        names = list(plans)
        first = plans[names[0]]
        n = len(names)
        steps: _Steps = {w: [] for w in names}
        rng = self.cluster.rng
        sigma = self.cluster.spec.noise_sigma
        timeout = self.spec.collective_timeout_s
        arrays_version = -1
        a = c = factor = np.zeros(n)
        isgd = first.isgd  # ISGD's chart, kept up to date step by step as the workers do
        for j in range(len(first.steps)):
            t0 = self.clock.now()
            step = first.steps[j].step
            self._advance(t0)
            self._fire_step_events(first.epoch, step, t0)
            if any(w not in self.workers for w in names):  # killed under the plan
                return self._lost(names, steps, np.zeros(n), t0)
            if arrays_version != self._version:
                nodes = [self.workers[w].node for w in names]
                a = np.fromiter((x.a_s for x in nodes), np.float64, n)
                c = np.fromiter((x.c_s for x in nodes), np.float64, n)
                factor = np.fromiter((x.factor for x in nodes), np.float64, n)
                arrays_version = self._version
            sps = [plans[w].steps[j] for w in names]
            b = np.fromiter((sp.own_size for sp in sps), np.int64, n)
            # A worker reports only its emulated slowdown, as on Ray: a node that is slow (or
            # slows down) does not know it.
            emu = self._emulated(names, first.epoch, step) if self.spec.emulated else np.ones(n)
            compute = compute_time(a, c, b, factor * emu, jitter(rng, sigma, n))
            size = sps[0].size
            end = t0 + float(compute.max()) + self.cluster.allreduce_s(n, size, self._model_bytes)
            # Events during the step happen at their time; one that takes a participant's
            # node down ends the step there (later events wait for their own time).
            self._advance(end, watch=names)
            if any(self._dead(w) for w in names):
                return self._lost(names, steps, compute, t0)
            erred = self._erring(names, first.epoch, step)
            if erred:
                return self._compute_error(names, steps, erred, compute, t0)
            enter = t0 + compute
            first_in = float(enter.min())
            if float(enter.max()) - first_in > timeout:
                return self._timed_out(names, steps, compute, enter, first_in + timeout, grace_s)
            self.clock.advance_to(end)
            if self._failed is not None:
                t_fail, lost = self._failed
                self.recoveries.append(Recovery(t_fail, lost, t0))
                self._failed = None
            wait = (end - t0) - compute  # the all-reduce, including the wait for the slowest
            coverage = _coverage(sps, b, size)
            charting = isgd is not None
            rule = isgd.rule() if charting else None
            out = (self.gradients.step(first.seed, first.epoch, first.dataset_size, sps, rule)
                   if self.gradients is not None else None)
            losses = out.losses if out is not None else None
            if isgd is not None:
                # ISGD, as on the workers: the batch loss is all-reduced every step (one
                # float), and each extra iteration is one more pass over every share (the
                # compute again) with its all-reduce and its loss's. The step's compute_s
                # stays its own pass (what the policy plans with); the clock pays them all.
                loss_ar = self.cluster.allreduce_s(n, 0, 8.0)
                extra = out.extra_iters if out is not None else 0
                wait = wait + loss_ar
                end += loss_ar + extra * (end - t0 + loss_ar)
                self.clock.advance_to(end)
                isgd = isgd.after(out.psi if out is not None else 0.0)
            slow, comp, waits = emu.tolist(), compute.tolist(), wait.tolist()
            for i, (w, sp) in enumerate(zip(names, sps, strict=True)):
                steps[w].append(StepTelemetry(
                    worker=w, epoch=first.epoch, step=sp.step, batch=sp.own_size,
                    samples=sp.own_size, compute_s=comp[i], wait_s=waits[i],
                    loss_sum=losses[i] if losses is not None else 0.0, slowdown=slow[i],
                    start=sp.own_start, step_start=sp.start, step_size=sp.size,
                    coverage=coverage,
                    flagged=out.flagged if out is not None else False,
                    extra_iters=out.extra_iters if out is not None else 0,
                    isgd_loss=out.psi if out is not None and charting else None,
                    local_sqnorm=out.local_sqnorms[i] if out and out.local_sqnorms else None,
                    global_sqnorm=out.global_sqnorm if out is not None else None))
            self.steps_completed += 1
        return [WorkerOutcome(w, result=SegmentResult(worker=w, steps=steps[w])) for w in names]

    def _emulated(self, names: Sequence[str], epoch: int, step: int) -> np.ndarray:
        em = self.spec.emulation
        return np.array([slowdown_at(em, self.workers[w].ordinal, epoch, step) for w in names])

    def _erring(self, names: Sequence[str], epoch: int, step: int) -> list[str]:
        em = self.spec.emulation
        if not em.errors:
            return []
        return [w for w in names if error_at(em, self.workers[w].ordinal, epoch, step)]

    def _lost(self, names: list[str], steps: _Steps, compute: np.ndarray,
              t0: float) -> list[WorkerOutcome]:
        """Nodes failed before or during this step: it fails for everyone. The survivors
        answer once they finished computing and the failure was detected."""
        lost = [w for w in names if self._dead(w)]
        t_fail = min(self._death_time(w) for w in lost)
        detect = self.cluster.spec.recovery.detect_s
        survivors = [i for i, w in enumerate(names) if w not in lost]
        done = max((t0 + float(compute[i]) for i in survivors), default=t0)
        self.clock.advance_to(max(done, t_fail + detect))
        if self._failed is None:
            self._failed = (t_fail, tuple(lost))
        out = []
        for i, w in enumerate(names):
            if w in lost:
                out.append(WorkerOutcome(w, lost=LOST))
            else:
                out.append(WorkerOutcome(w, result=SegmentResult(
                    worker=w, steps=steps[w], error=PEER_LOST, error_kind="peer",
                    failed_compute_s=float(compute[i]))))
        return out

    def _compute_error(self, names: list[str], steps: _Steps, erred: list[str],
                       compute: np.ndarray, t0: float) -> list[WorkerOutcome]:
        """An injected error raises at the start of compute; the worker leaves the group, so
        its peers' collective fails as soon as they reach it."""
        self.clock.advance_to(t0 + float(compute.max()))
        out = []
        for i, w in enumerate(names):
            if w in erred:
                ordinal = self.workers[w].ordinal
                res = SegmentResult(worker=w, steps=steps[w], error_kind="compute",
                                    error=f"InjectedFault: injected error (worker {ordinal})",
                                    failed_compute_s=0.0)
            else:
                res = SegmentResult(worker=w, steps=steps[w], error=PEER_LEFT,
                                    error_kind="peer", failed_compute_s=float(compute[i]))
            out.append(WorkerOutcome(w, result=res))
        return out

    def _timed_out(self, names: list[str], steps: _Steps, compute: np.ndarray,
                   enter: np.ndarray, t_fail: float, grace_s: float) -> list[WorkerOutcome]:
        """The first worker into the all-reduce timed out waiting for one still computing;
        the others fail with it. One computing past ``grace_s`` after that is hung."""
        deadline = t_fail + grace_s
        self.clock.advance_to(min(float(enter.max()), deadline))
        if self._failed is None:
            self._failed = (t_fail, tuple(w for i, w in enumerate(names) if enter[i] > t_fail))
        out = []
        for i, w in enumerate(names):
            if enter[i] > deadline:
                out.append(WorkerOutcome(w, lost="hung: no answer after its peers failed"))
            else:
                out.append(WorkerOutcome(w, result=SegmentResult(
                    worker=w, steps=steps[w], error=PEER_TIMEOUT, error_kind="peer",
                    failed_compute_s=float(compute[i]))))
        return out

    def regroup(self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
                timeout_s: float) -> RegroupResult:
        t0 = self.clock.now()
        self._advance(t0)
        rec = self.cluster.spec.recovery
        end = t0 + rec.regroup_s + self.cluster.broadcast_s()
        hit = self._advance(end, watch=members)
        lost = {w: "lost while joining the group: died (simulated node failure)"
                for w in members if self._dead(w)}
        if lost:
            t_fail = hit if hit is not None else min(self._death_time(w) for w in lost)
            self.clock.advance_to(max(t0, t_fail + rec.detect_s))
            others = [w for w in members if w not in lost]
            return RegroupResult(lost, "; ".join(f"{w}: rendezvous timed out" for w in others)
                                 or None)
        self.clock.advance_to(end)
        if state is not None and self.gradients is not None:
            self.gradients.load_state(state)
        return RegroupResult({})

    def submit_evaluation(self, shards: dict[str, tuple[int, int]]) -> list[ShardResult]:
        self._advance(self.clock.now())
        out = []
        for w, (lo, hi) in shards.items():
            if self._dead(w):
                out.append(ShardResult(w, error="worker process died or node lost (simulated)",
                                       lost=True))
            elif self.gradients is None:
                # No model in timing-only mode: the record says so (no loss, no accuracy).
                out.append(ShardResult(w, {"n": float(hi - lo)}))
            else:
                out.append(ShardResult(w, self.gradients.eval_sums(lo, hi)))
        return out

    def poll_evaluation(self, ticket: list[ShardResult], timeout_s: float
                        ) -> list[ShardResult]:
        out = list(ticket)
        ticket.clear()
        return out

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        return self.gradients.finish(sums) if self.gradients is not None else {}

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        self._check_alive(worker)
        return self.gradients.state() if self.gradients is not None else {}

    def _check_alive(self, worker: str) -> None:
        self._advance(self.clock.now())
        if self._dead(worker):
            raise WorkerCallError(worker, "worker process died or node lost (simulated)",
                                  lost=True)

    def node_of(self, node_id: str) -> Node:
        return self._nodes[node_id]

    def speeds_in_force(self, workers: Sequence[tuple[str, str]], epoch: int
                        ) -> tuple[np.ndarray, np.ndarray]:
        """True ``(a, c)`` of ``(worker, node)`` pairs at ``epoch``: the node's own speed
        times its slowdown events in force and the spec's emulated slowdown."""
        f = np.array([self._nodes[node].factor * slowdown_at(
            self.spec.emulation, self.ordinals.get(w, 0), epoch, 0) for w, node in workers])
        a = np.array([self._nodes[node].a_s for _, node in workers])
        c = np.array([self._nodes[node].c_s for _, node in workers])
        return a * f, c * f


def _coverage(sps: Sequence[StepPlan], b: np.ndarray, size: int) -> Coverage:
    """The step's per-position count as the SUM all-reduce builds it: each worker writes 1
    at the positions it trained."""
    lo = np.fromiter((sp.own_start - sp.start for sp in sps), np.int64, len(sps))
    counts = (np.bincount(lo, minlength=size + 1)[:size + 1]
              - np.bincount(lo + b, minlength=size + 1)[:size + 1])
    return encode_counts(np.cumsum(counts[:size]))


# ------------------------------------------------------------------------------ the driver
@dataclass
class SimResult:
    spec: JobSpec
    cluster: ClusterSpec
    snapshot: JobSnapshot
    history: list[EpochRecord]
    events: list[MembershipEvent]
    logs: list[LogLine]
    happened: list[ClusterHappening]
    recoveries: list[Recovery]
    sim_seconds: float
    wall_s: float
    dataset_size: int
    ideal: Ideal | None
    runtime: SimRuntime = field(repr=False)
    skip: int = 2

    def steady(self) -> list[EpochRecord]:
        """The epochs after the first ``skip`` (the policies' learning epochs)."""
        return self.history[self.skip:] or self.history

    @property
    def steady_epoch_s(self) -> float | None:
        s = self.steady()
        return statistics.mean(r.wall_s for r in s) if s else None

    @property
    def throughput(self) -> float | None:
        s = self.steady()
        wall = sum(r.wall_s for r in s)
        return sum(r.samples_trained for r in s) / wall if wall else None

    @property
    def fraction_of_ideal(self) -> float | None:
        """ideal epoch / measured steady epoch (see :mod:`dynabatch.scheduler.sim.cluster`)."""
        e = self.steady_epoch_s
        return self.ideal.epoch_s / e if self.ideal and e else None

    @property
    def compute_fraction(self) -> float | None:
        """Steady throughput over Σv_i: the compute-only ratio (communication and per-step
        jitter count against it)."""
        tp = self.throughput
        return tp / self.ideal.sum_v if self.ideal and tp else None

    def steady_mean(self, attr: str) -> float | None:
        s = self.steady()
        return statistics.mean(getattr(r, attr) for r in s) if s else None


def dataset_sizes(spec: JobSpec) -> tuple[str, int, int]:
    """(name, train, test) of the job's dataset, loaded as a real run loads it (no torch)."""
    from dynabatch.actors.workloads.datasets import load_dataset

    ds = load_dataset(spec.dataset, seed=spec.seed)
    return ds.name, len(ds.y_train), len(ds.y_test)


def simulate(
    spec: JobSpec,
    cluster: ClusterSpec,
    *,
    dataset_size: int | None = None,
    real_gradients: bool = False,
    holdout: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
    job_id: str | None = None,
    start_time: float | None = None,
    skip: int = 2,
    coordinator_hook: Callable[[Coordinator], None] | None = None,
) -> SimResult:
    """Run ``spec`` on ``cluster`` with the production coordinator over a :class:`SimRuntime`.

    ``dataset_size``: timing-only mode trains this many samples per epoch without loading the
    data (default: the size of the job's dataset). ``real_gradients``: train the actual model
    on the actual data (one worker's share after another); ``holdout``: evaluate it on that
    fraction of the training samples, held out of training (a validation split), instead of
    the test set. ``progress(done, total)`` is called
    after every control-loop step. ``coordinator_hook`` sees the coordinator before it runs
    (tests record its decisions).
    """
    check_job(cluster, spec.batch_range[0], spec.initial_workers)
    # The simulator never writes into the job's checkpoint directory.
    spec = spec.model_copy(update={"checkpoint": CheckpointSpec()})
    gradients = None
    if real_gradients:
        from dynabatch.scheduler.sim.gradients import GradientEngine

        gradients = GradientEngine(spec, holdout)
        if dataset_size is not None and dataset_size != gradients.n_train:
            raise ClusterError(f"dataset_size: real-gradient mode trains the job's dataset "
                               f"({gradients.n_train} samples), not {dataset_size}")
        data = DataInfo(gradients.name, gradients.n_train, gradients.n_test)
    elif dataset_size is None:
        data = DataInfo(*dataset_sizes(spec))
    else:
        if dataset_size < 1:
            raise ClusterError(f"dataset_size: must be at least 1, got {dataset_size}")
        data = DataInfo(f"{spec.dataset.name} (timing only)", dataset_size, 0)
    model = ClusterModel(cluster)
    clock = SimClock(start_time)
    runtime = SimRuntime(spec, model, clock=clock, data=data, gradients=gradients)

    from dynabatch.scheduler.sync.coordinator import (
        Coordinator,  # imports torch (dynabatch.scheduler.checkpoint)
    )

    coord = Coordinator(job_id or f"sim-{spec.policy}", spec, resume=False, runtime=runtime,
                        clock=clock)
    _lift_worker_cap(coord, spec)
    if coordinator_hook is not None:
        coordinator_hook(coord)
    # Steps per epoch at each epoch's planned batch (a stage schedule's; goodput mode's
    # first batch): the progress bar's scale.
    before = [0]
    for e in range(spec.epochs):
        before.append(before[-1] + -(-data.n_train // coord.regime.batch_for(e)))
    total = before[-1]
    t0 = time.perf_counter()
    while coord.step():
        if progress is not None:
            done = before[min(coord.epoch, spec.epochs)] + coord.step_in_epoch
            progress(min(done, total), total)
    wall = time.perf_counter() - t0
    if progress is not None:
        progress(total, total)
    history = coord.history()
    ideal = None
    if history:
        last = history[-1]
        a, c = runtime.speeds_in_force([(w.worker, w.node) for w in last.workers], last.epoch)
        ideal = model.ideal(a, c, spec.global_batch, data.n_train)
    return SimResult(
        spec=spec, cluster=cluster, snapshot=coord.snapshot(), history=history,
        events=coord.membership_events(), logs=coord.logs(), happened=runtime.happened,
        recoveries=runtime.recoveries, sim_seconds=clock.now(), wall_s=wall,
        dataset_size=data.n_train, ideal=ideal, runtime=runtime, skip=skip)


def _lift_worker_cap(coord: Coordinator, spec: JobSpec) -> None:
    """Let ``workers: auto`` grow past the service's 4096 in a simulated cluster."""
    if spec.workers == "auto":
        m = coord.membership
        m.max_size = min(spec.max_workers or SIM_MAX_WORKERS, spec.global_batch)
