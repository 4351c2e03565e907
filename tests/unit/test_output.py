"""Following a job's actors' output (dynabatch.actors.output) against a fake log API: what Ray's
``get_log`` returns for an actor's ``.out``/``.err`` file, as the file grows."""

from __future__ import annotations

import threading
import time

import dynabatch.actors.output as output
import pytest
from dynabatch.actors.output import ActorOutput, LogApiUnavailable


class FakeLogs:
    """Actor log files that tests append to; ``fetch`` is what the log API would return."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str], bytes] = {}
        self.fail: dict[str, BaseException] = {}
        self.reads = 0

    def write(self, actor: str, suffix: str, text: str) -> None:
        key = (actor, suffix)
        self.files[key] = self.files.get(key, b"") + text.encode()

    def fetch(self, actor: str, suffix: str) -> bytes:
        self.reads += 1
        if actor in self.fail:
            raise self.fail[actor]
        return self.files.get((actor, suffix), b"")


def follower(logs: FakeLogs, resolve=None) -> tuple[ActorOutput, list[tuple[str, str, str]]]:
    got: list[tuple[str, str, str]] = []
    return ActorOutput(lambda *line: got.append(line), logs.fetch, resolve), got


def test_new_complete_lines_are_handed_on_once_and_rays_markers_dropped() -> None:
    logs = FakeLogs()
    out, got = follower(logs)
    out.watch("w0", "a0")
    logs.write("a0", "out", ":job_id:01000000\n:actor_name:Worker\nhello\npart")
    logs.write("a0", "err", "Traceback (most recent call last):\n")
    out.poll()
    assert got == [("w0", "stdout", "hello"),
                   ("w0", "stderr", "Traceback (most recent call last):")]
    logs.write("a0", "out", "ial line\n\n  \nmore\n")
    out.poll()
    out.poll()  # nothing new: nothing handed on twice
    assert got[2:] == [("w0", "stdout", "partial line"), ("w0", "stdout", "more")]


def test_an_actor_that_left_is_read_to_its_end_then_dropped() -> None:
    logs = FakeLogs()
    out, got = follower(logs)
    out.watch("w1", "a1")
    logs.write("a1", "out", "step 1\n")
    out.poll()
    # It printed, then died: its stderr (and a last line without a newline) are read once.
    logs.write("a1", "out", "about to die")
    logs.write("a1", "err", "Fatal Python error: Segmentation fault\n")
    out.unwatch("w1")
    out.poll()
    assert got == [("w1", "stdout", "step 1"), ("w1", "stdout", "about to die"),
                   ("w1", "stderr", "Fatal Python error: Segmentation fault")]
    assert list(out._actors) == []
    reads = logs.reads
    out.poll()
    assert logs.reads == reads


def test_an_id_that_is_not_known_yet_is_resolved_later() -> None:
    logs = FakeLogs()
    ref = object()  # stands for handle.actor_id.remote()
    answers: dict[object, str | None] = {ref: None}
    calls: list[bool] = []

    def resolve(r, block):
        calls.append(block)
        return answers[r]

    out, got = follower(logs, resolve)
    out.watch("w2", ref)
    logs.write("a2", "out", "built\n")
    out.poll()
    assert got == [] and calls == [False]  # still constructing: nothing read yet
    answers[ref] = "a2"
    out.poll()
    assert got == [("w2", "stdout", "built")]


def test_a_driver_ignores_its_own_log_lines_echoed_on_its_stderr() -> None:
    logs = FakeLogs()
    out, got = follower(logs)
    out.watch("coordinator", "c", ignore="[abc123] ")
    logs.write("c", "err", "[abc123] worker w1 failure: died\nloader says hi\n")
    logs.write("c", "out", "2026 WARNING control.py -- [abc123] state FAILED\n")
    out.poll()
    assert got == [("coordinator", "stderr", "loader says hi")]


def test_without_a_log_api_the_job_log_says_so_once() -> None:
    logs = FakeLogs()
    logs.fail["a0"] = LogApiUnavailable("ConnectionError: refused")
    out, got = follower(logs)
    out.watch("w0", "a0")
    out.watch("w1", "a1")
    out.poll()
    out.poll()
    assert len(got) == 1
    _, stream, note = got[0]
    assert stream == "note" and "ray[default]" in note and "refused" in note


def test_a_live_actor_whose_files_cannot_be_read_is_given_up_after_some_tries() -> None:
    logs = FakeLogs()
    logs.fail["a0"] = RuntimeError("node gone")
    out, got = follower(logs)
    out.watch("w0", "a0")
    for _ in range(output.LOST_AFTER - 1):
        out.poll()
    assert got == [] and list(out._actors) == ["w0"]
    out.poll()
    assert got == [("w0", "note", "its output cannot be read any more (RuntimeError: node gone)")]
    assert list(out._actors) == []


def test_a_flood_is_cut_with_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "MAX_LINES_PER_READ", 3)
    logs = FakeLogs()
    out, got = follower(logs)
    out.watch("w0", "a0")
    logs.write("a0", "out", "".join(f"line {i}\n" for i in range(10)))
    out.poll()
    assert [g[2] for g in got[:3]] == ["line 0", "line 1", "line 2"]
    assert got[3][1] == "note" and got[3][2].startswith("7 more stdout lines not shown")


def test_a_file_that_starts_again_is_read_from_its_beginning() -> None:
    logs = FakeLogs()
    out, got = follower(logs)
    out.watch("w0", "a0")
    logs.write("a0", "out", "a long first line\n")
    out.poll()
    logs.files[("a0", "out")] = b"new\n"  # rotated by Ray
    out.poll()
    assert [g[2] for g in got] == ["a long first line", "new"]


def test_close_reads_every_actor_a_last_time_in_the_reading_thread() -> None:
    logs = FakeLogs()
    threads: set[str] = set()
    got: list[tuple[str, str, str]] = []

    def sink(*line: str) -> None:
        threads.add(threading.current_thread().name)
        got.append(line)

    out = ActorOutput(sink, logs.fetch, poll_s=0.05).start()
    out.watch("w0", "a0")
    logs.write("a0", "out", "early\n")
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got == [("w0", "stdout", "early")]  # read while it runs
    logs.write("a0", "out", "last words")
    out.close()
    assert got[-1] == ("w0", "stdout", "last words")
    assert threads == {"actor-output"}
    out.watch("w9", "a9")  # after close: nothing is followed any more
    assert list(out._actors) == []


def test_a_log_api_nobody_serves_is_told_apart_from_a_missing_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray.util.state as state
    import requests

    def refused(**kw):
        raise requests.exceptions.ConnectionError("HTTPConnectionPool(port=8265): refused")

    monkeypatch.setattr(state, "get_log", refused)
    fetch = output.ray_log_fetch("127.0.0.1:6379")
    with pytest.raises(LogApiUnavailable, match="refused"):
        fetch("a0", "out")

    from ray.util.state.exception import RayStateApiException

    def missing(**kw):
        raise RayStateApiException("file not found")  # one actor's problem

    monkeypatch.setattr(state, "get_log", missing)
    with pytest.raises(RayStateApiException):
        output.ray_log_fetch("127.0.0.1:6379")("a0", "out")
