"""Watching a synchronous job from outside the product, for benchmarks and tests.

The driver keeps no instrumentation of its own: these wrap the methods of the runtime it
drives (any :class:`~dynabatch.scheduler.runtime.seam.Runtime`: Ray's, the simulator's), as
a test wraps ``submit_evaluation``. Wrap before the job runs (for ``simulate``, in its
``coordinator_hook``: ``watch_steps(c.runtime, ...)``). A worker's start-up timeline comes
from Ray's own records of its actor (:func:`actor_timeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynabatch.actors.contracts import StepTelemetry


def watch_steps(runtime: Any, watcher: Callable[[list[StepTelemetry]], None]) -> None:
    """Call ``watcher`` with each step's reports (one per worker that trained it), in order,
    as the driver collects each segment: the steps it commits (it commits every step a
    collected segment reports: all of a segment that ran, what the state holders completed
    of one that failed). Called in the driver's thread, so it must be quick."""
    collect = runtime.collect_segment

    def collecting(ticket: Any, grace_s: float) -> Any:
        outcomes = collect(ticket, grace_s)
        results = [o.result for o in outcomes if o.result is not None]
        for j in range(max((len(r.steps) for r in results), default=0)):
            watcher([r.steps[j] for r in results if len(r.steps) > j])
        return outcomes

    runtime.collect_segment = collecting


@dataclass
class SegmentCounts:
    """What the driver asked of its runtime's segments (:func:`count_segments`)."""

    sent_ahead: int = 0  # segments sent while another was in flight
    updates_applied: int = 0  # plan updates posted to a segment in flight and applied
    updates_refused: int = 0  # ... refused (a worker had started the step): deferred


def count_segments(runtime: Any) -> SegmentCounts:
    """Count, from now on, the segments ``runtime`` is sent ahead of the one in flight and
    the plan updates it applies or refuses."""
    counts = SegmentCounts()
    submit, collect, update = (runtime.submit_segment, runtime.collect_segment,
                               runtime.update_segment)
    in_flight = [0]

    def submitting(plans: Any) -> Any:
        counts.sent_ahead += in_flight[0] > 0
        in_flight[0] += 1
        return submit(plans)

    def collecting(ticket: Any, grace_s: float) -> Any:
        in_flight[0] -= 1
        return collect(ticket, grace_s)

    def updating(plan_update: Any, timeout_s: float) -> bool:
        ok = update(plan_update, timeout_s)
        if ok:
            counts.updates_applied += 1
        else:
            counts.updates_refused += 1
        return ok

    runtime.submit_segment = submitting
    runtime.collect_segment = collecting
    runtime.update_segment = updating
    return counts


@dataclass
class StartedSpare:
    """A spare Ray's runtime started (:func:`record_spares`)."""

    handle: Any  # its actor
    built: Any  # an ``info()`` call made as it started: answers once the spare is built


def record_spares(started: dict[str, StartedSpare]) -> Callable[..., Any]:
    """A stand-in for Ray's ``start_spare`` (``dynabatch.scheduler.runtime.ray_runtime``'s,
    installed with ``monkeypatch.setattr`` or by assignment) that records each spare it
    starts in ``started`` by node id."""
    from dynabatch.scheduler.runtime.pool import start_spare

    def starting(spec: Any, node_id: str, *args: Any, **kwargs: Any) -> Any:
        handle = start_spare(spec, node_id, *args, **kwargs)
        started[node_id] = StartedSpare(handle, handle.info.remote())
        return handle

    return starting


def spares_up(started: dict[str, StartedSpare]) -> list[str]:
    """The nodes of ``started`` whose spare is built (its first ``info()`` answered)."""
    import ray

    up = []
    for node, spare in started.items():
        ready, _ = ray.wait([spare.built], timeout=0)
        if ready:
            try:
                ray.get(spare.built, timeout=0)
            except Exception:  # it died before it was built
                continue
            up.append(node)
    return up


def record_workers(started: dict[str, Any]) -> Callable[..., Any]:
    """A stand-in for Ray's ``spawn_worker`` (``dynabatch.scheduler.runtime.ray_runtime``'s,
    installed like :func:`record_spares`) that records each fresh worker's actor in
    ``started`` by worker id."""
    from dynabatch.scheduler.runtime.pool import spawn_worker

    def spawning(spec: Any, worker_id: str, *args: Any, **kwargs: Any) -> Any:
        started[worker_id] = handle = spawn_worker(spec, worker_id, *args, **kwargs)
        return handle

    return spawning


def process_started(pid: int) -> float | None:
    """When process ``pid`` of this host started (epoch seconds); None where /proc does not
    say (another host, or gone)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def actor_timeline(handle: Any, adopted: bool = False, timeout_s: float = 30.0
                   ) -> dict[str, float]:
    """Where a worker actor's start-up went (epoch seconds), from Ray's task events:
    ``spawn`` (its creation was asked), ``process`` (its process started: Ray may have
    started it earlier, in its pool), ``running`` (Ray began its creation task: the class's
    imports, torch's among them, then the constructor), ``built`` (the constructor returned:
    data, model, optimizer, warm-up done); with ``adopted`` (a spare that took a worker's
    identity), ``adopt_asked`` and ``adopted`` (its ``adopt`` call asked and returned).
    Ray reports task events about once a second: waited for up to ``timeout_s``."""
    import time

    from ray.util.state import list_tasks

    actor_id = handle._actor_id.hex()
    deadline = time.monotonic() + timeout_s
    while True:
        tasks = list_tasks(filters=[("actor_id", "=", actor_id)], detail=True,
                           raise_on_missing_output=False)
        create = next((t for t in tasks if t.type == "ACTOR_CREATION_TASK"), None)
        adopt = next((t for t in tasks if t.func_or_class_name.endswith("adopt")), None)
        done = create is not None and create.end_time_ms and (
            not adopted or (adopt is not None and adopt.end_time_ms))
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out: dict[str, float | None] = {}
    if create is not None:
        out |= {"spawn": create.creation_time_ms, "running": create.start_time_ms,
                "built": create.end_time_ms}
        out = {k: v / 1e3 for k, v in out.items() if v}
        out["process"] = process_started(create.worker_pid) if create.worker_pid else None
    if adopted and adopt is not None:
        out |= {k: v / 1e3 for k, v in (("adopt_asked", adopt.creation_time_ms),
                                        ("adopted", adopt.end_time_ms)) if v}
    return {k: v for k, v in out.items() if v is not None}
