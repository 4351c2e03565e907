"""The simulated cluster as the simulator's runtime sees it: :class:`SimWorld`, the nodes of a
:class:`~dynabatch.scheduler.sim.cost_model.SimulatedCluster`, the cluster's events and the
workers and spares placed on its nodes. Events happen at their simulated time, when the job
reaches their (epoch, step), or now (``happen``); a failure takes nodes by the rule every
simulator uses (``SimulatedCluster.apply``). Workers and spares
are up ``start_s`` after they were started; an adopted spare's worker is up as soon as the
spare is, as on Ray. :class:`~dynabatch.scheduler.sim.runtime.SimRuntime` adds the calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from dynabatch.actors.emulation import slowdown_at
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.membership import NodeInfo, Spawn
from dynabatch.scheduler.runtime.seam import DataInfo, Started, WorkerCallError
from dynabatch.scheduler.sim.calls import CallRecord
from dynabatch.scheduler.sim.cluster_spec import Event, Fault
from dynabatch.scheduler.sim.cost_model import Node, SimulatedCluster
from dynabatch.scheduler.sim.faults import FaultScript
from dynabatch.scheduler.sim.timeline import ClusterHappening, SimClock


@dataclass
class _SimWorker:
    worker_id: str
    ordinal: int
    node: Node
    ready_at: float
    died_at: float | None = None  # its process died (or hung) then; its node may live on
    start_error: str | None = None  # it will fail to start (an adopted spare that died)


class SimWorld:
    """The cluster's nodes, events and placed workers, on a virtual clock (see the module
    docstring): the part of the simulator's runtime that is the world."""

    def __init__(self, spec: JobSpec, cluster: SimulatedCluster, *, clock: SimClock,
                 data: DataInfo):
        self.spec = spec
        self.cluster = cluster
        self.clock = clock
        self.data = data
        self.workers: dict[str, _SimWorker] = {}
        self.ordinals: dict[str, int] = {}  # every worker ever spawned (kept after a kill)
        self._starting: dict[str, _SimWorker] = {}
        self._nodes = {n.node_id: n for n in cluster.nodes}
        self._died_at: dict[str, float] = {}
        self._hosted: dict[str, int] = {}  # node id -> workers on it
        self._spares: dict[str, float] = {}  # node id -> when its spare is warm
        self._timed = sorted((e for e in cluster.spec.events if e.at_s is not None),
                             key=lambda e: e.at_s)
        self._stepped = sorted((e for e in cluster.spec.events if e.epoch is not None),
                               key=lambda e: (e.epoch, e.step))
        self._node_infos: list[NodeInfo] | None = None
        self._version = 0  # bumped when a node's speed or life changes
        self.happened: list[ClusterHappening] = []
        self.record = CallRecord()
        self.faults = FaultScript(cluster.spec.faults)

    def inject(self, fault: Fault) -> None:
        """Arm one more fault (a run under way included); see
        :class:`~dynabatch.scheduler.sim.cluster_spec.Fault`."""
        if fault.node is not None and (err := self.cluster.spec.node_error(fault.node)):
            raise ValueError(f"node.{err[0]}: {err[1]}")
        self.faults.add(fault)

    def _node_key(self, node_id: str) -> tuple[str, int]:
        """The (class, index) a fault names the node by."""
        n = self._nodes[node_id]
        return n.node_class, self.cluster.by_class[n.node_class].index(n)

    def _process_dies(self, worker: str, t: float) -> None:
        w = self.workers.get(worker)
        if w is not None and w.died_at is None:
            w.died_at = t

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
        nodes = self.cluster.apply(e, {n for n, k in self._hosted.items() if k})
        for n in nodes:
            self._nodes[n.node_id] = n  # a joining node is new
            if e.kind == "fail":
                self._died_at[n.node_id] = t
        detail = f"x{e.slowdown.factor:g}" if e.slowdown is not None else ""
        self.happened.append(ClusterHappening(t, e.kind, tuple(n.node_id for n in nodes), detail))
        self._node_infos = None
        self._version += 1

    def happen(self, event: dict) -> None:
        """One event of the cluster file's ``events:`` shape, without its time, happens now
        (``{"fail": {"class": "n", "index": 0}}``, ``{"join": {"class": "n", "count": 2}}``):
        for a caller that changes the cluster between two steps of the driver."""
        now = self.clock.now()
        self._fire(Event.model_validate({**event, "at_s": max(now, 0.0)}), now)

    def _dead(self, worker: str) -> bool:
        w = self.workers.get(worker)
        return w is None or not w.node.alive or w.died_at is not None

    def _death_time(self, worker: str) -> float:
        w = self.workers.get(worker)
        if w is not None and w.died_at is not None:
            return w.died_at
        return self._died_at.get(w.node.node_id, self.clock.now()) if w else self.clock.now()

    # --- Runtime: data and workers ----------------------------------------------------------
    def load_data(self) -> DataInfo:
        return self.data

    def nodes(self) -> list[NodeInfo]:
        """The alive nodes that can host one of the job's workers, as Ray's runtime lists
        them (``JobSpec.workers_on``: its ``worker_cpus``, a GPU when it needs one). A
        simulated cluster declares no custom resources: a spec's ``node_resource`` is taken
        to be on every node. ``free``/``room``: what the node has left once the job's
        workers on it (starting or up) hold their CPUs and GPUs (``JobSpec.room_in``, Ray's
        rule); a spare holds nothing, as on Ray."""
        self._advance(self.clock.now())
        if self._node_infos is None:
            extra = {self.spec.node_resource: 1.0} if self.spec.node_resource else {}
            self._node_infos = []
            for n in self.cluster.nodes:
                if not (n.alive and self.spec.workers_on(
                        {"CPU": n.cpus, "GPU": n.gpus, **extra})):
                    continue
                k = self._hosted.get(n.node_id, 0)
                left = {"CPU": n.cpus - k * self.spec.worker_cpus,
                        "GPU": n.gpus - k * self.spec.gpus_on(n.gpus)}
                room = self.spec.room_in(left, n.gpus)
                self._node_infos.append(
                    NodeInfo(n.node_id, cpus=n.cpus, gpus=n.gpus, free=room > 0, room=room))
        return self._node_infos

    def spawn(self, spawn: Spawn) -> None:
        node = self._nodes[spawn.node_id]
        now = self.clock.now()
        spare = self._spares.pop(spawn.node_id, None) if spawn.adopt else None
        # Adopting a spare takes milliseconds on Ray: the worker is up once the spare is.
        ready = now + self.cluster.spec.recovery.start_s if spare is None else max(now, spare)
        w = _SimWorker(spawn.worker_id, spawn.ordinal, node, ready)
        if spare is None:
            self.record.fresh.append(spawn.worker_id)
        else:
            self.record.adopted.append(spawn.worker_id)
            if self.faults.counted("spare_dies_silently", self._node_key(node.node_id)):
                w.start_error = "spare process died before it was adopted (simulated)"
        self._starting[spawn.worker_id] = w
        self.ordinals[spawn.worker_id] = spawn.ordinal
        self._hosted[node.node_id] = self._hosted.get(node.node_id, 0) + 1
        self._node_infos = None  # its room changed

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
            if not w.node.alive or w.start_error:
                self._unhost(w)
                out.append(Started(wid, w.start_error
                                   or "node lost while the worker started (simulated)"))
                continue
            self.workers[wid] = w
            out.append(Started(wid))
        return out

    # --- Runtime: spares (they reserve nothing, as on Ray) --------------------------------
    def start_spare(self, node_id: str) -> None:
        if node_id not in self._spares:
            self._spares[node_id] = self.clock.now() + self.cluster.spec.recovery.start_s
            self.record.spares_started.append(node_id)

    def stop_spare(self, node_id: str) -> None:
        if self._spares.pop(node_id, None) is not None:
            self.record.spares_stopped.append(node_id)

    def lost_spares(self) -> list[tuple[str, str]]:
        self._advance(self.clock.now())
        lost = [(n, "node lost (simulated node failure)") if not self._nodes[n].alive
                else (n, "spare process died (simulated)") for n in self._spares
                if not self._nodes[n].alive
                or self.faults.counted("spare_dies", self._node_key(n))]
        for n, _ in lost:
            del self._spares[n]
        return lost

    def _unhost(self, w: _SimWorker) -> None:
        self._hosted[w.node.node_id] = max(0, self._hosted.get(w.node.node_id, 0) - 1)
        self._node_infos = None  # its room changed

    def kill(self, worker: str) -> None:
        w = self.workers.pop(worker, None) or self._starting.pop(worker, None)
        if w is not None:
            self._unhost(w)
            self.record.killed.append(worker)

    def _check_alive(self, worker: str) -> None:
        self._advance(self.clock.now())
        if self._dead(worker):
            raise WorkerCallError(worker, "worker process died or node lost (simulated)",
                                  lost=True)

    def speeds_in_force(self, workers: Sequence[tuple[str, str]], epoch: int
                        ) -> tuple[np.ndarray, np.ndarray]:
        """True ``(a, c)`` of ``(worker, node)`` pairs at ``epoch``: the node's own speed
        times its slowdown events in force and the spec's emulated slowdown."""
        f = np.array([self._nodes[node].factor * slowdown_at(
            self.spec.emulation, self.ordinals.get(w, 0), epoch, 0) for w, node in workers])
        a = np.array([self._nodes[node].a_s for _, node in workers])
        c = np.array([self._nodes[node].c_s for _, node in workers])
        return a * f, c * f
