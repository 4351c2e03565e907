"""Resolve and call user code named by an import path ``"pkg.mod:function"``.

User code fails in many ways (missing module, typo in the attribute, a module that raises
while importing, a function that raises); each becomes a :class:`WorkloadError` with one
line that names the spec field, so the job fails with a message the user can act on instead
of a traceback from deep inside a Ray worker.
"""

from __future__ import annotations

import pkgutil
import re
import sys
from collections.abc import Callable
from typing import Any

from dynabatch.actors.workloads import WorkloadError

_PATH = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)$")


def one_line(text: str) -> str:
    """Collapse whitespace (tracebacks, multi-line messages) so errors stay one line."""
    return " ".join(str(text).split())


def describe(err: BaseException) -> str:
    """``TypeError: message`` on one line; just the type when the message is empty."""
    msg = one_line(str(err))
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


def is_import_path(name: str) -> bool:
    return _PATH.match(name) is not None


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
        raise WorkloadError(
            f"{field}: cannot import module {module_name!r} ({one_line(str(err))})"
        ) from err
    except AttributeError as err:
        # resolve_name imports the module, then looks the attribute up: the module being
        # loaded now tells a missing attribute from a module whose own code raised it.
        if module_name in sys.modules and (was_loaded or _failed_in_lookup(err, attr)):
            raise WorkloadError(
                f"{field}: module {module_name!r} has no attribute {attr!r}"
            ) from err
        raise WorkloadError(
            f"{field}: importing module {module_name!r} failed ({describe(err)})"
        ) from err
    except Exception as err:
        # The module exists but its top-level code failed; say so rather than "not found".
        raise WorkloadError(
            f"{field}: importing module {module_name!r} failed ({describe(err)})"
        ) from err
    if not callable(obj):
        raise WorkloadError(f"{field}: {path!r} is not callable (it is a {type(obj).__name__})")
    return obj


def _failed_in_lookup(err: AttributeError, attr: str) -> bool:
    return getattr(err, "name", None) == attr or f"attribute {attr!r}" in str(err)


def call_user(fn: Callable[..., Any], path: str, field: str, **kwargs: Any) -> Any:
    """Call user code, turning any exception it raises into a field-named WorkloadError."""
    try:
        return fn(**kwargs)
    except WorkloadError:
        raise
    except Exception as err:
        raise WorkloadError(f"{field}: {path!r} raised {describe(err)}") from err
