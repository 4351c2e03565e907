"""The simulator's example clusters parse."""

from __future__ import annotations

from pathlib import Path

import pytest
from dynabatch.scheduler.sim.cluster_spec import load_cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "clusters").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_clusters_are_valid(path):
    assert load_cluster(path).classes
