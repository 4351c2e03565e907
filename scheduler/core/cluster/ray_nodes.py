"""A Ray node as the cluster scheduler sees it: its type and its worker slots (pure).

The type is the node's ``dynabatch.io/node-type`` label, else its ``node-type:<name>``
resource, else derived from its resources (:func:`node_type`). Slots: ``GPU_UNITS`` per GPU
on a GPU node, so fractional ``worker_gpus`` share one; Ray's fixed point per CPU on the
others, so fractional CPUs pack as Ray packs them. docs/cluster.md, "Node types and slots".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.scheduler.core.cluster.values import GPU_UNITS, ClusterNode

TYPE_LABEL = "dynabatch.io/node-type"
TYPE_RESOURCE = "node-type:"
ACCELERATOR = "accelerator_type:"
# A Ray node id is 56 hex digits; its first NODE_CHARS name it wherever we show it (the CLI's
# tables, the job page, the Prometheus labels, the job log, reasons), as ``git`` names a commit.
NODE_CHARS = 8


def node_label(node: str) -> str:
    """A Ray node id cut to its first 8 hex digits; any other name (an address, a host, a
    simulator's node) as it is."""
    ray_id = len(node) >= 40 and not node.strip("0123456789abcdef")
    return node[:NODE_CHARS] if ray_id else node

# Ray counts a resource in fixed point of 1/10000 (its RESOURCE_UNIT_SCALING).
RAY_UNITS = 10000
# Resources Ray gives every node (or a placement group's bundles): not what makes a type.
_RAY_OWN = {"CPU", "GPU", "memory", "object_store_memory", "TPU"}


@dataclass(frozen=True, slots=True)
class RayNode:
    """What Ray says about a node (``ray.nodes()``): id, total resources, labels."""

    node_id: str
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    alive: bool = True


def node_type(node: RayNode) -> str:
    """The node's type: its label, else its ``node-type:`` resource, else
    ``gpu-<model>x<count>`` or ``cpu<count>`` then ``+<name>`` per custom resource, so the
    nodes a job's ``node_resource`` picks never share a type with nodes that lack it."""
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
    custom = sorted(
        k
        for k, v in node.resources.items()
        if v > 0
        and k not in _RAY_OWN
        and not k.startswith(("node:", ACCELERATOR, TYPE_RESOURCE, "bundle_group_"))
        and "_group_" not in k
    )
    return "+".join([base, *custom])


def slots(node: RayNode) -> int:
    """Worker slots: ``GPU_UNITS`` per whole GPU, else ``RAY_UNITS`` per CPU (Ray's fixed
    point, fractions included)."""
    gpus = node.resources.get("GPU", 0.0)
    if gpus >= 1:
        return math.floor(gpus) * GPU_UNITS
    return _ray_units(node.resources.get("CPU", 0.0))


def _ray_units(amount: float) -> int:
    """``amount`` of a resource in Ray's fixed point (it rounds to 1/10000 too)."""
    return round(amount * RAY_UNITS)


def cluster_nodes(nodes: Iterable[RayNode]) -> tuple[ClusterNode, ...]:
    """The alive nodes with at least one slot, as the policy takes them."""
    return tuple(
        ClusterNode(
            n.node_id, node_type(n), slots(n), n.resources.get("GPU", 0.0) >= 1, RAY_UNITS
        )
        for n in sorted(nodes, key=lambda n: n.node_id)
        if n.alive and slots(n) > 0
    )


def worker_slots(worker_cpus: float) -> int:
    """Slots one worker of ``worker_cpus`` CPUs takes on a CPU node: its CPUs in Ray's
    fixed point (a node of 2 CPUs holds 4 workers of 0.5, 3 of 0.6: as Ray places them)."""
    return max(1, _ray_units(worker_cpus))


def gpu_units(worker_gpus: float | str) -> int:
    """Slots one worker of ``worker_gpus`` takes on a GPU node: a whole GPU for 1, ``auto``
    or 0 (a CPU-only worker is not packed beside GPU workers), else 1/k of one.

    Ray packs k = 10000 // (w in 1/10000) workers of w on one GPU, none spanning two (w =
    0.4: 2 per GPU), so a worker takes ``ceil(GPU_UNITS / k)`` slots: exact for k up to 16
    (docs/cluster.md, "Node types and slots", says where it is not)."""
    if worker_gpus == "auto" or not 0 < float(worker_gpus) < 1:
        return GPU_UNITS
    per_gpu = RAY_UNITS // max(1, round(float(worker_gpus) * RAY_UNITS))
    return math.ceil(GPU_UNITS / per_gpu)


def job_bounds(spec: Any) -> tuple[int, int]:
    """(min_workers, max_workers) the scheduler places a job spec within: its bounds,
    ``workers`` as both when it gives neither (``workers: auto``, one worker per eligible
    node: 1 up to the cap below, the policy capping it by the slots), and never more workers
    than its smallest global batch has samples."""
    lo = spec.min_workers or spec.initial_workers or 1
    hi = spec.max_workers or spec.initial_workers or spec.batch_range[0]
    return lo, max(lo, min(hi, spec.batch_range[0]))


def slot_error(worker_gpus: float | str) -> str | None:
    """Why a job's workers cannot be counted in the scheduler's slots, or None."""
    if worker_gpus != "auto" and float(worker_gpus) > 1:
        return (
            f"worker_gpus {float(worker_gpus):g}: the cluster scheduler places a worker on one "
            "GPU or a share of one; give it at most 1"
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
    worker_gpus: float | str = 0.0,
) -> str | None:
    """Why no set of the cluster's nodes can hold the job's ``min_workers`` together (its
    eligible types' slots hold fewer of its workers), or None."""
    nodes = list(nodes)
    ok = eligible_types(nodes, resource)
    size = worker_slots(worker_cpus)
    on_gpu = gpu_units(worker_gpus)
    total = sum(
        c.capacity // (on_gpu if c.gpu else size)
        for c in cluster_nodes(nodes)
        if ok is None or c.node_type in ok
    )
    if total >= min_workers:
        return None
    where = f" on node types whose nodes all have node_resource {resource!r}" if resource else ""
    if size != RAY_UNITS:
        return (
            f"min_workers {min_workers}: the cluster's worker slots{where} hold {total} "
            f"workers of {worker_cpus:g} CPUs (worker_cpus {worker_cpus:g}); the job could "
            "never start"
        )
    if on_gpu < GPU_UNITS:
        return (
            f"min_workers {min_workers}: the cluster's worker slots{where} hold {total} "
            f"workers of worker_gpus {float(worker_gpus):g}; the job could never start"
        )
    return (
        f"min_workers {min_workers}: the cluster has {total} worker slots{where}; "
        "the job could never start"
    )
