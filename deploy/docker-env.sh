# Sourced by deploy/*.sh: which docker client and which compose to run.
# DOCKER: Debian's client (/usr/bin/docker) when present, the same version as Debian's engine;
# COMPOSE: `docker compose` (v2) when the client has it, else Debian's docker-compose (v1).
if [[ -z "${DOCKER:-}" ]]; then
    if [[ -x /usr/bin/docker ]]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi
if [[ -z "${COMPOSE:-}" ]]; then
    if "$DOCKER" compose version >/dev/null 2>&1; then
        COMPOSE="$DOCKER compose"
    else
        COMPOSE=docker-compose
    fi
fi
export DOCKER COMPOSE
