"""What the CLI's commands share: one-line errors (never a traceback), the REST client, and
the views that ``run`` and ``status`` both show. Tests inject a client through the click
context: ``obj={"client_factory": lambda url, token: DynabatchClient(...)}``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, NoReturn, TextIO

import typer
from dynabatch.actors.data.fs import is_uri, join
from dynabatch.actors.errors import one_line
from dynabatch.actors.spec import SpecError
from dynabatch.scheduler.core.cluster.ray_nodes import node_label
from dynabatch.scheduler.telemetry import JobSnapshot, PSStatus, StepBreakdown
from dynabatch.service.job_service import JOB_ID_PATTERN, WORKER_ID_PATTERN
from dynabatch.service.rest_client import ApiError, DynabatchClient
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

# The width of output that goes to a file or a pipe: wide enough that no table header is
# cut (``partit…``); a terminal keeps its own width.
PIPE_WIDTH = 250


class CliError(Exception):
    """A problem to report as one line (and exit 1)."""


def stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def out_console(file: TextIO | None = None, **kwargs: Any) -> Console:
    """A console for a command's output (stdout by default): a terminal's own width, or
    :data:`PIPE_WIDTH` columns when the output is not a terminal, so tables are never cut to
    an 80-column default."""
    console = Console(file=file, soft_wrap=True, **kwargs)
    if not console.is_terminal:
        console = Console(file=file, soft_wrap=True, width=PIPE_WIDTH, **kwargs)
    return console


def timestamp(t: float | None) -> str:
    """A log line's time, local, to the second; ``-`` when unknown."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, tz=UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def log_text(time: float | None, level: str, message: str) -> Text:
    """One job-log line as plain text: whatever the user's code printed is shown as it is,
    never read as rich markup (``[red]``) or emoji codes (``mydata:cancer``)."""
    return Text(f"{timestamp(time)} {level:<7} {message}")


def print_plain(console: Console, text: str | Text) -> None:
    """Print ``text`` as it is: no markup, emoji or highlighting."""
    console.print(text if isinstance(text, Text) else Text(text), markup=False, emoji=False,
                  highlight=False)


@contextmanager
def live_view(console: Console, *args: Any, **options: Any) -> Iterator[Live]:
    """A rich ``Live`` view that ends its last line, which rich does only on a terminal
    (Textualize/rich#4192): redirected, what follows would run on from the view."""
    try:
        with Live(*args, console=console, transient=False, **options) as live:
            yield live
    finally:
        if not console.is_terminal:
            console.line()


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn any failure in the block into one ``error: ...`` line and exit status 1 (130 on
    Ctrl-C); a ``typer.Exit`` raised in it passes through."""
    try:
        yield
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        stderr().print("interrupted")
        raise typer.Exit(130) from None
    except ApiError as err:
        # A 401 is the token (or its absence): say how a command is given one.
        hint = (" (pass --token or set DYNABATCH_API_TOKEN to the service's token)"
                if err.status == 401 else "")
        fail(stderr(), f"{err}{hint}", code=1)
    except (SpecError, CliError) as err:
        fail(stderr(), str(err), code=1)
    except Exception as err:  # last resort: still one line
        fail(stderr(), f"{type(err).__name__}: {err}", code=1)


@contextmanager
def api_client(
    ctx: typer.Context,
    url: str,
    token: str | None,
    *,
    job_id: str | None = None,
    worker: str | None = None,
) -> Iterator[DynabatchClient]:
    """The block of one client command: ``job_id`` and ``worker`` checked, a client of the
    API at ``url``, and any failure one ``error: ...`` line (:func:`one_line_errors`)."""
    with one_line_errors():
        if job_id is not None:
            check_job_id(job_id)
        if worker is not None:
            check_worker(worker)
        with make_client(ctx, url, token) as client:
            yield client


def check_job_id(job_id: str) -> None:
    if not re.fullmatch(JOB_ID_PATTERN, job_id):
        raise CliError(f"{job_id!r} is not a job id (12 lowercase hex digits, as submit prints)")


def check_worker(worker: str) -> None:
    if not re.fullmatch(WORKER_ID_PATTERN, worker):
        raise CliError(f"{worker!r} is not a worker id (w0, w1, ... as status lists them)")


def make_client(ctx: typer.Context, url: str, token: str | None) -> DynabatchClient:
    """The context's ``client_factory`` (tests) or a client of ``url``."""
    obj = ctx.find_root().obj
    factory = obj.get("client_factory") if isinstance(obj, dict) else None
    if factory is not None:
        return factory(url, token)
    return DynabatchClient(url, token=token)


_COLUMNS = (
    ("gather", "gather_s"), ("data wait", "data_wait_s"), ("forward", "forward_s"),
    ("backward", "backward_s"),
    ("all-reduce wait", "allreduce_wait_s"), ("optimizer", "optimizer_s"),
    ("coordinator", "coordinator_s"), ("evaluation", "evaluation_s"),
    ("evaluation hidden", "evaluation_hidden_s"), ("overlapped", "overlap_s"),
)


def workers_table(snap: JobSnapshot) -> Table:
    """Each worker's node, batch, partition and measured speed (``run``'s live view and
    ``status``); a parameter-server learner has no partition, step times or slowdown ("-";
    its staleness: :func:`ps_table`)."""
    t = Table(title="workers", expand=False)
    for col in ("worker", "node", "batch", "partition", "samples/s", "compute/step",
                "wait/step", "slowdown"):
        t.add_column(col, justify="left" if col in ("worker", "node") else "right")
    for w in snap.workers:
        measured = ("-",) * 5 if snap.ps is not None else (
            str(w.partition), f"{w.throughput:,.0f}", f"{w.compute_s_per_step * 1e3:.1f} ms",
            f"{w.wait_s_per_step * 1e3:.1f} ms", f"{w.slowdown:g}x")
        t.add_row(w.worker, node_label(w.node), str(w.batch), *measured)
    return t


def ps_table(ps: PSStatus) -> Table:
    """Per-learner staleness of a parameter-server job."""
    t = Table(title=f"parameter server ({ps.mode}): version {ps.version}, applied "
              f"{ps.applied}, refused {ps.refused}, {ps.pushes_per_s:,.1f} pushes/s",
              expand=False)
    for col in ("worker", "batch", "pushes", "applied", "refused", "staleness mean",
                "staleness max"):
        t.add_column(col, justify="left" if col == "worker" else "right")
    for w in ps.workers:
        t.add_row(w.worker + ("" if w.member else " (gone)"), str(w.batch), str(w.pushes),
                  str(w.applied), str(w.refused), f"{w.staleness_mean:.2f}",
                  str(w.staleness_max))
    return t


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


def fail(err: Console, message: str, code: int = 2) -> NoReturn:
    """A one-line CLI error on stderr (the message's whitespace folded), exit status
    ``code`` (2: a usage error)."""
    # The message is the user's text (a path, a value): never read as rich markup.
    print_plain(err, Text.assemble(("error:", "red"), " ", one_line(message)))
    raise typer.Exit(code)
