"""Reading a job spec from a mapping or a YAML (or JSON) file, with one-line errors.

``str(SpecError)`` is always a single line: one ``field: problem`` entry per problem (every
invalid combination its own entry), joined by ``; ``. A setting accepted but without effect
is a :class:`SpecWarning`, which :func:`spec_warnings_caught` collects for a front end to
show as its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from dynabatch.actors.spec.schema import JobSpec
from dynabatch.actors.spec.sections import SPEC_WARNINGS_SINK
from dynabatch.actors.spec.validation import CombinationError
from pydantic import ValidationError


class SpecError(ValueError):
    """A job spec that failed validation, as one readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = [" ".join(p.split()) for p in problems]  # one line each
        super().__init__("; ".join(self.problems))


def format_validation_error(err: ValidationError) -> list[str]:
    """One ``field: problem`` string per error, e.g. ``global_batch: Input should be ...``."""
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, CombinationError):
            prefix = f"{loc}." if loc else ""
            out.extend(f"{prefix}{field}: {problem}" for field, problem in cause.problems)
            continue
        loc = loc or "spec"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        msg = msg.removeprefix("Value error, ")
        out.append(f"{loc}: {msg}")
    return out


def parse_spec(data: Any) -> JobSpec:
    """Validate a mapping into a JobSpec, raising SpecError with field-named messages."""
    if not isinstance(data, dict):
        raise SpecError([f"spec: expected a mapping of fields, got {type(data).__name__}"])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read a YAML (or JSON) config file into a JobSpec. Errors do not repeat the path:
    the callers (the CLI commands) name the file once, before any error."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError([f"cannot read config ({err.strerror})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError([f"not valid YAML ({err})".replace("\n", " ")]) from None
    return parse_spec(data)


@contextmanager
def spec_warnings_caught() -> Iterator[list[str]]:
    """Collect the :class:`SpecWarning`\\ s that validating a spec in the block raises
    (each message once), instead of letting Python show them in its form, whose file and
    line point into pydantic. Yields the list their messages are put in, for the caller to
    show as its own (the CLI's lines, the REST reply, the Python API's warning at the
    user's line), or to drop (a spec read back: warned about once, at its submission).
    Only this thread's (or task's) validations are collected, and no
    ``warnings`` filter changes: warnings of other kinds, and other threads' spec
    warnings, go on as they come, also when the block raises."""
    messages: list[str] = []
    token = SPEC_WARNINGS_SINK.set(messages)
    try:
        yield messages
    finally:
        SPEC_WARNINGS_SINK.reset(token)

