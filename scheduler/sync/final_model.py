"""The trained model out: at the job's end, its final weights as safetensors with a manifest.
:meth:`~dynabatch.scheduler.control.JobControl.publish_model` is how every driver puts it out
(the parameter server's too, from its final weights); :class:`FinalModel` is the synchronous
coordinator's part that calls it.

The files (:mod:`dynabatch.actors.export`) are built from the state a holder returns, the
same state a checkpoint saves, and kept by the coordinator (:meth:`~dynabatch.scheduler.
control.JobControl.model_files`) until it is released; the service copies them then. With
``artifacts.dir`` they are also written to ``DIR/JOB_ID/`` (a local path or a ``pyarrow.fs``
URI). With ``checkpoint.keep_best``, the best epoch's weights come from its checkpoint
(``best.pt``) and go beside the final ones. A job whose runtime has no real model (a
simulation without gradients) has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl
    from dynabatch.scheduler.sync.job import SyncJob
    from dynabatch.scheduler.sync.workforce import Workforce



class FinalModel:
    def __init__(self, job: SyncJob, control: JobControl, workforce: Workforce):
        self.job, self.control, self.workforce = job, control, workforce

    def save(self, reason: str) -> None:
        """Build the model's files from the state a holder returns, keep them, and write
        them to ``artifacts.dir`` when it is set (the job control's ``publish_model``). A job whose
        holders cannot be read still ends as it was going to: a WARNING in its log."""
        job = self.job
        data = job.data
        if data is None or not data.input_shape or not data.num_classes:
            return
        state = self.workforce.held_state("model export", job.start.weights)
        model = (state or {}).get("model")
        if not model:
            self.control.log("WARNING", f"model export ({reason}) skipped: no worker holds the "
                                        "state")
            return
        p = job.protocol
        epoch = p.epoch if p is not None else job.start.position.epoch
        self.control.publish_model(
            input_shape=data.input_shape,
            num_classes=data.num_classes,
            state=model,
            epoch=epoch,
            reason=reason,
            best=self._best(),
        )

    def _best(self) -> tuple[dict[str, Any] | None, int | None, dict[str, float] | None]:
        """The best epoch's model state, epoch (epochs trained) and metrics, from its
        checkpoint when the job keeps one (``checkpoint.keep_best``); Nones otherwise, or
        when it cannot be read (a WARNING: the final weights still go out)."""
        s = self.control.spec
        if getattr(s.checkpoint, "keep_best", None) is None or not s.checkpoint.dir:
            return None, None, None
        from dynabatch.scheduler.checkpoint import BEST, CheckpointError, load_checkpoint
        from dynabatch.scheduler.telemetry import EpochRecord

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
