# `make run` and `make test` work on a fresh machine: they create .venv, install torch pinned
# first (the local CPU wheel, no CUDA download), then exactly the versions in the committed
# lock (requirements/*.lock, with hashes), then the project itself without resolving anything.
# `make lock` refreshes the lock on purpose, from pyproject.toml's ranges.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
PIP_VERSION ?= 26.3
UV_VERSION ?= 0.13.9
# Where the CPU torch wheel lies (pip's find-links on this machine): `make lock` resolves
# torch's own dependencies against it, so no CUDA package enters the lock.
TORCH_WHEELS ?= /opt/wheels
RUNTIME_LOCK := requirements/runtime.lock
TEST_LOCK := requirements/test.lock

# The venv, pip and torch, each pinned.
$(VENV)/.base:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	touch $@

# A lock's packages (--no-deps: the lock is the whole closure; --require-hashes: the files
# are the ones locked), then the project itself, editable, built with the locked setuptools.
define install_lock
	$(BIN)/pip install -q --require-hashes --no-deps -r $(1)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
endef

$(VENV)/.runtime: $(VENV)/.base $(RUNTIME_LOCK) pyproject.toml setup.py
	$(call install_lock,$(RUNTIME_LOCK))
	touch $@

$(VENV)/.test: $(VENV)/.base $(TEST_LOCK) pyproject.toml setup.py
	$(call install_lock,$(TEST_LOCK))
	touch $@

STAMP := $(VENV)/.test

.PHONY: run test lint bench install lock clean prometheus chromium images deploy-test bundle

install: $(STAMP)

run: $(VENV)/.runtime
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

# The offline bundle for a GPU node without network (docs/operations.md): the wheels it needs
# beyond torch and numpy, cp312 manylinux x86-64, at the lock's versions and hashes, into
# .bundle/; Ray without its Java jar unless BUNDLE_FULL=1. Checks bundle + tree < 60 MiB.
BUNDLE_FULL ?=
bundle: $(STAMP)
	$(BIN)/python deploy/bundle.py --out .bundle $(if $(BUNDLE_FULL),--full)

# Refresh the lock from pyproject.toml's ranges (uv, pinned): the test set first (the runtime
# set, the `hf` and `test` extras), then the runtime set (with `hf`) held to the same versions.
# torch is left out of both (pinned above); its dependencies come from the CPU wheel's metadata.
lock: $(VENV)/.base
	$(BIN)/pip install -q uv==$(UV_VERSION)
	printf 'torch==%s\n' $(TORCH_VERSION) > $(VENV)/torch-constraint.txt
	$(call compile_lock,--extra test -c $(VENV)/torch-constraint.txt,$(TEST_LOCK))
	$(call compile_lock,-c $(VENV)/torch-constraint.txt -c $(TEST_LOCK),$(RUNTIME_LOCK))
	@! grep -qiE '^(nvidia|triton|cuda)' $(TEST_LOCK) $(RUNTIME_LOCK) || { echo "the lock took \
		CUDA packages: set TORCH_WHEELS to the folder of the CPU torch $(TORCH_VERSION) wheel"; exit 1; }

# pyproject.toml's runtime set with the `hf` extra, plus $(1), into the lock file $(2).
define compile_lock
	$(BIN)/uv pip compile -q pyproject.toml --extra hf $(1) --python-version 3.11 \
		--generate-hashes --no-emit-package torch --custom-compile-command 'make lock' \
		$(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS)) -o $(2)
endef

clean:
	rm -rf $(VENV) .pytest_cache
