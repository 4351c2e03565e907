#!/usr/bin/env bash
# `make images`: build every image docker-compose.yml runs, from package registries only
# (no image registry is needed):
#
#   1. dynabatch-base:bookworm   a Debian bookworm root file system made with debootstrap from
#                                the Debian mirror this host's apt uses, `docker import`ed;
#                                it trusts the CA certificates this host adds
#                                (/usr/local/share/ca-certificates), as this host's pip does.
#   2. dynabatch:0.1.0           deploy/Dockerfile on that base (BASE_IMAGE): Python from Debian,
#                                torch (CPU) and the rest from the Python package index, with
#                                this host's pip settings (certificate, find-links, extra
#                                indexes): local directories are served to the build over
#                                loopback HTTP, so the local CPU torch wheel is the one installed.
#   3. dynabatch-prometheus:0.1.0  Debian's `prometheus` package on the same base
#                                (deploy/prometheus/Dockerfile).
#
# Grafana has no Debian package: its compose service is under the `grafana` profile.
#
# It installs docker.io, debootstrap and docker-compose with apt-get when they are missing and
# starts the Docker engine (dockerd) when none answers. Run as root.
#
# Environment: DYNABATCH_IMAGE, DYNABATCH_BASE_IMAGE, DYNABATCH_PROMETHEUS_IMAGE (tags),
# DEBIAN_MIRROR (default: this host's apt source), REBUILD_BASE=1 (redo debootstrap),
# TORCH_VERSION (default: the Makefile's).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

IMAGE="${DYNABATCH_IMAGE:-dynabatch:0.1.0}"
BASE="${DYNABATCH_BASE_IMAGE:-dynabatch-base:bookworm}"
PROM_IMAGE="${DYNABATCH_PROMETHEUS_IMAGE:-dynabatch-prometheus:0.1.0}"
SUITE=bookworm
TORCH_VERSION="${TORCH_VERSION:-$(sed -n 's/^TORCH_VERSION ?= *//p' Makefile)}"
WORK="${DYNABATCH_BUILD_DIR:-/var/tmp/dynabatch-build}"

log() { printf '[images] %s\n' "$*" >&2; }

# --- tools -----------------------------------------------------------------------------
need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
command -v docker-compose >/dev/null 2>&1 || need_pkgs+=(docker-compose)
if ((${#need_pkgs[@]})); then
    log "installing ${need_pkgs[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
# shellcheck source=deploy/docker-env.sh
source "$ROOT/deploy/docker-env.sh"

# --- the engine ------------------------------------------------------------------------
start_engine() {
    if "$DOCKER" info >/dev/null 2>&1; then
        return
    fi
    log "starting dockerd (log: /var/log/dynabatch-dockerd.log)"
    # A daemon outlives this script: it must not keep the caller's other descriptors open
    # (a CI runner's output pipe would never reach EOF; a held flock would never be freed),
    # so every descriptor above stderr is closed before dockerd starts, in its own session.
    (
        for fd in /proc/self/fd/*; do
            fd=${fd##*/}
            if [ "$fd" -gt 2 ] 2>/dev/null; then eval "exec $fd>&-" 2>/dev/null || true; fi
        done
        exec setsid dockerd </dev/null >/var/log/dynabatch-dockerd.log 2>&1
    ) &
    for _ in $(seq 60); do
        if "$DOCKER" info >/dev/null 2>&1; then
            return
        fi
        sleep 1
    done
    log "dockerd did not come up:"
    tail -20 /var/log/dynabatch-dockerd.log >&2
    exit 1
}
start_engine

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# --- 1. the Debian base ----------------------------------------------------------------
debian_mirror() {
    if [[ -n "${DEBIAN_MIRROR:-}" ]]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '/^URIs:/ {print $2}' | grep -v -- '-security' | grep '/debian$' | head -1 || true)
    if [[ -z "$uri" ]]; then
        uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$1 == "deb" && $2 ~ /\/debian$/ {print $2; exit}' || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

build_base() {
    if have_image "$BASE" && [[ "${REBUILD_BASE:-0}" != 1 ]]; then
        log "$BASE: present"
        return
    fi
    local mirror rootfs
    mirror=$(debian_mirror)
    rootfs="$WORK/rootfs"
    rm -rf "$rootfs"
    mkdir -p "$rootfs"
    log "$BASE: debootstrap $SUITE from $mirror"
    debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$rootfs" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1 || {
        tail -30 "$WORK/debootstrap.log" >&2
        exit 1
    }
    cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $SUITE main
deb $mirror $SUITE-updates main
deb ${mirror%/debian}/debian-security $SUITE-security main
EOF
    # The CA certificates this host adds (its pip and apt trust them), then the bundle again.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    fi
    chroot "$rootfs" update-ca-certificates >/dev/null
    # What a container image leaves out.
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log \
        "$rootfs"/tmp/* "$rootfs"/dev/*
    printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/locale/*\npath-include /usr/share/doc/*/copyright\n' \
        >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-minimal"
    printf 'APT::Install-Recommends "false";\n' >"$rootfs/etc/apt/apt.conf.d/docker-no-recommends"
    tar -C "$rootfs" --numeric-owner -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["bash"]' \
        --message "debootstrap --variant=minbase $SUITE" - "$BASE" >/dev/null
    rm -rf "$rootfs"
    log "$BASE: imported"
}

# --- 2. pip settings for the build -----------------------------------------------------
# The host's pip settings, with local directories replaced by URLs of a loopback HTTP server
# that the build (run with --network host) reaches.
SERVE="$WORK/serve"
HTTP_PID=""
stop_http() {
    if [[ -n "$HTTP_PID" ]]; then
        kill "$HTTP_PID" 2>/dev/null || true
        wait "$HTTP_PID" 2>/dev/null || true
    fi
}
trap stop_http EXIT

host_pip() {
    if [[ -x "$ROOT/.venv/bin/pip" ]]; then
        "$ROOT/.venv/bin/pip" "$@"
    else
        python3 -m pip "$@"
    fi
}

pip_setting() { # the host's value of a pip option: the environment first, then pip config
    local env="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [[ -n "${!env:-}" ]]; then
        echo "${!env}"
        return
    fi
    host_pip config get "global.$1" 2>/dev/null || true
}

BUILD_ARGS=()
prepare_pip() {
    rm -rf "$SERVE"
    mkdir -p "$SERVE/torch/simple"
    # A fixed port when free: the URLs are build arguments, part of the layers' cache keys.
    local port="${DYNABATCH_BUILD_HTTP_PORT:-38765}"
    if ! python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null; then
        port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    fi
    local url="http://127.0.0.1:$port"

    # torch: what `pip install torch==$TORCH_VERSION` resolves here (the local CPU wheel and
    # its dependencies), as a simple index of its own: TORCH_INDEX_URL.
    log "torch $TORCH_VERSION: resolving with this host's pip settings"
    host_pip download -q -d "$SERVE/torch/files" "torch==$TORCH_VERSION" >"$WORK/torch-download.log" 2>&1 || {
        cat "$WORK/torch-download.log" >&2
        exit 1
    }
    python3 - "$SERVE/torch" <<'PY'
import html, re, sys
from pathlib import Path

root = Path(sys.argv[1])
projects: dict[str, list[str]] = {}
for f in sorted((root / "files").iterdir()):
    name = f.name.split("-")[0]
    projects.setdefault(re.sub(r"[-_.]+", "-", name).lower(), []).append(f.name)
for project, files in projects.items():
    d = root / "simple" / project
    d.mkdir(parents=True, exist_ok=True)
    links = "".join(f'<a href="../../files/{html.escape(n)}">{html.escape(n)}</a>\n' for n in files)
    (d / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
(root / "simple" / "index.html").write_text(
    "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
)
PY
    ls "$SERVE/torch/files" | grep -q "^torch-${TORCH_VERSION}" || {
        log "torch $TORCH_VERSION was not resolved"
        exit 1
    }
    BUILD_ARGS+=(--build-arg "TORCH_INDEX_URL=$url/torch/simple/")

    # The rest: the host's index settings, local directories served.
    local i=0 out=() item
    for item in $(pip_setting extra-index-url); do
        if [[ "$item" == file://* ]]; then
            # The parent too: a local index's pages link to files beside it (../../files/).
            local dir="${item#file://}"
            dir="${dir%/}"
            ln -s "$(dirname "$dir")" "$SERVE/index$i"
            out+=("$url/index$i/$(basename "$dir")/")
            i=$((i + 1))
        else
            out+=("$item")
        fi
    done
    ((${#out[@]})) && BUILD_ARGS+=(--build-arg "PIP_EXTRA_INDEX_URL=${out[*]}")
    out=()
    for item in $(pip_setting find-links); do
        if [[ -d "$item" ]]; then
            ln -s "$item" "$SERVE/links$i"
            out+=("$url/links$i/")
            i=$((i + 1))
        elif [[ "$item" == http* ]]; then
            out+=("$item")
        fi
    done
    ((${#out[@]})) && BUILD_ARGS+=(--build-arg "PIP_FIND_LINKS=${out[*]}")
    local index cert timeout
    index=$(pip_setting index-url)
    if [[ -n "$index" && "$index" != file://* ]]; then
        BUILD_ARGS+=(--build-arg "PIP_INDEX_URL=$index")
    fi
    # The base trusts the host's CA certificates; the bundle lies at Debian's path there.
    cert=$(pip_setting cert)
    if [[ -n "$cert" ]]; then
        BUILD_ARGS+=(--build-arg "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
    fi
    timeout=$(pip_setting default-timeout)
    [[ -n "$timeout" ]] && BUILD_ARGS+=(--build-arg "PIP_DEFAULT_TIMEOUT=$timeout")

    (cd "$SERVE" && exec python3 -m http.server --bind 127.0.0.1 "$port" >"$WORK/http.log" 2>&1) &
    HTTP_PID=$!
    for _ in $(seq 50); do
        curl -fsS -o /dev/null "$url/torch/simple/" 2>/dev/null && break
        sleep 0.1
    done
    log "pip settings for the build: ${BUILD_ARGS[*]}"
}

# --- 3. images ---------------------------------------------------------------------------
docker_build() { # the classic builder: it needs no frontend image from a registry
    DOCKER_BUILDKIT=0 "$DOCKER" build --force-rm --network host "$@"
}

mkdir -p "$WORK"
build_base

log "$IMAGE: deploy/Dockerfile on $BASE"
prepare_pip
docker_build -f deploy/Dockerfile -t "$IMAGE" \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
    "${BUILD_ARGS[@]}" . 2>&1 | tee "$WORK/dynabatch-build.log" | grep -E '^Step |^Successfully|rror' >&2
[[ "${PIPESTATUS[0]}" == 0 ]] || {
    tail -40 "$WORK/dynabatch-build.log" >&2
    exit 1
}
stop_http
HTTP_PID=""

log "$PROM_IMAGE: Debian's prometheus on $BASE"
docker_build -f deploy/prometheus/Dockerfile -t "$PROM_IMAGE" --build-arg "BASE_IMAGE=$BASE" \
    deploy/prometheus 2>&1 | tee "$WORK/prometheus-build.log" | grep -E '^Step |^Successfully|rror' >&2
[[ "${PIPESTATUS[0]}" == 0 ]] || {
    tail -40 "$WORK/prometheus-build.log" >&2
    exit 1
}

"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
    | grep -E "^(${BASE%%:*}|${IMAGE%%:*}|${PROM_IMAGE%%:*}):" >&2
log "done"
