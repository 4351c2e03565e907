"""Where workers run: eligible Ray nodes, and launching one pinned worker actor per node."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.spec import JobSpec
from actors.worker import Worker
from scheduler.membership import NodeInfo


def eligible_nodes(spec: JobSpec) -> list[NodeInfo]:
    """Alive nodes that can host one of this job's workers. With ``worker_gpus: auto`` a
    node without a GPU is eligible too (its worker trains on the CPU)."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        gpus = res.get("GPU", 0.0)
        if res.get("CPU", 0.0) < spec.worker_cpus or gpus < spec.gpus_on(gpus):
            continue
        if spec.node_resource and res.get(spec.node_resource, 0.0) <= 0:
            continue
        out.append(
            NodeInfo(n["NodeID"], n.get("NodeManagerAddress", ""), res.get("CPU", 0.0), gpus,
                     dict(res))
        )
    return sorted(out, key=lambda x: x.node_id)


def spawn_worker(
    spec: JobSpec, worker_id: str, ordinal: int, node_id: str, gpus: float,
    data: dict[str, Any],
) -> Any:
    """Start a worker actor pinned to ``node_id``. Data arrays travel as object refs."""
    cls = ray.remote(Worker)
    return cls.options(
        num_cpus=spec.worker_cpus,
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
