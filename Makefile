# The two commands a fresh machine needs: `make demo` and `make test`.
# Everything else here is a step those two depend on.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEMO_DIR ?= out/demo

.PHONY: demo test unit e2e install cluster-bins crd manifests bench clean

# The Python environment: one virtualenv in the checkout, rebuilt when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# pip 23 fails on some current package metadata: upgrade it first.
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[trainer,operator,dev]'
	touch $(STAMP)

install: $(STAMP)

# Go-built Kubernetes, etcd, helm, the training operator, JobSet, Kubeflow Trainer, Kueue, the S3
# server and Prometheus, cached per version (devcluster/versions.env).
cluster-bins:
	bash devcluster/build.sh

# Regenerate the CRD from the typed spec (a test fails when the committed one drifts).
crd: $(STAMP)
	$(PY) -m kubetune_api.crd --write

# Re-render manifests/install.yaml from the chart (a test fails when they differ).
manifests: $(STAMP) cluster-bins
	bash scripts/render-manifests.sh

demo: $(STAMP)
	bash scripts/demo.sh $(DEMO_DIR)

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

e2e: $(STAMP) cluster-bins
	$(PY) -m pytest tests/e2e -q

test: $(STAMP) cluster-bins
	$(PY) -m pytest tests -q -ra

bench: $(STAMP) cluster-bins
	$(PY) benchmarks/trainer_throughput.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/checkpoint_io.py --size-mib 1024
	$(PY) benchmarks/distributed_scaling.py
	$(PY) benchmarks/metrics_overhead.py
	$(PY) benchmarks/plan_accuracy.py

clean:
	rm -rf out build .pytest_cache
