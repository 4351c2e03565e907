"""The worker's output tee: lines pass through and are kept, tagged, for the job log."""

from __future__ import annotations

import io
import sys

from actors.output import OutputTee


def test_tee_passes_through_and_keeps_complete_lines(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    tee = OutputTee(max_lines=3).install()
    try:
        print("hello", "world")
        sys.stdout.write("part")
        sys.stdout.write("ial\n\n")
        print("oops", file=sys.stderr)
    finally:
        tee.uninstall()
    assert sys.stdout is out and out.getvalue() == "hello world\npartial\n\n"
    assert err.getvalue() == "oops\n"
    assert tee.drain() == ("stdout: hello world", "stdout: partial", "stderr: oops")
    assert tee.drain() == ()


def test_a_full_buffer_says_how_many_lines_it_dropped():
    tee = OutputTee(max_lines=2)
    for i in range(5):
        tee.add("stdout", f"line {i}")
    assert tee.drain() == ("stderr: (3 earlier output lines dropped)", "stdout: line 3",
                           "stdout: line 4")
