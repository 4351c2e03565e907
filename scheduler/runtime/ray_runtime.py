"""The Ray side of the coordinator: its commands become actor calls, with timeouts.

Worker actors are plain :class:`dynabatch.actors.worker.Worker` objects, pinned to a node
(``dynabatch.scheduler.runtime.pool``). Every ``ray.get`` here has a timeout; a worker that does
not answer
in time is reported as lost or hung, never waited on forever.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from dynabatch.actors.errors import first_line, is_user_error
from dynabatch.actors.group import choose_backend
from dynabatch.actors.output import ActorOutput
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.failures import WorkerOutcome
from dynabatch.scheduler.core.membership import NodeInfo, Spawn
from dynabatch.scheduler.runtime.pool import eligible_nodes, reserve, spawn_worker, start_spare
from dynabatch.scheduler.runtime.seam import (
    DataInfo,
    GroupReport,
    RegroupResult,
    ShardResult,
    Started,
    WorkerCallError,
)
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import remove_placement_group

log = logging.getLogger("dynabatch.coordinator")

# Small calls (info, open a store): a live actor answers in milliseconds.
CALL_TIMEOUT_S = 60.0
# A segment in which nobody fails still ends within this bound (every worker hung).
SEGMENT_LIMIT_S = 3600.0


def open_checked(spec: JobSpec) -> tuple[Any, Any]:
    """The job's :class:`~dynabatch.actors.data.open.Opened` data (arrays, or sources and
    the refs its workers open) and its objective, the model, the loss and the metrics
    checked on the first two training samples: a workload error names its field here,
    once, rather than inside every worker's constructor. No Ray (the simulator's tests use
    it too)."""
    import numpy as np
    from dynabatch.actors.data.open import open_dataset
    from dynabatch.actors.spec.validation import batch_fits_data
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.actors.workloads.hf import check_tokenizer
    from dynabatch.actors.workloads.models import build_model
    from dynabatch.actors.workloads.objective import check_objective

    check_tokenizer(spec)  # dataset.tokenizer against the model's vocab_size
    data = open_dataset(spec.dataset, seed=spec.seed)
    # A global batch the training set cannot fill fails the job here, naming the field, not
    # with a one-step epoch; a validation split held out of it is said as the reason.
    problem = batch_fits_data(spec, len(data.train))
    if problem is not None:
        held = (f"; dataset.validation held {len(data.validation)} out of it"
                if data.validation is not None and spec.dataset.validation_fraction else "")
        raise WorkloadError(f"{problem[0]}: {problem[1]}{held}")
    model = build_model(spec.model, tuple(data.input_shape), data.num_classes)
    x2, y2 = data.train.read(np.arange(min(2, len(data.train))))
    return data, check_objective(spec, model, x2, y2)


def own_generation(job_id: str) -> int | None:
    """The coordinator generation of the calling actor, read off its name
    (:func:`~dynabatch.scheduler.runtime.launch.coordinator_name`); None when it is not
    ``job_id``'s coordinator actor."""
    from dynabatch.scheduler.runtime.launch import coordinator_name

    context = ray.get_runtime_context()
    if context.get_actor_id() is None:  # a driver process (its name would be asked with a warning)
        return None
    name = context.get_actor_name() or ""
    base = coordinator_name(job_id, 0)
    if name == base:
        return 0
    tail = name.removeprefix(f"{base}-g")
    return int(tail) if tail != name and tail.isdigit() else None


class RayGroupReports:
    """Where a coordinator reports its group: the cluster scheduler actor, found by name at
    each report (a restarted one is a new actor), not waited for; with none, nothing is sent."""

    def report(self, report: GroupReport) -> None:
        from dynabatch.scheduler.runtime.launch import NAMESPACE, SCHEDULER_NAME

        generation = own_generation(report.job_id)
        if generation is None:
            return  # not a coordinator actor: no scheduler placed it
        try:
            scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        except ValueError:
            return
        try:  # fire and forget: its rounds poll the job anyway
            scheduler.report.remote(report.job_id, generation, report.workers,
                                    report.global_batch)
        except Exception as err:
            log.warning("[%s] could not report its group to the cluster scheduler: %s",
                        report.job_id, first_line(err))


class RayRuntime:
    """The coordinator's :class:`~dynabatch.scheduler.runtime.seam.Runtime` on Ray. Its
    tables of workers and spares change under ``_lock``: the step loop's thread and the
    actor's request threads (an assignment starts its workers as it arrives) both start
    and stop workers."""

    def __init__(self, spec: JobSpec, output: ActorOutput | None = None):
        self.spec = spec
        self._lock = threading.RLock()
        self.output = output  # follows each worker's stdout and stderr into the job log
        self._data: dict[str, Any] | None = None
        self._held: dict[str, tuple[Any, Any]] = {}  # the held-out splits' (x, y) by name
        self._handles: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._devices: dict[str, str] = {}
        # Each worker's physical GPU (node and Ray's GPU id), None on the CPU: workers that
        # share one (fractional worker_gpus) cannot be NCCL ranks together.
        self._gpus: dict[str, str | None] = {}
        self._objective: Any = None  # finishes the evaluation's sums (loaded with the data)
        self._spares: dict[str, _Spare] = {}  # node id -> its spare, not yet adopted
        self._node_gpus: dict[str, float] = {}  # node id -> its GPUs, as last listed
        self._reservations: dict[str, Any] = {}  # adopted worker -> its placement group
        self._rv: Any = None  # the group's rendezvous: its store takes plan updates
        self._plan_store: Any = None

    # --- data -------------------------------------------------------------------------
    def load_data(self) -> DataInfo:
        data, self._objective = open_checked(self.spec)
        if data.arrays is not None:  # in memory: the arrays travel through the object store
            ds = data.arrays
            train = (ray.put(ds.x_train), ray.put(ds.y_train))
            test = (ray.put(ds.x_test), ray.put(ds.y_test))
        else:  # read by position: each worker opens the source and reads what it trains
            train, test = (data.refs[0], None), (data.refs[1], None)
        self._data = {
            "x_train": train[0], "y_train": train[1], "x_test": test[0], "y_test": test[1],
            "input_shape": tuple(data.input_shape), "num_classes": data.num_classes,
        }
        # dataset.validation's split, scored where the driver asks for it (not sent to the
        # workers at spawn: evaluate_shard takes the split it scores).
        if data.validation_arrays is not None:
            self._held = {"validation": tuple(ray.put(a) for a in data.validation_arrays)}
        elif data.validation_ref is not None:
            self._held = {"validation": (data.validation_ref, None)}
        self._held["test"] = (test[0], test[1])
        n_val = len(data.validation) if data.validation is not None else 0
        return DataInfo(data.name, len(data.train), len(data.test),
                        tuple(data.input_shape), data.num_classes, n_validation=n_val)

    # --- workers ----------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            held = {n: s.gpus for n, s in self._spares.items()}
        nodes = eligible_nodes(self.spec, held)
        self._node_gpus = {n.node_id: n.gpus for n in nodes}
        return nodes

    def spawn(self, spawn: Spawn) -> None:
        with self._lock:
            w = spawn.worker_id
            spare = self._spares.pop(spawn.node_id, None) if spawn.adopt else None
            if spare is None:  # a fresh worker (also when the spare was lost meanwhile)
                handle = spawn_worker(self.spec, w, spawn.ordinal, spawn.node_id, spawn.gpus,
                                      self._data)
                self._handles[w] = handle
                self._pending[w] = handle.info.remote()
                self._watch(w)
                return
            # The spare takes the identity once the worker's CPUs are reserved on its node
            # (the placement group's ready() is the call's dependency); until then it is
            # pending, like a fresh worker waiting to be placed.
            pg = reserve(self.spec, spawn.node_id)
            self._reservations[w] = pg
            self._handles[w] = spare.handle
            self._pending[w] = spare.handle.adopt.remote(w, spawn.ordinal, pg.ready())
            self._watch(w)

    def _watch(self, worker: str) -> None:
        if self.output is not None:  # by its actor id, asked now, answered once it is built
            self.output.watch(worker, self._handles[worker].actor_id.remote())

    def poll_started(self, timeout_s: float) -> list[Started]:
        with self._lock:
            refs = list(self._pending.values())
        if not refs:
            return []
        ray.wait(refs, num_returns=1, timeout=timeout_s)  # not under the lock: it waits
        with self._lock:  # those still pending: one stopped meanwhile is not reported
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            out = []
            for worker, ref in list(self._pending.items()):
                if ref not in ready:
                    continue
                del self._pending[worker]
                try:
                    info = ray.get(ref, timeout=CALL_TIMEOUT_S)
                    self._devices[worker] = info["device"]
                    self._gpus[worker] = info.get("gpu")
                    out.append(Started(worker))
                except (RayError, GetTimeoutError) as err:
                    self.kill(worker)
                    out.append(Started(worker, first_line(err)))
            return out

    def kill(self, worker: str) -> None:
        if self.output is not None:  # its last lines (a dead worker's traceback) are read
            self.output.unwatch(worker)
        with self._lock:
            self._pending.pop(worker, None)
            self._devices.pop(worker, None)
            self._gpus.pop(worker, None)
            handle = self._handles.pop(worker, None)
            pg = self._reservations.pop(worker, None)
        if handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    # --- spares --------------------------------------------------------------------
    def start_spare(self, node_id: str) -> None:
        with self._lock:
            if node_id in self._spares:
                return
            node_gpus = self._node_gpus.get(node_id, 0.0)
            handle = start_spare(self.spec, node_id, self._data, node_gpus)
            self._spares[node_id] = _Spare(handle, handle.info.remote(), time.monotonic(),
                                           gpus=self.spec.gpus_on(node_gpus))

    def stop_spare(self, node_id: str) -> None:
        with self._lock:
            spare = self._spares.pop(node_id, None)
        if spare is not None:
            with contextlib.suppress(Exception):
                ray.kill(spare.handle, no_restart=True)

    def lost_spares(self) -> list[tuple[str, str]]:
        """Spares that died, or are not up ``start_timeout_s`` after they were started.
        A spare that dies once up is found when it is adopted (its worker fails to start
        and is started afresh)."""
        with self._lock:
            waiting = {s.ready: n for n, s in self._spares.items() if not s.up}
            if not waiting:
                return []
            done, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
            out = []
            for ref in done:
                node = waiting[ref]
                try:
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                    self._spares[node].up = True
                except (RayError, GetTimeoutError) as err:
                    self.stop_spare(node)
                    out.append((node, first_line(err)))
            limit = self.spec.start_timeout_s
            for node, spare in list(self._spares.items()):
                if not spare.up and time.monotonic() - spare.since > limit:
                    self.stop_spare(node)
                    out.append((node, f"not up after {limit:g}s"))
            return out

    # --- training ---------------------------------------------------------------------
    def submit_segment(self, plans: dict[str, Any]) -> tuple[dict[Any, str], list[str]]:
        # An actor runs its calls in order: a segment sent while another runs starts on
        # each worker as soon as the previous one ends there.
        return {self._handles[w].run_segment.remote(plans[w]): w for w in plans}, list(plans)

    def collect_segment(self, ticket: tuple[dict[Any, str], list[str]], grace_s: float
                        ) -> list[WorkerOutcome]:
        refs, order = ticket
        outcomes: dict[str, WorkerOutcome] = {}
        pending = list(refs)
        first_failure: float | None = None
        t0 = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in done:  # each result is fetched once, as it arrives
                o = _outcome(refs[ref], ref)
                outcomes[o.worker] = o
                if first_failure is None and o.failed:
                    first_failure = time.monotonic()
            now = time.monotonic()
            if pending and first_failure is not None and now - first_failure > grace_s:
                break
            if now - t0 > SEGMENT_LIMIT_S:
                break
        for ref in pending:
            w = refs[ref]
            outcomes[w] = WorkerOutcome(w, lost="hung: no answer after its peers failed")
        return [outcomes[w] for w in order]

    def regroup(
        self, generation: int, members: Sequence[str], state: dict[str, Any] | None,
        timeout_s: float,
    ) -> RegroupResult:
        src = self._handles[members[0]]
        backend = choose_backend([self._devices.get(w, "cpu") for w in members],
                                 [self._gpus.get(w) for w in members])
        try:
            if state is not None:
                ray.get(src.load_state.remote(state), timeout=CALL_TIMEOUT_S)
            rv = ray.get(src.open_store.remote(generation, len(members), backend),
                         timeout=CALL_TIMEOUT_S)
        except RayActorError as err:
            return RegroupResult({members[0]: f"lost while joining the group: {_why_lost(err)}"})
        except (RayError, GetTimeoutError) as err:
            return RegroupResult({}, f"{members[0]} could not open the group: {first_line(err)}")
        refs = [self._handles[w].join.remote(rv, rank, 0) for rank, w in enumerate(members)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        lost, errors = {}, []
        for w, ref in zip(members, refs, strict=True):
            if ref not in ready:
                # No answer: it never got to its join, or hangs in it past the store's
                # timeout. Either way it cannot be part of a group.
                lost[w] = "hung while joining the group: no answer"
                continue
            try:
                ray.get(ref, timeout=CALL_TIMEOUT_S)
            except RayActorError as err:
                lost[w] = f"lost while joining the group: {_why_lost(err)}"
            except (RayError, GetTimeoutError) as err:
                # Alive, but its rendezvous or broadcast failed: a peer died under it.
                errors.append(f"{w}: {first_line(err)}")
        # Plan updates are posted in this generation's store (update_segment).
        self._rv, self._plan_store = (rv if not lost and not errors else None), None
        return RegroupResult(lost, "; ".join(errors) or None)

    def update_segment(self, update: Any, timeout_s: float) -> bool:
        """Post a ``PlanUpdate`` under its step's key in the group's store (one
        compare-and-set): accepted unless a worker claimed the step first (it had started
        it) or the store does not answer within ``timeout_s``."""
        import pickle
        from datetime import timedelta

        import torch.distributed as dist

        rv = self._rv
        if rv is None:
            return False
        data = pickle.dumps(update.plans)  # each worker reads its own steps
        try:
            if self._plan_store is None:
                self._plan_store = dist.TCPStore(rv.host, rv.port, None, is_master=False,
                                                 timeout=timedelta(seconds=timeout_s))
            return self._plan_store.compare_set(update.key, "", data) == data
        except Exception:  # unreachable store: the update is not applied
            self._plan_store = None
            return False

    def submit_evaluation(self, shards: dict[str, tuple[int, int]],
                          split: str = "test") -> dict[Any, str]:
        # Queued on each actor behind the segment before it, ahead of the one after.
        (x, y), ticket = self._held[split], {}
        for w, (lo, hi) in shards.items():
            handle = self._handles.get(w)
            ticket[handle.evaluate_shard.remote(x, y, lo, hi)
                   if handle is not None else ("gone", w)] = w
        return ticket

    def poll_evaluation(self, ticket: dict[Any, str], timeout_s: float) -> list[ShardResult]:
        out = [ShardResult(w, error="worker process died or node lost", lost=True)
               for ref, w in list(ticket.items()) if isinstance(ref, tuple)]
        for ref in [r for r in ticket if isinstance(r, tuple)]:
            del ticket[ref]
        refs = list(ticket)
        if not refs:
            return out
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            w = ticket.pop(ref)
            try:
                got = ray.get(ref, timeout=CALL_TIMEOUT_S)
                out.append(ShardResult(w, got["sums"], float(got["seconds"])))
            except RayActorError as err:
                out.append(ShardResult(w, error=_why_lost(err), lost=True))
            except (RayError, GetTimeoutError) as err:
                # What evaluate_shard raised; a user error fails the job at once.
                out.append(ShardResult(w, error=first_line(err), user=is_user_error(err)))
        return out

    def finish_evaluation(self, sums: dict[str, float]) -> dict[str, float]:
        return self._objective.finish(sums)

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        try:
            return ray.get(self._handles[worker].state.remote(), timeout=timeout_s)
        except RayActorError as err:
            raise WorkerCallError(worker, _why_lost(err), lost=True) from None
        except GetTimeoutError:
            raise WorkerCallError(worker, f"state timed out after {timeout_s:g}s",
                                  lost=False) from None
        except RayError as err:
            raise WorkerCallError(worker, first_line(err), lost=False) from None


@dataclass
class _Spare:
    handle: Any
    ready: Any  # its info() call: answers once the spare is built
    since: float  # monotonic seconds when it was started
    up: bool = False
    gpus: float = 0.0  # the GPU it holds for its worker (a GPU node), else 0


def _outcome(worker: str, ref: Any) -> WorkerOutcome:
    try:
        return WorkerOutcome(worker, result=ray.get(ref, timeout=CALL_TIMEOUT_S))
    except (RayError, GetTimeoutError) as err:
        return WorkerOutcome(worker, lost=f"died: {_why_lost(err)}")


def _why_lost(err: BaseException) -> str:
    if isinstance(err, RayActorError):
        return "worker process died or node lost"
    return first_line(err)
