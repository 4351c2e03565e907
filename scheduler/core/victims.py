"""Which nodes a simulated failure takes: one rule for every protocol's simulator (the
synchronous :class:`~dynabatch.scheduler.sim.runtime.SimRuntime` and the parameter-server
:class:`~dynabatch.scheduler.sim.ps_runtime.SimPSRuntime`), so one cluster file fails the
same nodes whichever protocol runs on it. Pure: no ray, no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol, TypeVar


class NodeLike(Protocol):
    node_id: str
    node_class: str
    alive: bool


N = TypeVar("N", bound=NodeLike)


def failure_victims(nodes: Sequence[N], count: int, node_class: str | None = None,
                    index: int | None = None, busy: Container[str] = ()) -> list[N]:
    """The nodes a failure of ``count`` nodes takes from ``nodes`` (the cluster's, in
    creation order). With ``node_class`` and ``index``: that class's ``index``-th node, if it
    is alive. Otherwise the class's (or the cluster's) alive nodes, the latest first, those
    hosting a worker (``busy``: their ids) before idle ones."""
    pool = [n for n in nodes if node_class is None or n.node_class == node_class]
    if node_class is not None and index is not None:
        pool = pool[index:index + 1]
    alive = [n for n in reversed(pool) if n.alive]
    hit = [n for n in alive if n.node_id in busy]
    idle = [n for n in alive if n.node_id not in busy]
    return (hit + idle)[:count]
