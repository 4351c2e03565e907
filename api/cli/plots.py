"""PNG plots of a job report (``dynabatch run --report``), made with matplotlib.

Three figures from the per-epoch records: each worker's share of the global batch (a policy
moving work off a slow worker shows as its band thinning), per worker compute and all-reduce
wait seconds (a balanced job has short, even wait bars), and the loss and metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt

PLOTS = ("shares", "compute-wait", "loss")


def _workers(history: list[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for rec in history:
        for w in rec["workers"]:
            seen.setdefault(w["worker"], None)
    return list(seen)


def plot_shares(history: list[Mapping[str, Any]], ax: Any) -> None:
    names = _workers(history)
    epochs = [rec["epoch"] for rec in history]
    shares = {w: [] for w in names}
    for rec in history:
        batch = {w["worker"]: w["batch"] for w in rec["workers"]}
        total = sum(batch.values()) or 1
        for w in names:
            shares[w].append(batch.get(w, 0) / total)
    # Epoch e's band spans [e, e + 1): step="post" with the last epoch's values repeated.
    xs = [*epochs, epochs[-1] + 1]
    ax.stackplot(xs, *[[*shares[w], shares[w][-1]] for w in names], labels=names, step="post")
    ax.set(xlabel="epoch", ylabel="share of the global batch", ylim=(0, 1),
           title="Batch shares over time")
    ax.legend(loc="upper right", fontsize="small")


def plot_compute_wait(history: list[Mapping[str, Any]], ax: Any) -> None:
    names = _workers(history)
    compute = dict.fromkeys(names, 0.0)
    wait = dict.fromkeys(names, 0.0)
    for rec in history:
        for w in rec["workers"]:
            compute[w["worker"]] += w["compute_s"]
            wait[w["worker"]] += w["wait_s"]
    xs = range(len(names))
    ax.bar(xs, [compute[w] for w in names], label="compute")
    ax.bar(xs, [wait[w] for w in names], bottom=[compute[w] for w in names], label="wait")
    ax.set_xticks(list(xs), names)
    ax.set(ylabel="seconds (whole run)", title="Per-worker compute and all-reduce wait")
    ax.legend(fontsize="small")


def metric_series(history: list[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Each held-out metric's (epoch, value) points (``test_accuracy`` for old reports)."""
    metrics: dict[str, list[tuple[int, float]]] = {}
    for rec in history:
        values = dict(rec.get("test_metrics") or {})
        if not values and rec.get("test_accuracy") is not None:
            values = {"accuracy": rec["test_accuracy"]}
        for name, v in values.items():
            metrics.setdefault(name, []).append((rec["epoch"], v))
    return metrics


def plot_loss(history: list[Mapping[str, Any]], axes: Any) -> None:
    """Loss on the first axes; one metric per further axes (their scales differ: a
    perplexity of 12 would flatten an accuracy of 0.3)."""
    top, *rest = axes
    epochs = [rec["epoch"] for rec in history]
    top.plot(epochs, [rec["train_loss"] for rec in history], marker="o", label="train loss")
    test = [(rec["epoch"], rec["test_loss"]) for rec in history if rec.get("test_loss") is not None]
    if test:
        top.plot(*zip(*test, strict=True), marker="o", label="held-out loss")
    top.set(ylabel="loss", title="Loss and held-out metrics")
    top.legend(fontsize="small")
    for ax, (name, points) in zip(rest, metric_series(history).items(), strict=False):
        ax.plot(*zip(*points, strict=True), marker="o", color="tab:green")
        ax.set(ylabel=name)
    axes[-1].set(xlabel="epoch")


def render(report: Mapping[str, Any], out_dir: Path, prefix: str = "") -> list[Path]:
    """Write the report's PNG plots under ``out_dir``; returns their paths."""
    history = list(report.get("history") or [])
    if not history:
        raise ValueError("the report has no epochs to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        if name == "loss":
            rows = 1 + len(metric_series(history))
            fig, axes = plt.subplots(rows, 1, figsize=(7, 3 + 2 * rows), sharex=True,
                                     squeeze=False)
            plot_loss(history, list(axes[:, 0]))
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
            (plot_shares if name == "shares" else plot_compute_wait)(history, ax)
        fig.tight_layout()
        path = out_dir / f"{prefix}{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
