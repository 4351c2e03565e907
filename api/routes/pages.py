"""GET /jobs/{job_id}: a live web page per job, and /static for its scripts and styles.

The page is a static shell (api/static/job.html); its script (api/static/job.js) reads the
job from the REST API and follows GET /v1/jobs/{id}/events, a stream of server-sent
events, through ``fetch`` (not ``EventSource``, which cannot send the bearer token), and
draws the loss chart and one chart per metric the job reports with uPlot, vendored from
its npm package under api/static/vendor (no CDN: the machines are offline).

An unknown job is a 404 page when the request may know: no token is configured, or it
carries the token (``Authorization: Bearer``). Otherwise (a browser opening the link sends
no header) the shell reveals nothing and is served, 200, for any well-formed id; its script
asks for the token (or takes it from the link's ``#token=`` fragment, which never reaches
the server) and shows "not found" itself, so no job's existence is told to an
unauthenticated visitor. Scale and cancel controls appear once the page's own authenticated
requests succeed (the token that reads a job may also change it) and while the job is live.
"""

from __future__ import annotations

import html
import re
from importlib import resources
from pathlib import Path

from dynabatch.api.deps import Credentials, SettingsDep, token_ok
from dynabatch.service.job_service import JOB_ID_PATTERN
from dynabatch.service.service_errors import JobNotFound
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

STATIC_DIR = Path(str(resources.files("dynabatch.api") / "static"))

router = APIRouter(include_in_schema=False)


def not_found_page(what: str) -> HTMLResponse:
    body = (STATIC_DIR / "notfound.html").read_text().replace("{{what}}", html.escape(what))
    return HTMLResponse(body, status_code=404)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, request: Request, settings: SettingsDep,
             creds: Credentials) -> HTMLResponse:
    if not re.fullmatch(JOB_ID_PATTERN.strip("^$"), job_id):
        return not_found_page(f"'{job_id}' is not a job id")
    if token_ok(settings, creds):  # this request may learn whether the job exists
        try:
            request.app.state.service.get(job_id)
        except JobNotFound:
            return not_found_page(f"job {job_id} not found")
    page = (STATIC_DIR / "job.html").read_text()
    return HTMLResponse(page.replace("{{job_id}}", job_id).replace(
        "{{token_required}}", "true" if settings.token is not None else "false"))
