"""The parameter server on a virtual clock: :class:`SimPSRuntime`, the simulator's
:class:`~dynabatch.scheduler.runtime.ps_seam.PSRuntime` under the shipped
:class:`~dynabatch.scheduler.ps.driver.PSCoordinator` (wired by
:func:`~dynabatch.scheduler.sim.ps_job.simulate_ps`). The core, the event interpreter and the
driver are the ones that run on Ray; this module is only the world: learners, nodes, time.

Learner ``w`` takes ``t(b) = (a + c·b)·ε`` seconds to compute a gradient over ``b`` samples
(``a, c``: its node's times the spec's emulated slowdown of its ordinal; ``ε`` a log-normal
jitter with σ = the cluster's ``noise_sigma``), plus the pull and push of the model's bytes
over the job's ``protocol.shards`` server actors (the cluster's ``parameter_server``). The
gradient is computed, for real, when the learner pulls (it depends only on the version
pulled, so this is exact) and pushed ``t(b)`` and the transfers later; the server's own work
takes no virtual time. Timed cluster events: ``fail`` takes nodes by the rule every simulator
uses (``SimulatedCluster.apply``) and their learners are lost;
``join`` adds nodes, and the driver starts a learner on each.

This module imports torch (through :mod:`dynabatch.actors.ps` and :mod:`dynabatch.actors.learner`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dynabatch.actors.learner import GradientComputer
from dynabatch.actors.ps import ParamStore
from dynabatch.actors.ps_events import CoreEventInterpreter
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.membership import NodeInfo
from dynabatch.scheduler.core.ps.machine import Idle, PSCore, Work
from dynabatch.scheduler.core.ps.messages import LearnerEnded
from dynabatch.scheduler.runtime.ps_seam import Happening, NodeJoined
from dynabatch.scheduler.sim.cluster_spec import Event
from dynabatch.scheduler.sim.cost_model import Node, SimulatedCluster
from dynabatch.scheduler.sim.timeline import ClusterHappening, SimClock

LOST = "died: learner process died or node lost (simulated node failure)"
STALLED = "lost: the simulation has nothing left to happen (simulated)"


class SimPSRuntime:
    """``spec`` on ``cluster``'s nodes (joins add to them), with its ``at_s`` events (see the
    module docstring)."""

    def __init__(self, spec: JobSpec, data: Any, cluster: SimulatedCluster, *,
                 clock: SimClock | None = None):
        self.spec = spec
        self.ds = data
        self.cluster = cluster
        self.clock = clock or SimClock()
        self.noise = cluster.spec.noise_sigma
        self.rng = np.random.default_rng(cluster.spec.seed)
        self.shards = spec.protocol.shards
        self.epochs: list[dict[str, Any]] = []
        self.happened: list[ClusterHappening] = []
        self.core: PSCore | None = None
        self.store: ParamStore | None = None
        self.events: CoreEventInterpreter | None = None
        # Scheduled at the first wait, after the first requests.
        self._pending = list(cluster.spec.events)
        self._heap: list[tuple[float, int, str, str, Any]] = []
        self._seq = 0
        self._placed: dict[str, Node] = {}
        self._speeds: dict[str, tuple[float, float]] = {}
        self._alive: set[str] = set()
        self._idle: set[str] = set()

    # --- PSRuntime ------------------------------------------------------------------------
    def load_data(self) -> Any:
        return self.ds

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(n.node_id, cpus=n.cpus, gpus=n.gpus)
                for n in self.cluster.nodes if n.alive]

    def start_server(self, core: PSCore, learners: int) -> None:
        ds, shape = self.ds, tuple(self.ds.input_shape)
        self.core = core
        self.store = ParamStore(self.spec, shape, ds.num_classes)
        self.computer = GradientComputer(self.spec, ds.x_train, ds.y_train, shape,
                                         ds.num_classes)
        self.events = CoreEventInterpreter(self.store, keep_staleness=True)
        cost, nbytes = self.cluster.spec.parameter_server, 4.0 * self.store.size  # float32
        self.comm_s = cost.pull_s(nbytes, self.shards) + cost.push_s(nbytes, self.shards)

    def spawn(self, worker: str, ordinal: int, node_id: str) -> None:
        node = next(n for n in self.cluster.nodes if n.node_id == node_id)
        slow = self.spec.emulation.slowdowns
        f = slow[ordinal] if ordinal < len(slow) else 1.0
        self._placed[worker] = node
        self._speeds[worker] = (node.a_s * f, node.c_s * f)
        self.core.join(worker)
        self._alive.add(worker)
        self._at(self.clock.now(), "request", worker)

    def wait(self, timeout_s: float) -> list[Happening]:
        for e in self._pending:
            self._at(e.at_s, "cluster", "", e)
        self._pending = []
        end = self.clock.now() + timeout_s
        core = self.core
        while self._heap and not core.finished:
            if self._heap[0][0] > end:
                self.clock.advance_to(end)
                return []
            t, _, kind, w, payload = heapq.heappop(self._heap)
            self.clock.advance_to(t)
            if kind == "cluster":
                out = self._fire(payload, t)
                if out:
                    return out
            elif w not in self._alive:
                continue  # a lost learner's pending request or push never happens
            elif kind == "request":
                self._request(w, t)
            else:  # push
                work, dt = payload
                self._handle(core.push(w, work.ticket, work.version, dt), t)
                self._at(t, "request", w)
                self._wake(t)
        if core.finished:
            return []
        # Nothing left to happen and the job is not done: its learners can never finish.
        return [LearnerEnded(w, STALLED) for w in sorted(self._alive)]

    def leave(self, worker: str) -> None:
        self._alive.discard(worker)
        self._idle.discard(worker)
        ticket = self.core.ticket_of(worker)
        if ticket is not None:
            self.events.forget(ticket)
        self._handle(self.core.leave(worker), self.clock.now())
        self._wake(self.clock.now())

    def kill(self, worker: str) -> None:
        self._alive.discard(worker)
        self._idle.discard(worker)

    def snapshot(self) -> dict[str, Any]:
        snap = self.core.snapshot()
        now = self.clock.now()
        snap.update(epochs=list(self.epochs), elapsed_s=now, started_s=0.0,
                    pushes_per_s=snap["pushes"] / now if now else 0.0, shards=self.shards,
                    apply_ms_mean=0.0, puts=0)
        return snap

    def final_weights(self) -> Any:
        return self.store.weights()

    def shutdown(self) -> None:
        pass

    # --- the world ------------------------------------------------------------------------
    def _at(self, t: float, kind: str, worker: str, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, worker, payload))

    def _wake(self, t: float) -> None:
        for w in sorted(self._idle):
            self._at(t, "request", w)
        self._idle.clear()

    def _handle(self, events: Sequence[Any], t: float) -> None:
        for closed in self.events.handle(events).closed:
            loss, acc = self.store.evaluate(self.ds.x_test, self.ds.y_test)
            self.epochs.append(self.events.record(closed, loss, acc, t))

    def _request(self, w: str, t: float) -> None:
        work, events = self.core.request(w)
        self._handle(events, t)
        if isinstance(work, Work):
            c = self.computer
            ids = c.indices(work.seed, work.epoch, work.dataset_size, work.chunk.ranges)
            g, loss_sum = c.gradient(self.store.flat.detach(), ids)
            self.events.pushed(work.ticket, g.copy(), loss_sum)
            a, per_sample = self._speeds[w]
            dt = (a + per_sample * len(ids)) * math.exp(self.noise * self.rng.standard_normal())
            self._at(t + dt + self.comm_s, "push", w, (work, dt))
        elif isinstance(work, Idle):  # woken by the next event (Finished: nothing to do)
            self._idle.add(w)
        if events:
            self._wake(t)

    def _fire(self, e: Event, t: float) -> list[Happening]:
        nodes = self.cluster.apply(e, {self._placed[w].node_id for w in self._alive})
        self.happened.append(ClusterHappening(t, e.kind, tuple(n.node_id for n in nodes)))
        if e.join is not None:
            return [NodeJoined(n.node_id) for n in nodes]
        lost = [w for w, n in self._placed.items() if w in self._alive and not n.alive]
        for w in lost:
            self._alive.discard(w)
            self._idle.discard(w)
        return [LearnerEnded(w, LOST) for w in lost]
