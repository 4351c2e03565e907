"""``dynabatch export ID -o DIR``: a job's trained model (``GET /v1/jobs/{id}/model``)
unpacked into a directory, for ``dynabatch.load_model(DIR)`` or, ``--format hf``, for
``transformers``' ``from_pretrained(DIR)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from dynabatch.actors.export import EXPORT_FORMATS
from dynabatch.api.cli.common import CliError, api_client
from dynabatch.api.cli.job_commands import JobIdArg, Token, Url
from dynabatch.service.artifacts import unzip_model, write_hf_export
from dynabatch.service.rest_client import DEFAULT_URL


def export(
    ctx: typer.Context,
    job_id: JobIdArg,
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Directory to write the model's files into (created)."),
    ],
    fmt: Annotated[
        str,
        typer.Option("--format", help="dynabatch: safetensors and manifest, for "
                     "dynabatch.load_model; hf: a Hugging Face folder (config.json, "
                     "model.safetensors, the tokenizer) for transformers' from_pretrained."),
    ] = "dynabatch",
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Download a job's trained model (safetensors and manifest) into a directory."""
    if fmt not in EXPORT_FORMATS:
        raise CliError(f"--format: must be {' or '.join(EXPORT_FORMATS)}, got {fmt!r}")
    with api_client(ctx, url, token, job_id=job_id) as client:
        if out.exists() and not out.is_dir():
            raise CliError(f"--out: {out} is a file, not a directory")
        data = client.model(job_id)
        try:
            names = write_hf_export(data, out) if fmt == "hf" else unzip_model(data, out)
        except (ValueError, OSError) as err:
            raise CliError(f"--out: {out}: {err}") from None
        typer.echo(f"job {job_id}: {', '.join(names)} written to {out}")


def register(app: typer.Typer) -> None:
    """Add ``export``."""
    app.command("export")(export)
