"""Where the pinned control-plane binaries live.

devcluster/versions.env is the single list of versions; devcluster/build.sh builds each
component into ``<cache>/<component>-<version>/bin``. This module reads the same file so the
Python side always looks for exactly what the builder produced.
"""
from __future__ import annotations

import os
from pathlib import Path

VERSIONS_FILE = Path(__file__).resolve().parents[2] / "versions.env"
BUILD_SCRIPT = VERSIONS_FILE.parent / "build.sh"

# Binary name -> (component directory prefix, key in versions.env).
_COMPONENTS = {
    "etcd": ("etcd", "ETCD_VERSION"),
    "kube-apiserver": ("kubernetes", "KUBERNETES_VERSION"),
    "kube-controller-manager": ("kubernetes", "KUBERNETES_VERSION"),
    "kubectl": ("kubernetes", "KUBERNETES_VERSION"),
    "helm": ("helm", "HELM_VERSION"),
    "training-operator.v1": ("training-operator", "TRAINING_OPERATOR_VERSION"),
    "versitygw": ("versitygw", "VERSITYGW_VERSION"),
    "prometheus": ("prometheus", "PROMETHEUS_VERSION"),
    "jobset": ("jobset", "JOBSET_VERSION"),
    "trainer-controller-manager": ("trainer", "TRAINER_VERSION"),
    "kueue": ("kueue", "KUEUE_VERSION"),
    # Not part of the control plane: the manifest linter of `make lint` (kubetune_dev.lint).
    "kube-score": ("kube-score", "KUBE_SCORE_VERSION"),
}


class MissingBinary(RuntimeError):
    """A control-plane binary has not been built (or installed) yet."""


def versions() -> dict[str, str]:
    """The KEY=VALUE pairs of versions.env (comments and blank lines skipped)."""
    pairs = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def cache_dir() -> Path:
    return Path(os.environ.get("KUBETUNE_CACHE", Path.home() / ".cache" / "kubetune"))


def component_dir(binary: str) -> Path:
    prefix, key = _COMPONENTS[binary]
    return cache_dir() / f"{prefix}-{versions()[key]}"


def binary(name: str) -> Path:
    """Absolute path of a built binary."""
    path = component_dir(name) / "bin" / name
    if not path.exists():
        raise MissingBinary(f"{path} is missing: run `bash {BUILD_SCRIPT}` (cached per version)")
    return path


def training_operator_crds() -> list[Path]:
    """The training operator's CRDs (copied from its Go module by the builder) that we serve:
    only PyTorchJob, the one scheme the operator runs with here."""
    return [component_dir("training-operator.v1") / "crds" / "kubeflow.org_pytorchjobs.yaml"]


def config_dir(binary: str) -> Path:
    """What the builder copied from a controller's Go module: CRDs and webhook configurations."""
    return component_dir(binary) / "config"
