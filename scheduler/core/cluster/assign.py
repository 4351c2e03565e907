"""Concrete nodes for worker counts per (job, node type): deterministic and sticky (pure).

Per type, every job first keeps the slots it holds, up to its new count (a shrink gives up
the nodes where it has fewest workers); then growing jobs take free slots on their own
nodes first, then on the node that fits the rest best, largest workers first (first-fit
decreasing, so fractional-GPU workers fill what whole-GPU ones leave), ties by node id. With
workers of several slots a count may not be placed whole: the job gets fewer workers, and
:func:`~.decision.decide` decides again with its count there capped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
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
    for members in by_type.values():
        ids = [n.node_id for n in members]  # sorted: the first of equals is the lowest id
        pos = {k: i for i, k in enumerate(ids)}
        free = np.array([n.capacity for n in members], dtype=np.int64)
        need: dict[str, int] = {}
        for job in order:
            want = counts.get(job, {}).get(members[0].node_type, 0)
            if want <= 0:
                continue
            held = sorted(
                ((k, v) for k, v in current.get(job, {}).items() if k in pos),
                key=lambda kv: (-kv[1], kv[0]),
            )
            for node_id, n in held:
                if want <= 0:
                    break
                i = pos[node_id]
                each = size(job, members[i])
                keep = min(n, want, int(free[i]) // each)
                if keep <= 0:
                    continue
                out[job][node_id] = keep
                free[i] -= keep * each
                want -= keep
            need[job] = want
        # New places for the largest workers first (first-fit decreasing): smaller ones
        # then fill what they leave, rather than splitting the room the large ones need.
        kinds = {n.gpu: n for n in members}.values()  # a size depends on no more
        growing = sorted(
            (job for job in order if need.get(job, 0) > 0),
            key=lambda job: -max(size(job, n) for n in kinds),
        )
        for job in growing:
            want = need[job]
            mine = out[job]
            sizes = np.array([size(job, n) for n in members], dtype=np.int64)
            for node_id in sorted(k for k in mine if k in pos):
                if want <= 0:
                    break
                i = pos[node_id]
                take = min(want, int(free[i] // sizes[i]))
                if take:
                    mine[node_id] += take
                    free[i] -= take * sizes[i]
                    want -= take
            while want > 0:
                whole = free // sizes  # workers of this job each node holds whole
                fits = np.flatnonzero(whole >= want)
                if fits.size:
                    i = int(fits[np.argmin(whole[fits])])
                else:
                    i = int(np.argmax(whole))
                    if whole[i] <= 0:
                        break  # the free slots are split too finely for its workers
                take = min(want, int(whole[i]))
                mine[ids[i]] = mine.get(ids[i], 0) + take
                free[i] -= take * sizes[i]
                want -= take
    return out
