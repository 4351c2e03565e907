"""Concrete nodes for worker counts per (job, node type): deterministic and sticky (pure).

Per type: every job first keeps the slots it holds there, up to its new count (a shrinking
job gives up the nodes where it has fewest workers, so it stays on few nodes); then jobs
that grow take free slots, first on nodes they already use, then the node that fits the
rest best (the fullest node with room for all of it, else the emptiest node), ties broken
by node id. Jobs are served in the queue order. A worker takes its job's slots on a node
whole (``ClusterJob.size_on``). With one slot per worker every count is placed, since the
counts per type never exceed the type's slots; with larger workers the free slots may be
split over nodes so that a count is not placed whole: the job gets fewer workers, and the
policy decides again without it if that leaves it below its minimum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dynabatch.scheduler.core.cluster.values import ClusterNode


def assign(
    nodes: Sequence[ClusterNode],
    counts: Mapping[str, Mapping[str, int]],
    current: Mapping[str, Mapping[str, int]],
    order: Sequence[str],
    size: Callable[[str, ClusterNode], int] = lambda job, node: 1,
) -> dict[str, dict[str, int]]:
    """job → node → workers. ``counts``: job → type → workers; ``current``: job → node →
    workers (already within the nodes' capacity); ``order``: the jobs, served first to last;
    ``size``: the slots one of a job's workers takes on a node."""
    by_type: dict[str, list[ClusterNode]] = {}
    for node in sorted(nodes, key=lambda n: n.node_id):
        by_type.setdefault(node.node_type, []).append(node)
    out: dict[str, dict[str, int]] = {j: {} for j in order}
    for node_type, members in by_type.items():
        free = {n.node_id: n.capacity for n in members}
        member = {n.node_id: n for n in members}
        need: dict[str, int] = {}
        for job in order:
            want = counts.get(job, {}).get(node_type, 0)
            if want <= 0:
                continue
            held = sorted(
                ((k, v) for k, v in current.get(job, {}).items() if k in free),
                key=lambda kv: (-kv[1], kv[0]),
            )
            for node_id, n in held:
                keep = min(n, want, free[node_id] // size(job, member[node_id]))
                if want <= 0:
                    break
                if keep <= 0:
                    continue
                out[job][node_id] = keep
                free[node_id] -= keep * size(job, member[node_id])
                want -= keep
            need[job] = want
        for job in order:
            want = need.get(job, 0)
            mine = out[job]

            def whole(node_id: str, job: str = job, free=free, member=member) -> int:
                """Workers of ``job`` that fit whole in the node's free slots."""
                return free[node_id] // size(job, member[node_id])

            for node_id in sorted(k for k in mine if k in free):
                if want <= 0:
                    break
                take = min(want, whole(node_id))
                if take:
                    mine[node_id] += take
                    free[node_id] -= take * size(job, member[node_id])
                    want -= take
            while want > 0:
                fits = [(whole(k), k) for k in free if whole(k) >= want]
                if fits:
                    _, node_id = min(fits)
                else:
                    roomy = [(-whole(k), k) for k in free if whole(k) > 0]
                    if not roomy:
                        break  # the free slots are split too finely for its workers
                    node_id = min(roomy)[1]
                take = min(want, whole(node_id))
                mine[node_id] = mine.get(node_id, 0) + take
                free[node_id] -= take * size(job, member[node_id])
                want -= take
    return out
