"""Headless Chromium (Debian's ``chromium``), driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` makes Chromium read protocol messages from fd 3 and write its
answers to fd 4, NUL-terminated JSON; no websocket library is needed. A test opens a page,
evaluates expressions in it as its scripts run (the page is live: a job's charts grow while
the test watches), and saves screenshots.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _high_fd(fd: int) -> int:
    """``fd`` moved above 9, so putting the pipes on fds 3 and 4 never clobbers one."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class Browser:
    def __init__(self, exe: str, *, width: int = 1200, height: int = 1700,
                 env: dict[str, str] | None = None):
        self._profile = tempfile.mkdtemp(prefix="dbx-chromium-")
        to_chrome_r, self._to_chrome = map(_high_fd, os.pipe())
        self._from_chrome, from_chrome_w = map(_high_fd, os.pipe())

        def on_fds_3_and_4() -> None:  # in the child, before exec
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={self._profile}",
             f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=on_fds_3_and_4, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._ids = itertools.count(1)
        self._buf = b""

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                    raise TimeoutError(f"chromium did not answer {method} in {timeout:.0f}s")
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise ConnectionError("chromium closed its DevTools pipe")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == msg_id:  # events and other answers are skipped
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        return Page(self, session["sessionId"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._to_chrome, self._from_chrome):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session

    def eval(self, expression: str) -> Any:
        """The expression's value (JSON-able), evaluated in the page as it is now."""
        r = self.browser.call("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True,
        }, self.session)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails'].get('text')}")
        return r["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(RuntimeError):  # the page may still be loading
                value = self.eval(expression)
                if value:
                    return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.2)

    def html(self) -> str:
        return self.eval("document.documentElement.outerHTML")

    def screenshot(self, path: Path) -> None:
        r = self.browser.call("Page.captureScreenshot",
                              {"format": "png", "captureBeyondViewport": True}, self.session)
        path.write_bytes(base64.b64decode(r["data"]))
