"""Where workers run: eligible Ray nodes, and launching one pinned worker actor per node.

A worker is started afresh (:func:`spawn_worker`), or a spare started ahead on an idle node
(:func:`start_spare`, holding no CPU while it waits) is adopted once the worker's CPUs are
reserved there (:func:`reserve`): docs/elasticity.md, "Spares".
"""

from __future__ import annotations

from typing import Any

import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.worker import Worker
from dynabatch.scheduler.core.membership import NodeInfo
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def _available() -> dict[str, dict[str, float]] | None:
    try:
        from ray._private.state import available_resources_per_node

        return available_resources_per_node()
    except Exception:  # a DeveloperAPI: without it no node counts as free (no spares)
        return None


def eligible_nodes(spec: JobSpec, spare_gpus: dict[str, float] | None = None
                   ) -> list[NodeInfo]:
    """Alive nodes that can host one of this job's workers (``spec.workers_on``). With
    ``worker_gpus: auto`` (and device ``auto``) a node without a GPU is eligible too (its
    worker trains on the CPU). ``free``: it has the unreserved CPUs (and GPUs) for one more
    worker now. ``spare_gpus``: the GPUs this job's spares hold, per node: its own, free for
    the worker that adopts the spare there."""
    avail = _available()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        if spec.workers_on(res) <= 0:
            continue
        gpus = res.get("GPU", 0.0)
        left = dict((avail or {}).get(n["NodeID"], {}))
        held = (spare_gpus or {}).get(n["NodeID"], 0.0)
        if held:
            left["GPU"] = left.get("GPU", 0.0) + held
        room = spec.room_in(left, gpus) if avail is not None else 0
        out.append(
            NodeInfo(n["NodeID"], res.get("CPU", 0.0), gpus, free=room > 0, room=room)
        )
    return sorted(out, key=lambda x: x.node_id)


def spawn_worker(
    spec: JobSpec, worker_id: str | None, ordinal: int, node_id: str, gpus: float,
    data: dict[str, Any], cpus: float | None = None,
) -> Any:
    """Start a worker actor pinned to ``node_id``, asking ``cpus`` (default: the spec's
    ``worker_cpus``). Data arrays travel as object refs."""
    return ray.remote(Worker).options(
        num_cpus=spec.worker_cpus if cpus is None else cpus,
        num_gpus=gpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        max_restarts=0,
        name=None,
    ).remote(
        worker_id,
        ordinal,
        spec,
        data["x_train"],
        data["y_train"],
        data["input_shape"],
        data["num_classes"],
        gpus,
    )


def start_spare(spec: JobSpec, node_id: str, data: dict[str, Any], node_gpus: float) -> Any:
    """Start a spare worker on ``node_id`` (which offers ``node_gpus``): a :class:`Worker`
    without an identity, holding no CPU. Where the job's worker takes a GPU the spare holds
    it from the start, since a GPU is visible only to the process Ray reserved it for;
    :func:`eligible_nodes` counts that GPU as the job's own."""
    return spawn_worker(spec, None, -1, node_id, spec.gpus_on(node_gpus), data, cpus=0)


def reserve(spec: JobSpec, node_id: str) -> PlacementGroup:
    """Reserve one worker's CPUs on ``node_id`` for an adopted spare. ``ready()`` resolves
    once they are held (at once on a free node; when another job took them meanwhile, once
    it lets them go, as a fresh worker would wait to be placed)."""
    return placement_group([{"CPU": spec.worker_cpus}], strategy="STRICT_PACK",
                           bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}])

