#!/usr/bin/env bash
# Entrypoint of the dynabatch image, which runs the Ray head, the Ray workers and the API.
#
#   docker-entrypoint.sh COMMAND [ARGS...]          run COMMAND (ray start ..., dynabatch serve ...)
#   docker-entrypoint.sh healthcheck [auto|api|head|worker]
#                                                   exit 0 when this container's role is healthy
#
# DYNABATCH_RAY_JOIN=HOST:PORT makes the container join that Ray cluster as a node with no CPUs
# before COMMAND starts. The API needs it: Ray attaches a driver (ray.init(address=...)) only on
# a machine that runs a raylet of the cluster. Nothing is scheduled there: it offers 0 CPUs and
# none of the workers' custom resources.
set -euo pipefail

join_ray() {
    local address="$1"
    local timeout="${DYNABATCH_RAY_JOIN_TIMEOUT_S:-180}"
    local deadline=$((SECONDS + timeout))
    local log=/tmp/dynabatch-ray-join.log
    until ray start --address="$address" --num-cpus=0 --num-gpus=0 \
        --metrics-export-port="${RAY_METRICS_EXPORT_PORT:-8080}" \
        --disable-usage-stats >"$log" 2>&1; do
        ray stop --force >/dev/null 2>&1 || true
        if ((SECONDS >= deadline)); then
            echo "docker-entrypoint: could not join the Ray cluster at $address in ${timeout}s:" >&2
            cat "$log" >&2
            exit 1
        fi
        echo "docker-entrypoint: waiting for the Ray head at $address" >&2
        sleep 3
    done
    echo "docker-entrypoint: joined the Ray cluster at $address" >&2
}

healthcheck() {
    exec python - "${1:-auto}" <<'PY'
"""Health of this container, by role: the API answers /readyz, the head's GCS answers, a
worker's raylet runs. ``auto`` finds the role from the running processes."""

import os
import socket
import sys
import urllib.request


def processes():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv:
            yield argv


def is_api(argv):
    return "serve" in argv and any(os.path.basename(a) == "dynabatch" for a in argv[:2])


def named(name):
    return lambda argv: os.path.basename(argv[0]) == name


def find(pred):
    return next((argv for argv in processes() if pred(argv)), None)


def option(argv, name, default):
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def check_api(argv):
    port = option(argv, "--port", os.environ.get("DYNABATCH_PORT", "8000"))
    host = option(argv, "--host", os.environ.get("DYNABATCH_HOST", "127.0.0.1"))
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    path = os.environ.get("DYNABATCH_HEALTHCHECK_PATH", "/readyz")
    req = urllib.request.Request(f"http://{host}:{port}{path}")
    token = os.environ.get("DYNABATCH_API_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status == 200


def check_head(argv):
    # The GCS accepts connections on its port. (Not `ray health-check`: importing Ray's CLI
    # took longer than the check's timeout on a loaded host and marked a working head
    # unhealthy, and compose then refused to start everything that waits for it.)
    port = int(option(argv, "--gcs_server_port", os.environ.get("RAY_GCS_PORT", "6379")))
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        return True


def main(role):
    api, gcs, raylet = find(is_api), find(named("gcs_server")), find(named("raylet"))
    if role == "auto":
        role = "api" if api else "head" if gcs else "worker" if raylet else "none"
    if role == "api":
        return api is not None and check_api(api)
    if role == "head":
        return gcs is not None and raylet is not None and check_head(gcs)
    if role == "worker":
        return raylet is not None
    print(f"healthcheck: nothing to check (role {role!r})", file=sys.stderr)
    return False


try:
    ok = main(sys.argv[1])
except Exception as err:  # any failure to check is unhealthy
    print(f"healthcheck: {type(err).__name__}: {err}", file=sys.stderr)
    ok = False
sys.exit(0 if ok else 1)
PY
}

if [[ $# -eq 0 ]]; then
    set -- dynabatch serve --host "${DYNABATCH_HOST:-0.0.0.0}" --port "${DYNABATCH_PORT:-8000}"
fi

if [[ "$1" == "healthcheck" ]]; then
    shift
    healthcheck "$@"
fi

# Ray opens many files: the soft limit up to the hard one (compose cannot ask for more than
# the engine has; a higher `ulimits:` makes container creation fail).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

if [[ -n "${DYNABATCH_RAY_JOIN:-}" ]]; then
    join_ray "$DYNABATCH_RAY_JOIN"
fi

exec "$@"
