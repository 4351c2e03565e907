"""Reading a job config for ``run`` and ``submit``: the file, ``--set`` overrides, and a local
``working_dir`` resolved against the config's own folder.

Every problem is one :class:`CliError` line naming the file and the field (or the option):
``job.yaml: working_dir: /home/me/mycode is not a directory (...)``. A setting the spec
accepts but that has no effect is one ``warning: job.yaml: ...`` line
(:func:`spec_warnings_shown`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from dynabatch.actors.spec import JobSpec, SpecError, parse_spec, spec_warnings_caught
from dynabatch.api.cli.common import CliError, one_line, print_plain, stderr
from dynabatch.service.code_store import local_working_dir

# ``--set FIELD=VALUE`` of ``run`` and ``submit``: one option, read by :func:`read_config`.
SetOption = Annotated[list[str] | None, typer.Option(
    "--set", metavar="FIELD=VALUE", help="Override a field of the config, e.g. "
    "--set epochs=3 --set optimizer.lr=0.01 (repeatable; the value is YAML).")]


@contextmanager
def spec_warnings_shown(config: Path | str) -> Iterator[list[str]]:
    """:func:`spec_warnings_caught`, shown as the CLI's own lines on stderr once the block
    ends, ``warning: CONFIG: message``. The messages stay in the yielded list, so ``submit``
    does not repeat the ones the service sends back."""
    with spec_warnings_caught() as messages:
        yield messages
    for m in messages:
        print_plain(stderr(), f"warning: {config}: {one_line(m)}")


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def parse_set(item: str) -> tuple[list[str], Any]:
    """``field.sub=value`` as (["field", "sub"], value); the value is read as YAML, so
    ``epochs=3`` is a number, ``micro_batch=[64,32]`` a list, ``policy=dbs`` a string."""
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not _KEY.match(key):
        raise CliError(f"--set {item!r}: expected FIELD=VALUE, e.g. epochs=3 or "
                       "optimizer.lr=0.01")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise CliError(f"--set {key}: the value is not valid YAML ({one_line(str(err))})") from None
    return key.split("."), value


def apply_sets(data: dict[str, Any], sets: Sequence[str]) -> None:
    """Apply ``--set field.sub=value`` overrides to a config's mapping, in order."""
    for item in sets:
        path, value = parse_set(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif isinstance(child, str) and part in ("dataset", "model", "optimizer"):
                child = node[part] = {"name": child}  # the short form of a section
            elif not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise CliError(f"--set {'.'.join(path)}: {where} is not a section of fields")
            node = child
        node[path[-1]] = value


def _absolute(p: Path) -> Path:
    """``p`` made absolute, ``..`` folded (symlinks kept)."""
    return Path(os.path.normpath(p.expanduser().absolute()))


def read_config(
    path: Path, *, sets: Sequence[str] = (), working_dir: Path | None = None,
    working_dir_name: str = "--working-dir",
) -> tuple[dict[str, Any], JobSpec]:
    """The config at ``path`` as a mapping and a validated spec (:func:`mapping_config`)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise CliError(f"{path}: cannot read config ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CliError(f"{path}: not valid YAML ({one_line(str(err))})") from None
    if data is None:
        data = {}
    return mapping_config(data, sets=sets, working_dir=working_dir, config=path,
                          working_dir_name=working_dir_name)


def mapping_config(
    data: Any, *, sets: Sequence[str] = (), working_dir: Path | None = None,
    config: Path | None = None, working_dir_name: str = "--working-dir",
) -> tuple[dict[str, Any], JobSpec]:
    """A config's mapping (``data``, changed in place) with ``sets`` applied and its local
    ``working_dir`` made absolute, and the validated spec. A relative ``working_dir`` is read
    from the ``config`` file's folder (as ``include``s are), else from the current directory,
    as the ``working_dir`` override is; errors name the file."""
    prefix = f"{config}: " if config is not None else ""
    if not isinstance(data, dict):
        raise CliError(f"{prefix}spec: expected a mapping of fields, got {type(data).__name__}")
    apply_sets(data, sets)
    if working_dir is not None:
        local, what = _absolute(Path(working_dir)), working_dir_name
    elif local_working_dir(data.get("working_dir")):
        named = Path(data["working_dir"]).expanduser()
        base = config.parent if config is not None else Path.cwd()
        local, what = _absolute(base / named), f"{prefix}working_dir"
    else:
        local, what = None, ""
    if local is not None:
        if not local.is_dir():
            hint = (" (a relative working_dir is read from the config's folder)"
                    if config is not None and what != working_dir_name
                    and not Path(data["working_dir"]).is_absolute() else "")
            raise CliError(f"{what}: {local} is not a directory{hint}")
        data["working_dir"] = str(local)
    try:
        spec = parse_spec(data)
    except SpecError as err:
        raise CliError(f"{prefix}{err}") from None
    return data, spec
