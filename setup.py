"""Maps the repository's four top-level folders onto the ``dynabatch`` import package.

``service/``, ``actors/``, ``scheduler/`` and ``api/`` stay where the design card puts them;
installed, they are ``dynabatch.service``, ``dynabatch.actors``, ``dynabatch.scheduler`` and
``dynabatch.api``, so a module a user ships with a job under one of those bare names cannot
shadow ours. ``dynabatch`` itself is ``api/public/``, the top layer's folder that names the
public Python API (``dynabatch.load_model``), declared as that package only. Everything
else about the build is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

TOP = ("service", "actors", "scheduler", "api")
PUBLIC = "api/public"
ROOT = Path(__file__).resolve().parent


def _packages() -> dict[str, str]:
    """Every folder under the four, by its dotted name: the code's packages and the folders
    of data files among them (the job page's ``api/static``). setuptools wants each folder it
    installs files from declared as a package; one that is not gets a "Package would be
    ignored" warning box on every install."""
    out = {"dynabatch": PUBLIC}
    for top in TOP:
        for folder in sorted([ROOT / top, *(ROOT / top).rglob("*")]):
            rel = folder.relative_to(ROOT)
            if (folder.is_dir() and rel.as_posix() != PUBLIC
                    and all(p.isidentifier() and p != "__pycache__" for p in rel.parts)):
                out["dynabatch." + ".".join(rel.parts)] = rel.as_posix()
    return out


_dirs = _packages()
setup(packages=sorted(_dirs), package_dir=_dirs)
