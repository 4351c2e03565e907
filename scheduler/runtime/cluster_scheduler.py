"""The cluster scheduler that runs: one named, detached Ray actor per Ray cluster.

It holds the pure rounds (:mod:`dynabatch.scheduler.core.cluster.rounds`) and executes their
commands on Ray: launching a granted job's coordinator on its nodes, or telling a running job
to train on new ones. Every remote call has a timeout. It keeps nothing on disk: a new one
rebuilds from the service's :meth:`ClusterScheduler.sync`. docs/cluster.md, "The scheduler
that runs", describes its calls, its rebuild and the jobs of ``dynabatch run --address``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.cluster.ray_nodes import (
    RayNode,
    cluster_nodes,
    eligible_types,
    gang_error,
    gpu_units,
    job_bounds,
    node_label,
    slot_error,
    worker_slots,
)
from dynabatch.scheduler.core.cluster.rounds import (
    Abandon,
    AssignRefused,
    AssignTaken,
    Command,
    Drained,
    Dropped,
    Entry,
    Event,
    FoundRunning,
    Heard,
    JobGone,
    JobReported,
    Launched,
    Listed,
    NodesSeen,
    Reassign,
    RequestRefused,
    ResizeRequested,
    RoundState,
    Run,
    Slots,
    Start,
    StartFailed,
    Tick,
    step,
)
from dynabatch.scheduler.core.cluster.values import ClusterKnobs
from dynabatch.scheduler.core.cluster.view import ClusterView
from dynabatch.scheduler.core.membership import NodeAssignment
from dynabatch.scheduler.runtime.launch import (
    NAMESPACE,
    SCHEDULER_NAME,
    find_coordinator,
    launch_coordinator,
)
from dynabatch.scheduler.runtime.seam import GroupReport

log = logging.getLogger("dynabatch.cluster")

# Why the job's own scale and drain are answered by the scheduler, not the job.
PLACES = "the cluster scheduler places this job"
# How long a coordinator's launch (and its assignment) may take.
START_TIMEOUT_S = 120.0


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


def admissible(spec: JobSpec, nodes: Sequence[RayNode]) -> str | None:
    """Why the scheduler cannot place this job, or None (a one-line reason naming the
    field)."""
    lo, _ = job_bounds(spec)
    return slot_error(spec.worker_gpus) or gang_error(
        nodes, lo, spec.node_resource, spec.worker_cpus, spec.worker_gpus
    )


class RayCalls:
    """What the scheduler asks of Ray: the nodes, a job's coordinator by name, a launch, a
    remote call's answer (``get``, within a timeout) and a kill. The one seam its tests
    replace (:class:`ClusterScheduler`'s ``calls``)."""

    def nodes(self) -> list[RayNode]:
        return [
            RayNode(
                str(n.get("NodeID", "")),
                {k: float(v) for k, v in (n.get("Resources") or {}).items()},
                dict(n.get("Labels") or {}),
                bool(n.get("Alive")),
            )
            for n in ray.nodes()
        ]

    def find(self, job_id: str, generation: int) -> Any | None:
        return find_coordinator(job_id, generation)

    def launch(
        self, job_id: str, spec: JobSpec, generation: int, slots: Slots, timeout_s: float
    ) -> Any:
        """The job's coordinator, detached, with ``slots`` in force and no worker started
        (its ``run`` comes later)."""
        return launch_coordinator(
            job_id,
            spec,
            detached=True,
            generation=generation,
            assignment=dict(slots),
            timeout_s=timeout_s,
            start=False,
        )

    def get(self, ref: Any, timeout_s: float) -> Any:
        return ray.get(ref, timeout=timeout_s)

    def kill(self, handle: Any) -> None:
        ray.kill(handle, no_restart=True)


class ClusterScheduler:
    """The actor: Ray calls, threads and relaying; everything decided is the pure round state
    (:mod:`~dynabatch.scheduler.core.cluster.rounds`). Its methods may be called from other
    threads while the round loop runs: state changes go through ``_lock``."""

    def __init__(
        self,
        policy: str = "goodput",
        round_s: float = 30.0,
        hold_s: float = 120.0,
        call_timeout_s: float = 10.0,
        synced: bool = False,
        background: bool = True,
        clock: Callable[[], float] = time.time,
        calls: RayCalls | None = None,
    ):
        """``synced``: rounds run from the start (a scheduler ``dynabatch run`` started, with
        no service to rebuild it); else none before the service's first :meth:`sync`.
        ``background``: False runs rounds only when :meth:`round` is called (its caller
        drives them). ``clock``: the time rounds and holds are decided at. ``calls``: Ray
        (:class:`RayCalls`)."""
        self.knobs = ClusterKnobs(policy=policy, hold_s=hold_s)
        self.round_s = round_s
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        self.calls = calls or RayCalls()
        self._lock = threading.RLock()
        self._state = RoundState(synced=synced)
        # What a launch needs (the spec), and the coordinators' handles by (job, generation):
        # Ray's objects, no decision.
        self._entries: dict[str, JobEntry] = {}
        self._handles: dict[tuple[str, int], Any] = {}
        self._wake = threading.Event()
        self._round_lock = threading.Lock()
        if background:
            self._thread = threading.Thread(target=self._loop, name="cluster-rounds", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the service's calls
    def admissible(self, spec: JobSpec) -> str | None:
        return admissible(spec, self.calls.nodes())

    def register(self, entry: JobEntry) -> None:
        """Place ``entry``'s job (a known job of the same generation: nothing changes; a
        later generation is a resumed job, placed again). Raises ``ValueError`` when the
        scheduler cannot place it."""
        nodes = self.calls.nodes()
        why = admissible(entry.spec, nodes)
        if why is not None:
            raise ValueError(why)
        with self._lock:
            self._add(entry, nodes)
            if entry.client:
                self._step(Heard(entry.job_id, self.clock()))
        self._wake.set()

    def grant(self, job_id: str) -> tuple[Slots | None, str]:
        """A client job's driver asks whether it may start: (its (node id, worker slots) pairs,
        "") once granted, else (None, the queue's reason). ``ValueError`` for a job not held."""
        with self._lock:
            self._step(Heard(job_id, self.clock()))
            entry = self._state.job(job_id)
            if entry is None:
                raise ValueError(f"the cluster scheduler does not hold job {job_id}")
            if entry.started and not entry.launched:
                return entry.allocation, ""
            view = self._state.view
            shown = next((j for j in view.jobs if j.job_id == job_id), None) if view else None
            why = shown.reason if shown is not None else "queued: waiting for the next round"
            return None, (f"{why} ({entry.note})" if entry.note else why)

    def launched(self, job_id: str, slots: Sequence[tuple[str, int]]) -> None:
        """A client job's driver launched its coordinator on ``slots`` (the grant it read):
        from now it is polled and resized like any job. A round that moved it meanwhile is
        sent to it now. (Its run owns that coordinator: never killed here.)"""
        with self._lock:
            entry = self._state.job(job_id)
        if entry is None:
            return
        handle = self.calls.find(job_id, entry.generation)
        if handle is None:
            return
        with self._lock:
            self._handles[(job_id, entry.generation)] = handle
            commands = self._step(
                Launched(job_id, entry.generation, tuple(tuple(s) for s in slots))
            )
        self._execute(c for c in commands if not isinstance(c, Abandon))

    def sync(self, entries: Sequence[JobEntry]) -> tuple[list[str], ClusterView | None]:
        """Every live job the service knows, at once: unknown ones are adopted (coordinator
        alive, holding its nodes from now) or queued, known ones not listed are dropped. A new
        scheduler's rounds start after its first call (its rebuild). Returns the jobs whose
        coordinator it has launched (the launch returned) or adopted, or saw end or die (the
        service polls them all), and the last round's view."""
        nodes = self.calls.nodes()
        with self._lock:
            first = not self._state.synced
            for e in entries:
                self._add(e, nodes)
            # The run's jobs are not in the service's store: kept, not dropped.
            self._step(Listed(frozenset(e.job_id for e in entries)))
            # A job whose coordinator ended or died is the service's to poll: it finds the
            # end, or resumes the job as its next generation (or fails it).
            started = [j.job_id for j in self._state.jobs if j.started and j.launched]
            started += [job_id for job_id, _ in self._state.ended]
            view = self._state.view
            if first:
                self._state = replace(self._state, synced=True)
                log.info("cluster scheduler rebuilt: %d running, %d queued", len(started),
                         len(self._state.jobs) - len(started))
        if first:
            self._wake.set()
        return started, view

    def finished(self, job_id: str) -> None:
        with self._lock:
            self._step(JobGone(job_id))
        self._wake.set()

    def request_scale(self, job_id: str, workers: int) -> str:
        """The job's own scale request, answered at once by the rounds (:class:`ResizeRequested`);
        ``ValueError`` with the reason when refused."""
        with self._lock:
            commands = self._step(ResizeRequested(job_id, workers, self.clock()))
            entry = self._state.job(job_id)
        self._carry_out(commands, "", f"scale to {workers}: ")
        self._wake.set()
        if entry is not None and entry.waits:
            return f"{PLACES}; {entry.waits}"
        if any(isinstance(c, Reassign) for c in commands):
            return f"{PLACES}; scaled to {workers} workers from its next step boundary"
        return f"{PLACES}; it has {workers} workers"

    def request_drain(self, job_id: str, node: str, worker: str | None = None) -> str:
        """The job's own drain of ``worker`` on ``node``, answered at once by the rounds
        (:class:`Drained`); ``ValueError`` with the reason when refused."""
        with self._lock:
            e = self._entries.get(job_id)
            # Its own min_workers (``workers`` alone is the gang it starts with, no floor).
            least = (e.spec.min_workers if e is not None else None) or 1
            commands = self._step(Drained(job_id, node, self.clock(), least, worker))
        self._carry_out(commands, "drain: ", "drain: ")
        self._wake.set()  # the freed slot may start or grow another job
        keeps = sum(c.workers for c in commands if isinstance(c, Reassign))
        return (f"{PLACES}; its slot on node {node_label(node)} is freed, and its max_workers is "
                f"now {keeps}")

    def report(
        self,
        job_id: str,
        generation: int,
        workers: Sequence[tuple[str, float]],
        global_batch: float,
    ) -> None:
        """The job's group as its coordinator (of ``generation``) reports it whenever it forms
        (:class:`~dynabatch.scheduler.runtime.seam.GroupReport`): the view shows it at once."""
        workers = tuple((str(node), float(speed)) for node, speed in workers)
        self._heard_from(generation, JobReported(job_id, workers, float(global_batch or 1)))

    def view(self) -> ClusterView | None:
        with self._lock:
            return self._state.view

    def round(self) -> ClusterView | None:
        """Run one round now (tests need not wait for the next)."""
        self._round()
        return self.view()

    def allocation(self, job_id: str) -> Slots | None:
        with self._lock:
            entry = self._state.job(job_id)
            return None if entry is None else entry.allocation

    # ------------------------------------------------------------------ state
    def _step(self, event: Event) -> tuple[Command, ...]:
        """One event into the rounds (under ``_lock``); what it dropped is forgotten here."""
        self._state, commands = step(self._state, event, self.knobs)
        held = {(j.job_id, j.generation) for j in self._state.jobs}
        for key in [k for k in self._handles if k not in held]:
            del self._handles[key]
        for job_id in [j for j in self._entries if self._state.job(j) is None]:
            del self._entries[job_id]
        return commands

    def _carry_out(self, commands: Sequence[Command], refused: str, relayed: str) -> None:
        """An owner's request: ``ValueError`` when the rounds refused it (``refused`` begins
        the answer) or the job did (its ``assign`` raised: ``relayed``), else done."""
        for c in commands:
            if isinstance(c, RequestRefused):
                raise ValueError(f"{refused}{PLACES}; {c.why}")
        why = self._execute(commands)
        if why is not None:
            raise ValueError(f"{relayed}{PLACES}; the job refused it: {why}")

    def _entry(self, e: JobEntry, nodes: Sequence[RayNode], allocation: Slots = ()) -> Entry:
        lo, hi = job_bounds(e.spec)
        return Entry(
            e.job_id,
            lo,
            hi,
            e.spec.priority,
            e.submit_s,
            allocation,
            eligible_types(nodes, e.spec.node_resource),
            worker_slots(e.spec.worker_cpus),
            gpu_units(e.spec.worker_gpus),
            generation=e.generation,
            client=e.client,
        )

    def _add(self, e: JobEntry, nodes: Sequence[RayNode]) -> None:
        """Register ``e`` (the rounds decide whether it is news); a new one whose
        coordinator is alive is adopted as it runs."""
        before = self._state.job(e.job_id)
        self._entries.setdefault(e.job_id, e)
        self._step(self._entry(e, nodes))
        after = self._state.job(e.job_id)
        if after is before or after is None:
            return
        self._entries[e.job_id] = e
        allocation = self._live(e)
        if allocation is not None:
            self._step(FoundRunning(self._entry(e, nodes, allocation), self.clock()))

    def _live(self, e: JobEntry) -> Slots | None:
        """Where the job's alive coordinator trains (its assignment, else its workers'
        nodes), or None (no coordinator, or it does not answer: then it is queued, and its
        coordinator, if any, is found again when it is granted, as its name is taken)."""
        handle = self.calls.find(e.job_id, e.generation)
        if handle is None:
            return None
        try:
            assigned = self.calls.get(handle.assigned.remote(), self.call_timeout_s)
            if assigned is None:
                snap = self.calls.get(handle.snapshot.remote(), self.call_timeout_s)
                if snap.state.is_terminal:
                    return None
                assigned = tuple(sorted(Counter(w.node for w in snap.workers).items()))
        except Exception as err:
            log.warning("job %s: cannot read its coordinator (%s)", e.job_id, err)
            return None
        self._handles[(e.job_id, e.generation)] = handle
        return tuple(sorted(tuple(a) for a in assigned))

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
            with self._lock:
                if not self._state.synced:
                    return
            nodes = self.calls.nodes()
            with self._lock:
                self._step(NodesSeen(cluster_nodes(nodes)))
                # JobReported: the jobs whose driver is up (a granted client job has none until
                # its run launches it).
                running = [
                    (j.job_id, j.generation) for j in self._state.jobs if j.started and j.launched
                ]
            for job_id, generation in running:
                self._poll(job_id, generation)
            with self._lock:
                commands = self._step(Tick(self.clock()))
            self._execute(commands)

    def _execute(self, commands: Iterable[Command]) -> str | None:
        """Carry out ``commands``; the job's reason when it refused an assignment."""
        refused = None
        for c in commands:
            if isinstance(c, Start):
                self._start(c)
            elif isinstance(c, Reassign):
                refused = self._assign(c) or refused
            elif isinstance(c, Dropped):
                log.info("job %s: dropped from the cluster rounds (%s)", c.job_id, c.why)
        return refused

    def _poll(self, job_id: str, generation: int) -> None:
        """Its snapshot: ended or gone → dropped; else its report (members, speeds)."""
        with self._lock:
            handle = self._handles.get((job_id, generation))
        if handle is None:
            handle = self.calls.find(job_id, generation)
        if handle is None:
            self._gone(job_id, "no coordinator actor by its name")
            return
        try:
            snap = self.calls.get(handle.snapshot.remote(), self.call_timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError) as err:
            # Not dead (a loaded or unreachable node): asked again next round, not dropped.
            log.warning("job %s: its coordinator did not answer: %s", job_id,
                        first_line(err, typed=False))
            return
        except ray.exceptions.RayActorError as err:
            self._gone(job_id, first_line(err, typed=False) if str(err) else "actor died")
            return
        if snap.state.is_terminal:
            self._gone(job_id, f"it ended {snap.state.value}")
            return
        r = GroupReport.of(job_id, snap)
        self._heard_from(generation, JobReported(job_id, r.workers, r.global_batch), handle)

    def _heard_from(self, generation: int, report: JobReported, handle: Any = None) -> None:
        """The job's report into the rounds, when it comes from the coordinator generation
        held (one of a job resumed since, or dropped, is ignored); ``handle``: that
        coordinator's, kept."""
        with self._lock:
            entry = self._state.job(report.job_id)
            if entry is None or entry.generation != generation:
                return
            if handle is not None:
                self._handles[(report.job_id, generation)] = handle
            self._step(report)

    def _gone(self, job_id: str, why: str) -> None:
        log.info("job %s: dropped from the cluster rounds (%s)", job_id, why)
        with self._lock:
            self._step(JobGone(job_id))

    def _start(self, c: Start) -> None:
        """Launch the granted job's coordinator (outside the lock); the rounds then say
        whether its workers start (``Run``) or, the job no longer held meanwhile (cancelled or
        resumed), it is killed unstarted (``Abandon``). A client job's run launches its own."""
        with self._lock:
            entry = self._state.job(c.job_id)
            e = self._entries.get(c.job_id)
        if entry is None or e is None:
            return
        if entry.client:
            log.info("job %s: granted %s to its run", c.job_id, c.slots)
            return
        try:
            handle = self.calls.launch(
                c.job_id, e.spec, entry.generation, c.slots, START_TIMEOUT_S
            )
        except Exception as err:
            why = first_line(err, typed=False)
            log.warning("job %s: could not start on %s: %s", c.job_id, c.slots, why)
            with self._lock:
                self._step(StartFailed(c.job_id, why))
            return
        with self._lock:
            commands = self._step(Launched(c.job_id, entry.generation, c.slots))
            if not any(isinstance(x, Abandon) for x in commands):
                self._handles[(c.job_id, entry.generation)] = handle
        for x in commands:
            if isinstance(x, Abandon):
                log.info("job %s: %s; not started", c.job_id, x.why)
                self.calls.kill(handle)
            elif isinstance(x, Reassign):
                log.info("job %s: a round moved it during its launch", c.job_id)
                self._assign(x)
            elif isinstance(x, Run):
                handle.run.remote()
                log.info("job %s: started on %s", c.job_id, c.slots)

    def _assign(self, c: Reassign) -> str | None:
        """Send ``c`` to the job; the job's reason when it refused it (also a fact the
        rounds keep), else None."""
        with self._lock:
            entry = self._state.job(c.job_id)
            handle = None if entry is None else self._handles.get((c.job_id, entry.generation))
        if handle is None:
            # Dropped meanwhile, or its launch (which sends the newest) runs; a launched job's
            # driver not found yet is sent it again by the next round.
            return None
        try:
            self.calls.get(handle.assign.remote(NodeAssignment(c.slots, c.leaving)),
                           self.call_timeout_s)
        except ValueError as err:  # the job refused it: a fact the rounds keep and show
            why = first_line(err, typed=False)
            log.warning("job %s: refused the assignment %s: %s", c.job_id, c.slots, why)
            with self._lock:
                self._step(AssignRefused(c.job_id, c.slots, why))
            return why
        except Exception as err:
            if (isinstance(err, ray.exceptions.RayActorError)
                    and not isinstance(err, ray.exceptions.ActorUnavailableError)):
                self._gone(c.job_id, first_line(err, typed=False) if str(err) else "actor died")
            else:  # a timeout, or unreachable for a moment: the next round sends it again
                log.warning("job %s: assignment %s not confirmed (the next round sends it "
                            "again): %s", c.job_id, c.slots, first_line(err, typed=False))
        else:
            log.info("job %s: assigned %s", c.job_id, c.slots)
            with self._lock:
                self._step(AssignTaken(c.job_id, c.slots))
        return None


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
