"""What the parameter-server driver needs from the world it drives, and nothing more: a
:class:`PSRuntime`, Ray's (:class:`~dynabatch.scheduler.runtime.ray_ps.RayPSRuntime`) or the
simulator's. The pure :class:`~dynabatch.scheduler.core.ps.machine.PSCore` lives behind it, in
the server; learners talk to the server, not to the driver. Every call is bounded: an
implementation that cannot answer in time reports a learner lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dynabatch.scheduler.core.membership import NodeInfo
from dynabatch.scheduler.core.ps.messages import LearnerEnded
from dynabatch.scheduler.runtime.seam import Clock

if TYPE_CHECKING:
    from dynabatch.scheduler.core.ps.machine import PSCore


@dataclass(frozen=True, slots=True)
class NodeJoined:
    """A node was added for this job (the simulator's cluster ``join`` events): the driver
    starts a learner on it. Ray's runtime reports none (scale the job instead)."""

    node_id: str


Happening = LearnerEnded | NodeJoined  # a learner's exit is the engine's event as it is


class PSRuntime(Protocol):
    clock: Clock

    def load_data(self) -> Any:
        """The job's dataset (``targets``, ``y_train``, ...); raises ``WorkloadError``."""

    def nodes(self) -> list[NodeInfo]:
        """Alive nodes that can host one of this job's learners, in a stable order."""

    def start_server(self, core: PSCore, learners: int) -> None:
        """Start the server holding ``core`` (and its shards); requests wait until
        ``learners`` have asked (the start barrier)."""

    def spawn(self, worker: str, ordinal: int, node_id: str) -> None:
        """Join ``worker`` to the core and start it on ``node_id``: it pulls, computes and
        pushes until the job is finished."""

    def wait(self, timeout_s: float) -> list[Happening]:
        """What happened to the learners and nodes, waiting up to ``timeout_s``."""

    def leave(self, worker: str) -> None:
        """``worker`` is gone: the core re-queues its in-flight samples (no regroup)."""

    def kill(self, worker: str) -> None:
        """Stop ``worker``'s process (it still has to :meth:`leave`)."""

    def snapshot(self) -> dict[str, Any]:
        """The server's view: the core's snapshot plus ``epochs`` (the epoch records of
        :class:`dynabatch.actors.ps_events.CoreEventInterpreter`), ``started_s``,
        ``elapsed_s``, ``pushes_per_s``, ``shards``, ``puts``."""

    def final_weights(self) -> Any:
        """The server's weights now (the final ones once the job finished): the model's
        flat float32 parameter vector (every shard's slice, in order), a numpy array."""

    def shutdown(self) -> None: ...
