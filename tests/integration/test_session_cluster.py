"""The integration tier's own cluster beside another Ray on the same host.

Under ``pytest -n 2 --dist loadgroup`` the modules that start their own Ray (a ``dynabatch
run``'s embedded cluster) run beside the session's cluster, and so may another session's
Ray on a shared machine. The jobs' logs are read through Ray's log API, which the head's
dashboard serves: a head whose dashboard could not start loses every actor's output.
"""

from __future__ import annotations

import socket
import urllib.request

import pytest

from .conftest import head_node_args

pytestmark = pytest.mark.integration

DEFAULT_DASHBOARD_PORT = 8265  # Ray's, which another Ray on the host may already hold


def test_the_session_heads_dashboard_starts_when_another_ray_holds_its_default_port():
    from ray.cluster_utils import Cluster

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", DEFAULT_DASHBOARD_PORT))
        holder.listen()
    except OSError:  # another Ray on the host holds it already: the same situation
        holder.close()
        holder = None
    try:
        c = Cluster(initialize_head=True, head_node_args=head_node_args())
        try:
            url = c.head_node.webui_url
            assert url, "the head started without a dashboard: Ray's log API is gone"
            with urllib.request.urlopen(f"http://{url}/api/version", timeout=30) as r:
                assert r.status == 200
        finally:
            c.shutdown()
    finally:
        if holder is not None:
            holder.close()
