"""``dynabatch.run(spec)``: train a job from a script or a notebook, as ``dynabatch run`` does.

The job runs on an embedded local Ray (or the cluster at ``address``) through the command's
own path (:func:`dynabatch.api.cli.run.run_job`); instead of the command's live table, a
tqdm progress bar counts the job's steps, one line per finished epoch is printed above it
(the table's columns), and the job's log lines scroll above both. Where nothing redraws
a line (output redirected to a file or a pipe), the bar is a plain progress line now and
then (:class:`PlainProgress`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynabatch.actors.data.fs import join
from dynabatch.actors.export import has_model
from dynabatch.actors.spec import SpecError
from dynabatch.api.cli.common import one_line, out_console
from dynabatch.api.cli.run import (
    EPOCH_COLUMNS,
    epoch_cells,
    run_job,
    run_problem,
)
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, scores_text
from dynabatch.specs import SpecLike, resolve_spec

__all__ = ["RunResult", "run"]


@dataclass(frozen=True)
class RunResult:
    """How an embedded run ended: its final ``state`` (and ``reason``), the held-out
    ``test_metrics``, one :class:`EpochRecord` per finished epoch (``history``), the last
    ``snapshot``, and where the trained model was written (``model_dir``: the spec's
    ``artifacts.dir/JOB_ID``, for ``dynabatch.load_model``; None without ``artifacts.dir``)."""

    job_id: str
    state: JobState
    reason: str | None
    test_metrics: dict[str, float]
    history: list[EpochRecord]
    snapshot: JobSnapshot
    model_dir: str | None

    @property
    def succeeded(self) -> bool:
        return self.state == JobState.SUCCEEDED


def run(
    spec: SpecLike,
    *,
    address: str | None = None,
    progress: bool = True,
    working_dir: str | os.PathLike[str] | None = None,
    report: str | os.PathLike[str] | None = None,
    scheduler: bool | None = None,
) -> RunResult:
    """Train ``spec`` to its end and return a :class:`RunResult`.

    ``spec`` is a :class:`JobSpec`, a dict of its fields or a config file's path.
    ``address`` names a Ray cluster (default: ``RAY_ADDRESS``, else an embedded local Ray
    started in this process); ``working_dir`` ships a local directory with the job (its
    modules importable by the spec's import paths); ``report`` writes the JSON report (and
    its plots) as ``dynabatch run --report``; ``scheduler`` is ``--scheduler`` /
    ``--no-scheduler``. ``progress`` False leaves out the bar and the epoch lines (the job's
    log lines still print). The first Ctrl-C (interrupting the kernel) cancels the job at its
    next step boundary; a second aborts.

    A job that fails or is cancelled is a result, not an exception. Raises
    :class:`SpecError` (one line naming the field) before Ray starts when the spec, or an
    option of its dataset or model, is not valid; ``ValueError`` when ``report``'s folder
    cannot be made or written; ``ConnectionError`` when the cluster at
    ``address`` cannot be reached.
    """
    _, job, _ = resolve_spec(spec, working_dir=working_dir)
    # Before the job trains, not after: a typo or a report that cannot be written is found now.
    if found := run_problem(job, address=address, scheduler=scheduler, report=report):
        option, problem = found
        raise SpecError([problem]) if option == "spec" else ValueError(f"{option}: {problem}")
    view = ProgressView(enabled=progress)
    try:
        snap = run_job(
            job,
            address=address,
            report=Path(report) if report else None,
            quiet=True,
            console=view.console,
            scheduler=scheduler,
            on_update=view.update,
        )
    except ConnectionError as err:
        raise ConnectionError(f"cannot reach Ray at {address}: {one_line(str(err))}") from None
    finally:
        view.close()
    model_dir = None
    if job.artifacts.dir:
        place = join(job.artifacts.dir, snap.job_id)
        model_dir = place if has_model(place) else None
    return RunResult(
        job_id=snap.job_id,
        state=snap.state,
        reason=snap.reason,
        test_metrics=dict(snap.test_metrics or {}),
        history=view.history,
        snapshot=snap,
        model_dir=model_dir,
    )


class ProgressView:
    """The job as a tqdm bar over its steps (loss, held-out metrics and utilization after
    it), a line per finished epoch above the bar, and a rich console that prints the job's
    log lines above it too (through ``tqdm.write``, so the bar is redrawn below them)."""

    def __init__(self, *, enabled: bool, file: Any = None):
        from tqdm.contrib import DummyTqdmFile

        self.enabled = enabled
        self.file = file if file is not None else sys.stdout
        # Plain text to a file-like (never a notebook's HTML nor a terminal's cursor moves):
        # tqdm owns the bottom line.
        self.console = out_console(
            file=DummyTqdmFile(self.file), force_terminal=False, force_jupyter=False
        )
        self.history: list[EpochRecord] = []
        self._bar: Any = None
        self._widths = [max(len(c), 9) for c in EPOCH_COLUMNS]

    def _row(self, cells: list[str] | tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, self._widths, strict=True))

    def update(self, snap: JobSnapshot, history: list[EpochRecord]) -> None:
        fresh = history[len(self.history) :]
        self.history = list(history)
        if not self.enabled:
            return
        steps = max(snap.steps_per_epoch, 0)
        total = snap.epochs * steps or None
        if self._bar is None:
            self._bar = (_tqdm(total=total, desc=snap.name, unit="step", file=self.file)
                         if _draws_a_bar(self.file) else PlainProgress(self.file, snap.name))
            self._bar.write(self._row(EPOCH_COLUMNS), file=self.file)
        for record in fresh:
            self._bar.write(self._row(epoch_cells(record)), file=self.file)
        done = snap.epoch * steps + snap.step
        if snap.state == JobState.SUCCEEDED and total:
            done = total
        self._bar.total = total
        self._bar.n = min(done, total) if total else done
        facts = [f"epoch {min(snap.epoch + 1, snap.epochs)}/{snap.epochs}"]
        if snap.train_loss is not None:
            facts.append(f"loss {snap.train_loss:.4f}")
        if snap.test_metrics:
            facts.append(scores_text(snap.test_metrics))
        if snap.utilization is not None:
            facts.append(f"utilization {snap.utilization:.3f}")
        if snap.state.is_terminal:
            facts.append(snap.state.value)
        self._bar.set_postfix_str(", ".join(facts), refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# How often a redirected run prints a progress line between its epochs' lines.
PROGRESS_EVERY_S = 30.0


class PlainProgress:
    """The bar's stand-in where nothing redraws a line (output to a file or a pipe): a plain
    progress line when the epoch changes, at the end and at most every
    :data:`PROGRESS_EVERY_S` in between."""

    def __init__(self, file: Any, desc: str):
        self.file, self.desc = file, desc
        self.n: int = 0
        self.total: int | None = None
        self._last: tuple[float, str] | None = None  # when, and the epoch, last printed

    def write(self, line: str, file: Any = None) -> None:
        print(line, file=file or self.file, flush=True)

    def set_postfix_str(self, facts: str, refresh: bool = True) -> None:
        import time

        epoch = facts.split(",", 1)[0]
        now = time.monotonic()
        ended = facts.endswith(tuple(s.value for s in JobState if s.is_terminal))
        if (self._last is not None and not ended and epoch == self._last[1]
                and now - self._last[0] < PROGRESS_EVERY_S):
            return
        self._last = (now, epoch)
        if self.total:
            steps = f"step {self.n}/{self.total} ({100 * self.n // self.total}%)"
        else:
            steps = f"step {self.n}"
        self.write(f"{self.desc}: {steps}, {facts}")

    def close(self) -> None:
        self.file.flush()


def _draws_a_bar(file: Any) -> bool:
    """Whether a bar can redraw its line here: a terminal, or a notebook (whose output is
    no terminal, but shows tqdm's bar)."""
    isatty = getattr(file, "isatty", None)
    if isatty is not None and isatty():
        return True
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _tqdm(**kwargs: Any) -> Any:
    """A notebook's widget bar where ipywidgets is installed, else tqdm's text bar (which
    a notebook shows too)."""
    from tqdm import tqdm
    from tqdm.auto import tqdm as auto

    try:
        return auto(**kwargs)
    except ImportError:  # a notebook without ipywidgets: tqdm.notebook cannot draw
        return tqdm(**kwargs)
