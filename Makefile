# `make run` and `make test` work on a fresh machine: they create .venv,
# install torch pinned first (the local CPU wheel, no CUDA download), then the rest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: run test lint bench install clean prometheus chromium images deploy-test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/dynabatch run examples/digits-hetero.yaml --report dynabatch-report.json

# Prometheus (Debian's package) is needed by the end-to-end tier; install it if missing.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus >/dev/null) || echo "prometheus not installable; e2e tests that need it will fail"

# Chromium (Debian's package) runs the job page's end-to-end test, headless.
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installable; the job page's e2e test will fail"

# pytest workers (pytest-xdist): 2 runs the Ray groups beside the unit tier, as
# tests/conftest.py's xdist_group_of groups them (docs/testing.md, "Suite time");
# PYTEST_WORKERS=0 runs the suite serially in one process.
PYTEST_WORKERS ?= 2

test: $(STAMP) prometheus chromium
	$(BIN)/ruff check .
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 \
		-n $(PYTEST_WORKERS) --dist loadgroup tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/python bench/policy_scale.py
	RAY_AUTH_MODE=disabled $(BIN)/python bench/hetero.py

# The docker-compose stack's images, from package registries only (no image registry):
# a debootstrapped Debian base, the dynabatch image, Prometheus from Debian. Needs root;
# installs docker.io, debootstrap and docker-compose and starts dockerd when missing.
images:
	bash deploy/build-images.sh

# The stack for real (after `make images`; takes a while, not part of `make test`):
# docker-compose up with CPU-quota-unequal workers, a job over REST, Prometheus and the
# dashboards' queries, `docker kill` and `--scale` mid-run, static/dbs/affine side by side,
# a clean `down`. Writes bench/results-compose.json.
deploy-test: $(STAMP)
	DYNABATCH_DEPLOY_TEST=1 RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -p no:cacheprovider \
		-s -x --timeout 5400 tests/deploy

clean:
	rm -rf $(VENV) .pytest_cache
