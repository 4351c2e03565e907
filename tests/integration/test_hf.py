"""examples/hf-text on real Ray workers: its prepare.py writes the Parquet token set, and
the example's own spec (a GPT-2-style causal LM from config, 2 unequal workers) trains to
SUCCEEDED with every epoch's ledger verified and the held-out perplexity falling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dynabatch.actors.spec import load_spec
from dynabatch.scheduler.core.lifecycle import JobState
from dynabatch.scheduler.sync.coordinator import Coordinator

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf-text"


def test_the_hf_text_example_trains_on_ray_workers(cluster, tmp_path):
    # A smaller text than the example's default, so the test stays short.
    subprocess.run(
        [sys.executable, str(EXAMPLE / "prepare.py"), str(tmp_path), "--chars", "80000"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    spec = load_spec(EXAMPLE / "gpt2-hetero.yaml").model_copy(
        # No spare process on the session's idle third node: nothing here adopts one.
        update={"node_resource": "dynabatch_worker", "epochs": 3, "spares": 0}
    )
    spec = spec.model_copy(
        update={"dataset": spec.dataset.model_copy(update={"path": str(tmp_path)})}
    )
    coord = Coordinator("hf-text", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.SUCCEEDED, snap.reason
    hist = coord.history()
    assert len(hist) == 3
    assert all(r.verified and r.samples_trained == r.dataset_size for r in hist)
    ppl = [r.test_metrics["perplexity"] for r in hist]
    assert ppl[-1] < ppl[0], ppl
