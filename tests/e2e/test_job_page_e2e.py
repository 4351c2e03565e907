"""Bring your own code, and watch the job: real uvicorn, Ray as its own cluster, real Chromium.

`dynabatch submit --working-dir DIR` ships a directory holding the user's loss (which
prints) to the cluster through Ray's runtime_env; submit waits, streams the job's server-sent
events (log lines, the user's print among them, and a live table) and exits 0 on SUCCEEDED.
`dynabatch logs` has the print too. Then headless Chromium (Debian's `chromium`) loads the
job's page: after its scripts ran, the DOM holds the job's state, workers, epochs table and
charts whose data are the job's history, read back over REST. A screenshot is saved under
tests/artifacts/. An unknown job's page is a 404 page.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import BIN, ApiServer, base_env, find_free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
USER_LOSS = '''\
import torch.nn.functional as F

_said = False


def loss(outputs, targets):
    global _said
    if not _said:  # once per worker: the job log shows it
        print("hello from the user's loss, batch", len(targets), flush=True)
        _said = True
    return F.cross_entropy(outputs, targets, reduction="none")
'''
CONFIG = """\
name: e2e-page
dataset: {name: digits}
model: {name: mlp, hidden: 32}
loss: "chatty_user_loss:loss"
metrics: [accuracy]
workers: 2
global_batch: 64
epochs: 3
"""


@pytest.fixture(scope="module")
def server(ray_head: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    # Any user module, so that a working dir may be shipped (see check_user_code).
    srv = ApiServer(ray_head, find_free_port(), tmp_path_factory.mktemp("api"),
                    user_code_modules="*")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `make chromium` (Debian package)")
    return exe


def browse(url: str, *extra: str) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--virtual-time-budget=20000", *extra, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=base_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


class _Dom(HTMLParser):
    """Elements by id (their attributes and text) and the rows of each table body."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self._open: list[tuple[str, dict]] = []
        self._table: str | None = None
        self.classes: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.classes.update((a.get("class") or "").split())
        node = {"tag": tag, "attrs": a, "text": ""}
        if "id" in a:
            self.by_id[a["id"]] = node
            if tag == "table":
                self._table = a["id"]
                self.rows[a["id"]] = []
        if tag == "tr" and self._table and self._open and any(
                t == "tbody" for t, _ in self._open):
            self.rows[self._table].append([])
        if tag == "td" and self._table and self.rows.get(self._table):
            self.rows[self._table][-1].append("")
        if tag not in ("br", "img", "input", "link", "meta", "col"):
            self._open.append((tag, node))

    def handle_endtag(self, tag):
        while self._open:
            t, _ = self._open.pop()
            if t == tag:
                break
        if tag == "table":
            self._table = None

    def handle_data(self, data):
        for _, node in self._open:
            node["text"] += data
        if self._open and self._open[-1][0] == "td" and self._table:
            self.rows[self._table][-1][-1] += data.strip()


def dom(html: str) -> _Dom:
    d = _Dom()
    d.feed(html)
    return d


def test_submit_with_working_dir_streams_the_users_output_and_the_page_shows_the_job(
    server: ApiServer, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "chatty_user_loss.py").write_text(USER_LOSS)
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    r = subprocess.run(
        [str(BIN / "dynabatch"), "submit", str(config), "--url", server.url,
         "--working-dir", str(code), "--interval", "0.2"],
        capture_output=True, text=True, timeout=240, env=base_env(),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    job = lines[0].strip()
    assert re.fullmatch(r"[0-9a-f]{12}", job), lines[:3]
    assert lines[-1] == f"job {job} SUCCEEDED"
    said = [ln for ln in lines if "stdout: hello from the user's loss" in ln]
    assert said, r.stdout[-3000:]  # streamed while the job ran
    logs = subprocess.run([str(BIN / "dynabatch"), "logs", job, "--url", server.url],
                          capture_output=True, text=True, timeout=60, env=base_env())
    assert logs.returncode == 0 and "stdout: hello from the user's loss" in logs.stdout

    history = httpx.get(f"{server.url}/v1/jobs/{job}/history", timeout=10).json()["records"]
    assert len(history) == 3
    page_url = f"{server.url}/jobs/{job}"
    d = dom(browse(page_url, "--dump-dom"))
    assert d.by_id["state"]["text"].strip() == "SUCCEEDED"
    assert "uplot" in d.classes  # uPlot drew the charts
    loss = json.loads(d.by_id["loss-chart"]["attrs"]["data-points"])
    acc = json.loads(d.by_id["accuracy-chart"]["attrs"]["data-points"])
    assert loss[0] == acc[0] == [0, 1, 2]
    assert loss[1] == pytest.approx([h["train_loss"] for h in history])
    assert loss[2] == pytest.approx([h["test_loss"] for h in history])
    assert acc[1] == pytest.approx([h["test_accuracy"] for h in history])
    assert [row[0] for row in d.rows["epochs"]] == ["0", "1", "2"]
    final = httpx.get(f"{server.url}/v1/jobs/{job}", timeout=10).json()
    shown = {row[0]: (int(row[2]), int(row[3])) for row in d.rows["workers"]}
    assert shown == {w["worker"]: (w["batch"], w["partition"]) for w in final["workers"]}
    assert d.by_id["balance"]["text"].strip() == f"{history[-1]['compute_balance']:.3f}"
    assert d.by_id["controls"]["attrs"].get("hidden") is not None  # finished: no controls
    assert "hello from the user's loss" in d.by_id["log"]["text"]

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "job-page.png"
    shot.unlink(missing_ok=True)
    browse(page_url, f"--screenshot={shot}", "--window-size=1200,1700")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    missing = dom(browse(f"{server.url}/jobs/000000000000", "--dump-dom"))
    assert "job 000000000000 not found" in missing.by_id["notfound"]["text"]
    assert httpx.get(f"{server.url}/jobs/000000000000", timeout=10).status_code == 404
