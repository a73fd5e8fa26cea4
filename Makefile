# The two commands a fresh machine needs: `make demo` and `make test`.
# Everything else here is a step those two depend on.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEMO_DIR ?= out/demo
# checkov's own virtualenv: its pinned dependencies conflict with the main one's (requirements-lint.txt).
LINT_VENV ?= .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
# The Kubeflow SDK's own virtualenv: it pins an older kubernetes client than the main one (requirements-sdk.txt).
SDK_VENV ?= .venv-sdk
SDK_STAMP := $(SDK_VENV)/.installed
# Every target starts Python processes that import our packages from their source folders (an
# editable install); an environment that sets PYTHONDONTWRITEBYTECODE (as some images do) makes each
# compile those modules again (~1.2 s of CPU per trainer process, and the tests start many), so
# Python may cache their bytecode here (an empty value is unset for Python).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-time unit e2e install cluster-bins browser images crd manifests lint lint-tools sdk-client bench clean

# The Python environment: one virtualenv in the checkout, rebuilt when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# pip 23 fails on some current package metadata: upgrade it first.
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[trainer,operator,dev]'
	touch $(STAMP)

install: $(STAMP)

$(LINT_STAMP): requirements-lint.txt
	test -x $(LINT_VENV)/bin/python || python3 -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q --upgrade pip
	$(LINT_VENV)/bin/pip install -q -r requirements-lint.txt
	touch $(LINT_STAMP)

$(SDK_STAMP): requirements-sdk.txt
	test -x $(SDK_VENV)/bin/python || python3 -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install -q --upgrade pip
	$(SDK_VENV)/bin/pip install -q -r requirements-sdk.txt
	touch $(SDK_STAMP)

# The Kubeflow SDK a user reads a TrainJob's logs with (the e2e suite does too).
sdk-client: $(SDK_STAMP)

# The linters of `make lint`: checkov (PyPI, .venv-lint) and kube-score (built with the cluster binaries).
lint-tools: $(LINT_STAMP) cluster-bins

# kube-score and checkov over the chart (several value sets), manifests/install.yaml and the trainer
# pods the operator creates; every finding kept on purpose is explained in lint/exceptions.yaml.
# `make test` runs it too (tests/unit/test_lint.py).
lint: $(STAMP) lint-tools
	CHECKOV=$(abspath $(LINT_VENV))/bin/checkov $(PY) -m kubetune_dev.lint

# Go-built Kubernetes, etcd, helm, the training operator, JobSet, Kubeflow Trainer, Kueue, the S3
# server and Prometheus, cached per version (devcluster/versions.env).
cluster-bins:
	bash devcluster/build.sh

# A headless Chromium unpacked from the Debian packages (no installation), cached like the binaries
# above: the report test opens `kubetune report`'s page in it.
browser:
	bash devcluster/chromium.sh

# The operator and trainer images from their Dockerfiles, with podman (installed from Debian's packages
# where missing), tagged kubetune/operator:$(IMAGE_TAG) and kubetune/trainer:$(IMAGE_TAG) in the local
# store; a base image that cannot be pulled is stood in for (devcluster/standin-base.sh). Cached by
# content: an image whose sources did not change is not built again (kubetune_dev.image_build).
IMAGE_TAG ?= dev
images: $(STAMP)
	IMAGE_TAG=$(IMAGE_TAG) $(PY) -m kubetune_dev.image_build

# Regenerate the CRD from the typed spec (a test fails when the committed one drifts).
crd: $(STAMP)
	$(PY) -m kubetune_api.crd --write

# Re-render manifests/install.yaml from the chart (a test fails when they differ).
manifests: $(STAMP) cluster-bins
	bash scripts/render-manifests.sh

demo: $(STAMP)
	bash scripts/demo.sh $(DEMO_DIR)

unit: $(STAMP) lint-tools
	CHECKOV=$(abspath $(LINT_VENV))/bin/checkov $(PY) -m pytest tests/unit -q

e2e: $(STAMP) cluster-bins images sdk-client
	$(PY) -m pytest tests/e2e -q

# Two workers: the control-plane tests (one control plane per machine) run in one, in file order,
# while the other takes the unit, trainer and storage tests (tests/conftest.py schedules them).
# The budget is 45 minutes on a 2-core machine with warm caches (README, "Testing"): every run ends
# with its 30 slowest tests and its total, so that a test that grows shows at once.
test: $(STAMP) cluster-bins browser lint-tools images sdk-client
	CHECKOV=$(abspath $(LINT_VENV))/bin/checkov $(PY) -m pytest tests -q -ra -n 2 --durations=30

# `make test`, measured: wall and CPU per file and per test, the Python processes each test started and
# their imports, control-plane starts, each worker's busy and idle time (benchmarks/test_time.py).
test-time: $(STAMP) cluster-bins browser lint-tools images sdk-client
	$(PY) benchmarks/test_time.py run --records out/test-time-$$(date +%Y%m%d-%H%M%S)

bench: $(STAMP) cluster-bins
	$(PY) benchmarks/trainer_throughput.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/checkpoint_io.py --size-mib 1024
	$(PY) benchmarks/distributed_scaling.py
	$(PY) benchmarks/metrics_overhead.py
	$(PY) benchmarks/plan_accuracy.py
	$(PY) benchmarks/plan_families.py
	$(PY) benchmarks/trainer_throughput.py --families --steps 6 --warmup-steps 2
	$(PY) benchmarks/cache_lookup.py

clean:
	rm -rf out build .pytest_cache
