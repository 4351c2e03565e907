"""The ``dynabatch`` command line: ``run`` trains a config on Ray; client commands talk to
the REST service (see :mod:`dynabatch.api.cli.job_commands`)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="dynabatch",
    help="Heterogeneity-aware elastic training on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        from dynabatch.actors.export import dynabatch_version

        typer.echo(f"dynabatch {dynabatch_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True,
        help="Print the version and exit."),
) -> None:
    """Heterogeneity-aware elastic training on Ray."""


def _register() -> None:
    from dynabatch.api.cli import (
        cluster_commands,
        export_commands,
        job_commands,
        run,
        simulate,
        tune,
    )

    run.register(app)
    simulate.register(app)
    tune.register(app)
    job_commands.register(app)
    export_commands.register(app)
    cluster_commands.register(app)


def main() -> None:
    from dynabatch.service.install_check import ForeignPackage, check_own_install_once

    try:
        check_own_install_once()
    except ForeignPackage as err:
        typer.echo(f"error: {err}", err=True)
        raise SystemExit(2) from None
    _register()
    app()
