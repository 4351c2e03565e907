"""The Ray side of the coordinator: its commands become actor calls, with timeouts.

Worker actors are plain :class:`actors.worker.Worker` objects, pinned to a node
(``scheduler.pool``). Every ``ray.get`` here has a timeout; a worker that does not answer
in time is reported as lost or hung, never waited on forever.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.group import choose_backend
from actors.spec import JobSpec
from scheduler.failures import WorkerOutcome
from scheduler.membership import NodeInfo, Spawn
from scheduler.pool import eligible_nodes, spawn_worker
from scheduler.runtime import DataInfo, RegroupResult, Started, WorkerCallError

# Small calls (info, open a store): a live actor answers in milliseconds.
CALL_TIMEOUT_S = 60.0
# A segment in which nobody fails still ends within this bound (every worker hung).
SEGMENT_LIMIT_S = 3600.0


def first_line(err: BaseException) -> str:
    """One line for a log or a reason. A task error's own first line names only the task
    (``ray::Worker.join()``): what the worker raised is its cause."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {line}"[:300] if line else type(err).__name__


class RayRuntime:
    def __init__(self, spec: JobSpec):
        self.spec = spec
        self._data: dict[str, Any] | None = None
        self._handles: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._devices: dict[str, str] = {}

    # --- data -------------------------------------------------------------------------
    def load_data(self) -> DataInfo:
        from actors.workloads.datasets import load_dataset
        from actors.workloads.models import build_model
        from actors.workloads.objective import check_objective

        ds = load_dataset(self.spec.dataset, seed=self.spec.seed)
        # Fail here, with the field named, rather than inside every worker's constructor:
        # the model, and the loss and metrics run on two samples of the data.
        model = build_model(self.spec.model, tuple(ds.input_shape), ds.num_classes)
        check_objective(self.spec, model, ds.x_train, ds.y_train)
        self._data = {
            "x_train": ray.put(ds.x_train),
            "y_train": ray.put(ds.y_train),
            "x_test": ray.put(ds.x_test),
            "y_test": ray.put(ds.y_test),
            "input_shape": tuple(ds.input_shape),
            "num_classes": ds.num_classes,
        }
        return DataInfo(ds.name, len(ds.y_train), len(ds.y_test))

    # --- workers ----------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        return eligible_nodes(self.spec)

    def spawn(self, spawn: Spawn) -> None:
        handle = spawn_worker(self.spec, spawn.worker_id, spawn.ordinal, spawn.node_id,
                              spawn.gpus, self._data)
        self._handles[spawn.worker_id] = handle
        self._pending[spawn.worker_id] = handle.info.remote()

    def poll_started(self, timeout_s: float) -> list[Started]:
        if not self._pending:
            return []
        refs = list(self._pending.values())
        ray.wait(refs, num_returns=1, timeout=timeout_s)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for worker, ref in list(self._pending.items()):
            if ref not in ready:
                continue
            del self._pending[worker]
            try:
                self._devices[worker] = ray.get(ref, timeout=CALL_TIMEOUT_S)["device"]
                out.append(Started(worker))
            except (RayError, GetTimeoutError) as err:
                self.kill(worker)
                out.append(Started(worker, first_line(err)))
        return out

    def kill(self, worker: str) -> None:
        self._pending.pop(worker, None)
        self._devices.pop(worker, None)
        handle = self._handles.pop(worker, None)
        if handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    def handle(self, worker: str) -> Any:
        """The worker's actor handle (tests and benchmarks inject stalls through it)."""
        return self._handles[worker]

    # --- training ---------------------------------------------------------------------
    def run_segment(self, plans: dict[str, Any], grace_s: float) -> list[WorkerOutcome]:
        return self.collect_segment(self.submit_segment(plans), grace_s)

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
        backend = choose_backend([self._devices.get(w, "cpu") for w in members])
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
        return RegroupResult(lost, "; ".join(errors) or None)

    def evaluate(self, worker: str, timeout_s: float) -> dict[str, float]:
        data = self._data
        return self._call(worker, "evaluate", timeout_s, data["x_test"], data["y_test"])

    def fetch_state(self, worker: str, timeout_s: float) -> dict[str, Any]:
        return self._call(worker, "state", timeout_s)

    def _call(self, worker: str, method: str, timeout_s: float, *args: Any) -> Any:
        return self._get(worker, method, getattr(self._handles[worker], method).remote(*args),
                         timeout_s)

    def _get(self, worker: str, method: str, ref: Any, timeout_s: float) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except RayActorError as err:
            raise WorkerCallError(worker, _why_lost(err), lost=True) from None
        except GetTimeoutError:
            raise WorkerCallError(worker, f"{method} timed out after {timeout_s:g}s",
                                  lost=False) from None
        except RayError as err:
            raise WorkerCallError(worker, first_line(err), lost=False) from None


def _outcome(worker: str, ref: Any) -> WorkerOutcome:
    try:
        return WorkerOutcome(worker, result=ray.get(ref, timeout=CALL_TIMEOUT_S))
    except (RayError, GetTimeoutError) as err:
        return WorkerOutcome(worker, lost=f"died: {_why_lost(err)}")


def _why_lost(err: BaseException) -> str:
    if isinstance(err, RayActorError):
        return "worker process died or node lost"
    return first_line(err)
