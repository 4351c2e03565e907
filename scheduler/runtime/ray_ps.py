"""The Ray side of a parameter-server job: :class:`RayPSRuntime`, whose calls become actor
calls, each ``ray.get`` with a timeout. The server and its shards run on the head node, never
on a learner's node, so losing a learner's node costs that learner only; a learner's ``run``
ref ends when the job finishes, or fails: a Ray error means it is lost, an error its own code
raised fails the job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from dynabatch.actors.errors import TransportError, first_line
from dynabatch.actors.output import ActorOutput
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.membership import NodeInfo
from dynabatch.scheduler.core.ps.machine import PSCore
from dynabatch.scheduler.core.ps.messages import LearnerEnded
from dynabatch.scheduler.runtime.ps_seam import Happening
from dynabatch.scheduler.runtime.seam import Clock, RealClock

CALL_TIMEOUT_S = 30.0
# A new actor's first call also waits for its process to start and import torch (tens of
# seconds on a loaded 2-core machine).
START_TIMEOUT_S = 180.0
HEAD = {"node:__internal_head__": 0.001}


class RayPSRuntime:
    """``follow``: starts following the job's actors' output (the driver's
    ``_follow_actor_output``), called once the job starts."""

    def __init__(self, spec: JobSpec, follow: Callable[[], ActorOutput] | None = None,
                 clock: Clock | None = None):
        self.spec = spec
        self.clock = clock or RealClock()
        self._follow = follow
        self.output: ActorOutput | None = None
        self._server: Any = None
        self._shards: list[Any] = []
        self._bounds: tuple[tuple[int, int], ...] | None = None
        self._learners: dict[str, tuple[Any, Any]] = {}  # id → (handle, run ref)
        self._data: dict[str, Any] = {}
        self._ds: Any = None

    def load_data(self) -> Any:
        from dynabatch.actors.workloads.datasets import load_dataset

        if self._follow is not None:  # this driver's, the server's, each learner's
            self.output = self._follow()
        ds = load_dataset(self.spec.dataset, seed=self.spec.seed)
        self._ds = ds
        return ds

    def nodes(self) -> list[NodeInfo]:
        from dynabatch.scheduler.runtime.pool import eligible_nodes

        return eligible_nodes(self.spec)

    def start_server(self, core: PSCore, learners: int) -> None:
        from dynabatch.actors.ps import ParameterServer, ParamShard, param_count, shard_bounds

        s, ds = self.spec, self._ds
        self._data = {"x_train": ray.put(ds.x_train), "y_train": ray.put(ds.y_train),
                      "input_shape": tuple(ds.input_shape), "num_classes": ds.num_classes}
        shape = tuple(ds.input_shape)
        self._bounds = shard_bounds(param_count(s, shape, ds.num_classes), s.protocol.shards)
        self._shards = [
            ray.remote(ParamShard).options(num_cpus=0, max_restarts=0, resources=HEAD).remote(
                s, shape, ds.num_classes, b) for b in self._bounds[1:]]
        self._server = ray.remote(ParameterServer).options(
            num_cpus=0, max_restarts=0, max_concurrency=1000, resources=HEAD,
        ).remote(s, core, shape, ds.num_classes, ds.x_test, ds.y_test, self._shards,
                 self._bounds, start_learners=learners,
                 start_timeout_s=max(60.0, s.worker_wait_timeout_s),
                 call_timeout_s=CALL_TIMEOUT_S)
        if self.output is not None:
            self.output.watch("server", self._server.actor_id.remote())
            for i, shard in enumerate(self._shards, start=1):
                self.output.watch(f"shard{i}", shard.actor_id.remote())
        ray.get([h.actor_id.remote() for h in (self._server, *self._shards)],
                timeout=START_TIMEOUT_S)  # up (the later calls get the short timeout)

    def spawn(self, worker: str, ordinal: int, node_id: str) -> None:
        from dynabatch.actors.learner import Learner
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        s, d = self.spec, self._data
        handle = ray.remote(Learner).options(
            num_cpus=s.worker_cpus, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(worker, ordinal, s, d["x_train"], d["y_train"], d["input_shape"],
                 d["num_classes"])
        if self.output is not None:
            self.output.watch(worker, handle.actor_id.remote())
        ray.get(self._server.join.remote(worker), timeout=CALL_TIMEOUT_S)
        ref = handle.run.remote(self._server, self._shards, self._bounds, CALL_TIMEOUT_S)
        self._learners[worker] = (handle, ref)

    def wait(self, timeout_s: float) -> list[Happening]:
        refs = {ref: w for w, (_, ref) in self._learners.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out: list[Happening] = []
        for ref in done:
            w = refs[ref]
            try:
                ray.get(ref, timeout=CALL_TIMEOUT_S)
                self._learners.pop(w)  # finished normally
                out.append(LearnerEnded(w))
            except Exception as err:
                own = own_error(err)
                out.append(LearnerEnded(w, own, lost=False) if own is not None
                           else LearnerEnded(w, first_line(err, typed=False)))
        return out

    def leave(self, worker: str) -> None:
        self._learners.pop(worker, None)
        if self.output is not None:  # a dead learner's last lines, its traceback
            self.output.unwatch(worker)
        ray.get(self._server.leave.remote(worker), timeout=CALL_TIMEOUT_S)

    def kill(self, worker: str) -> None:
        if worker in self._learners:
            ray.kill(self._learners[worker][0], no_restart=True)

    def snapshot(self) -> dict[str, Any]:
        return ray.get(self._server.snapshot.remote(), timeout=CALL_TIMEOUT_S)

    def final_weights(self) -> Any:
        _, flat = ray.get(self._server.pull.remote(), timeout=CALL_TIMEOUT_S)
        return flat

    def shutdown(self) -> None:
        for handle, _ in list(self._learners.values()):
            ray.kill(handle, no_restart=True)
        self._learners.clear()
        if self._server is not None:
            ray.kill(self._server, no_restart=True)
            self._server = None
        for shard in self._shards:
            ray.kill(shard, no_restart=True)
        self._shards = []


def own_error(err: BaseException) -> str | None:
    """The message of an error the learner's own code raised (None when its actor, node or
    a remote call failed: Ray's errors and a :class:`TransportError`, which mean it is
    lost). A ``WorkloadError`` names the spec field, so its message is the reason as it
    is."""
    from dynabatch.actors.workloads import WorkloadError
    from ray.exceptions import RayError, RayTaskError

    cause = err.cause if isinstance(err, RayTaskError) else None
    if cause is None or isinstance(cause, RayError | TimeoutError | TransportError):
        return None
    if isinstance(cause, WorkloadError):
        return first_line(cause, typed=False)
    return first_line(cause)
