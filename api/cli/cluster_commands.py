"""``dynabatch cluster``: the cluster scheduler's last round (``GET /v1/cluster``) as tables
of its nodes, placed jobs and queue."""

from __future__ import annotations

from typing import Annotated

import typer
from dynabatch.api.cli.common import api_client, out_console, print_plain
from dynabatch.api.cli.job_commands import Token, Url
from dynabatch.scheduler.core.cluster.ray_nodes import node_label
from dynabatch.service.cluster_schemas import ClusterState, Slot
from dynabatch.service.rest_client import DEFAULT_URL
from rich.console import Group
from rich.table import Table
from rich.text import Text


def _slots(slots: list[Slot] | None) -> str:
    """``3 (a1b2c3d4: 2, e5f6a7b8: 1)``; ``-`` when none was reported."""
    if slots is None:
        return "-"
    per_node = ", ".join(f"{node_label(s.node_id)}: {s.workers}" for s in slots)
    return f"{sum(s.workers for s in slots)} ({per_node or 'none'})"


def cluster_tables(state: ClusterState) -> Group:
    """The round's heading, its nodes, the placed jobs and the queue."""
    s = state.scheduler
    assert s is not None  # the caller prints the message instead
    head = Text(
        f"policy {s.policy}  round {s.round}  in use {s.used:g}/{s.capacity:g}  "
        f"utilization {s.utilization:.2f}  resizes {s.resizes}"
    )
    nodes = Table(title=f"nodes ({len(state.nodes)})", expand=False)
    for col in ("node", "type", "in use", "jobs"):  # GPUs on a GPU node, else CPUs
        nodes.add_column(col, justify="right" if col == "in use" else "left")
    for n in state.nodes:
        jobs = ", ".join(f"{h.job_id} ({h.workers})" for h in n.jobs)
        nodes.add_row(node_label(n.node_id), n.node_type, f"{n.used:g}/{n.capacity:g}", jobs or "-")
    placed = [j for j in state.jobs if j.position is None]
    jobs = Table(title=f"jobs ({len(placed)})", expand=False)
    for col in ("job", "allocated", "members", "differs"):
        jobs.add_column(col)
    for j in placed:
        note = "; ".join(x for x in (j.differs, j.waits and f"waits: {j.waits}") if x)
        jobs.add_row(j.job_id, _slots(j.allocation), _slots(j.members), Text(note or "-"))
    queue = Table(title=f"queue ({len(state.queue)})", expand=False)
    for col in ("position", "job", "priority", "reason"):
        queue.add_column(col, justify="right" if col in ("position", "priority") else "left")
    for q in state.queue:
        # Reasons are our own text, but shown as they are: never read as markup.
        queue.add_row(str(q.position), q.job_id, str(q.priority), Text(q.reason))
    return Group(head, nodes, jobs, queue)


def cluster(
    ctx: typer.Context,
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the response as JSON.")] = False,
) -> None:
    """Show the cluster scheduler's nodes, the jobs holding them and the queue."""
    with api_client(ctx, url, token) as client:
        state = client.cluster()
        if as_json:
            typer.echo(state.model_dump_json())
            return
        console = out_console()
        if state.scheduler is None:
            print_plain(console, state.message or "no cluster scheduler runs")
            return
        console.print(cluster_tables(state))


def register(app: typer.Typer) -> None:
    """Add ``cluster``."""
    app.command("cluster")(cluster)
