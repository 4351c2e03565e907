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


def test_a_vocab_size_below_the_token_ids_fails_the_job_once_naming_it(cluster):
    """The largest id (59) is first seen by a worker's step, not by the load-time check:
    the worker's TokenIdError is a user error, so the job FAILS at once (no retry, though
    max_retries allows 2) with one line naming the field, the id and the vocab_size, in
    its reason and its log."""
    from dynabatch.actors.spec import parse_spec

    spec = parse_spec({
        "name": "vocab", "workers": 2, "global_batch": 8, "epochs": 1, "max_retries": 2,
        "node_resource": "dynabatch_worker", "spares": 0, "collective_timeout_s": 10,
        "dataset": {"name": "tests.unit.hf_plugins:token_classes",
                    "options": {"vocab": 60, "n": 32, "at": 20}},
        "model": {"name": "hf", "options": {"task": "sequence-classification", "config": {
            "model_type": "bert", "num_hidden_layers": 1, "hidden_size": 16,
            "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 40,
            "max_position_embeddings": 16}}},
    })
    coord = Coordinator("vocab", spec, resume=False)
    snap = coord.run()
    assert snap.state == JobState.FAILED, snap.reason
    named = ("model.options.config.vocab_size: token id 59 in the batch's input_ids is at "
             "or above the model's vocab_size 40")
    assert named in snap.reason and "not retried" in snap.reason, snap.reason
    assert "attempts" not in snap.reason and "\n" not in snap.reason
    assert "internal error" not in snap.reason and "IndexError" not in snap.reason
    logs = [line.message for line in coord.logs()]
    assert any(named in m for m in logs), logs[-10:]
    # One failed step, not 1 + max_retries of them.
    assert sum(m.startswith("step ") and " failed: " in m for m in logs) == 1, logs[-10:]
