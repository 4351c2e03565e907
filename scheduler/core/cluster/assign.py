"""Concrete nodes for worker counts per (job, node type): deterministic and sticky (pure).

Per type: every job first keeps the slots it holds there, up to its new count (a shrinking
job gives up the nodes where it has fewest workers, so it stays on few nodes); then jobs
that grow take free slots, first on nodes they already use, then the node that fits the
rest best (the fullest node with room for all of it, else the emptiest node), ties broken
by node id. Jobs are served in the queue order. Since the counts per type never exceed
the type's capacity, every count is placed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynabatch.scheduler.core.cluster.values import ClusterNode


def assign(
    nodes: Sequence[ClusterNode],
    counts: Mapping[str, Mapping[str, int]],
    current: Mapping[str, Mapping[str, int]],
    order: Sequence[str],
) -> dict[str, dict[str, int]]:
    """job → node → workers. ``counts``: job → type → workers; ``current``: job → node →
    workers (already within the nodes' capacity); ``order``: the jobs, served first to last."""
    by_type: dict[str, list[ClusterNode]] = {}
    for node in sorted(nodes, key=lambda n: n.node_id):
        by_type.setdefault(node.node_type, []).append(node)
    out: dict[str, dict[str, int]] = {j: {} for j in order}
    for node_type, members in by_type.items():
        free = {n.node_id: n.capacity for n in members}
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
                keep = min(n, want)
                if keep <= 0:
                    break
                out[job][node_id] = keep
                free[node_id] -= keep
                want -= keep
            need[job] = want
        for job in order:
            want = need.get(job, 0)
            mine = out[job]
            for node_id in sorted(k for k in mine if k in free):
                if want <= 0:
                    break
                take = min(want, free[node_id])
                if take:
                    mine[node_id] += take
                    free[node_id] -= take
                    want -= take
            while want > 0:
                fits = [(f, k) for k, f in free.items() if f >= want]
                if fits:
                    _, node_id = min(fits)
                else:
                    node_id = min(((-f, k) for k, f in free.items() if f > 0))[1]
                take = min(want, free[node_id])
                mine[node_id] = mine.get(node_id, 0) + take
                free[node_id] -= take
                want -= take
    return out
