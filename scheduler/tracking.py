"""Experiment tracking: a job's scalars as TensorBoard event files (``tracking.tensorboard``).

One :class:`Tracking` sink per job, made by :class:`~dynabatch.scheduler.control.JobControl`:
the drivers hand it each epoch's record once its held-out scores are in
(:meth:`Tracking.epoch`, at step = the epoch) and each committed synchronous step's reports
(:meth:`Tracking.step`, at step = samples trained since the job began: monotone across
batch-size changes and the same after a resume). Tags: docs/spec.md, "Experiment tracking".

The files go to ``DIR/JOB_ID/`` on the machine that runs the job's driver. Tracking never
fails the job: the first error becomes one WARNING in the job log and the sink writes
nothing more. ``torch.utils.tensorboard`` is imported only by a job that tracks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from dynabatch.actors.contracts import StepTelemetry
from dynabatch.actors.data.fs import join
from dynabatch.actors.errors import first_line
from dynabatch.scheduler.telemetry import EpochRecord


def epoch_scalars(record: EpochRecord) -> dict[str, float]:
    """The epoch's scalars by TensorBoard tag."""
    out = {"epoch/train_loss": record.train_loss}
    for split in ("validation", "test"):  # each tag names the held-out split it is from
        loss, scores = record.held_out(split)
        if loss is not None:
            out[f"epoch/{split}_loss"] = loss
        for name, value in scores.items():
            out[f"epoch/{split}_{name}"] = value
    out["epoch/utilization"] = record.utilization
    out["epoch/compute_balance"] = record.compute_balance
    out["epoch/time_s"] = record.wall_s
    if record.wall_s > 0:
        out["epoch/samples_per_s"] = record.samples_trained / record.wall_s
    if record.global_batch is not None:
        out["epoch/global_batch"] = record.global_batch
    if record.lr is not None:
        out["epoch/lr"] = record.lr
    trained = sum(w.partition for w in record.workers)
    for w in record.workers:
        if trained:
            out[f"worker_share/{w.worker}"] = w.partition / trained
        out[f"worker_batch/{w.worker}"] = w.batch
    return out


def matrix_image(matrix: Sequence[Sequence[float]], cell: int = 16) -> Any:
    """A confusion matrix as a grey image ``(H, W)`` of uint8: each row (a true class)
    scaled by its count, so a cell's brightness is the fraction of the class predicted as
    the column's; ``cell`` pixels a side per cell."""
    import numpy as np

    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or not m.size:
        return None
    rows = m.sum(axis=1, keepdims=True)
    frac = np.divide(m, rows, out=np.zeros_like(m), where=rows > 0)
    img = np.round(frac * 255).astype(np.uint8)
    return np.kron(img, np.ones((cell, cell), dtype=np.uint8))


def _summary_writer(logdir: str) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=logdir)


class Tracking:
    """A job's tracking sink: TensorBoard event files under ``root/job_id/``, or nothing
    when ``root`` is None. ``warn`` gets the one line of the first failure."""

    def __init__(self, root: str | None, job_id: str, warn: Callable[[str], None]):
        self.logdir = join(root, job_id) if root else None
        self._warn = warn
        self._writer: Any = None
        self._broken = self.logdir is None  # nothing to write, or it failed once

    @property
    def active(self) -> bool:
        """Whether it still writes (tracking asked for, and no failure yet)."""
        return not self._broken

    def epoch(self, record: EpochRecord) -> None:
        """Write an epoch's scalars and tables and flush, so TensorBoard shows the epoch at
        once."""
        tables = {**{f"epoch/validation_{k}": m for k, m in record.validation_matrices.items()},
                  **{f"epoch/test_{k}": m for k, m in record.test_matrices.items()}}
        images = {tag: img for tag, m in tables.items() if (img := matrix_image(m)) is not None}
        self._write(record.epoch, epoch_scalars(record), flush=True, images=images)

    def step(self, reports: Sequence[StepTelemetry], dataset_size: int) -> None:
        """Write a committed step's scalars (queued: the writer's thread writes them)."""
        if self._broken or not reports:
            return
        first = reports[0]
        scalars: dict[str, float] = {"step/global_batch": first.step_size}
        samples = sum(r.samples for r in reports)
        if samples:
            scalars["step/loss"] = sum(r.loss_sum for r in reports) / samples
        self._write(first.epoch * dataset_size + first.step_start + first.step_size, scalars,
                    flush=False)

    def close(self) -> None:
        """Flush and close the files (the job's end); a later write opens them again."""
        writer, self._writer = self._writer, None
        if writer is None or self._broken:
            return
        try:
            writer.close()
        except Exception as err:  # never the job's failure
            self._fail(err)

    def _write(self, step: int, scalars: dict[str, float], flush: bool,
               images: dict[str, Any] | None = None) -> None:
        if self._broken:
            return
        try:
            if self._writer is None:
                self._writer = _summary_writer(self.logdir)
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, global_step=step)
            for tag, img in (images or {}).items():
                self._writer.add_image(tag, img, global_step=step, dataformats="HW")
            if flush:
                self._writer.flush()
        except Exception as err:  # a full disk, a path that is a file: never the job's
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        self._broken = True
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):  # it failed already: reported below
                writer.close()
        why = first_line(err, typed=False)
        self._warn(
            f"tracking.tensorboard: cannot write event files to {self.logdir} "
            f"({why}); the job goes on without them"
        )
