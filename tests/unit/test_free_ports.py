"""The ports the end-to-end tier hands to the servers it starts (``tests.e2e.procs.
find_free_port``): never one the kernel could give anything else meanwhile.

A port picked by binding to port 0 comes from the kernel's ephemeral range, which is also
where every outgoing connection and every Ray process beside the tests gets its ports; one
was taken between the pick and the Ray head's own bind ("Failed to bind to 127.0.0.1:45791
because it's already occupied"), and three end-to-end tests errored.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tests.e2e import procs


def test_ports_come_from_below_the_ephemeral_range_each_once_and_free(monkeypatch):
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [procs.find_free_port() for _ in range(40)]
    assert all(p < start for p in picked), (start, picked)
    assert len(set(picked)) == len(picked)  # none handed out twice
    for port in picked[:5]:  # free now: a server can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

    # Two pytest-xdist workers draw from disjoint slices.
    mine = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        mine[worker] = {procs.find_free_port() for _ in range(30)}
    assert {p % 2 for p in mine["gw0"]} == {0} and {p % 2 for p in mine["gw1"]} == {1}


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(procs, "_LOW", port)
        monkeypatch.setattr(procs, "_HIGH", port + 50)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
        assert {procs.find_free_port() for _ in range(20)} <= set(range(port + 1, port + 50))
