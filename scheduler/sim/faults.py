"""The simulator's fault script (the cluster's ``faults:``, or ``SimRuntime.inject``): which
of the job's workers (by ordinal) or spares (by node) fail, and when; the kinds are
:class:`~dynabatch.scheduler.sim.cluster_spec.Fault`'s. A step fault fires once, at the first
step at or after its (epoch, step) its worker takes part in (``error`` and ``oom`` hold from
there on); a fault counted per call fires at its ``nth`` call. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from dynabatch.actors.accumulate import largest_micro
from dynabatch.scheduler.sim.cluster_spec import NODE_FAULTS, Fault

# A step's faults of one worker, in the order they are tried: the first that fires is the
# worker's fault of that step.
_STEP_ORDER = ("die", "hang", "error", "straggle", "oom")
# In force on every step from their (epoch, step) on; on every evaluation.
_REPEATING = ("error", "oom", "eval_error")
EVAL_ERROR = "InjectedFault: injected evaluation error (simulated)"


@dataclass
class StepFaults:
    """The faults of one step: whose process died, who hung, who raised what (kind,
    message, the micro-batch an out-of-memory error tried), and whether the first survivor
    completed the step before the failure (``uneven``)."""

    died: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    errors: dict[str, tuple[str, str, int | None]] = field(default_factory=dict)
    uneven: bool = False


@dataclass
class _Armed:
    fault: Fault
    key: int | tuple[str, int]  # the worker's ordinal, or the node's (class, index)
    left: int  # calls until a counted fault fires
    done: bool = False
    fired: bool = False


class FaultScript:
    """The faults armed in a simulated run and what is left of each (see the module
    docstring). Workers are named by ordinal, nodes by (class, index)."""

    def __init__(self, faults: Iterable[Fault] = ()):
        self._armed: list[_Armed] = []
        self.fired: list[Fault] = []  # every fault that fired, in order
        for f in faults:
            self.add(f)

    def __bool__(self) -> bool:
        return bool(self._armed)

    def add(self, fault: Fault) -> None:
        key = (
            (fault.node.node_class, fault.node.index) if fault.kind in NODE_FAULTS else fault.worker
        )
        self._armed.append(_Armed(fault, key, fault.nth))

    def _fire(self, a: _Armed) -> Fault:
        if a.fault.kind not in _REPEATING:
            a.done = True
        if not a.fired:
            a.fired = True
            self.fired.append(a.fault)
        return a.fault

    def _due(self, kind: str, ordinal: int, epoch: int, step: int) -> _Armed | None:
        for a in self._armed:
            f = a.fault
            if (
                f.kind == kind
                and a.key == ordinal
                and not a.done
                and (epoch, step) >= (f.epoch, f.step)
            ):
                return a
        return None

    def at_step(
        self, ordinal: int, epoch: int, step: int, share: int, cap: int | None
    ) -> Fault | None:
        """The worker's fault at this step, if one fires: ``share`` is its samples of the
        step, ``cap`` its micro-batch cap (an ``oom`` fires when the largest micro-batch
        exceeds the fault's ``batch``)."""
        for kind in _STEP_ORDER:
            a = self._due(kind, ordinal, epoch, step)
            if a is None or (kind == "oom" and largest_micro(share, cap) <= a.fault.batch):
                continue
            return self._fire(a)
        return None

    def step(
        self,
        names: Sequence[str],
        ordinals: Sequence[int],
        epoch: int,
        step: int,
        shares: np.ndarray,
        caps: Sequence[int | None],
        compute: np.ndarray,
        hang_s: float,
    ) -> StepFaults:
        """The faults of a step of the workers ``names`` (``ordinals``, their ``shares`` and
        micro-batch ``caps``). ``compute`` (each worker's seconds) is changed in place: a
        hung worker computes ``hang_s`` (past its peers' timeout and the grace), a straggler
        its fault's ``seconds`` more."""
        hit = StepFaults()
        for i, (w, ordinal) in enumerate(zip(names, ordinals, strict=True)):
            f = self.at_step(ordinal, epoch, step, int(shares[i]), caps[i])
            if f is None:
                continue
            hit.uneven = hit.uneven or f.uneven
            if f.kind == "die":
                hit.died.append(w)
            elif f.kind == "hang":
                hit.hung.append(w)
                compute[i] = hang_s
            elif f.kind == "straggle":
                compute[i] += f.seconds
            elif f.kind == "error":
                message = (
                    f"InjectedFault: injected error at epoch {epoch} step {step} (worker {ordinal})"
                )
                hit.errors[w] = ("compute", message, None)
            else:  # oom
                m = largest_micro(int(shares[i]), caps[i])
                message = (
                    f"OutOfMemoryError: CUDA out of memory (simulated: a micro-batch "
                    f"of {m} samples)"
                )
                hit.errors[w] = ("oom", message, m)
        return hit

    def result_lost(self, ordinal: int, epoch: int, last_step: int) -> bool:
        """A ``lose_result`` fault fires for the worker's segment ending at ``last_step``; its
        process is then armed to die one step into the next segment."""
        a = self._due("lose_result", ordinal, epoch, last_step)
        if a is None:
            return False
        self._fire(a)
        self.add(Fault(kind="die", worker=ordinal, epoch=epoch, step=last_step + 2))
        return True

    def counted(self, kind: str, key: int | tuple[str, int]) -> bool:
        """One more call of ``kind`` for the worker's ordinal or the node's (class, index):
        True when its fault fires now (its ``nth`` call)."""
        for a in self._armed:
            if a.fault.kind == kind and a.key == key and not a.done:
                a.left -= 1
                if a.left <= 0:
                    self._fire(a)
                    return True
                return False
        return False

    def eval_error(self, ordinal: int) -> str | None:
        """The message every evaluation of the worker's shard raises, if it has one."""
        for a in self._armed:
            if a.fault.kind == "eval_error" and a.key == ordinal:
                self._fire(a)
                return a.fault.error or EVAL_ERROR
        return None
