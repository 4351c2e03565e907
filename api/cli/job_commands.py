"""CLI subcommands of the REST service: ``serve`` runs it; the others are clients of it, at
``--url`` with ``--token``, and print any failure as one ``error: ...`` line
(:mod:`dynabatch.api.cli.common`)."""

from __future__ import annotations

import ipaddress
import os
import sys
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Annotated, Any

import typer
from dynabatch.actors.spec import SpecWarning, spec_warnings_caught
from dynabatch.api.cli.common import (
    CliError,
    api_client,
    breakdown_table,
    fail,
    live_view,
    log_text,
    make_client,
    one_line,
    one_line_errors,
    out_console,
    print_plain,
    ps_table,
    stderr,
    tensorboard_line,
    tensorboard_made,
    timestamp,
    workers_table,
)
from dynabatch.api.cli.config import SetOption, read_config, spec_warnings_shown
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.telemetry import LogLine, splits_text
from dynabatch.service.rest_client import DEFAULT_URL, DynabatchClient
from dynabatch.service.schemas import JobDetail
from rich.console import Group
from rich.table import Table
from rich.text import Text

Url = Annotated[
    str, typer.Option("--url", envvar="DYNABATCH_URL", help="Base URL of the dynabatch API.")
]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar="DYNABATCH_API_TOKEN", help="Bearer token.", show_default=False),
]
JobIdArg = Annotated[str, typer.Argument(help="Job id, as printed by submit.")]


def _job_table(job: Any) -> Group:
    state_style = {
        JobState.SUCCEEDED: "green",
        JobState.FAILED: "red",
        JobState.CANCELLED: "yellow",
    }.get(job.state, "cyan")
    head = Text.assemble(
        (f"{job.name} ", "bold"),
        (f"{job.job_id} ", "dim"),
        (f"[{job.state.value}]", state_style),
        f"  {job.progress}"
        + ("" if job.state.is_terminal else f"  step {job.step}/{job.steps_per_epoch}")
        + f"  policy {job.policy}  generation {job.generation}",
    )
    facts = []
    if job.train_loss is not None:
        facts.append(f"train loss {job.train_loss:.4f}")
    held = splits_text(getattr(job, "validation_metrics", None), job.test_metrics)
    if held:  # the job's own metrics, by their names in its spec, each split named
        facts.append(held)
    if job.utilization is not None:
        facts.append(f"utilization {job.utilization:.3f}")
    facts.append(f"rebalances {job.rebalances_total}")
    head.append("\n" + "  ".join(facts))
    if job.reason:
        head.append(f"\nreason: {job.reason}", style="dim")
    spec = getattr(job, "spec", None)
    # The folder is made at the job's first step: none for a job that ended before it.
    if spec is not None and spec.tracking.tensorboard and tensorboard_made(
            spec.tracking.tensorboard, job.job_id, here=False,
            trained=not job.state.is_terminal or job.epoch > 0 or job.step > 0):
        head.append("\n" + tensorboard_line(spec.tracking.tensorboard, job.job_id), style="dim")
    parts: list[Any] = [head, workers_table(job)]
    if job.step_breakdown is not None:
        parts.append(breakdown_table(job.step_breakdown))
    if job.ps is not None:
        parts.append(ps_table(job.ps))
    return Group(*parts)


def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [DYNABATCH_HOST].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [DYNABATCH_PORT].")] = None,
    address: Annotated[
        str | None,
        typer.Option(help="Ray cluster address; default: embedded Ray [RAY_ADDRESS]."),
    ] = None,
    db: Annotated[str | None, typer.Option(help="SQLite file [DYNABATCH_DB_PATH].")] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen on a non-loopback address even without DYNABATCH_API_TOKEN.",
        ),
    ] = False,
) -> None:
    """Run the REST API (uvicorn) connected to Ray."""
    with one_line_errors():
        _serve(insecure, host=host, port=port, ray_address=address, db_path=db)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the API on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # any other name may resolve to a public interface
        return False


def _serve(insecure: bool, **overrides: Any) -> None:
    import logging

    import uvicorn
    from dynabatch.api.app import create_app  # the composition root: serve starts the HTTP layer
    from dynabatch.service.job_service import build_service
    from dynabatch.service.service_errors import RayCallError
    from dynabatch.service.settings import Settings, settings_problems
    from pydantic import ValidationError

    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as err:
        problems = settings_problems(err)
        raise CliError(f"invalid settings ({len(problems)}): {'; '.join(problems)}") from None
    if settings.token is None and not insecure and not is_loopback(settings.host):
        # Whoever reaches an unauthenticated API can run jobs on the cluster: exit 2.
        fail(stderr(), f"refusing to listen on {settings.host} without DYNABATCH_API_TOKEN: "
             "anyone who can reach it could run jobs; set the token, bind 127.0.0.1, or pass "
             "--insecure")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A submitted spec's warnings go back to its submitter (the reply's ``warnings``); in
    # the service's own log they would be Python's form, pointing into pydantic.
    warnings.filterwarnings("ignore", category=SpecWarning)
    service = build_service(settings)
    try:
        service.cluster.connect()  # fail here, with one line, rather than in the lifespan
    except RayCallError as err:
        raise CliError(str(err)) from None
    app = create_app(settings, service=service)

    def past_deadline() -> None:
        # The graceful stop is stuck (on a Ray that is gone, say): record the live jobs as
        # the lifespan would have, and leave.
        logging.getLogger("dynabatch.service").warning(
            "shutdown took over %.0f s; exiting now", SHUTDOWN_DEADLINE_S)
        try:
            service.reconciler.interrupt_live()
        finally:
            _exit_now(0)

    server = graceful_server(
        uvicorn.Config(app, host=settings.host, port=settings.port,
                       log_level=settings.log_level),
        deadline_s=SHUTDOWN_DEADLINE_S, on_deadline=past_deadline,
        on_signal=service.reconciler.begin_shutdown,
    )
    try:
        server.run()
    finally:
        service.cluster.close()
        service.store.close()
    if server.signalled:
        # Asked to stop (SIGTERM, SIGINT), and stopped: exit 0, without the interpreter's
        # exit handlers (Ray's would wait on a GCS that the same signal may have ended).
        _exit_now(0)
    if not server.started:
        raise CliError(f"the API did not start on {settings.host}:{settings.port} "
                       "(see the log above)")


# How long `serve` may take to stop once signalled (SIGTERM or SIGINT, to it or to its whole
# process group); then it exits anyway, 0.
SHUTDOWN_DEADLINE_S = 4.0


def _exit_now(code: int) -> None:
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def graceful_server(config: Any, *, deadline_s: float, on_deadline: Any,
                    on_signal: Any) -> Any:
    """A uvicorn server that stops gracefully on SIGTERM or SIGINT and then lets ``serve``
    exit 0 (uvicorn itself raises the signal again once it stopped, so the process ends
    *by* the signal: status 143 for SIGTERM), with ``on_deadline`` called if the stop has
    not finished ``deadline_s`` after the first signal, and ``on_signal`` at the first
    signal (the service learns at once that its embedded Ray is going down with it)."""
    import signal
    import threading
    from contextlib import contextmanager

    import uvicorn

    class Server(uvicorn.Server):
        signalled = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.signalled:
                self.signalled = True
                on_signal()
                timer = threading.Timer(deadline_s, on_deadline)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        @contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def submit(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="Job config (YAML or JSON).")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the response as JSON.")] = False,
    wait: Annotated[bool, typer.Option(
        "--wait/--no-wait", help="Wait for the job, streaming its logs and a live table; "
        "exit 0 when it SUCCEEDED, 1 otherwise. --no-wait prints the id and returns.")] = True,
    working_dir: Annotated[Path | None, typer.Option(
        "--working-dir", help="Ship this directory with the job to every node: it is zipped "
        "and uploaded to the service (POST /v1/code), and Ray unpacks it on each node "
        "(runtime_env); import paths may then name its modules. The service must allow user "
        "code (DYNABATCH_USER_CODE_MODULES='*') and keep uploads (DYNABATCH_CODE_ROOT).")
    ] = None,
    interval: Annotated[float, typer.Option(min=0.02, help="Seconds between the "
                                            "server's checks for news.")] = 0.5,
    sets: SetOption = None,
) -> None:
    """Submit a job config: print its id (its page's URL on stderr), then follow it."""
    with one_line_errors():
        with spec_warnings_shown(config) as local:
            spec, _ = read_config(config, sets=sets or (), working_dir=working_dir)
        what = "--working-dir" if working_dir is not None else f"{config}: working_dir"
        with make_client(ctx, url, token) as client:
            job = client.submit_with_code(spec, what=what)
            if as_json:
                typer.echo(job.model_dump_json())
            else:
                typer.echo(job.job_id)
            # On stderr: stdout stays the id alone, for scripts.
            print_plain(stderr(), f"job page: {client.url}/jobs/{job.job_id}")
            for w in job.warnings:
                if w not in local:  # the same validation, already shown for the file
                    print_plain(stderr(), f"warning: {one_line(w)}")
            if wait and (code := _follow(client, job.job_id, interval)):
                raise typer.Exit(code)


def _follow(client: DynabatchClient, job_id: str, interval: float) -> int:
    """Stream the job's events: log lines scroll above a live table; the exit code is 0
    for SUCCEEDED, 1 otherwise."""
    console = out_console()
    final = None
    with live_view(console, auto_refresh=False) as live:
        for event, data in client.events(job_id, interval_s=interval):
            if event == "log":
                # The user's own output: printed as it is, never as markup or emoji.
                print_plain(live.console, log_text(data["time"], data["level"],
                                                   data["message"]))
            elif event in ("job", "end"):
                with spec_warnings_caught():  # read back: warned at the submission
                    final = JobDetail.model_validate(data)
                live.update(_job_table(final), refresh=True)
    assert final is not None  # events() ends with `end` or raises
    line = _outcome(final)
    if held := splits_text(getattr(final, "validation_metrics", None), final.test_metrics):
        line += f"; {held}"
    console.print(line, markup=False, highlight=False)
    return 0 if final.state == JobState.SUCCEEDED else 1


def list_jobs(
    ctx: typer.Context,
    url: Url = DEFAULT_URL,
    token: Token = None,
    state: Annotated[JobState | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the response as JSON.")] = False,
) -> None:
    """List jobs, newest first."""
    with api_client(ctx, url, token) as client:
        page = client.list(state, offset=offset, limit=limit)
        if as_json:
            typer.echo(page.model_dump_json())
            return
        table = Table(title=f"jobs ({page.total})", expand=False)
        for col in ("id", "name", "state", "progress", "workers", "created", "reason"):
            table.add_column(col)
        for j in page.items:
            table.add_row(
                j.job_id,
                j.name,
                j.state.value,
                j.progress,
                str(j.workers),
                timestamp(j.created_at),
                j.reason or "",
            )
        out_console().print(table)


def status(
    ctx: typer.Context,
    job_id: JobIdArg,
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the response as JSON.")] = False,
) -> None:
    """Show a job's state, progress and per-worker allocation."""
    with api_client(ctx, url, token, job_id=job_id) as client:
        job = client.get(job_id)
        if as_json:
            typer.echo(job.model_dump_json())
            return
        out_console().print(_job_table(job))


def watch(
    ctx: typer.Context,
    job_id: JobIdArg,
    url: Url = DEFAULT_URL,
    token: Token = None,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
) -> None:
    """Live table until the job ends; exit 0 when it SUCCEEDED, 1 otherwise."""
    console = out_console()
    with api_client(ctx, url, token, job_id=job_id) as client:
        job = client.get(job_id)
        with live_view(console, _job_table(job), auto_refresh=False) as live:
            while not job.state.is_terminal:
                time.sleep(interval)
                job = client.get(job_id)
                live.update(_job_table(job), refresh=True)
        console.print(_outcome(job), markup=False, highlight=False)
        if job.state != JobState.SUCCEEDED:
            raise typer.Exit(1)


def cancel(
    ctx: typer.Context,
    job_id: JobIdArg,
    url: Url = DEFAULT_URL,
    token: Token = None,
    reason: Annotated[str | None, typer.Option(help="Why (kept with the job).")] = None,
) -> None:
    """Cancel a job (409 if it already finished)."""

    with api_client(ctx, url, token, job_id=job_id) as client:
        job = client.cancel(job_id, reason)
        typer.echo(_outcome(job))


def logs(
    ctx: typer.Context,
    job_id: JobIdArg,
    url: Url = DEFAULT_URL,
    token: Token = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
    since: Annotated[int, typer.Option(min=0, help="First sequence number.")] = 0,
    tail: Annotated[int | None, typer.Option(
        "--tail", min=1, help="Only the last N lines (of those from --since on); with "
        "--follow, then the new ones.", show_default=False)] = None,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
) -> None:
    """Print a job's log lines: all of them, to the end (or the last N, --tail)."""
    with api_client(ctx, url, token, job_id=job_id) as client:
        backlog: deque[LogLine] = deque(maxlen=tail)
        since = client.read_logs(job_id, since, backlog.append)
        for line in backlog:
            _echo_log(line)
        while follow:
            seen = since
            since = client.read_logs(job_id, since, _echo_log)
            if since == seen and client.get(job_id).state.is_terminal:
                return
            time.sleep(interval)


def _outcome(job: Any) -> str:
    """``job ID STATE`` and the job's reason, if any."""
    return f"job {job.job_id} {job.state.value}" + (f": {job.reason}" if job.reason else "")


def _echo_log(line: LogLine) -> None:
    typer.echo(f"{timestamp(line.time)} {line.level:<7} {line.message}")


def _accepted(job: Any, what: str) -> str:
    line = f"job {job.job_id} {job.state.value}: {what}"
    names = ", ".join(w.worker for w in job.workers)
    return line + (f" (workers now: {names})" if names else "")


def scale(
    ctx: typer.Context,
    job_id: JobIdArg,
    workers: Annotated[int, typer.Argument(min=1, max=4096, help="Number of workers.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Run a job with exactly N workers from its next step boundary on."""

    with api_client(ctx, url, token, job_id=job_id) as client:
        job = client.scale(job_id, workers)
        typer.echo(_accepted(job, f"scale to {workers} workers requested"))
        if job.reason:  # e.g. no node has room for the workers asked for
            typer.echo(f"note: {job.reason}")


def drain(
    ctx: typer.Context,
    job_id: JobIdArg,
    worker: Annotated[str, typer.Argument(help="Worker id (w0, w1, ...), as status lists.")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Remove one worker gracefully at the job's next step boundary."""

    with api_client(ctx, url, token, job_id=job_id, worker=worker) as client:
        job = client.drain(job_id, worker)
        typer.echo(_accepted(job, f"drain of {worker} requested"))


def resume(
    ctx: typer.Context,
    job_id: JobIdArg,
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Resume a FAILED job (or one whose coordinator is gone) from its checkpoint."""

    with api_client(ctx, url, token, job_id=job_id) as client:
        job = client.resume(job_id)
        typer.echo(_outcome(job))


def register(app: typer.Typer) -> None:
    """Add ``serve``, ``submit``, ``list``, ``status``, ``watch``, ``cancel``, ``logs``,
    ``scale``, ``drain`` and ``resume``."""
    app.command("serve")(serve)
    app.command("submit")(submit)
    app.command("list")(list_jobs)
    app.command("status")(status)
    app.command("watch")(watch)
    app.command("cancel")(cancel)
    app.command("logs")(logs)
    app.command("scale")(scale)
    app.command("drain")(drain)
    app.command("resume")(resume)
