"""The job page shell, its static files and the 404 page (the browser side: tests/e2e)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from service.settings import Settings
from tests.fakes import FakeCluster


def _client(tmp_path: Path, **settings) -> TestClient:
    return TestClient(create_app(Settings(db_path=str(tmp_path / "p.db"), sync_interval_s=0.01,
                                          **settings), cluster=FakeCluster()))


def test_page_static_files_and_404(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json={"workers": 2}).json()["job_id"]
        page = c.get(f"/jobs/{job}")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert f'data-job-id="{job}"' in page.text and 'data-token-required="false"' in page.text
        for src in ("/static/vendor/uplot/uPlot.iife.min.js", "/static/job.js",
                    "/static/vendor/uplot/uPlot.min.css", "/static/job.css"):
            assert src in page.text
            assert c.get(src).status_code == 200, src
        assert "cdn" not in page.text.lower() and "http" not in page.text
        for bad, why in (("000000000000", "job 000000000000 not found"),
                         ("nope", "is not a job id")):
            r = c.get(f"/jobs/{bad}")
            assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
            assert why in r.text and "Traceback" not in r.text
        assert c.get("/static/nope.js").status_code == 404


def test_with_a_token_the_shell_tells_nothing(tmp_path: Path) -> None:
    with _client(tmp_path, api_token="s3cret") as c:
        page = c.get("/jobs/000000000000")  # unknown, but the visitor has no token
        assert page.status_code == 200 and 'data-token-required="true"' in page.text
        assert c.get("/v1/jobs/000000000000/events").status_code == 401
