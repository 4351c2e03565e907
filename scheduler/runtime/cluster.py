"""The cluster scheduler that runs: one named, detached Ray actor per Ray cluster.

It holds the queue and the allocations (the pure rounds of
:mod:`dynabatch.scheduler.core.cluster.rounds`) and executes their commands: a granted job's
coordinator is launched to train on the nodes it was granted
(:func:`~dynabatch.scheduler.runtime.launch.launch_coordinator` with ``assignment``), and a
running job is told to train on new nodes (``assign``), which it does at its next step
boundary through its elastic membership. Rounds run every ``round_s`` and on events: a job
registered or finished, a node joined or lost (nodes are listed each round and whenever a
caller wakes it). A granted job's workers start only if it is still held once its
coordinator is up: a cancel that arrived meanwhile gets the coordinator killed unstarted.

Every remote call has a timeout. A coordinator that is gone (Ray says the actor died, or
no actor has its name) is dropped from the rounds, its nodes free at the same round; one
that does not answer in time is asked again next round.

Rebuild. The scheduler keeps nothing on disk. A new one (after the actor or the API
process restarted) runs no round until the service has told it every live job
(:meth:`ClusterScheduler.sync`, from the store): a job whose coordinator is alive is adopted
as it runs (its assignment, or its workers' nodes), holding its nodes from then
(:func:`~dynabatch.scheduler.core.cluster.rounds.rebuild`); the others queue. No job is
touched.

Jobs of ``dynabatch run --address`` (``JobEntry.client``). Their own driver launches the
coordinator (in its own Ray job, so it ships the run's local code and ends with the run):
a round that grants such a job records the grant, the driver reads it (:meth:`grant`),
launches its coordinator on those nodes and says so (:meth:`launched`); from then it is
polled and resized like any job. The service's store does not know them, so its
:meth:`~ClusterScheduler.sync` never drops them and its rebuild keeps them; their driver
tells a new scheduler about them again (:meth:`register`, repeated while it follows the
job). One whose driver has not been heard from for ``client_lease_s`` before its
coordinator runs (the run was killed while it waited) is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.nodes import (
    RayNode,
    cluster_nodes,
    eligible_types,
    gang_error,
    gpu_units,
    job_bounds,
    node_type,
    owner_bounds,
    slot_error,
    worker_slots,
)
from dynabatch.scheduler.core.cluster.rounds import (
    Assign,
    Bounds,
    Drained,
    Finished,
    LiveJob,
    Measured,
    NodesSeen,
    Registered,
    RoundState,
    Running,
    Start,
    StartFailed,
    Tick,
    drain_refusal,
    rebuild,
    step,
)
from dynabatch.scheduler.core.cluster.throughput import ThroughputModel
from dynabatch.scheduler.core.cluster.values import ClusterKnobs
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.runtime.launch import (
    NAMESPACE,
    SCHEDULER_NAME,
    find_coordinator,
    launch_coordinator,
)

log = logging.getLogger("dynabatch.cluster")

# Why the job's own scale and drain are answered by the scheduler, not the job.
PLACES = "the cluster scheduler places this job"


@dataclass(frozen=True, slots=True)
class JobEntry:
    """A job the service asks the scheduler to place: its id, spec, submit time and the
    coordinator generation to launch (the store's count of resumes). ``client``: the job's
    own driver (``dynabatch run``) launches its coordinator once granted, and the service
    does not know it."""

    job_id: str
    spec: JobSpec
    submit_s: float
    generation: int = 0
    client: bool = False


def ray_nodes() -> list[RayNode]:
    return [
        RayNode(
            str(n.get("NodeID", "")),
            {k: float(v) for k, v in (n.get("Resources") or {}).items()},
            dict(n.get("Labels") or {}),
            bool(n.get("Alive")),
        )
        for n in ray.nodes()
    ]


def admissible(spec: JobSpec, nodes: Sequence[RayNode]) -> str | None:
    """Why the scheduler cannot place this job, or None (a one-line reason naming the
    field)."""
    lo, _ = job_bounds(spec)
    return slot_error(spec.worker_gpus) or gang_error(
        nodes, lo, spec.node_resource, spec.worker_cpus, spec.worker_gpus
    )


def model_of(snapshot: Any, types: Mapping[str, str]) -> ThroughputModel | None:
    """The job's samples/s of compute per worker on each node type it runs on (the median of
    its workers there, batch over compute seconds per step), from its snapshot."""
    per: dict[str, list[float]] = {}
    for w in snapshot.workers:
        t = types.get(w.node)
        if t is not None and w.compute_s_per_step > 0 and w.batch > 0:
            per.setdefault(t, []).append(w.batch / w.compute_s_per_step)
    if not per:
        return None
    rates = {t: sorted(v)[len(v) // 2] for t, v in per.items()}
    return ThroughputModel.of(rates, rates, 0.0, float(snapshot.global_batch or 1))


class ClusterScheduler:
    """The actor (see the module docstring). Its methods may be called from other threads
    while the round loop runs: state changes go through ``_lock``."""

    def __init__(
        self,
        policy: str = "goodput",
        round_s: float = 30.0,
        hold_s: float = 120.0,
        call_timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        synced: bool = False,
        client_lease_s: float = 60.0,
        background: bool = True,
    ):
        """``synced``: rounds run from the start (a scheduler ``dynabatch run`` started, with
        no service to rebuild it); else none before the service's first :meth:`sync`.
        ``background``: False runs rounds only when :meth:`round` is called (its caller
        drives them)."""
        self.knobs = ClusterKnobs(policy=policy, hold_s=hold_s)
        self.round_s = round_s
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.client_lease_s = client_lease_s
        self._lock = threading.RLock()
        self._state = RoundState()
        self._jobs: dict[str, JobEntry] = {}
        self._handles: dict[str, Any] = {}
        # Client jobs granted whose driver has not launched their coordinator yet, and when
        # each client job's driver was last heard from.
        self._granted: set[str] = set()
        self._seen: dict[str, float] = {}
        self._synced = synced  # no round before the service has said which jobs live
        self._wake = threading.Event()
        self._round_lock = threading.Lock()
        if background:
            self._thread = threading.Thread(target=self._loop, name="cluster-rounds", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the service's calls
    def admissible(self, spec: JobSpec) -> str | None:
        return admissible(spec, ray_nodes())

    def register(self, entry: JobEntry) -> None:
        """Place ``entry``'s job (a known job of the same generation: nothing changes; a
        later generation is a resumed job, placed again). Raises ``ValueError`` when the
        scheduler cannot place it."""
        why = self.admissible(entry.spec)
        if why is not None:
            raise ValueError(why)
        with self._lock:
            if entry.client:
                self._seen[entry.job_id] = time.time()
            self._add(entry)
        self._wake.set()

    def grant(self, job_id: str) -> tuple[tuple[tuple[str, int], ...] | None, str]:
        """A client job's driver asks whether it may start: (its nodes as (node id, worker
        slots) pairs, "") once granted, else (None, why it waits: the queue's reason).
        Raises ``ValueError`` for a job the scheduler does not hold (dropped, or never
        registered)."""
        with self._lock:
            entry = self._state.job(job_id)
            if entry is None or job_id not in self._jobs:
                raise ValueError(f"the cluster scheduler does not hold job {job_id}")
            self._seen[job_id] = time.time()
            if entry.started and job_id in self._granted:
                return entry.allocation, ""
            view = self._state.view
            shown = next((j for j in view.jobs if j.job_id == job_id), None) if view else None
            why = shown.reason if shown is not None else "queued: waiting for the next round"
            return None, (f"{why} ({entry.note})" if entry.note else why)

    def launched(self, job_id: str, slots: Sequence[tuple[str, int]]) -> None:
        """A client job's driver launched its coordinator on ``slots`` (the grant it read):
        from now it is polled and resized like any job. A round that moved it meanwhile is
        sent to it now."""
        handle = find_coordinator(job_id, 0)
        with self._lock:
            entry = self._state.job(job_id)
            if entry is None or handle is None:
                return
            self._granted.discard(job_id)
            self._handles[job_id] = handle
            allocation = entry.allocation
        if tuple(sorted(allocation)) != tuple(sorted(tuple(s) for s in slots)):
            self._assign(Assign(job_id, allocation))

    def sync(self, entries: Sequence[JobEntry]) -> tuple[list[str], ClusterView | None]:
        """Every live job the service knows, at once: unknown ones are adopted (coordinator
        alive) or queued, known ones not listed are dropped. The first call of a new
        scheduler rebuilds its state this way. Returns the jobs whose coordinator it has
        launched (the launch returned) or adopted, and the last round's view."""
        listed = {e.job_id for e in entries}
        with self._lock:
            first = not self._synced
            # The run's jobs are not in the service's store: kept, not dropped.
            clients = [e for e in self._jobs.values() if e.client and e.job_id not in listed]
            if first:
                self._state = self._rebuilt([*entries, *clients])
                self._synced = True
            else:
                for e in entries:
                    self._add(e)
            kept = listed | {e.job_id for e in clients}
            for job_id in [j.job_id for j in self._state.jobs if j.job_id not in kept]:
                self._drop(job_id)
            # Started once its coordinator exists: the rounds mark a job started when they
            # grant it, before its launch (in the round's thread) has returned.
            started = [
                j.job_id for j in self._state.jobs if j.started and j.job_id in self._handles
            ]
            view = self._state.view
        if first:
            self._wake.set()
        return started, view

    def finished(self, job_id: str) -> None:
        with self._lock:
            self._drop(job_id)
        self._wake.set()

    def request_scale(self, job_id: str, workers: int) -> str:
        """The job's own scale request: recorded as its bounds (at most ``workers``) for the
        next round, which grants what the policy gives it. Raises ``ValueError`` (refused,
        with the reason) below its ``min_workers`` or for a job not placed here."""
        with self._lock:
            entry = self._state.job(job_id)
            if entry is None:
                raise ValueError(f"{PLACES}, but it does not know job {job_id}")
            least, most = owner_bounds(self._jobs[job_id].spec)
            if workers > most:
                raise ValueError(
                    f"scale to {workers}: {PLACES}; refused: above its max_workers {most}"
                )
            if workers < least:
                raise ValueError(
                    f"scale to {workers}: {PLACES}; refused: below its min_workers "
                    f"{least}, which are placed together or not at all"
                )
            # Below the gang it started with (``workers`` without min_workers): the owner's
            # new size is its gang from now on.
            lo = min(entry.min_workers, workers)
            self._state, _ = step(self._state, Bounds(job_id, lo, workers), self.knobs)
        self._wake.set()
        return (
            f"{PLACES}; scale to {workers} recorded as its max_workers: the next round "
            f"gives it up to {workers} workers as the policy decides"
        )

    def request_drain(self, job_id: str, node: str) -> str:
        """The job's own drain of a worker on ``node``: the job gives up one slot there at
        its next step boundary (its driver is assigned its nodes less that slot) and its
        max_workers drops by one. Raises ``ValueError`` (refused, with the reason) when the
        job holds no slot there or would fall below its ``min_workers``."""
        with self._lock:
            least = owner_bounds(self._jobs[job_id].spec)[0] if job_id in self._jobs else 1
            why = drain_refusal(self._state, job_id, node, least)
            if why is not None:
                raise ValueError(f"drain: {PLACES}; {why}")
            self._state, commands = step(
                self._state, Drained(job_id, node, time.time(), least), self.knobs
            )
        keeps = sum(n for c in commands for _, n in c.slots)
        for c in commands:
            self._assign(c)
        self._wake.set()  # the freed slot may start or grow another job
        return f"{PLACES}; its slot on node {node} is freed, and its max_workers is now {keeps}"

    def view(self) -> ClusterView | None:
        with self._lock:
            return self._state.view

    def round(self) -> ClusterView | None:
        """Run one round now (tests and ``dynabatch cluster --now`` need not wait)."""
        self._round()
        return self.view()

    def allocation(self, job_id: str) -> tuple[tuple[str, int], ...] | None:
        with self._lock:
            entry = self._state.job(job_id)
            return None if entry is None else entry.allocation

    # ------------------------------------------------------------------ state
    def _registered(self, e: JobEntry, nodes: Sequence[RayNode]) -> Registered:
        lo, hi = job_bounds(e.spec)
        return Registered(
            e.job_id,
            lo,
            hi,
            e.spec.priority,
            e.submit_s,
            eligible_types(nodes, e.spec.node_resource),
            worker_slots(e.spec.worker_cpus),
            gpu_units(e.spec.worker_gpus),
        )

    def _add(self, e: JobEntry) -> None:
        known = self._jobs.get(e.job_id)
        if known is not None and known.generation >= e.generation:
            return
        if known is not None:  # a resumed job: its old coordinator is gone
            self._drop(e.job_id)
        self._jobs[e.job_id] = e
        nodes = ray_nodes()
        live = self._live(e, nodes)
        event = Running(live, time.time()) if live is not None else self._registered(e, nodes)
        self._state, _ = step(self._state, event, self.knobs)

    def _drop(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._handles.pop(job_id, None)
        self._granted.discard(job_id)
        self._seen.pop(job_id, None)
        self._state, _ = step(self._state, Finished(job_id), self.knobs)

    def _rebuilt(self, entries: Sequence[JobEntry]) -> RoundState:
        nodes = ray_nodes()
        running, queued = [], []
        self._jobs.clear()
        for e in entries:
            self._jobs[e.job_id] = e
            live = self._live(e, nodes)
            if live is not None:
                running.append(live)
            else:
                queued.append(self._registered(e, nodes))
        log.info("cluster scheduler rebuilt: %d running, %d queued", len(running), len(queued))
        return rebuild(cluster_nodes(nodes), running, queued, time.time(), self.knobs)

    def _live(self, e: JobEntry, nodes: Sequence[RayNode]) -> LiveJob | None:
        """The job as its alive coordinator runs it, or None (no coordinator, or it does not
        answer: then it is queued, and its coordinator, if any, is found again when it
        is granted, as its name is taken)."""
        handle = find_coordinator(e.job_id, e.generation)
        if handle is None:
            return None
        try:
            assigned = ray.get(handle.assigned.remote(), timeout=self.call_timeout_s)
            if assigned is None:
                snap = ray.get(handle.snapshot.remote(), timeout=self.call_timeout_s)
                if snap.state.is_terminal:
                    return None
                counts: dict[str, int] = {}
                for w in snap.workers:
                    counts[w.node] = counts.get(w.node, 0) + 1
                assigned = tuple(sorted(counts.items()))
        except Exception as err:
            log.warning("job %s: cannot read its coordinator (%s)", e.job_id, err)
            return None
        self._handles[e.job_id] = handle
        r = self._registered(e, nodes)
        return LiveJob(
            e.job_id,
            r.min_workers,
            r.max_workers,
            r.priority,
            r.submit_s,
            tuple(assigned),
            r.eligible,
            r.worker_slots,
            r.gpu_units,
        )

    # ------------------------------------------------------------------ rounds
    def _loop(self) -> None:
        while True:
            self._wake.wait(self.round_s)
            self._wake.clear()
            try:
                self._round()
            except Exception:  # the loop must outlive any one round
                log.exception("cluster round failed")

    def _round(self) -> None:
        with self._round_lock:
            if not self._synced:
                return
            nodes = ray_nodes()
            types = {n.node_id: node_type(n) for n in nodes}
            with self._lock:
                self._drop_silent_clients(time.time())
                self._state, _ = step(self._state, NodesSeen(cluster_nodes(nodes)), self.knobs)
                # A granted client job has no coordinator until its driver launches it.
                granted = self._granted
                running = [
                    j.job_id for j in self._state.jobs if j.started and j.job_id not in granted
                ]
            for job_id in running:
                self._poll(job_id, types)
            with self._lock:
                self._state, commands = step(self._state, Tick(time.time()), self.knobs)
            for c in commands:
                if isinstance(c, Start):
                    self._start(c)
                elif isinstance(c, Assign):
                    self._assign(c)

    def _drop_silent_clients(self, now: float) -> None:
        """Client jobs with no coordinator yet whose driver is not heard from any more."""
        for job_id, e in list(self._jobs.items()):
            silent = now - self._seen.get(job_id, now) > self.client_lease_s
            if e.client and job_id not in self._handles and silent:
                log.info("job %s: its run is not heard from; dropped", job_id)
                self._drop(job_id)

    def _poll(self, job_id: str, types: Mapping[str, str]) -> None:
        """Its snapshot: ended or gone → dropped; else its telemetry → its model."""
        with self._lock:
            handle = self._handles.get(job_id)
            entry = self._jobs.get(job_id)
        if entry is None:
            return
        if handle is None:
            handle = find_coordinator(job_id, entry.generation)
        if handle is None:
            self._gone(job_id, "no coordinator actor by its name")
            return
        try:
            snap = ray.get(handle.snapshot.remote(), timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            log.warning("job %s: its coordinator did not answer in time", job_id)
            return
        except ray.exceptions.RayActorError as err:
            self._gone(job_id, str(err).splitlines()[0] if str(err) else "actor died")
            return
        if snap.state.is_terminal:
            self._gone(job_id, f"it ended {snap.state.value}")
            return
        model = model_of(snap, types)
        with self._lock:
            self._handles[job_id] = handle
            if model is not None:
                self._state, _ = step(self._state, Measured(job_id, model), self.knobs)

    def _gone(self, job_id: str, why: str) -> None:
        log.info("job %s: dropped from the cluster rounds (%s)", job_id, why)
        with self._lock:
            self._drop(job_id)

    def _start(self, c: Start) -> None:
        """Launch the granted job's coordinator, its workers only once the job is still
        held when the launch returns: a cancel (``finished``) or a later generation
        (``register``) may arrive meanwhile, since the launch runs outside the lock. Such a
        coordinator is killed before it starts a worker; the rounds already freed its
        slots (the job was dropped), so the queue gets them at the next round."""
        with self._lock:
            entry = self._jobs.get(c.job_id)
            if entry is not None and entry.client:  # its run launches it (grant)
                self._granted.add(c.job_id)
                self._seen[c.job_id] = time.time()
                log.info("job %s: granted %s to its run", c.job_id, c.slots)
                return
        if entry is None:
            return
        try:
            handle = launch_coordinator(
                c.job_id,
                entry.spec,
                detached=True,
                generation=entry.generation,
                assignment=dict(c.slots),
                timeout_s=self.start_timeout_s,
                start=False,
            )
        except Exception as err:
            why = str(err).strip().splitlines()[-1][:300] if str(err).strip() else repr(err)
            log.warning("job %s: could not start on %s: %s", c.job_id, c.slots, why)
            with self._lock:
                self._state, _ = step(self._state, StartFailed(c.job_id, why), self.knobs)
            return
        with self._lock:
            held = self._state.job(c.job_id)
            wanted = self._jobs.get(c.job_id) is entry and held is not None and held.started
            if wanted:
                self._handles[c.job_id] = handle
                handle.run.remote()
        if not wanted:
            log.info("job %s: left the queue while it was granted; not started", c.job_id)
            ray.kill(handle, no_restart=True)
            return
        log.info("job %s: started on %s", c.job_id, c.slots)

    def _assign(self, c: Assign) -> None:
        with self._lock:
            handle = self._handles.get(c.job_id)
        if handle is None:
            return  # dropped meanwhile
        try:
            ray.get(handle.assign.remote(dict(c.slots)), timeout=self.call_timeout_s)
        except ray.exceptions.RayActorError as err:
            self._gone(c.job_id, str(err).splitlines()[0] if str(err) else "actor died")
        except Exception as err:  # a timeout, or refused: the next round decides again
            log.warning("job %s: assignment %s not confirmed: %s", c.job_id, c.slots, err)
        else:
            log.info("job %s: assigned %s", c.job_id, c.slots)


def ensure_scheduler(
    policy: str = "goodput",
    round_s: float = 30.0,
    hold_s: float = 120.0,
    call_timeout_s: float = 10.0,
    synced: bool = False,
) -> Any:
    """The cluster's scheduler actor: the one running, else a new one (detached, on the
    head node like the coordinators, so it outlives the process that started it).
    ``synced``: see :class:`ClusterScheduler` (``dynabatch run`` starts one that way)."""
    return (
        ray.remote(ClusterScheduler)
        .options(
            name=SCHEDULER_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=16,
            max_restarts=0,
            resources={"node:__internal_head__": 0.001},
        )
        .remote(policy, round_s, hold_s, call_timeout_s, synced=synced)
    )


def find_scheduler() -> Any | None:
    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
