"""Helpers shared by the e2e tests that run the operator: its namespace, the S3 bucket, the
example TrainingJob pointed at tiny inputs, and reading jobs and logs back.

The fixtures that install the chart and stage the inputs are in conftest.py.
"""
from __future__ import annotations

import os
import subprocess

import yaml
from kubernetes import client

from tests.conftest import REPO

OPERATOR_NAMESPACE = "kubetune-system"
BUCKET = "kubetune-e2e"


def os_env() -> dict[str, str]:
    return dict(os.environ)


def kubectl(cluster, *args, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return cluster.kubectl(*args, input=input, check=check)


def example_job(inputs: dict, name: str, run_prefix: str, **training) -> dict:
    """The SD1.5 example a user applies, pointed at the tiny model and data in S3."""
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    spec["model"]["pretrained"] = inputs["model"]
    spec["data"].update(uri=inputs["data"], resolution=32)
    spec["training"].update({"maxSteps": 8, "batchSize": 2, "mixedPrecision": "no", "lrWarmupSteps": 0, **training})
    spec["checkpoints"].update(uri=f"s3://{BUCKET}/{run_prefix}", everySteps=4)
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["s3"] = {"credentialsSecret": "s3-credentials"}
    return manifest


def operator_log(control_plane, core) -> str:
    """The operator pod's log, for failure messages."""
    pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=kubetune-operator")
    return "\n".join(control_plane.pod_log(p.metadata.name, OPERATOR_NAMESPACE, "operator").read_text()[-4000:]
                     for p in pods.items)


def get_job(api_client, namespace: str, name: str) -> dict:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        "kubetune.dev", "v1alpha1", namespace, "trainingjobs", name)


def phase(api_client, namespace, name):
    return (get_job(api_client, namespace, name).get("status") or {}).get("phase")
