"""The start-up check that dynabatch's generic package names are its own."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from dynabatch.service import install_check
from dynabatch.service.install_check import ForeignPackage, check_own_install


def test_this_checkout_passes() -> None:
    check_own_install()


def test_a_shadowing_package_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = types.ModuleType("dynabatch.scheduler")
    fake.__path__ = [str(tmp_path / "site-packages" / "dynabatch" / "scheduler")]
    fake.__file__ = str(tmp_path / "site-packages" / "dynabatch" / "scheduler" / "__init__.py")
    monkeypatch.setitem(sys.modules, "dynabatch.scheduler", fake)
    with pytest.raises(ForeignPackage, match=r"^the package 'scheduler' is imported from "):
        check_own_install()


def test_a_distribution_merged_into_our_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path
    for name in install_check.PACKAGES:
        (root / name).mkdir()
        mod = types.ModuleType(f"dynabatch.{name}")
        mod.__path__ = [str(root / name)]
        mod.__file__ = str(root / name / "__init__.py")
        monkeypatch.setitem(sys.modules, f"dynabatch.{name}", mod)

    class Dist:
        metadata = {"Name": "service"}  # a distribution that ships a dynabatch/service folder
        files = [Path("dynabatch/service/__init__.py"), Path("dynabatch/service/core.py")]

        def locate_file(self, f):
            return root / Path(*f.parts[1:])

    monkeypatch.setattr(install_check.md, "distributions", lambda: [Dist()])
    with pytest.raises(ForeignPackage, match=r"'service' installed files into dynabatch's"):
        check_own_install(root)


def test_create_app_runs_the_check_so_a_plain_uvicorn_start_is_checked_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from dynabatch.api.app import create_app
    from dynabatch.service.settings import Settings

    from tests.fakes import FakeCluster

    def foreign(root: Path | None = None) -> None:
        raise ForeignPackage("the package 'service' is imported from /elsewhere/service")

    install_check.check_own_install_once.cache_clear()
    monkeypatch.setattr(install_check, "check_own_install", foreign)
    settings = Settings(db_path=str(tmp_path / "jobs.db"), sync_interval_s=0.0)
    with pytest.raises(ForeignPackage, match="imported from /elsewhere/service"):
        create_app(settings, cluster=FakeCluster())
    # A failure is not remembered: the next start checks again.
    with pytest.raises(ForeignPackage):
        create_app(settings, cluster=FakeCluster())
    monkeypatch.undo()
    install_check.check_own_install_once.cache_clear()
    assert create_app(settings, cluster=FakeCluster()).title == "dynabatch"


def test_the_check_runs_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    install_check.check_own_install_once.cache_clear()
    monkeypatch.setattr(install_check, "check_own_install", lambda root=None: calls.append(1))
    install_check.check_own_install_once()
    install_check.check_own_install_once()
    assert calls == [1]
    install_check.check_own_install_once.cache_clear()


def test_the_build_declares_every_folder_it_installs_files_from(tmp_path: Path) -> None:
    """Issue 29 item 11: ``pip install -e .`` printed "Package would be ignored" boxes for
    the job page's static folders. Built with warnings as errors, the build is silent, and
    the page's files are in it."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-W", "error", "setup.py", "-q", "build_py", "--build-lib",
         str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "would be ignored" not in out.stdout + out.stderr
    static = tmp_path / "dynabatch" / "api" / "static"
    for name in ("job.html", "job.js", "job.css", "notfound.html",
                 "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/LICENSE"):
        assert (static / name).is_file(), name
