"""The job page shell, its static files and the 404 page (the browser side: tests/e2e)."""

from __future__ import annotations

from pathlib import Path

from dynabatch.api.app import create_app
from dynabatch.service.settings import Settings
from fastapi.testclient import TestClient

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


def test_with_a_token_the_shell_tells_nothing_to_a_visitor_without_it(tmp_path: Path) -> None:
    with _client(tmp_path, api_token="s3cret") as c:
        auth = {"Authorization": "Bearer s3cret"}
        job = c.post("/v1/jobs", json={"workers": 2}, headers=auth).json()["job_id"]
        for unknown_or_not in ("000000000000", job):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                # A browser opening a link sends no header: the same shell, known job or not.
                page = c.get(f"/jobs/{unknown_or_not}", headers=headers)
                assert page.status_code == 200 and 'data-token-required="true"' in page.text
        assert c.get("/v1/jobs/000000000000/events").status_code == 401
        # A request that carries the token may know: an unknown job is a 404 page.
        missing = c.get("/jobs/000000000000", headers=auth)
        assert missing.status_code == 404 and "job 000000000000 not found" in missing.text
        assert c.get(f"/jobs/{job}", headers=auth).status_code == 200


def test_the_page_script_charts_every_metric_and_takes_a_token_from_the_link(
    tmp_path: Path,
) -> None:
    # The behaviour runs in Chromium (tests/e2e/test_job_page_e2e.py); here, that the shell
    # has the one loss chart, and the script the per-metric charts and the #token= link.
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json={"workers": 2}).json()["job_id"]
        page = c.get(f"/jobs/{job}").text
        assert 'id="loss-chart"' in page and 'id="charts"' in page
        assert "accuracy-chart" not in page
        script = c.get("/static/job.js").text
        assert "test_metrics" in script and "metricChart" in script
        assert 'get("token")' in script and "history.replaceState" in script


def test_the_page_shows_the_jobs_own_metrics_and_progress_wraps_logs_and_fits_its_axes(
    tmp_path: Path,
) -> None:
    # Issue 29: a regression job's page said "test accuracy -"; its progress was counted
    # apart from list's and status's; long log lines were cut off; the "samples/s" label
    # ran into its ticks. The drawing is checked in Chromium (tests/e2e, and by eye: the
    # screenshot command in docs/operations.md).
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json={"workers": 2}).json()["job_id"]
        page = c.get(f"/jobs/{job}").text
        assert 'id="metrics"' in page and "test accuracy" not in page
        script = c.get("/static/job.js").text
        assert "j.test_metrics" in script and "j.progress" in script
        assert "epochs_completed" not in script  # the server's `progress`, as list's
        assert "size: fitTicks" in script  # y axes as wide as their tick labels
        css = c.get("/static/job.css").text
        log_rule = next(r for r in css.split("}") if "#log {" in r)
        assert "white-space: pre-wrap" in log_rule


def test_the_page_shows_the_latest_confusion_matrix_as_a_table(tmp_path: Path) -> None:
    # Issue 54: a record's test_matrices (a confusion matrix) is drawn as a table under
    # the epochs, rows the true classes; the drawing itself runs in Chromium (tests/e2e).
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json={"workers": 2}).json()["job_id"]
        assert 'id="matrices"' in c.get(f"/jobs/{job}").text
        script = c.get("/static/job.js").text
        assert "e.test_matrices" in script and "drawMatrices(e)" in script
