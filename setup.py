"""Maps the repository's four top-level folders onto the ``dynabatch`` import namespace.

``service/``, ``actors/``, ``scheduler/`` and ``api/`` stay where the design card puts them;
installed, they are ``dynabatch.service``, ``dynabatch.actors``, ``dynabatch.scheduler`` and
``dynabatch.api`` (``dynabatch`` itself is a namespace package with no code of its own), so a
module a user ships with a job under one of those bare names cannot shadow ours. Everything
else about the build is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

TOP = ("service", "actors", "scheduler", "api")
ROOT = Path(__file__).resolve().parent


def _packages() -> dict[str, str]:
    out = {}
    for top in TOP:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            out["dynabatch." + ".".join(rel.parts)] = rel.as_posix()
    return out


_dirs = _packages()
setup(packages=sorted(_dirs), package_dir=_dirs)
