"""Resolve and call user code named by an import path ``"pkg.mod:function"``.

User code fails in many ways (missing module, typo in the attribute, a module that raises
while importing, a function that raises); each becomes a :class:`WorkloadError` with one
line that names the spec field, so the job fails with a message the user can act on instead
of a traceback from deep inside a Ray worker.
"""

from __future__ import annotations

import inspect
import pkgutil
import re
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

from dynabatch.actors.errors import one_line
from dynabatch.actors.workloads import WorkloadError

_PATH = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)$")


class NotImportable(WorkloadError):
    """An import path whose module or attribute cannot be imported here (it may still be
    importable where the job runs: a cluster's own packages, a remote working_dir)."""


def describe(err: BaseException) -> str:
    """``TypeError: message`` on one line; just the type when the message is empty."""
    msg = one_line(str(err))
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


def resolve_callable(path: str, field: str) -> Callable[..., Any]:
    """Import ``module`` and return its callable ``attr`` for ``path = "module:attr"``.

    ``field`` (e.g. ``"dataset.name"``) prefixes every error message.
    """
    m = _PATH.match(path)
    if m is None:
        raise WorkloadError(
            f"{field}: {path!r} is not an import path of the form 'pkg.mod:function'"
        )
    module_name, attr = m["module"], m["attr"]
    was_loaded = module_name in sys.modules
    try:
        obj = pkgutil.resolve_name(path)
    except ImportError as err:
        raise NotImportable(
            f"{field}: cannot import module {module_name!r} ({one_line(str(err))})"
        ) from err
    except AttributeError as err:
        # resolve_name imports the module, then looks the attribute up: the module being
        # loaded now tells a missing attribute from a module whose own code raised it.
        if module_name in sys.modules and (was_loaded or getattr(err, "name", None) == attr
                                           or f"attribute {attr!r}" in str(err)):
            raise NotImportable(
                f"{field}: module {module_name!r} has no attribute {attr!r}"
            ) from err
        raise NotImportable(
            f"{field}: importing module {module_name!r} failed ({describe(err)})"
        ) from err
    except Exception as err:
        # The module exists but its top-level code failed; say so rather than "not found".
        raise NotImportable(
            f"{field}: importing module {module_name!r} failed ({describe(err)})"
        ) from err
    if not callable(obj):
        raise WorkloadError(f"{field}: {path!r} is not callable (it is a {type(obj).__name__})")
    return obj


def call_user(fn: Callable[..., Any], path: str, field: str, /, **options: Any) -> Any:
    """Call user code with ``options`` as keyword arguments, turning any exception it raises
    into a field-named WorkloadError. Our own parameters are positional-only, so a user's
    option may have any name (``path``, ``field``, ``fn``) and reaches ``fn`` as it is."""
    try:
        return fn(**options)
    except WorkloadError:
        raise
    except Exception as err:
        raise WorkloadError(f"{field}: {path!r} raised {describe(err)}") from err


def check_user_options(fn: Callable[..., Any], path: str, field: str,
                       options: Mapping[str, Any], passed: Collection[str] = ()) -> None:
    """Raise a WorkloadError when ``fn``'s signature cannot take ``options`` as keyword
    arguments (beside ``passed``, the names the service passes itself): an option it has no
    parameter for, or a parameter without a default that no option fills. ``field`` names
    the options (``dataset.options``). Read from the signature only, so it runs before
    anything is loaded or started; a callable whose signature Python cannot read is left to
    the call itself."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes = [p.name for p in named if p.name not in passed]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [k for k in options if k not in takes]
        if unknown:
            raise WorkloadError(f"{field}: unknown option {unknown[0]!r} for {path!r} "
                                f"(it takes: {', '.join(takes) or 'no options'})")
    for p in params:
        if p.default is not p.empty or p.name in passed or p.kind in (
                p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise WorkloadError(f"{field}: {path!r} has a positional-only parameter "
                                f"{p.name!r} without a default; options are passed by name")
        if p.name not in options:
            raise WorkloadError(f"{field}: {path!r} needs option {p.name!r} (it has no "
                                "default)")
