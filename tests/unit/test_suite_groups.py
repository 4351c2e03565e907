"""How ``pytest -n 2 --dist loadgroup`` splits the suite over two workers
(``tests/conftest.py``).

The integration tests on the session's Ray cluster must stay in one group (one worker, one
cluster, run one after another); a module listed as starting its own Ray must exist and not
use that cluster, or it would run beside the group and start a second one.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import OWN_RAY_MODULES, xdist_group_of

TESTS = Path(__file__).resolve().parents[1]


def _test_params(module: Path) -> set[str]:
    """Every parameter name of the module's test functions and fixtures."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.FunctionDef):
            names.update(a.arg for a in node.args.args)
    return names


def test_each_tier_gets_its_group() -> None:
    assert xdist_group_of("tests/integration/test_elastic.py::test_x[a-b]") == "ray-cluster"
    assert xdist_group_of("tests/e2e/test_service_e2e.py::test_y") == "e2e"
    assert xdist_group_of("tests/unit/test_policy.py::test_z") is None
    for name in OWN_RAY_MODULES:
        assert xdist_group_of(f"tests/integration/{name}::test_w") is None


def test_modules_that_start_their_own_ray_exist_and_never_ask_for_the_cluster() -> None:
    for name in OWN_RAY_MODULES:
        module = TESTS / "integration" / name
        assert module.is_file(), f"{name} is listed in OWN_RAY_MODULES but does not exist"
        assert "cluster" not in _test_params(module), f"{name} uses the session cluster"
