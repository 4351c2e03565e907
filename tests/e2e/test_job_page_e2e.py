"""Bring your own code, and watch the job: real uvicorn, Ray as its own cluster, real Chromium.

The service runs with a token, allows shipped code and keeps uploads under a code root.
`dynabatch submit --working-dir DIR` zips DIR and uploads it (POST /v1/code); the job names
the upload, and Ray unpacks it on the nodes. The shipped loss prints; one worker, once,
prints and then kills its own process mid-step. Submit waits and streams the job's
server-sent events (the user's print among the log lines) and exits 0 on SUCCEEDED;
`dynabatch logs` has the dead worker's last lines, read through Ray's log API.

Headless Chromium (Debian's `chromium`, driven over the DevTools pipe: tests/e2e/cdp.py)
opens the job's page from a link carrying the token while the job runs: the state is
RUNNING, the scale and cancel controls show, and the charts hold the epochs so far and grow
as the job goes on, without a reload. Once it ends, the same page shows the finished state,
and the charts (the loss, one per metric, each worker's share of the global batch, compute
and wait per worker, samples per second) hold the job's whole history as REST reports it:
the test reads what uPlot holds and that its canvas is painted, and switches the loss to a
log scale. A screenshot is saved under tests/artifacts/. A parameter-server job's page lists its
learners. An unknown job's page is a 404 for a request that carries the token, and tells
nothing to one that does not.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cdp import Browser, Page, chromium_path
from tests.e2e.procs import BIN, ApiServer, base_env, find_free_port, stop_process, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
TOKEN = "e2e-page-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EPOCHS = 5
USER_LOSS = '''\
import os

import torch.nn.functional as F

_said = False


def loss(outputs, targets):
    global _said
    if not _said:  # once per process: the job log shows it
        print("hello from the user's loss, batch", len(targets), flush=True)
        _said = True
    if len(targets) > 8:  # a training step (not the coordinator's check, nor a warm-up)
        try:  # the first worker here, once: its working dir is shared on this node
            fd = os.open("died-once", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            print("about to die", flush=True)
            os.write(2, b"fatal: the user's loss ends this process\\n")
            os._exit(3)
    return F.cross_entropy(outputs, targets, reduction="none")
'''
# Emulated slowdowns stretch each epoch to a few seconds, so the page can be watched live.
CONFIG = f"""\
name: e2e-page
dataset: {{name: digits}}
model: {{name: mlp, hidden: 32}}
loss: "chatty_user_loss:loss"
metrics: [accuracy, perplexity]
workers: 2
global_batch: 64
epochs: {EPOCHS}
emulation: {{slowdowns: [120, 120]}}
"""


@pytest.fixture(scope="module")
def server(ray_head: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    work = tmp_path_factory.mktemp("api")
    # Any user module and a code root: shipped code may be uploaded (api/routes/code.py).
    srv = ApiServer(ray_head, find_free_port(), work, user_code_modules="*",
                    code_root=str(work / "code"), api_token=TOKEN)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    exe = chromium_path()
    if exe is None:
        pytest.fail("chromium is not installed: run `make chromium` (Debian package)")
    with Browser(exe, env=base_env()) as b:
        yield b


def cli_env() -> dict[str, str]:
    return {**base_env(), "DYNABATCH_API_TOKEN": TOKEN}


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


def points(page: Page, chart_id: str) -> list[list[Any]]:
    return json.loads(page.eval(f"document.getElementById('{chart_id}').dataset.points || '[[]]'"))


def rest(server: ApiServer, path: str) -> Any:
    r = httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10)
    r.raise_for_status()
    return r.json()


def test_shipped_code_live_page_and_the_output_of_a_worker_that_died(
    server: ApiServer, browser: Browser, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "chatty_user_loss.py").write_text(USER_LOSS)
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    out_path = tmp_path / "submit.out"
    with out_path.open("w") as out:
        submit = subprocess.Popen(
            [str(BIN / "dynabatch"), "submit", str(config), "--url", server.url,
             "--working-dir", str(code), "--interval", "0.2"],
            stdout=out, stderr=subprocess.STDOUT, env=cli_env(), start_new_session=True)
    try:
        job = wait_for("submit to print the job id",
                       lambda: re.match(r"[0-9a-f]{12}\n", out_path.read_text()), 60)[0].strip()

        # While it runs: the page, opened from a link that carries the token.
        page = browser.open(f"{server.url}/jobs/{job}#token={TOKEN}")
        first = page.wait_for("document.body.dataset.state === 'RUNNING' && "
                              "document.querySelectorAll('#epochs tbody tr').length",
                              "the live page to show an epoch of the running job", 180)
        assert "#token=" not in page.eval("location.href")  # taken out of the address bar
        assert page.eval("document.getElementById('controls').hidden") is False
        assert page.eval("document.getElementById('state').textContent") == "RUNNING"
        assert page.eval("document.getElementById('progress').textContent").startswith("epoch ")
        loss_then = points(page, "loss-chart")
        assert len(loss_then[0]) == first < EPOCHS  # partial: the epochs so far
        history = rest(server, f"/v1/jobs/{job}/history")["records"]
        assert loss_then[1] == pytest.approx([h["train_loss"] for h in history[:first]])
        assert points(page, "metric-accuracy")[1] == pytest.approx(
            [h["test_metrics"]["accuracy"] for h in history[:first]])
        # The same page grows as epochs end: no reload.
        grown = page.wait_for(f"document.querySelectorAll('#epochs tbody tr').length > {first}"
                              " && document.querySelectorAll('#epochs tbody tr').length",
                              "the live page's charts to grow", 120)
        assert len(points(page, "loss-chart")[0]) >= grown > first

        submit.wait(timeout=300)
    finally:
        stop_process(submit, grace=5.0)
    lines = out_path.read_text().splitlines()
    assert submit.returncode == 0, "\n".join(lines[-60:])
    # The last line: the outcome and the job's own held-out metrics, by their spec names.
    last = rest(server, f"/v1/jobs/{job}")["test_metrics"]
    assert lines[-1] == (f"job {job} SUCCEEDED; test accuracy {last['accuracy']:.4f}, "
                         f"perplexity {last['perplexity']:.4f}")
    assert any("stdout: hello from the user's loss" in ln for ln in lines), lines[-40:]

    # The job shipped the upload, and `dynabatch logs` has every process's output, the last
    # lines of the worker that killed itself included (Ray's log API).
    (stored,) = (server.workdir / "code").glob("*.zip")
    assert rest(server, f"/v1/jobs/{job}")["spec"]["working_dir"] == stored.as_uri()
    logs = subprocess.run([str(BIN / "dynabatch"), "logs", job, "--url", server.url],
                          capture_output=True, text=True, timeout=60, env=cli_env())
    assert logs.returncode == 0, logs.stderr
    text = logs.stdout
    died = re.search(r"(w\d+) stdout: about to die", text)
    assert died, text[-4000:]
    assert f"{died[1]} stderr: fatal: the user's loss ends this process" in text
    assert "coordinator stdout: hello from the user's loss, batch 2" in text  # its check
    assert "NumPy array is not writable" not in text

    # Finished: the same page shows the end, the whole history and every metric.
    page.wait_for("document.body.dataset.streamEnded === 'true'", "the page's stream to end")
    history = rest(server, f"/v1/jobs/{job}/history")["records"]
    final = rest(server, f"/v1/jobs/{job}")
    assert len(history) == EPOCHS
    d = dom(page.html())
    assert d.by_id["state"]["text"].strip() == "SUCCEEDED"
    assert d.by_id["progress"]["text"].startswith(f"succeeded: {EPOCHS} of {EPOCHS} epochs "
                                                  "completed")
    assert "uplot" in d.classes  # uPlot drew the charts
    loss = json.loads(d.by_id["loss-chart"]["attrs"]["data-points"])
    assert loss[0] == list(range(1, EPOCHS + 1))
    assert loss[1] == pytest.approx([h["train_loss"] for h in history])
    assert loss[2] == pytest.approx([h["test_loss"] for h in history])
    metrics = {e["attrs"]["data-metric"]: json.loads(e["attrs"]["data-points"])
               for e in d.by_id.values() if "data-metric" in e["attrs"]}
    assert set(metrics) == set(history[-1]["test_metrics"]) == {"accuracy", "perplexity"}
    for name, series in metrics.items():
        assert series[0] == list(range(1, EPOCHS + 1))
        assert series[1] == pytest.approx([h["test_metrics"][name] for h in history])
    # Epochs are counted from 1, as in the job's log, the CLI and the progress line.
    assert [row[0] for row in d.rows["epochs"]] == [str(i) for i in range(1, EPOCHS + 1)]
    shown = {row[0]: (int(row[2]), int(row[3])) for row in d.rows["workers"]}
    assert shown == {w["worker"]: (w["batch"], w["partition"]) for w in final["workers"]}
    assert d.by_id["balance"]["text"].strip() == f"{history[-1]['compute_balance']:.3f}"
    # The headline: the job's own metrics, by name (issue 29: "test accuracy -").
    # The split is named (the job has no validation split: its held-out set is the test set).
    assert d.by_id["metrics"]["text"].strip() == "test " + ", ".join(
        f"{k} {v:.4f}" for k, v in final["test_metrics"].items())
    assert final["progress"] == f"{EPOCHS} of {EPOCHS} epochs completed"
    assert d.by_id["controls"]["attrs"].get("hidden") is not None  # finished: no controls
    assert "about to die" in d.by_id["log"]["text"]
    _check_work_charts(page, history)

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "job-page.png"
    shot.unlink(missing_ok=True)
    page.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# job.js's palette: worker i's colour.
PALETTE = ["#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def drawn(page: Page, chart_id: str, colors: tuple[str, ...] = ()) -> dict[str, Any]:
    """What uPlot holds and drew for a chart: its data, series labels and y scale, and, per
    colour asked for, how many of its canvas's pixels are painted in it (the series drawn)."""
    rgb = [[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in colors]
    return json.loads(page.eval(f"""(() => {{
        const p = window.dynabatchCharts['{chart_id}'].plot;
        const c = p.ctx.canvas;
        const px = p.ctx.getImageData(0, 0, c.width, c.height).data;
        const want = {json.dumps(rgb)};
        const painted = want.map(() => 0);
        for (let i = 0; i < px.length; i += 4) {{
            if (px[i + 3] < 64) continue;
            want.forEach((w, k) => {{
                if (Math.abs(px[i] - w[0]) + Math.abs(px[i + 1] - w[1])
                    + Math.abs(px[i + 2] - w[2]) < 40) painted[k]++;
            }});
        }}
        return JSON.stringify({{data: p.data, labels: p.series.map((s) => s.label),
                               distr: p.scales.y.distr, painted}});
    }})()"""))


def _check_work_charts(page: Page, history: list[dict[str, Any]]) -> None:
    """Issue 24 item 10: how dynabatch shares the work, from the epochs' records (what the
    workers reported): each worker's share of the global batch (stacked), its compute and
    wait per step, samples per second; and the loss on a log scale."""
    x = list(range(1, EPOCHS + 1))  # epochs counted from 1, as the table and the log say
    names: list[str] = []
    for h in history:
        names += [w["worker"] for w in h["workers"] if w["worker"] not in names]
    rows = [{w["worker"]: w for w in h["workers"]} for h in history]

    def share(r: dict[str, Any], n: str) -> float:
        total = sum(w["batch"] for w in r.values())
        return r[n]["batch"] / total if n in r and total else 0.0

    colors = tuple(PALETTE[i % len(PALETTE)] for i in range(len(names)))
    shares = drawn(page, "share-chart", colors)
    assert shares["labels"][1:] == names
    stacked = shares["data"]
    assert stacked[0] == x
    running = [0.0] * EPOCHS
    for i, n in enumerate(names):  # uPlot draws the running sums: each band is a share
        running = [v + share(r, n) for v, r in zip(running, rows, strict=True)]
        assert stacked[i + 1] == pytest.approx(running)
    assert stacked[-1] == pytest.approx([1.0] * EPOCHS)
    assert points(page, "share-chart")[1:] == [
        pytest.approx([share(r, n) for r in rows]) for n in names]
    assert all(n > 200 for n in shares["painted"]), shares["painted"]  # every band

    time = drawn(page, "time-chart", colors)
    assert time["labels"][1:] == [f"{n} {k}" for n in names for k in ("compute", "wait")]
    for i, n in enumerate(names):
        for j, key in enumerate(("compute_s", "wait_s")):
            want = [r[n][key] / r[n]["steps"] * 1e3 if n in r and r[n]["steps"] else None
                    for r in rows]
            assert time["data"][1 + 2 * i + j] == pytest.approx(want)
    assert all(n > 20 for n in time["painted"]), time["painted"]

    rate = drawn(page, "throughput-chart")
    assert rate["labels"][1:] == [f"{n} per compute-s" for n in names] + ["job per wall-s"]
    for i, n in enumerate(names):
        assert rate["data"][1 + i] == pytest.approx(
            [r[n]["throughput"] if n in r else None for r in rows])
    assert rate["data"][-1] == pytest.approx(
        [h["samples_trained"] / h["wall_s"] for h in history])
    assert all(v > 0 for v in rate["data"][-1])

    # The loss: linear, then log at a click, drawing the same values.
    loss = drawn(page, "loss-chart", ("#1f77b4",))
    assert loss["distr"] == 1
    page.eval("document.getElementById('loss-log').click(), true")
    logged = page.wait_for("window.dynabatchCharts['loss-chart'].plot.scales.y.distr === 3",
                           "the loss chart on a log scale", 10)
    assert logged
    log_loss = drawn(page, "loss-chart", ("#1f77b4",))
    assert page.eval("document.getElementById('loss-chart').dataset.scale") == "log"
    assert log_loss["data"][1] == pytest.approx([h["train_loss"] for h in history])
    assert log_loss["painted"][0] > 20


# A parameter-server job long enough to be watched (cancelled once its page is read).
PS_SPEC = {
    "name": "e2e-ps-page",
    "dataset": {"name": "digits"},
    "model": {"name": "mlp", "hidden": 16},
    "protocol": {"name": "ps", "mode": "async"},
    "workers": 2,
    "global_batch": 64,
    "epochs": 500,
}


def test_a_parameter_server_jobs_page_lists_its_learners(
    server: ApiServer, browser: Browser
) -> None:
    """A parameter-server job's learners are its workers on its page, as in its status:
    each on its node with its batch, and "-" for the partition, step times, speed and
    slowdown a learner's status does not carry (not zeros)."""
    r = httpx.post(f"{server.url}/v1/jobs", json=PS_SPEC, headers=AUTH, timeout=30)
    r.raise_for_status()
    job = r.json()["job_id"]
    try:
        page = browser.open(f"{server.url}/jobs/{job}#token={TOKEN}")
        page.wait_for("document.body.dataset.state === 'RUNNING' && "
                      "document.querySelectorAll('#workers tbody tr').length === 2",
                      "the parameter-server job's learners on its page", 180)
        rows = dom(page.html()).rows["workers"]
        learners = {w["worker"]: w for w in rest(server, f"/v1/jobs/{job}")["workers"]}
        assert sorted(row[0] for row in rows) == sorted(learners) == ["w0", "w1"]
        for worker, node, batch, *rest_of_row in rows:
            assert node == learners[worker]["node"][:8]  # the node's label, as everywhere
            assert int(batch) > 0
            assert rest_of_row == ["-"] * 5, rest_of_row
    finally:
        httpx.post(f"{server.url}/v1/jobs/{job}/cancel", headers=AUTH, timeout=30)


def test_an_unknown_jobs_page(server: ApiServer, browser: Browser) -> None:
    url = f"{server.url}/jobs/000000000000"
    # A request with the token may know: 404. One without it gets the shell, as for any job.
    assert httpx.get(url, headers=AUTH, timeout=10).status_code == 404
    shell = httpx.get(url, timeout=10)
    assert shell.status_code == 200 and 'data-token-required="true"' in shell.text
    # The shell's script, given the token, says so.
    page = browser.open(f"{url}#token={TOKEN}")
    text = page.wait_for("!document.getElementById('notfound').hidden && "
                         "document.getElementById('notfound').textContent", "not found")
    assert text == "job 000000000000 not found"
