"""CPU time and niceness of ``dynabatch serve`` and the processes under it, from ``/proc``
(Linux), by group: ``api`` (the serve process: HTTP, the sync loop, the Ray driver),
``workers`` (the training workers, ``ray::Worker``), ``coordinator`` (``ray::Coordinator``)
and ``ray`` (Ray's own: GCS, raylet, agents). CPU time, not wall time: the figures hold on a
busy machine too."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
GROUPS = ("api", "workers", "coordinator", "ray")


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds of the process and all its threads, niceness)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[16])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def process_cpu(pid: int) -> float:
    """CPU seconds so far of one process (all its threads); 0 when it is gone."""
    s = _stat(pid)
    return s[1] if s else 0.0


def _group(pid: int, root: int) -> str:
    if pid == root:
        return "api"
    cmd = _cmdline(pid)
    if cmd.startswith("ray::Worker"):
        return "workers"
    if cmd.startswith("ray::Coordinator"):
        return "coordinator"
    return "ray"


def _tree(root: int) -> dict[int, tuple[int, float, int]]:
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            s = _stat(int(entry))
            if s is not None:
                stats[int(entry)] = s

    def under(pid: int) -> bool:
        for _ in range(64):
            if pid == root:
                return True
            if pid not in stats:
                return False
            pid = stats[pid][0]
        return False

    return {pid: s for pid, s in stats.items() if under(pid)}


def group_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants, by group."""
    out = dict.fromkeys(GROUPS, 0.0)
    for pid, (_, cpu, _) in _tree(root).items():
        out[_group(pid, root)] += cpu
    return out


def group_niceness(root: int) -> dict[str, list[int]]:
    """The niceness values found in each group (Ray starts its worker processes, actors
    included, at ``RAY_worker_niceness``, 15 by default)."""
    out: dict[str, set[int]] = {g: set() for g in GROUPS}
    for pid, (_, _, nice) in _tree(root).items():
        out[_group(pid, root)].add(nice)
    return {g: sorted(v) for g, v in out.items()}
