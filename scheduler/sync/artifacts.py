"""The trained model out: at the job's end, its final weights as safetensors with a manifest.
:func:`publish_model` is how every driver puts it out (the parameter server's too, from its
final weights); :class:`Artifacts` is the synchronous coordinator's part that calls it.

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

from dynabatch.actors.data.fs import join
from dynabatch.scheduler.sync.job import Part

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl


def publish_model(
    control: JobControl,
    *,
    input_shape: tuple[int, ...] | list[int],
    num_classes: int,
    state: dict[str, Any],
    epoch: int,
    reason: str,
    best: tuple[dict[str, Any] | None, int | None, dict[str, float] | None] = (None, None, None),
) -> None:
    """The one way a job's driver (synchronous or parameter server) puts its trained model
    out: build the files from ``state`` (a model state dict) and the last epoch's metrics,
    keep them in ``control`` (its ``model_files``), and write them to ``artifacts.dir/JOB_ID``
    when the spec sets it. ``best``: the best epoch's state, epoch and metrics, when kept. A
    problem (a state safetensors cannot hold, a directory it cannot write) is a WARNING in
    the job's log: the job still ends as it was going to."""
    from dynabatch.actors.data.source import DataError
    from dynabatch.actors.export import ExportError, model_files, write_files

    s = control.spec
    last = control._history[-1] if control._history else None
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
            job_id=control.job_id,
        )
    except ExportError as err:
        control._log("WARNING", f"model export ({reason}) skipped: {err}")
        return
    with control._lock:
        control._model_files = files
    if not s.artifacts.dir:
        control._log(
            "INFO",
            f"trained model ({reason}) at epoch {epoch}: kept for "
            f"download ({', '.join(sorted(files))})",
        )
        return
    target = join(s.artifacts.dir, control.job_id)
    try:
        write_files(files, target)
    except (ExportError, DataError) as err:
        control._log("WARNING", f"model export ({reason}): {err}")
        return
    control._log("INFO", f"trained model ({reason}) at epoch {epoch}: {target}")


class Artifacts(Part):
    def save(self, reason: str) -> None:
        """Build the model's files from the state a holder returns, keep them, and write
        them to ``artifacts.dir`` when it is set (:func:`publish_model`). A job whose
        holders cannot be read still ends as it was going to: a WARNING in its log."""
        job = self.job
        data = job.data
        if data is None or not data.input_shape or not data.num_classes:
            return
        state = self.held_state("model export")
        model = (state or {}).get("model")
        if not model:
            self.log("WARNING", f"model export ({reason}) skipped: no worker holds the state")
            return
        p = job.protocol
        epoch = p.epoch if p is not None else job.position.epoch
        publish_model(
            self.c,
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
        s = self.spec
        if getattr(s.checkpoint, "keep_best", None) is None or not s.checkpoint.dir:
            return None, None, None
        from dynabatch.scheduler.checkpoint import BEST, CheckpointError, load_checkpoint
        from dynabatch.scheduler.telemetry import EpochRecord

        try:
            ckpt = load_checkpoint(s.checkpoint.dir, self.c.job_id, BEST)
            if ckpt is None:
                return None, None, None
            state = ckpt["weights"]["model"]
            history = ckpt.get("history") or []
            rec = EpochRecord.model_validate(history[-1]) if history else None
            metrics = {"train_loss": rec.train_loss, **rec.scores} if rec else {}
            return state, ckpt.get("epoch"), metrics
        except (CheckpointError, KeyError, TypeError, ValueError) as err:
            self.log("WARNING", f"model export: the best weights are left out ({err})")
            return None, None, None
