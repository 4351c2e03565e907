"""What every job driver shows and accepts, whatever its protocol.

:class:`JobControl` holds the lifecycle (:class:`~dynabatch.scheduler.core.lifecycle.JobState`),
the job's log, membership events and epoch history, and the requests (cancel, and the typed
:data:`Request`: scale, drain, assign) that other threads queue for the driver's next step
boundary. The synchronous and the parameter-server drivers extend it, so the service, REST
and the CLI see one interface. Its public methods may be called from other threads while
``run()`` blocks; every shared field is read and written under ``lock``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynabatch.actors.output import ActorOutput
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.core.membership import NodeAssignment
from dynabatch.scheduler.core.repeats import Repeats
from dynabatch.scheduler.runtime.seam import Clock, RealClock
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine, MembershipEvent
from dynabatch.scheduler.tracking import Tracking

log = logging.getLogger("dynabatch.coordinator")

LOG_LINES_KEPT = 5000


@dataclass(frozen=True, slots=True)
class Scale:
    """Run with exactly ``workers`` workers."""

    workers: int

    def __str__(self) -> str:
        return f"scale to {self.workers}"


@dataclass(frozen=True, slots=True)
class Drain:
    """``worker`` leaves, its state handed over."""

    worker: str

    def __str__(self) -> str:
        return f"drain {self.worker}"


@dataclass(frozen=True, slots=True)
class Assign:
    """Train on exactly these nodes (the cluster scheduler's placement)."""

    nodes: NodeAssignment

    def __str__(self) -> str:
        return f"assign {self.nodes}"


# A membership request, applied at the driver's next step boundary.
Request = Scale | Drain | Assign

# The best epoch's model state, epoch and metrics (checkpoint.keep_best), or Nones.
BestEpoch = tuple[dict[str, Any] | None, int | None, dict[str, float] | None]


class JobControl:
    def __init__(self, job_id: str, spec: JobSpec, clock: Clock | None = None):
        self.job_id = job_id
        self.spec = spec
        self.clock = clock or RealClock()
        self.lock = threading.RLock()
        self.state = JobState.PENDING
        self.reason: str | None = None
        self.records: list[EpochRecord] = []
        self._logs: deque[LogLine] = deque(maxlen=LOG_LINES_KEPT)
        self._log_seq = 0
        # One event repeated (a loop, a user's print in a loop) is counted, not repeated:
        # the log and the service's store of it stay small.
        self._repeats = Repeats()
        self.events: list[MembershipEvent] = []
        self.cancel_reason: str | None = None
        self._requests: deque[Request] = deque()
        # The node assignment in force (the last one accepted), or None.
        self.assignment: NodeAssignment | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        # The job's actors' stdout/stderr, through Ray's log API (Ray drivers set it).
        self.output: ActorOutput | None = None
        # Why requested workers cannot all be placed now (shown as the reason while so).
        self.placement_note: str | None = None
        # The trained model's files (dynabatch.actors.export), kept from the job's end.
        self._model_files: dict[str, bytes] | None = None
        # Experiment tracking (tracking.tensorboard), closed at the job's end.
        self.tracking = Tracking(spec.tracking.tensorboard, job_id,
                                 warn=lambda message: self.log("WARNING", message))

    # ------------------------------------------------------------------ for subclasses
    def snapshot(self) -> JobSnapshot:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _member_ids(self) -> list[str]:
        """The workers that take part in training now (drain's candidates)."""
        raise NotImplementedError

    def _placement_note(self, workers: int) -> str | None:
        """Why ``workers`` workers cannot all be placed now, or None (drivers that can
        tell say so at once, in the reply to the request)."""
        return None

    def _assignment_error(self, nodes: NodeAssignment) -> str | None:
        """Why this job cannot train on ``nodes`` (its batch cannot be split over that many
        workers), or None. A driver that cannot honour an assignment says so here."""
        return "this job's driver does not take node assignments"

    def _assignment_arrived(self) -> None:
        """An assignment was queued (on the caller's thread): a driver that can start its
        workers at once, while its step loop trains, does so here; by default its next step
        boundary takes it."""

    # ------------------------------------------------------------------ public interface
    def model_files(self) -> dict[str, bytes] | None:
        """The trained model's files by name (safetensors and manifest), once the job has
        ended with weights; None before, or when it has none."""
        with self.lock:
            return None if self._model_files is None else dict(self._model_files)

    def history(self, since: int = 0) -> list[EpochRecord]:
        with self.lock:
            return [r for r in self.records if r.epoch >= since]

    def logs(self, since: int = 0) -> list[LogLine]:
        with self.lock:
            return [line for line in self._logs if line.seq >= since]

    def membership_events(self) -> list[MembershipEvent]:
        with self.lock:
            return list(self.events)

    def cancel(self, reason: str = "cancelled by user") -> JobSnapshot:
        with self.lock:
            if self.state.is_terminal:
                raise InvalidTransition(self.state, JobState.CANCELLED)
            self.cancel_reason = reason
        return self.snapshot()

    def scale(self, workers: int) -> JobSnapshot:
        """Run with exactly ``workers`` workers from the next step boundary. Refused
        (``ValueError``) while a node assignment is in force: see :meth:`assign`."""
        if workers < 1:
            raise ValueError("workers: must be at least 1")
        with self.lock:
            if self.state.is_terminal:
                raise InvalidTransition(self.state, JobState.RUNNING)
            self._refuse_if_assigned("scale")
            self._requests.append(Scale(workers))
            self.log("INFO", f"scale requested: {workers} workers")
        note = self._placement_note(workers)
        with self.lock:
            if note is not None:
                self.log("WARNING", f"scale to {workers}: {note}")
            self.placement(note)
        return self.snapshot()

    def placement(self, note: str | None) -> None:
        """Why requested workers cannot all be placed now (None: they are), shown as the
        job's reason while so, unless another reason stands."""
        with self.lock:
            if self.reason is None or self.reason == self.placement_note:
                self.reason = note
            self.placement_note = note

    def waiting(self, why: str) -> None:
        """Why the job waits now (for its workers to start, for nodes): its reason."""
        with self.lock:
            self.reason = why

    def drain(self, worker: str) -> JobSnapshot:
        """``worker`` leaves at the next step boundary. Refused (``ValueError``) while a
        node assignment is in force: see :meth:`assign`."""
        with self.lock:
            members = self._member_ids()
            if worker not in members:
                raise KeyError(f"worker {worker!r} is not a member of job {self.job_id}")
            self._refuse_if_assigned("drain")
            draining = sum(1 for r in self._requests if isinstance(r, Drain))
            if len(members) - draining <= 1:
                raise ValueError("cannot drain the last worker")
            self._requests.append(Drain(worker))
            self.log("INFO", f"drain requested for {worker}")
        return self.snapshot()

    def assign(self, nodes: Mapping[str, int] | NodeAssignment) -> JobSnapshot:
        """Train on exactly these nodes (node id: worker slots), whatever the spec's
        ``min_workers``/``max_workers``: new workers start on the assigned nodes' empty
        slots, workers elsewhere or beyond a node's slots drain with their state handed
        over, its ``leaving`` first. Refused (``ValueError``, one line, logged as a WARNING
        first) when an entry is not a node id with a slot or the batch cannot be split;
        :class:`InvalidTransition` when the job has ended. From then on the job's own
        ``scale`` and ``drain`` are refused; a later ``assign`` replaces this one."""
        try:
            a = nodes if isinstance(nodes, NodeAssignment) else NodeAssignment.of(nodes)
        except ValueError as err:
            self.log("WARNING", str(err))
            raise
        with self.lock:
            refused: ValueError | None = None
            if self.state.is_terminal:
                refused = InvalidTransition(self.state, JobState.RUNNING)
            elif (why := self._assignment_error(a)) is not None:
                refused = ValueError(why)
            if refused is not None:
                line = f"assignment ({a}): {refused}"
                self.log("WARNING", line)
                # An ended job's refusal keeps its kind (the service answers it as such).
                raise refused if isinstance(refused, InvalidTransition) else ValueError(line)
            self.assignment = a
            self._requests.append(Assign(a))
            self.log("INFO", f"assignment requested: {a}")
        self._assignment_arrived()
        return self.snapshot()

    def assigned(self) -> tuple[tuple[str, int], ...] | None:
        """The node assignment in force as (node id, slots) pairs, or None: what a new
        cluster scheduler reads back when it adopts the running job."""
        with self.lock:
            return None if self.assignment is None else self.assignment.slots

    def _refuse_if_assigned(self, what: str) -> None:
        """Under the lock: the job's own resizing stops once its nodes are assigned."""
        if self.assignment is not None:
            raise ValueError(f"{what}: placement is the cluster scheduler's: this job trains on "
                             f"the nodes assigned to it ({self.assignment})")

    # ------------------------------------------------------------------ for the drivers
    def take_requests(self, assignments: bool = False) -> list[Request]:
        """The queued requests, oldest first (``assignments``: only the assignments at the
        head of the queue; the rest stay queued, in order)."""
        with self.lock:
            if not assignments:
                requests, self._requests = list(self._requests), deque()
                return requests
            taken: list[Request] = []
            while self._requests and isinstance(self._requests[0], Assign):
                taken.append(self._requests.popleft())
        return taken

    def scale_queued(self) -> bool:
        """A scale request is queued (not yet taken)."""
        with self.lock:
            return any(isinstance(r, Scale) for r in self._requests)

    def publish_model(
        self,
        *,
        input_shape: tuple[int, ...] | list[int],
        num_classes: int,
        state: dict[str, Any],
        epoch: int,
        reason: str,
        best: BestEpoch = (None, None, None),
    ) -> None:
        """Put the trained model out: build its files from ``state`` (a model state dict) and
        the last epoch's metrics (``best``: the best epoch's, when kept), keep them
        (:meth:`model_files`) and write them to ``artifacts.dir/JOB_ID`` when set. A problem
        is a WARNING in the job's log: the job still ends as it was going to."""
        from dynabatch.actors.data.fs import join
        from dynabatch.actors.data.source import DataError
        from dynabatch.actors.export import ExportError, model_files, write_files

        s = self.spec
        last = self.records[-1] if self.records else None
        metrics = {"train_loss": last.train_loss, **last.scores} if last else {}
        best_state, best_epoch, best_metrics = best
        try:
            files = model_files(
                spec=s,
                input_shape=input_shape,
                num_classes=num_classes,
                final=state,
                epoch=epoch,
                metrics=metrics,
                best=best_state,
                best_epoch=best_epoch,
                best_metrics=best_metrics,
                job_id=self.job_id,
            )
        except ExportError as err:
            self.log("WARNING", f"model export ({reason}) skipped: {err}")
            return
        with self.lock:
            self._model_files = files
        if not s.artifacts.dir:
            self.log(
                "INFO",
                f"trained model ({reason}) at epoch {epoch}: kept for "
                f"download ({', '.join(sorted(files))})",
            )
            return
        target = join(s.artifacts.dir, self.job_id)
        try:
            write_files(files, target)
        except (ExportError, DataError) as err:
            self.log("WARNING", f"model export ({reason}): {err}")
            return
        self.log("INFO", f"trained model ({reason}) at epoch {epoch}: {target}")

    def _snapshot(self, **fields: Any) -> JobSnapshot:
        """The snapshot with what every driver reports alike (its lifecycle, its history's
        last scores and durations, its workers' events) and the driver's own ``fields``.
        The caller holds ``lock``."""
        last = self.records[-1] if self.records else None
        return JobSnapshot(
            job_id=self.job_id, name=self.spec.name, state=self.state, reason=self.reason,
            epochs=self.spec.epochs, emulated=self.spec.emulated,
            train_loss=last.train_loss if last else None,
            test_accuracy=last.test_accuracy if last else None,
            test_metrics=last.scores if last else {}, epochs_completed=len(self.records),
            epoch_durations_s=[r.wall_s for r in self.records],
            worker_events=dict(Counter(f"{e.kind}:{e.reason}" for e in self.events)),
            started_at=self.started_at, finished_at=self.finished_at, **fields)

    def record_event(self, kind: str, worker: str, node: str, reason: str,
               generation: int = 0) -> None:
        with self.lock:
            self.events.append(MembershipEvent(time=self.clock.time(), kind=kind,
                                               worker=worker, node=node, reason=reason,
                                               generation=generation))
        level = "INFO" if kind in ("join", "leave") else "WARNING"
        self.log(level, f"worker {worker} {kind}: {reason}")

    def log(self, level: str, message: str) -> None:
        with self.lock:
            self._append(self._repeats.offer(level, message))

    def _append(self, lines: list[tuple[str, str]]) -> None:
        """Log ``lines`` (what :class:`Repeats` let through) as they are; under the lock."""
        for level, message in lines:
            self._logs.append(LogLine(seq=self._log_seq, time=self.clock.time(), level=level,
                                      message=message))
            self._log_seq += 1
            log.log(logging.getLevelName(level), "[%s] %s", self.job_id, message)

    def _follow_actor_output(self) -> ActorOutput:
        """Start following the output of the job's actors (dynabatch.actors.output), this driver's
        own actor first: the dataset loader and the model check run user code here."""
        self.output = ActorOutput.for_ray(self._actor_line)
        # The driver's own log lines reach its stderr too (Python's last-resort handler):
        # they are in the job log already.
        self.output.watch_self("coordinator", ignore=f"[{self.job_id}] ")
        return self.output.start()

    def _actor_line(self, source: str, stream: str, line: str) -> None:
        if stream == "note":
            self.log("WARNING", f"{source}: {line}")
        else:
            self.log("INFO" if stream == "stdout" else "WARNING", f"{source} {stream}: {line}")

    def transition(self, new: JobState, reason: str | None) -> None:
        with self.lock:
            if not self.state.can_become(new):
                raise InvalidTransition(self.state, new)
            self.state = new
            self.reason = reason
            if new == JobState.RUNNING and self.started_at is None:
                self.started_at = self.clock.time()
            self.log("INFO", f"state {new.value}" + (f": {reason}" if reason else ""))

    def finish(self, state: JobState, reason: str | None) -> None:
        if self.output is not None and not self.state.is_terminal:
            # The actors' last lines, before anyone can see the job end.
            self.output.close()
        with self.lock:
            if self.state.is_terminal:
                return
            self._append(self._repeats.flush())  # the counts of repeats not shown yet
            self.transition(state, reason)
            self.finished_at = self.clock.time()
        self.tracking.close()
        self.shutdown()

