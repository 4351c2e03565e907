"""Character-level LM on the stdlib's source: held-out perplexity against the unigram baseline.

Runs ``examples/charlm-hetero.yaml`` (3 workers at emulated slowdowns 1, 1, 2; a small
causal Transformer) on an embedded Ray, exactly as ``dynabatch run`` does, then compares the
last epoch's held-out perplexity (reported by the workers' evaluation) with the unigram
baseline's: the add-one smoothed training character frequencies scored on the same held-out
targets (:func:`unigram_perplexity`). Target: at least 30% lower.

Prints one JSON object. Usage: python bench/charlm.py [--config examples/charlm-hetero.yaml]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dynabatch.actors.spec import load_spec
from dynabatch.actors.workloads.datasets import load_dataset
from dynabatch.api.cli.run import run_job
from rich.console import Console

TARGET_REDUCTION = 0.30


def unigram_perplexity(y_train: np.ndarray, y_test: np.ndarray, vocab: int) -> float:
    """The baseline a language model must beat: the perplexity on the held-out targets of
    the training set's character frequencies (add-one smoothed), ``exp(-mean_t log p(y_t))``."""
    counts = np.bincount(np.asarray(y_train).ravel(), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[np.asarray(y_test).ravel()].mean()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="examples/charlm-hetero.yaml")
    args = ap.parse_args()
    spec = load_spec(args.config)
    ds = load_dataset(spec.dataset, seed=spec.seed)
    baseline = unigram_perplexity(ds.y_train, ds.y_test, ds.num_classes)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        snap = run_job(spec, address=None, report=report, quiet=True,
                       console=Console(file=open(os.devnull, "w")))  # noqa: SIM115
        hist = json.loads(report.read_text())["history"]
    last = hist[-1] if hist else {}
    ppl = (last.get("test_metrics") or {}).get("perplexity")
    reduction = None if ppl is None else 1.0 - ppl / baseline
    print(json.dumps({
        "bench": "charlm",
        "config": args.config,
        "state": snap.state.value,
        "emulated": spec.emulated,
        "train_sequences": len(ds.y_train),
        "test_sequences": len(ds.y_test),
        "seq_len": int(ds.x_train.shape[1]),
        "epochs": len(hist),
        "unigram_perplexity": round(baseline, 4),
        "perplexity_by_epoch": [round((r.get("test_metrics") or {}).get("perplexity", 0.0), 4)
                                for r in hist],
        "test_accuracy": last.get("test_accuracy"),
        "perplexity": None if ppl is None else round(ppl, 4),
        "reduction": None if reduction is None else round(reduction, 4),
        "target_reduction": TARGET_REDUCTION,
        "met": reduction is not None and reduction >= TARGET_REDUCTION,
        "wall_s": round(sum(r["wall_s"] for r in hist), 2),
    }, indent=2))


if __name__ == "__main__":
    main()
