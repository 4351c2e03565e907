"""The report's PNG plots and `dynabatch report`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from dynabatch.api.cli import plots
from dynabatch.api.cli import run as run_cli
from typer.testing import CliRunner


def _rec(epoch: int, batches: dict[str, int], loss: float) -> dict:
    return {
        "epoch": epoch, "train_loss": loss, "test_loss": loss + 0.1, "test_accuracy": 0.5,
        "test_metrics": {"accuracy": 0.5 + epoch / 10, "perplexity": 9.0 - epoch},
        "workers": [{"worker": w, "batch": b, "compute_s": b / 10, "wait_s": 1.0}
                    for w, b in batches.items()],
    }


HISTORY = [_rec(0, {"w0": 32, "w1": 32}, 2.0), _rec(1, {"w0": 48, "w1": 16}, 1.5)]


class _Axes:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))


def test_shares_are_each_workers_fraction_of_the_batch():
    ax = _Axes()
    plots.plot_shares(HISTORY, ax)
    (_, args, kwargs), = [c for c in ax.calls if c[0] == "stackplot"]
    epochs, w0, w1 = args
    # Each epoch's band spans [e, e + 1): the last epoch's shares end the plot.
    assert list(epochs) == [0, 1, 2] and w0 == [0.5, 0.75, 0.75] and w1 == [0.5, 0.25, 0.25]
    assert kwargs["labels"] == ["w0", "w1"]


def test_report_command_writes_three_pngs(tmp_path: Path):
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"history": HISTORY}))
    app = typer.Typer()
    run_cli.register(app)
    result = CliRunner().invoke(app, ["report", str(report), "--out", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    paths = sorted((tmp_path / "png").glob("*.png"))
    assert [p.name for p in paths] == ["run-compute-wait.png", "run-loss.png", "run-shares.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"history": []}))
    bad = CliRunner().invoke(app, ["report", str(empty)])
    assert bad.exit_code == 1 and "no epochs to plot" in bad.output
    # The file's name as it is: rich markup once swallowed "[b]" from it.
    named = tmp_path / "run[b]1.json"
    named.write_text(json.dumps({"history": []}))
    bad = CliRunner().invoke(app, ["report", str(named)])
    assert bad.exit_code == 1 and f"error: {named}: " in bad.output, bad.output
