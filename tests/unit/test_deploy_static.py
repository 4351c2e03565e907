"""Static checks of the deployment files (there is no Docker engine or Kubernetes here).

docker-compose.yml, deploy/Dockerfile, the Prometheus config, the Grafana provisioning and
dashboards, and deploy/k8s are checked against each other and against the real command-line
interfaces: the api's command line is parsed by the click command behind `dynabatch serve`,
and the Ray nodes' command lines by the one behind `ray start`. PromQL is parsed by promtool.
The live check (every dashboard query returns data from a real API) is
tests/e2e/test_deploy_live.py; it reuses the helpers at the top of this module.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "docker-entrypoint.sh"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards"
DASHBOARDS = GRAFANA / "dashboards"
K8S = ROOT / "deploy" / "k8s"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DEPLOYING = ROOT / "README.md"  # its "Deploying" section
RAYCLUSTER = ROOT / "service" / "raycluster.py"
INTEGRATION_CONFTEST = ROOT / "tests" / "integration" / "conftest.py"

IMAGE_SERVICES = ("ray-head", "worker-fast", "worker-slow", "api")
WORKER_SERVICES = ("worker-fast", "worker-slow")
RAY_SERVICES = ("ray-head", *WORKER_SERVICES)
WORKER_RESOURCE = "dynabatch_worker"

# Values for the variables that compose requires (${VAR:?message}).
COMPOSE_ENV = {"GRAFANA_ADMIN_PASSWORD": "not-a-secret"}


# Shared helpers (also used by tests/e2e/test_deploy_live.py) ---------------------------
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package prometheus; see `make prometheus`)")
    return path


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def panel_queries(dash: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(panel title, panel, target) for every query target of every panel."""
    for panel in all_panels(dash["panels"]):
        for t in panel.get("targets", []):
            yield panel.get("title", "?"), panel, t


def variable_query(var: dict[str, Any]) -> str:
    q = var.get("query", "")
    return q.get("query", "") if isinstance(q, dict) else str(q)


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*(?P<label>\w+)\s*\)\s*$")


def label_values_parts(query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    m = LABEL_VALUES.match(query)
    assert m, f"not a label_values() query: {query!r}"
    return m.group("selector"), m.group("label")


def substitute(
    expr: str,
    job: str = "0123456789ab",
    worker: str = ".*",
    rate_interval: str = "20s",
    interval: str = "5s",
) -> str:
    """Replace Grafana's variables the way Grafana would before it sends a query."""
    out = expr
    for name, value in (
        ("__rate_interval", rate_interval),
        ("__interval", interval),
        ("__range", "5m"),
        ("job", job),
        ("worker", worker),
    ):
        out = out.replace("${" + name + "}", value)
        out = re.sub(r"\$" + name + r"(?![A-Za-z0-9_])", lambda _m, v=value: v, out)
    assert "$" not in out, f"unknown variable left in {out!r}"
    return out


PROMQL_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
        "atan2",
    }
)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names that a PromQL expression selects (a small tokenizer, enough for the
    dashboards: strings, label matchers, ranges and grouping clauses are removed first, and
    identifiers that call a function are skipped)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(?!\w)", s):
        name = m.group(1)
        if name.lower() in PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", s[m.end() :]):  # a function call
            continue
        names.add(name)
    return names


def exported_metric_names() -> set[str]:
    """Sample names the API exports, from the contract in docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Metric names") :]
    names: set[str] = set()
    for line in section.splitlines():
        for name in re.findall(r"`(dynabatch_[a-z0-9_]+)", line):
            names.add(name)
            if "histogram" in line:
                names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return names


def compose_interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: $$, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error} and ${VAR?error}."""
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name") or m.group("bare"), m.group("op"), m.group("arg")
        val = env.get(name)
        if op in (":-", "-"):
            return arg if (val is None or (op == ":-" and val == "")) else val
        if op in (":?", "?"):
            if val is None or (op == ":?" and val == ""):
                raise KeyError(f"compose requires {name}: {arg}")
            return val
        return val or ""

    pattern = r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:-|-|:\?|\?)(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)"
    return re.sub(pattern, one, value)


@functools.cache
def compose() -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())
    return compose_interpolate(raw, COMPOSE_ENV)


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def command(service: str) -> list[str]:
    cmd = services()[service]["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def env_of(service: str) -> dict[str, str]:
    env = services()[service].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


@functools.cache
def serve_command() -> Any:
    """The real click command behind `dynabatch serve`."""
    import typer
    from dynabatch.api import cli

    cli._register()
    group = typer.main.get_command(cli.app)
    return group.commands["serve"]


@functools.cache
def ray_start_command() -> Any:
    """The real click command behind `ray start`."""
    from ray.scripts.scripts import start

    return start


def parse_serve(argv: list[str]) -> dict[str, Any]:
    assert argv[:2] == ["dynabatch", "serve"], argv
    return serve_command().make_context("serve", list(argv[2:])).params


def parse_ray_start(argv: list[str]) -> dict[str, Any]:
    assert argv[:2] == ["ray", "start"], argv
    return ray_start_command().make_context("start", list(argv[2:])).params


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def duration_seconds(text: str) -> float:
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text):
        assert m.start() == pos, f"bad duration {text!r}"
        total += float(m.group(1)) * units[m.group(2)]
        pos = m.end()
    assert pos == len(text) and pos > 0, f"bad duration {text!r}"
    return total


def mounts(service: str) -> list[tuple[str, str]]:
    """(source, target) of the service's volumes, short or long syntax."""
    out = []
    for v in services()[service].get("volumes", []):
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), str(v["target"])))
        else:
            parts = str(v).split(":")
            out.append((parts[0], parts[1]))
    return out


def is_bind(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~"))


# Self-tests of the helpers ---------------------------------------------------------------
def test_promql_metric_names_tokenizer() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job="x", k=~"y|z"}[5m])))'
    ) == {"a_bucket"}
    assert promql_metric_names(
        'a{job="$job"} / on (job) group_left () sum by (job) (b{job="j"})'
    ) == {"a", "b"}
    assert promql_metric_names('sum(c{kind="failure"}) or on () vector(0)') == {"c"}
    assert promql_metric_names("max(d) > bool 1 unless e offset 5m") == {"d", "e"}


def test_substitute_replaces_grafana_variables() -> None:
    got = substitute('rate(x{job="$job", w=~"${worker}"}[$__rate_interval])', job="j1")
    assert got == 'rate(x{job="j1", w=~".*"}[20s])'
    with pytest.raises(AssertionError):
        substitute('x{a="$unknown"}')


def test_compose_interpolation() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert compose_interpolate("${SET:-d}-${UNSET:-d}-${EMPTY:-d}-${EMPTY-d}-$$", env) == (
        "v-d-d--$"
    )
    with pytest.raises(KeyError):
        compose_interpolate("${UNSET:?needed}", env)


# docker-compose.yml -------------------------------------------------------------------
def test_compose_parses_with_the_expected_services() -> None:
    data = compose()
    assert set(data) <= {"name", "services", "volumes", "networks", "secrets", "configs"} | {
        k for k in data if k.startswith("x-")
    }
    assert set(services()) == {*IMAGE_SERVICES, "prometheus", "grafana"}
    for name, svc in services().items():
        assert "image" in svc or "build" in svc, name
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name


def test_compose_requires_the_grafana_password_from_the_environment() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    pw = raw["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", pw), pw
    with pytest.raises(KeyError):
        compose_interpolate(raw, {})
    env = env_of("grafana")
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_every_service_has_a_well_formed_healthcheck() -> None:
    roles = {"ray-head": "head", "worker-fast": "worker", "worker-slow": "worker", "api": "api"}
    entry = ENTRYPOINT.read_text()
    for name, svc in services().items():
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable"), f"{name} has no healthcheck"
        test = hc["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), (name, test)
        for key in ("interval", "timeout", "start_period"):
            if key in hc:
                assert duration_seconds(hc[key]) > 0, (name, key)
        assert duration_seconds(hc["timeout"]) <= duration_seconds(hc["interval"]), name
        assert int(hc.get("retries", 3)) >= 1
        if name in roles:
            assert test[1:] == ["docker-entrypoint.sh", "healthcheck", roles[name]], (name, test)
            assert f'"{roles[name]}"' in entry or f"== {roles[name]!r}" in entry, roles[name]


def test_depends_on_targets_exist_and_are_healthchecked() -> None:
    graph: dict[str, set[str]] = {}
    for name, svc in services().items():
        deps = svc.get("depends_on", {})
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        graph[name] = set(deps)
        for target, spec in deps.items():
            assert target in services(), f"{name} depends on unknown service {target}"
            cond = spec.get("condition", "service_started")
            assert cond in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            ), (name, cond)
            if cond == "service_healthy":
                hc = services()[target].get("healthcheck") or {}
                assert hc.get("test") and not hc.get("disable"), (
                    f"{name} waits for {target} to be healthy, but it has no healthcheck"
                )
    # No cycles: a topological order exists.
    done: set[str] = set()
    while len(done) < len(graph):
        ready = [n for n, d in graph.items() if n not in done and d <= done]
        assert ready, f"depends_on has a cycle among {set(graph) - done}"
        done.update(ready)
    for name in (*WORKER_SERVICES, "api"):
        assert services()[name]["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_named_volumes_are_declared_and_bind_sources_exist() -> None:
    declared = set(compose().get("volumes") or {})
    used = set()
    for name in services():
        for source, target in mounts(name):
            assert target.startswith("/"), (name, target)
            if is_bind(source):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"
                used.add(source)
    assert used == declared, f"declared but unused volumes: {declared - used}"


def test_checkpoints_are_shared_by_every_ray_node_and_the_api() -> None:
    for name in IMAGE_SERVICES:
        assert ("checkpoints", "/data/checkpoints") in mounts(name), name


def test_ports_are_consistent() -> None:
    published: dict[int, str] = {}
    for name, svc in services().items():
        for spec in svc.get("ports", []):
            parts = str(spec).split(":")
            assert len(parts) == 3, f"{name}: bind an explicit host address: {spec}"
            host_ip, host, container = parts
            assert host_ip in ("127.0.0.1", "0.0.0.0"), (name, spec)
            assert int(host) not in published, f"host port {host} used twice"
            published[int(host)] = name
            assert int(container) == int(host), (name, spec)
    api = parse_serve(command("api"))
    assert published[int(api["port"])] == "api"
    prom = [a for a in services()["prometheus"]["command"] if a.startswith("--web.listen-address")]
    assert published[host_port(prom[0].split("=", 1)[1])[1]] == "prometheus"
    assert published[3000] == "grafana"
    head = parse_ray_start(command("ray-head"))
    assert published[head["dashboard_port"]] == "ray-head"
    for name in WORKER_SERVICES:  # scalable: no fixed host ports, no fixed container name
        assert not services()[name].get("ports")
        assert "container_name" not in services()[name]


def test_api_listens_beyond_loopback_only_with_a_token_or_insecure() -> None:
    """`dynabatch serve` exits on a public address without a token unless --insecure: the
    deployments must say which (compose: an optional token, so --insecure; k8s: a token)."""
    from dynabatch.api.cli.job_commands import is_loopback

    params = parse_serve(command("api"))
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["api"]["environment"]
    token_required = re.fullmatch(r"\$\{DYNABATCH_API_TOKEN:\?[^}]+\}", raw["DYNABATCH_API_TOKEN"])
    assert is_loopback(params["host"]) or params["insecure"] or token_required
    (dep,) = k8s_docs("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    params = parse_serve(c["args"])
    env = {e["name"]: e for e in c["env"]}
    ref = env.get("DYNABATCH_API_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
    token_required = bool(ref) and not ref.get("optional", False)
    assert is_loopback(params["host"]) or params["insecure"] or token_required
    assert not params["insecure"], "k8s takes its token from a required secret"


def test_api_command_matches_the_real_serve_cli() -> None:
    params = parse_serve(command("api"))
    assert params["host"] == "0.0.0.0"
    head = parse_ray_start(command("ray-head"))
    assert params["address"] == f"ray-head:{head['port']}"
    env = env_of("api")
    assert env["DYNABATCH_RAY_JOIN"] == params["address"], "the api joins the cluster it uses"
    db_dir = str(Path(params["db"]).parent)
    assert ("jobstore", db_dir) in mounts("api"), "the job store is on a volume"


def system_configs_in(path: Path) -> list[dict[str, Any]]:
    """Every ``_system_config`` a Python file passes (``_system_config=...`` or a
    ``"_system_config": ...`` entry): a literal dict, or a name (or a no-argument call of a
    function) that the file imports from dynabatch.service.raycluster or defines itself."""
    import dynabatch.service.raycluster

    tree = ast.parse(path.read_text())
    defined: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dynabatch.service.raycluster":
            for alias in node.names:
                raycluster = dynabatch.service.raycluster
                defined[alias.asname or alias.name] = getattr(raycluster, alias.name)
        elif isinstance(node, ast.FunctionDef) and path.resolve() == Path(
            dynabatch.service.raycluster.__file__
        ).resolve():
            defined[node.name] = getattr(dynabatch.service.raycluster, node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    defined[t.id] = ast.literal_eval(node.value)
    values: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "_system_config":
            values.append(node.value)
        elif isinstance(node, ast.Dict):
            values += [
                v
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "_system_config"
            ]
    out = []
    for v in values:
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and not v.args:
            out.append(defined[v.func.id]())  # fast_health_check(): a copy per use
        elif isinstance(v, ast.Name):
            out.append(defined[v.id])
        else:
            out.append(ast.literal_eval(v))
    return out


def test_every_ray_head_uses_the_same_fast_health_checks() -> None:
    """README's detection time holds wherever dynabatch runs: the compose and k8s heads,
    the embedded Ray and the integration tests' cluster use one set of health checks."""
    from dynabatch.service.raycluster import FAST_HEALTH_CHECK, fast_health_check

    # Read-only, so Ray (which adds keys to the dict it is given) cannot change it for the
    # next user; each use gets an equal, fresh copy.
    with pytest.raises(TypeError):
        FAST_HEALTH_CHECK["health_check_period_ms"] = 1  # type: ignore[index]
    assert fast_health_check() == FAST_HEALTH_CHECK
    assert fast_health_check() is not fast_health_check()
    assert set(FAST_HEALTH_CHECK) == {
        "health_check_initial_delay_ms",
        "health_check_period_ms",
        "health_check_failure_threshold",
    }
    assert parse_ray_start(command("ray-head"))["system_config"] == FAST_HEALTH_CHECK
    (rc,) = k8s_docs("RayCluster")
    head = ray_start_params(rc["spec"]["headGroupSpec"]["rayStartParams"], head=True)
    assert head["system_config"] == FAST_HEALTH_CHECK
    for path in (RAYCLUSTER, INTEGRATION_CONFTEST):
        found = system_configs_in(path)
        assert found, f"{path.name} passes no _system_config"
        assert all(c == FAST_HEALTH_CHECK for c in found), (path.name, found)


def test_ray_commands_match_the_real_ray_start_cli() -> None:
    head = parse_ray_start(command("ray-head"))
    assert head["head"] and head["block"]
    assert head["num_cpus"] == 0, "the head runs no training"
    assert head["dashboard_host"] == "0.0.0.0"
    metrics_port = head["metrics_export_port"]
    assert metrics_port
    resources = {}
    for name in WORKER_SERVICES:
        w = parse_ray_start(command(name))
        assert w["address"] == f"ray-head:{head['port']}", name
        assert w["block"] and not w["head"]
        assert w["metrics_export_port"] == metrics_port, name
        res = json.loads(w["resources"])
        assert res.get(WORKER_RESOURCE) == 1, f"{name} must offer {WORKER_RESOURCE}"
        resources[name] = res
        limit = float(services()[name]["deploy"]["resources"]["limits"]["cpus"])
        # Ray CPUs are worker slots on the node's CFS quota: two per quota CPU at most (two
        # jobs' workers may share a node, each on half of it), never more.
        assert 1 <= w["num_cpus"] <= 2 * max(1, math.ceil(limit)), (name, w["num_cpus"], limit)
    assert resources["worker-fast"] != resources["worker-slow"], "node labels must differ"
    limits = {
        float(services()[n]["deploy"]["resources"]["limits"]["cpus"]) for n in WORKER_SERVICES
    }
    assert len(limits) == len(WORKER_SERVICES), "the worker kinds must differ in CPU"


def test_image_services_share_one_image_and_the_ray_settings() -> None:
    images = {services()[n]["image"] for n in IMAGE_SERVICES}
    assert len(images) == 1
    for name in IMAGE_SERVICES:
        svc = services()[name]
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == (
            DOCKERFILE.resolve()
        )
        assert env_of(name)["RAY_AUTH_MODE"] == "disabled", name
        assert svc.get("shm_size"), f"{name} needs shm for the object store"


def test_dynabatch_environment_variables_are_settings() -> None:
    from dynabatch.service.settings import Settings

    known = {f"DYNABATCH_{n.upper()}" for n in Settings.model_fields}
    entrypoint_vars = set(re.findall(r"\b(DYNABATCH_[A-Z_]+)", ENTRYPOINT.read_text()))
    found: dict[str, str] = {}
    for name in IMAGE_SERVICES:
        found.update({k: name for k in env_of(name) if k.startswith("DYNABATCH_")})
    found.update(
        {k: "Dockerfile" for k in re.findall(r"\b(DYNABATCH_[A-Z_]+)=", DOCKERFILE.read_text())}
    )
    for doc in k8s_docs():
        for c in pod_containers(doc):
            found.update(
                {
                    e["name"]: doc["kind"]
                    for e in c.get("env", [])
                    if e["name"].startswith("DYNABATCH_")
                }
            )
    unknown = {
        k: where for k, where in found.items() if k not in known and k not in entrypoint_vars
    }
    assert not unknown, f"not a Settings field nor read by the entrypoint: {unknown}"


# deploy/Dockerfile, .dockerignore, entrypoint ------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    lines = iter(text.splitlines())
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        op, _, rest = stripped.partition(" ")
        m = re.search(r"<<-?'?(\w+)'?", rest)
        if m:  # a heredoc: take its body along
            body = []
            for more in lines:
                if more.strip() == m.group(1):
                    break
                body.append(more)
            rest = rest + "\n" + "\n".join(body)
        out.append((op.upper(), rest))
    return out


def test_dockerfile_pins_cpu_torch_first_and_runs_as_non_root() -> None:
    ins = dockerfile_instructions()
    args = dict(re.match(r"(\w+)=?(.*)", rest).groups() for op, rest in ins if op == "ARG")
    makefile = (ROOT / "Makefile").read_text()
    assert args["TORCH_VERSION"] == re.search(r"TORCH_VERSION \?= (\S+)", makefile).group(1)
    assert args["BASE_IMAGE"].startswith("python:3.11-slim")
    assert args["TORCH_INDEX_URL"].endswith("/cpu")
    assert [rest for op, rest in ins if op == "FROM"] == ["${BASE_IMAGE}"]
    runs = [rest for op, rest in ins if op == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    assert "--index-url" in runs[torch_at]
    deps_at = next(i for i, r in enumerate(runs) if "runtime.lock" in r and "pip install" in r)
    project_at = next(i for i, r in enumerate(runs) if "pip install --no-deps --no-build" in r)
    assert torch_at < deps_at < project_at, "torch, then the dependencies, then the project"
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert any(op == "HEALTHCHECK" for op, _ in ins)
    entry = next(rest for op, rest in ins if op == "ENTRYPOINT")
    assert "docker-entrypoint.sh" in entry


def test_dockerfile_installs_the_runtime_lock_with_hashes() -> None:
    """The image resolves nothing: it installs the committed runtime lock, whole and hashed,
    and builds the project with the locked setuptools."""
    ins = dockerfile_instructions()
    copied = [rest.split() for op, rest in ins if op == "COPY"]
    assert ["requirements/runtime.lock", "./requirements/runtime.lock"] in copied
    runs = [rest for op, rest in ins if op == "RUN"]
    deps = next(r for r in runs if "requirements/runtime.lock" in r)
    assert "--require-hashes" in deps and "--no-deps" in deps and "pip check" in deps
    assert any("pip install --no-deps --no-build-isolation ." in r for r in runs)
    args = dict(re.match(r"(\w+)=?(.*)", rest).groups() for op, rest in ins if op == "ARG")
    makefile = (ROOT / "Makefile").read_text()
    assert args["PIP_VERSION"] == re.search(r"PIP_VERSION \?= (\S+)", makefile).group(1)
    assert any('pip install "pip==${PIP_VERSION}"' in r for r in runs)


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matches a path or a parent."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.strip("/")
        if any(
            fnmatch(pre, p) or (p.startswith("**/") and fnmatch(pre.split("/")[-1], p[3:]))
            for pre in prefixes
        ):
            excluded = not neg
    return excluded


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = []
    for op, rest in dockerfile_instructions():
        if op == "COPY":
            srcs = [a for a in rest.split() if not a.startswith("--")][:-1]
            copies += [s for s in srcs if "*" not in s]
    assert copies
    for src in copies:
        assert (ROOT / src).exists(), f"COPY {src}: missing"
        assert not dockerignore_excludes(src, patterns), f"COPY {src} is excluded by .dockerignore"
        for f in (ROOT / src).rglob("*.py") if (ROOT / src).is_dir() else []:
            rel = str(f.relative_to(ROOT))
            if "__pycache__" not in rel:
                assert not dockerignore_excludes(rel, patterns), rel
    for secret in (".venv", ".git", ".env", "tests", "dynabatch.db", "checkpoints"):
        assert dockerignore_excludes(secret, patterns), f"{secret} goes into the build context"


def test_entrypoint_is_valid_bash_with_a_valid_healthcheck() -> None:
    assert os.access(ENTRYPOINT, os.X_OK), "docker-entrypoint.sh must be executable"
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    text = ENTRYPOINT.read_text()
    body = re.search(r"<<'PY'\n(.*?)\nPY\n", text, re.S)
    assert body, "the healthcheck's Python heredoc"
    ast.parse(body.group(1))
    # The Ray flags the entrypoint uses to join the cluster exist.
    join = re.search(r"until (ray start .*?); do", re.sub(r"\\\n\s*", " ", text), re.S).group(1)
    argv = [a for a in shlex.split(join) if not a.startswith(">")][:-1]
    argv = [re.sub(r"\$\{?\w+(:-(\d+))?\}?", lambda m: m.group(2) or "x:1", a) for a in argv]
    params = parse_ray_start(argv)
    assert params["num_cpus"] == 0 and params["address"]


def test_healthcheck_fails_cleanly_for_an_unknown_role() -> None:
    # (The real roles look at the machine's processes, which are not this container's here.)
    r = subprocess.run(
        [str(ENTRYPOINT), "healthcheck", "no-such-role"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "nothing to check" in r.stderr, r.stderr


# Prometheus --------------------------------------------------------------------------
def test_prometheus_config_passes_promtool() -> None:
    r = subprocess.run(
        [promtool(), "check", "config", str(PROMETHEUS)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_scrapes_the_api_and_every_ray_node() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    api = jobs["dynabatch-api"]
    # The series' job label is job_id: nothing collides with the target's `job` label.
    assert not api.get("honor_labels"), "no label of the API's collides with `job`"
    port = parse_serve(command("api"))["port"]
    assert api["static_configs"][0]["targets"] == [f"api:{port}"]
    assert api.get("metrics_path", "/metrics") == "/metrics"
    ray = jobs["ray"]
    head = parse_ray_start(command("ray-head"))
    sd = ray["dns_sd_configs"]
    assert all(s["type"] == "A" and s["port"] == head["metrics_export_port"] for s in sd)
    names = {n for s in sd for n in s["names"]}
    assert set(RAY_SERVICES) <= names <= set(services()), names
    mounted = dict((t, s) for s, t in mounts("prometheus"))
    cfg_arg = next(a for a in services()["prometheus"]["command"] if "--config.file" in a)
    assert (ROOT / mounted[cfg_arg.split("=", 1)[1]]).resolve() == PROMETHEUS.resolve()


# Grafana --------------------------------------------------------------------------------
def provisioned_datasource() -> dict[str, Any]:
    sources = []
    for f in DATASOURCES.glob("*.y*ml"):
        sources += yaml.safe_load(f.read_text())["datasources"]
    assert len(sources) == 1, sources
    return sources[0]


def test_grafana_provisioning_matches_compose() -> None:
    ds = provisioned_datasource()
    assert ds["type"] == "prometheus" and ds["uid"]
    m = re.fullmatch(r"http://([\w-]+):(\d+)", ds["url"])
    assert m and m.group(1) == "prometheus", ds["url"]
    prom = next(a for a in services()["prometheus"]["command"] if "--web.listen-address" in a)
    assert int(m.group(2)) == host_port(prom.split("=", 1)[1])[1]
    targets = {t: s for s, t in mounts("grafana")}
    assert (ROOT / targets["/etc/grafana/provisioning"]).resolve() == (
        GRAFANA / "provisioning"
    ).resolve()
    providers = []
    for f in DASHBOARD_PROVIDERS.glob("*.y*ml"):
        providers += yaml.safe_load(f.read_text())["providers"]
    assert len(providers) == 1
    path = providers[0]["options"]["path"]
    assert (ROOT / targets[path]).resolve() == DASHBOARDS.resolve(), (
        "the dashboards folder must be mounted where the provider reads"
    )
    home = env_of("grafana").get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home.startswith(path + "/") and (DASHBOARDS / Path(home).name).exists()


def test_dashboards_load_and_are_templated_by_job() -> None:
    dashes = dashboards()
    assert set(dashes) == {"dynabatch-job.json", "dynabatch-workers.json", "dynabatch-cluster.json"}
    uids = [d["uid"] for d in dashes.values()]
    assert len(set(uids)) == len(uids)
    for name, d in dashes.items():
        assert d.get("id") is None, f"{name}: provisioned dashboards carry no numeric id"
        variables = {v["name"]: v for v in d["templating"]["list"]}
        job = variables.get("job")
        assert job, f"{name} has no job variable"
        assert job["type"] == "query"
        assert label_values_parts(variable_query(job)) == ("dynabatch_job_info", "job_id")
        used = json.dumps(d["panels"])
        for var in variables:
            assert f"${var}" in used, f"{name}: variable {var} is not used"


def test_every_panel_uses_the_provisioned_datasource() -> None:
    uid = provisioned_datasource()["uid"]
    for name, d in dashboards().items():
        for var in d["templating"]["list"]:
            if var["type"] == "query":
                assert var["datasource"]["uid"] == uid, (name, var["name"])
        for panel in all_panels(d["panels"]):
            if panel["type"] == "row":
                continue
            assert panel.get("datasource", {}).get("uid") == uid, (name, panel["title"])
            assert panel.get("targets"), (name, panel["title"])
            for t in panel["targets"]:
                assert t.get("datasource", {"uid": uid})["uid"] == uid, (name, panel["title"])
                assert t.get("expr", "").strip(), (name, panel["title"])


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    for name, d in dashboards().items():
        panels = list(all_panels(d["panels"]))
        ids = [p["id"] for p in panels]
        assert len(set(ids)) == len(ids), name
        cells: dict[tuple[int, int], str] = {}
        for p in panels:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, (name, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{name}: {p['title']} overlaps {cells[(x, y)]}"
                    cells[(x, y)] = p["title"]
            if "repeat" in p:
                variables = {v["name"] for v in d["templating"]["list"]}
                assert p["repeat"] in variables, (name, p["title"])


def dashboard_expressions() -> list[tuple[str, str, str]]:
    """(dashboard, what, expr) for every panel query and every variable's selector."""
    out = []
    for name, d in dashboards().items():
        for title, _, t in panel_queries(d):
            out.append((name, f"panel {title!r} {t['refId']}", t["expr"]))
        for var in d["templating"]["list"]:
            if var["type"] == "query":
                selector, _ = label_values_parts(variable_query(var))
                out.append((name, f"variable {var['name']}", selector))
    return out


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": substitute(expr)}
        for i, (_, _, expr) in enumerate(dashboard_expressions())
    ]
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_dashboards_query_only_metrics_the_api_exports() -> None:
    exported = exported_metric_names()
    assert "dynabatch_job_info" in exported and "dynabatch_job_epoch_duration_seconds_bucket" in (
        exported
    )
    queried: set[str] = set()
    for name, what, expr in dashboard_expressions():
        names = promql_metric_names(substitute(expr))
        assert names, f"{name} {what} selects no metric: {expr}"
        unknown = names - exported
        assert not unknown, f"{name} {what} queries {unknown}, which the API does not export"
        queried |= names
    # The panels: everything per worker, and the job's state, epoch, loss, accuracy,
    # utilization and epoch time.
    for must in (
        "dynabatch_worker_batch_size",
        "dynabatch_worker_partition_samples",
        "dynabatch_worker_throughput_samples_per_second",
        "dynabatch_worker_compute_seconds",
        "dynabatch_worker_wait_seconds",
        "dynabatch_job_state",
        "dynabatch_job_epoch",
        "dynabatch_job_train_loss",
        "dynabatch_job_test_accuracy_ratio",
        "dynabatch_job_utilization_ratio",
        "dynabatch_job_epoch_duration_seconds_sum",
        "dynabatch_cluster_nodes",
        "dynabatch_job_worker_events_total",
        # The cluster scheduler's panels (issue 31).
        "dynabatch_cluster_queue_length",
        "dynabatch_cluster_allocated_workers",
        "dynabatch_cluster_utilization_ratio",
        "dynabatch_cluster_resizes_total",
    ):
        assert must in queried, must


def test_compute_versus_wait_is_drawn_as_stacked_bars() -> None:
    d = dashboards()["dynabatch-workers.json"]
    stacked = []
    for panel in all_panels(d["panels"]):
        exprs = " ".join(t["expr"] for t in panel.get("targets", []))
        if "compute_seconds" in exprs and "wait_seconds" in exprs:
            if panel["type"] == "barchart":
                stacked.append(panel["options"]["stacking"] == "normal")
            else:
                custom = panel["fieldConfig"]["defaults"]["custom"]
                stacked.append(
                    custom["drawStyle"] == "bars" and custom["stacking"]["mode"] == "normal"
                )
    assert stacked and all(stacked)


# Kubernetes -------------------------------------------------------------------------------
@functools.cache
def _k8s_docs() -> tuple[tuple[str, str], ...]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f.name, json.dumps(doc)))
    return tuple(out)


def k8s_docs(kind: str | None = None) -> list[dict[str, Any]]:
    docs = [json.loads(d) for _, d in _k8s_docs()]
    return [d for d in docs if kind is None or d["kind"] == kind]


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        return [spec["headGroupSpec"]["template"]] + [
            g["template"] for g in spec["workerGroupSpecs"]
        ]
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        return [doc["spec"]["template"]]
    return []


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for t in pod_templates(doc) for c in t["spec"]["containers"]]


def ray_start_params(params: dict[str, str], *, head: bool) -> dict[str, Any]:
    """KubeRay renders rayStartParams as `--key=value` on a bash command line."""
    line = "ray start " + ("--head " if head else "--address=dynabatch-head-svc:6379 ")
    line += " ".join(f"--{k}={v}" for k, v in params.items()) + " --block"
    return parse_ray_start(shlex.split(line))


def test_k8s_manifests_parse_with_the_expected_kinds() -> None:
    kinds = sorted(d["kind"] for d in k8s_docs())
    for kind in ("RayCluster", "Deployment", "Service", "ServiceMonitor", "PersistentVolumeClaim"):
        assert kind in kinds, kind
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    present = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, "kustomization.yaml lists every manifest"
    for d in k8s_docs():
        assert d["metadata"]["name"] and "apiVersion" in d


def test_k8s_raycluster_has_heterogeneous_worker_groups() -> None:
    (rc,) = k8s_docs("RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    import ray

    assert rc["spec"]["rayVersion"] == ray.__version__
    head = ray_start_params(rc["spec"]["headGroupSpec"]["rayStartParams"], head=True)
    assert head["num_cpus"] == 0 and head["metrics_export_port"]
    groups = rc["spec"]["workerGroupSpecs"]
    assert len(groups) >= 2 and len({g["groupName"] for g in groups}) == len(groups)
    cpus, labels = set(), []
    for g in groups:
        p = ray_start_params(g["rayStartParams"], head=False)
        res = json.loads(p["resources"])
        assert res.get(WORKER_RESOURCE) == 1, g["groupName"]
        labels.append(json.dumps(res, sort_keys=True))
        assert p["metrics_export_port"] == head["metrics_export_port"]
        (c,) = g["template"]["spec"]["containers"]
        cpus.add(c["resources"]["limits"]["cpu"])
        assert str(p["num_cpus"]) == c["resources"]["limits"]["cpu"], g["groupName"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    assert len(cpus) == len(groups) and len(set(labels)) == len(groups)
    for c in pod_containers(rc):
        assert any(p["name"] == "metrics" for p in c["ports"]), "PodMonitor scrapes `metrics`"
        assert {"name": "RAY_AUTH_MODE", "value": "disabled"} in c["env"]


def test_k8s_api_deployment_matches_the_cli_and_the_cluster() -> None:
    (rc,) = k8s_docs("RayCluster")
    (dep,) = k8s_docs("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    params = parse_serve(c["args"])
    head_port = int(rc["spec"]["headGroupSpec"]["rayStartParams"].get("port", 6379))
    assert params["address"] == f"{rc['metadata']['name']}-head-svc:{head_port}"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DYNABATCH_RAY_JOIN"] == params["address"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == params["port"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(Path(params["db"]).parent) in mounted
    from dynabatch.api.routes.health import health

    paths = {r.path for r in health.routes}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] in paths, probe
        assert c[probe]["httpGet"]["port"] in ports, probe
    sel = dep["spec"]["selector"]["matchLabels"]
    assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_service_and_monitors_select_the_right_pods() -> None:
    (dep,) = k8s_docs("Deployment")
    (svc,) = [s for s in k8s_docs("Service") if s["metadata"]["name"] == "dynabatch-api"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"] for c in pod_containers(dep) for p in c["ports"]}
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    assert all(p["targetPort"] in container_ports for p in svc["spec"]["ports"])
    (sm,) = k8s_docs("ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in svc_ports and ep["path"] == "/metrics"
        assert not ep.get("honorLabels"), "job_id collides with no target label"
    (rc,) = k8s_docs("RayCluster")
    for pm in k8s_docs("PodMonitor"):
        assert pm["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": rc["metadata"]["name"]}


def test_k8s_claims_exist() -> None:
    claims = {d["metadata"]["name"]: d for d in k8s_docs("PersistentVolumeClaim")}
    for doc in k8s_docs():
        for t in pod_templates(doc):
            for v in t["spec"].get("volumes", []):
                if "persistentVolumeClaim" in v:
                    assert v["persistentVolumeClaim"]["claimName"] in claims, v
    assert "ReadWriteMany" in claims["dynabatch-checkpoints"]["spec"]["accessModes"]


def test_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rendered = list(yaml.safe_load_all(r.stdout))
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} == {
        "dynabatch"
    }


# README.md, "Deploying" ---------------------------------------------------------------
def test_deploying_doc_refers_to_real_services() -> None:
    text = DEPLOYING.read_text()
    for m in re.finditer(r"--scale ([\w-]+)=\d+", text):
        assert m.group(1) in services(), m.group(0)
    for host in ("pypi.org", "pythonhosted.org", "download.pytorch.org", "npmjs", "deb.debian.org"):
        assert host not in text, f"the docs must not name package registry hosts ({host})"
    assert "node_resource" in text and WORKER_RESOURCE in text


def _api_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    from dynabatch.service.settings import Settings

    for var in [v for v in os.environ if v.startswith("DYNABATCH_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        if var.startswith("DYNABATCH_") and value is not None:
            monkeypatch.setenv(var, value)
    return Settings()


def test_deployments_accept_the_documented_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's settings in compose and k8s allow what the README's job names (its
    checkpoint dir), and not more than the deployment provides."""
    from dynabatch.actors.spec import parse_spec
    from dynabatch.service.submit_policy import check_submission

    bodies = re.findall(r"-d '(\{.*?\})'", DEPLOYING.read_text(), re.S)
    specs = [parse_spec(json.loads(body)) for body in bodies]
    assert specs, "the doc submits a job with curl"
    (dep,) = k8s_docs("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    k8s_env = {e["name"]: e.get("value") for e in c["env"]}
    for where, env, mounted in (
        ("compose", env_of("api"), {t for _, t in mounts("api")}),
        ("k8s", k8s_env, {m["mountPath"] for m in c["volumeMounts"]}),
    ):
        settings = _api_settings(env, monkeypatch)
        for spec in specs:
            assert check_submission(spec, settings.submit_policy) == [], where
        policy = settings.submit_policy
        assert policy.checkpoint_root in mounted, (where, "checkpoints go to the shared volume")
        for root in policy.data_roots:
            assert root in mounted, (where, root)
        assert policy.user_code_modules == (), (where, "no user code unless chosen")


def test_deploying_doc_job_spec_is_valid() -> None:
    from dynabatch.actors.spec import parse_spec

    bodies = re.findall(r"-d '(\{.*?\})'", DEPLOYING.read_text(), re.S)
    assert bodies, "the doc submits a job with curl"
    for body in bodies:
        spec = parse_spec(json.loads(body))
        assert spec.node_resource == WORKER_RESOURCE
        assert spec.workers == "auto", "so that nodes added mid-run get workers"
        assert spec.checkpoint.dir == "/data/checkpoints"
