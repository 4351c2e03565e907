"""What ``dynabatch run`` and ``status`` both show: the per-step time breakdown as a table,
and where a job's TensorBoard event files are."""

from __future__ import annotations

import os
from typing import NoReturn

import typer
from dynabatch.actors.data.fs import is_uri, join
from dynabatch.scheduler.telemetry import StepBreakdown
from rich.console import Console
from rich.table import Table

_COLUMNS = (
    ("gather", "gather_s"), ("data wait", "data_wait_s"), ("forward", "forward_s"),
    ("backward", "backward_s"),
    ("all-reduce wait", "allreduce_wait_s"), ("optimizer", "optimizer_s"),
    ("coordinator", "coordinator_s"), ("evaluation", "evaluation_s"),
    ("evaluation hidden", "evaluation_hidden_s"), ("overlapped", "overlap_s"),
)


def breakdown_table(b: StepBreakdown) -> Table:
    """One row: milliseconds per step in each phase (last epoch), and the micro-batches.
    "evaluation" is what evaluating cost the critical path; "evaluation hidden" the rest of
    its work, which splitting it across the holders kept off it."""
    table = Table(title="where a step's time goes (last epoch, ms per step)", expand=False)
    for title, _ in _COLUMNS:
        table.add_column(title, justify="right")
    table.add_column("micro-batches", justify="right")
    table.add_row(*(f"{getattr(b, key) * 1e3:.1f}" for _, key in _COLUMNS),
                  f"{b.micro_batches:.2g}")
    return table


def tensorboard_line(root: str, job_id: str) -> str:
    """Where a job's TensorBoard event files are (``tracking.tensorboard``: ``root``), and
    how to view them, in one line."""
    return (f"TensorBoard event files: {join(root, job_id)} "
            f"(view: tensorboard --logdir {root})")


def tensorboard_made(root: str, job_id: str, *, trained: bool, here: bool) -> bool:
    """Whether the job's TensorBoard folder exists (its tracking makes it at the first
    step it writes): looked at when ``here`` (the job's driver runs on this machine and
    ``root`` is a local path), else told by ``trained`` (the job trained a step)."""
    if here and not is_uri(root):
        return os.path.isdir(join(os.path.expanduser(root), job_id))
    return trained


def fail(err: Console, message: str) -> NoReturn:
    """A one-line CLI error on stderr (the message's whitespace folded), exit status 2."""
    err.print(f"[red]error:[/] {' '.join(message.split())}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)
