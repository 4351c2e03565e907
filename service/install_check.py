"""Start-up check: ``dynabatch.api``, ``.service``, ``.scheduler`` and ``.actors`` are our own.

They are installed under the ``dynabatch`` namespace (setup.py), so a user's bare
``scheduler.py`` cannot shadow them; but pip installs a distribution's files into
``site-packages/dynabatch/<name>/`` whoever else owns that folder, so another distribution
could merge into one of ours, or put its own ``dynabatch/<name>`` earlier on ``sys.path``.
Either way dynabatch would run someone else's code. :func:`check_own_install` fails at
start-up with one line instead:

* each package must be a regular package (an ``__init__.py``) in the same directory as
  this one's parent (where dynabatch is installed or checked out);
* no other installed distribution may own a file in those package folders
  (``importlib.metadata``'s file lists).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
from pathlib import Path

PACKAGES = ("api", "service", "scheduler", "actors")
DISTRIBUTION = "dynabatch"
NAMESPACE = "dynabatch"


class ForeignPackage(RuntimeError):
    """A dynabatch package name resolves to, or shares files with, another distribution."""


def check_own_install(root: Path | None = None) -> None:
    root = root or Path(__file__).resolve().parents[1]
    for name in PACKAGES:
        module = importlib.import_module(f"{NAMESPACE}.{name}")
        paths = [Path(p).resolve() for p in getattr(module, "__path__", [])]
        init = getattr(module, "__file__", None)
        if paths != [root / name] or init is None:
            raise ForeignPackage(
                f"the package {name!r} is imported from {', '.join(map(str, paths)) or '?'}, "
                f"not from dynabatch's install at {root / name}: another distribution named "
                f"{name!r} is in the way (pip uninstall it, or use a separate environment)"
            )
    for dist in md.distributions():
        dist_name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if dist_name == DISTRIBUTION:
            continue
        for f in dist.files or ():
            top = next((p for p in f.parts[:2] if p in PACKAGES), "")
            if top and Path(dist.locate_file(f)).resolve().is_relative_to(root / top):
                raise ForeignPackage(
                    f"the distribution {dist.metadata['Name']!r} installed files into "
                    f"dynabatch's package {top!r} ({f}): pip uninstall it, or use a separate "
                    "environment"
                )


@functools.cache
def check_own_install_once() -> None:
    """:func:`check_own_install`, once per process: it reads every installed distribution's
    file list (about half a second). A failure is not cached: it raises every time."""
    check_own_install()
