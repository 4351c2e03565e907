"""A Ray node as the cluster scheduler sees it: its type and its worker slots (pure).

Type, first found of:

1. the node label ``dynabatch.io/node-type`` (``ray start --labels``);
2. a custom resource ``node-type:<name>`` (any amount; for Ray versions or clusters
   without labels);
3. derived from its resources: ``gpu-<model>x<count>`` when it has GPUs (the model from
   Ray's ``accelerator_type:<model>`` resource, else ``gpu``), else ``cpu<count>``; then
   ``+<name>`` for each custom resource it carries (``ray start --resources``), so nodes a
   job's ``node_resource`` picks are never one type with nodes it does not (a type is the
   policy's unit: a job may use a type only if every node of it has the resource).

Slots. A node's capacity is counted in slots: one per GPU on a node with GPUs, one per CPU
on the others. A worker takes ``ceil(worker_cpus)`` slots on a CPU node
(:func:`worker_slots`) and one slot on a GPU node, whatever its ``worker_gpus`` up to 1 (a
fractional GPU is not shared between workers by the policy: it counts the whole slot; a
CPU-only worker there takes one too). ``worker_gpus`` above 1 is refused
(:func:`slot_error`). A job's ``node_resource`` limits it to the types whose every node
carries that resource (:func:`eligible_types`): a type is the policy's unit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.scheduler.core.cluster.values import ClusterNode

TYPE_LABEL = "dynabatch.io/node-type"
TYPE_RESOURCE = "node-type:"
ACCELERATOR = "accelerator_type:"


@dataclass(frozen=True, slots=True)
class RayNode:
    """What Ray says about a node (``ray.nodes()``): id, total resources, labels."""

    node_id: str
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    alive: bool = True


def node_type(node: RayNode) -> str:
    """The node's type (see the module docstring)."""
    label = (node.labels or {}).get(TYPE_LABEL, "").strip()
    if label:
        return label
    named = sorted(
        k[len(TYPE_RESOURCE) :]
        for k in node.resources
        if k.startswith(TYPE_RESOURCE) and len(k) > len(TYPE_RESOURCE)
    )
    if named:
        return named[0]
    gpus = int(node.resources.get("GPU", 0.0))
    if gpus >= 1:
        models = sorted(k[len(ACCELERATOR) :] for k in node.resources if k.startswith(ACCELERATOR))
        base = f"gpu-{models[0] if models else 'gpu'}x{gpus}"
    else:
        base = f"cpu{int(node.resources.get('CPU', 0.0))}"
    return "+".join([base, *custom_resources(node)])


# Resources Ray gives every node (or a placement group's bundles): not what makes a type.
_RAY_OWN = {"CPU", "GPU", "memory", "object_store_memory", "TPU"}


def custom_resources(node: RayNode) -> list[str]:
    """The node's custom resources (sorted), Ray's own ones left out."""
    return sorted(
        k
        for k, v in node.resources.items()
        if v > 0
        and k not in _RAY_OWN
        and not k.startswith(("node:", ACCELERATOR, TYPE_RESOURCE, "bundle_group_"))
        and "_group_" not in k
    )


def slots(node: RayNode) -> int:
    """Worker slots: one per whole GPU, else one per whole CPU."""
    gpus = node.resources.get("GPU", 0.0)
    if gpus >= 1:
        return math.floor(gpus)
    return math.floor(node.resources.get("CPU", 0.0))


def has_gpu(node: RayNode) -> bool:
    return node.resources.get("GPU", 0.0) >= 1


def cluster_nodes(nodes: Iterable[RayNode]) -> tuple[ClusterNode, ...]:
    """The alive nodes with at least one slot, as the policy takes them."""
    return tuple(
        ClusterNode(n.node_id, node_type(n), slots(n), has_gpu(n))
        for n in sorted(nodes, key=lambda n: n.node_id)
        if n.alive and slots(n) > 0
    )


def worker_slots(worker_cpus: float) -> int:
    """Slots one worker of ``worker_cpus`` CPUs takes on a CPU node."""
    return max(1, math.ceil(worker_cpus))


def job_bounds(spec: Any) -> tuple[int, int]:
    """(min_workers, max_workers) the scheduler places a job spec within: its bounds,
    ``workers`` as both when it gives neither, and never more workers than its smallest
    global batch has samples."""
    lo = spec.min_workers or spec.initial_workers or 1
    hi = spec.max_workers or spec.initial_workers or lo
    return lo, max(lo, min(hi, spec.batch_range[0]))


def slot_error(worker_gpus: float | str) -> str | None:
    """Why a job's workers cannot be counted in the scheduler's slots, or None."""
    if worker_gpus != "auto" and float(worker_gpus) > 1:
        return (
            f"worker_gpus {float(worker_gpus):g}: the cluster scheduler counts one worker per "
            "GPU; give it at most 1"
        )
    return None


def eligible_types(nodes: Iterable[RayNode], resource: str | None) -> frozenset[str] | None:
    """The types a job limited to nodes with ``resource`` may use: those whose every alive
    node has it (None: no limit)."""
    if not resource:
        return None
    has: dict[str, bool] = {}
    for n in nodes:
        if n.alive and slots(n) > 0:
            t = node_type(n)
            has[t] = has.get(t, True) and n.resources.get(resource, 0.0) > 0
    return frozenset(t for t, ok in has.items() if ok)


def gang_error(
    nodes: Iterable[RayNode],
    min_workers: int,
    resource: str | None = None,
    worker_cpus: float = 1.0,
) -> str | None:
    """Why no set of the cluster's nodes can hold the job's ``min_workers`` together (its
    eligible types' slots hold fewer of its workers), or None."""
    nodes = list(nodes)
    ok = eligible_types(nodes, resource)
    size = worker_slots(worker_cpus)
    total = sum(
        c.capacity // (1 if c.gpu else size)
        for c in cluster_nodes(nodes)
        if ok is None or c.node_type in ok
    )
    if total >= min_workers:
        return None
    where = f" on node types whose nodes all have node_resource {resource!r}" if resource else ""
    if size > 1:
        return (
            f"min_workers {min_workers}: the cluster's worker slots{where} hold {total} "
            f"workers of {size} CPUs (worker_cpus {worker_cpus:g}); the job could never start"
        )
    return (
        f"min_workers {min_workers}: the cluster has {total} worker slots{where}; "
        "the job could never start"
    )
