"""Checkpoints: save the job, restore it (resuming), roll back to it; and the trained model out.

A checkpoint holds a holder's weights, the ledger, the schedule's position and state, the
history and the counters. Restored weights stay here (:attr:`Checkpoints.weights`) until a
regroup loads them into the group. When a regroup finds no member
holding the committed state, the job rolls back to its last checkpoint or fails
(:class:`~dynabatch.scheduler.core.failures.FailurePolicy` decides which). Checkpoints need
torch, so ``dynabatch.scheduler.checkpoint`` is imported lazily: a simulated job keeps none.

At the job's end the model goes out from the same state a checkpoint saves, as safetensors
with a manifest (:meth:`~dynabatch.scheduler.control.JobControl.publish_model`, which the
parameter server's driver uses too), with the best epoch's weights (``checkpoint.keep_best``)
beside the final ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynabatch.actors.errors import first_line
from dynabatch.scheduler.core.failures import FailureEvent, RollBack
from dynabatch.scheduler.core.sync.protocol import Position
from dynabatch.scheduler.telemetry import EpochRecord

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl
    from dynabatch.scheduler.core.ledger import Ledger
    from dynabatch.scheduler.core.membership import Membership
    from dynabatch.scheduler.core.regime.regime import Regime
    from dynabatch.scheduler.core.sync.protocol import SyncProtocol
    from dynabatch.scheduler.runtime.seam import DataInfo
    from dynabatch.scheduler.sync.workforce import Workforce

# What :meth:`Checkpoints.restore` reads without a default: a file without them is not one of
# ours (or is damaged), and is named as such rather than failing on a KeyError.
_RESTORED = ("epoch", "step", "weights", "history", "counters")


class Checkpoints:
    def __init__(self, protocol: SyncProtocol, membership: Membership, regime: Regime,
                 ledger: Ledger, control: JobControl, workforce: Workforce):
        self.protocol, self.membership, self.regime = protocol, membership, regime
        self.ledger, self.control, self.workforce = ledger, control, workforce
        self.rollbacks = 0  # this coordinator's (the snapshot's rollbacks_total)
        # A restored checkpoint's weights, until a regroup loads them into the group (one
        # that fails must be able to load them again), and the rebalances its epoch made
        # before its position (written inside an epoch).
        self.weights: dict[str, Any] | None = None
        self.epoch_rebalances = 0

    def save(self, reason: str, position: Position | None = None,
             best: dict[str, Any] | None = None, epoch_rebalances: int = 0) -> None:
        """Save the job where it stands (or at ``position``: the epoch that just ended is
        saved as the start of the next). ``best``: this is the best epoch by a metric
        (keep_best; what it was judged by): written as ``best.pt``, not the latest.
        ``epoch_rebalances``: those the open epoch made before the position saved."""
        s = self.control.spec
        if not s.checkpoint.dir:
            return
        weights = self.workforce.held_state("checkpoint", self.weights)
        if weights is None:
            self.control.log("WARNING", f"checkpoint ({reason}) skipped: no worker holds the state")
            return
        pos = position or self.protocol.position
        payload = {
            "job_id": self.control.job_id,
            "spec": s.model_dump(mode="json"),
            "epoch": pos.epoch,
            "step": pos.step,
            "weights": weights,
            "ledger": self.ledger.to_state(),
            # The schedule's position: the batch trained there and the regime's state (ISGD
            # chart, noise estimate, goodput's batch); the LR follows from them.
            "schedule": {"epoch": pos.epoch, "step": pos.step,
                         "global_batch": self.protocol.global_batch,
                         "regime": self.regime.to_state()},
            "history": [r.model_dump(mode="json") for r in self.control.records],
            # (The job's rebalances: its history's and these; retried samples: the ledger's.)
            "counters": {
                "epoch_rebalances": epoch_rebalances,
                "next_ordinal": self.membership.next_ordinal,
            },
            "time": self.control.clock.time(),
            "reason": reason,
        }
        from dynabatch.scheduler.checkpoint import BEST, LATEST, save_checkpoint

        if best is not None:
            payload["best"] = best
        path = save_checkpoint(s.checkpoint.dir, self.control.job_id, payload,
                               LATEST if best is None else BEST)
        self.control.log("INFO", f"checkpoint ({reason}) at epoch {pos.epoch} step {pos.step}: "
                                 f"{path}")

    def resume(self) -> str | None:
        """A job given a new coordinator goes on from its own checkpoint, when it has one.
        When that cannot be loaded: one line naming the file and the problem, with which
        the job fails. Nothing is raised: this runs in the coordinator's constructor, and an
        actor whose constructor raised cannot show the job's end to anyone."""
        from dynabatch.scheduler.checkpoint import (
            CheckpointError,
            checkpoint_path,
            load_checkpoint,
        )

        path = checkpoint_path(self.control.spec.checkpoint.dir, self.control.job_id)
        try:
            ckpt = load_checkpoint(self.control.spec.checkpoint.dir, self.control.job_id)
            if ckpt is None:
                return None
            missing = [k for k in _RESTORED if k not in ckpt]
            if missing:
                raise CheckpointError(f"{path}: not a dynabatch checkpoint (it holds no "
                                      f"{', '.join(missing)})")
            try:
                self.restore(ckpt, why="resuming")
            except (KeyError, TypeError, ValueError) as err:  # a value of the wrong shape
                raise CheckpointError(f"{path}: cannot restore it ({first_line(err)})") from None
        except CheckpointError as err:
            return f"checkpoint: {err}"
        return None

    def restore(self, ckpt: dict[str, Any], why: str) -> None:
        pos = Position(ckpt["epoch"], ckpt["step"])
        with self.control.lock:
            self.control.records[:] = [EpochRecord.model_validate(r) for r in ckpt["history"]]
            c = ckpt["counters"]
            self.membership.restored(pos, c.get("next_ordinal", 0))
            # (An older checkpoint has the job's retried samples among its counters.)
            self.ledger.load_state(ckpt.get("ledger") or {}, c.get("retried_samples_total"))
            sched = ckpt.get("schedule") or {}
            self.regime.load_state(sched.get("regime") or {})
            # The batch trained there: the checkpoint's, else the regime's for that epoch.
            self.protocol.rewind(pos, sched.get("global_batch")
                                 or self.regime.batch_for(pos.epoch))
            self.weights, self.epoch_rebalances = ckpt["weights"], c.get("epoch_rebalances", 0)
        self.control.log("INFO" if why == "resuming" else "WARNING",
                         f"{why} from checkpoint at epoch {pos.epoch} step {pos.step}")

    def start_from(self, path: str) -> str | None:
        """A new job starts from another job's checkpoint (``checkpoint.from``): its weights,
        and its optimizer state when that job used the same optimizer (another optimizer's
        state does not fit this one); not its position, history or schedule, which are the
        other job's. The first regroup loads them into the group. When the file cannot be
        loaded: one line naming the field and file, with which the job fails."""
        from dynabatch.scheduler.checkpoint import CheckpointError, load_checkpoint_file

        try:
            ckpt = load_checkpoint_file(path)
            weights = ckpt.get("weights")
            if not isinstance(weights, dict):
                raise CheckpointError(f"{path}: not a dynabatch checkpoint (it holds no weights)")
        except CheckpointError as err:
            return f"checkpoint.from: {err}"
        source = ckpt.get("spec") or {}
        theirs = (source.get("optimizer") or {}).get("name")
        mine = self.control.spec.optimizer.name
        note = "weights and optimizer state"
        if "optimizer" in weights and theirs != mine:
            weights = {k: v for k, v in weights.items() if k != "optimizer"}
            note = f"weights (its {theirs} optimizer state does not fit {mine}: not loaded)"
        self.weights = weights
        self.control.log("INFO", f"starting from checkpoint {path} (job "
                                 f"{ckpt.get('job_id', '?')}, epoch {ckpt.get('epoch', '?')} step "
                                 f"{ckpt.get('step', '?')}): {note}")
        return None

    def loaded(self) -> None:
        """A group formed with the restored weights: they go (kept until then, so that a
        failed join can load them again)."""
        self.weights = None

    def roll_back(self) -> bool:
        """No member holds the committed state (the loop's rolling back): load the last
        checkpoint (True), or fail; the regroup goes on with its weights. (The loop settled
        the evaluations in flight first: the checkpoint's history replaces their records.)"""
        s = self.control.spec
        ckpt, error = None, None
        if s.checkpoint.dir:
            from dynabatch.scheduler.checkpoint import CheckpointError, load_checkpoint

            try:
                ckpt = load_checkpoint(s.checkpoint.dir, self.control.job_id)
            except CheckpointError as err:
                error = str(err)
        decision = self.workforce.failed(FailureEvent(
            "state_lost", position=self.membership.committed, error=error or "",
            checkpoint=ckpt is not None))
        if not isinstance(decision, RollBack):
            return False
        self.restore(ckpt, why=decision.reason)
        self.rollbacks += 1
        return True

    # ---------------------------------------------------------------- the model out
    def save_model(self, reason: str, data: DataInfo | None) -> None:
        """Build the model's files from the state a holder returns, keep them, and write
        them to ``artifacts.dir`` when it is set (the job control's ``publish_model``). A
        job whose runtime has no real model (a simulation without gradients) has none; one
        whose holders cannot be read still ends as it was going to: a WARNING in its log.
        ``data``: the job's, once loaded."""
        if data is None or not data.input_shape or not data.num_classes:
            return
        state = self.workforce.held_state("model export", self.weights)
        model = (state or {}).get("model")
        if not model:
            self.control.log("WARNING", f"model export ({reason}) skipped: no worker holds the "
                                        "state")
            return
        epoch = self.protocol.epoch
        self.control.publish_model(input_shape=data.input_shape, num_classes=data.num_classes,
                                   state=model, epoch=epoch, reason=reason, best=self._best())

    def _best(self) -> tuple[dict[str, Any] | None, int | None, dict[str, float] | None]:
        """The best epoch's model state, epoch (epochs trained) and metrics, from its
        checkpoint when the job keeps one (``checkpoint.keep_best``); Nones otherwise, or
        when it cannot be read (a WARNING: the final weights still go out)."""
        s = self.control.spec
        if s.checkpoint.keep_best is None or not s.checkpoint.dir:
            return None, None, None
        from dynabatch.scheduler.checkpoint import BEST, CheckpointError, load_checkpoint

        try:
            ckpt = load_checkpoint(s.checkpoint.dir, self.control.job_id, BEST)
            if ckpt is None:
                return None, None, None
            state = ckpt["weights"]["model"]
            history = ckpt.get("history") or []
            rec = EpochRecord.model_validate(history[-1]) if history else None
            metrics = {"train_loss": rec.train_loss, **rec.scores} if rec else {}
            return state, ckpt.get("epoch"), metrics
        except (CheckpointError, KeyError, TypeError, ValueError) as err:
            self.control.log("WARNING", f"model export: the best weights are left out ({err})")
            return None, None, None
