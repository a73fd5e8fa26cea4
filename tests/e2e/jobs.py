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
    spec.pop("volumes")  # its inputs and checkpoints are in S3: no claim to mount
    return manifest


def operator_log(control_plane, core) -> str:
    """The operator pod's log, for failure messages."""
    pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=kubetune-operator")
    logs = []
    for pod in pods.items:  # the chart's `helm test` pod carries the label too, without an operator container
        try:
            logs.append(control_plane.pod_log(pod.metadata.name, OPERATOR_NAMESPACE, "operator").read_text()[-4000:])
        except FileNotFoundError:
            continue
    return "\n".join(logs)


def printed_columns(header: str, row: str) -> dict[str, str]:
    """A kubectl table row as {column: value}, cut at the header's column starts."""
    names = header.split()
    starts = [header.index(name) for name in names] + [None]
    return {name: row[starts[i]:starts[i + 1]].strip() for i, name in enumerate(names)}


def get_job(api_client, namespace: str, name: str) -> dict:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        "kubetune.dev", "v1alpha1", namespace, "trainingjobs", name)


def phase(api_client, namespace, name):
    return (get_job(api_client, namespace, name).get("status") or {}).get("phase")


# ---- the child job, whichever backend runs it ------------------------------------------------------
# The tests run once per backend (the `backend` fixture); these read what the backend created
# through the backend module itself, so a test names no PyTorchJob or TrainJob detail.

def backend_of(name: str):
    from kubetune_operator.backends import BACKENDS

    return BACKENDS[name]


def get_child(api_client, backend: str, namespace: str, name: str) -> dict | None:
    """The child job of TrainingJob NAME, or None while there is none."""
    child = backend_of(backend)
    try:
        return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            child.group, child.version, namespace, child.plural, name)
    except client.exceptions.ApiException as err:
        if err.status == 404:
            return None
        raise


def children(api_client, backend: str, namespace: str) -> list[dict]:
    child = backend_of(backend)
    return client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        child.group, child.version, namespace, child.plural)["items"]


def job_pods(core, namespace: str, name: str) -> list:
    """Every pod of TrainingJob NAME (the operator labels them all, whichever backend)."""
    return core.list_namespaced_pod(namespace, label_selector=f"kubetune.dev/trainingjob={name}").items


def rank0_pod(core, backend: str, namespace: str, name: str) -> str | None:
    """The name of the pod that runs rank 0 now (its name changes per restart under a TrainJob)."""
    pods = core.list_namespaced_pod(namespace, label_selector=backend_of(backend).rank0_pod_selector(name)).items
    live = [p for p in pods if not p.metadata.deletion_timestamp]
    return live[0].metadata.name if live else None


def rank0_pod_logs(control_plane, backend: str, namespace: str, name: str) -> list[str]:
    """The trainer log of every pod that ran rank 0, oldest first (a deleted pod's log stays).

    PyTorchJob: the Master, re-created under the same name; TrainJob: node 0 of the JobSet's node
    Job, a new name per (re)start.
    """
    pattern = f"{name}-master-0" if backend == "pytorchjob" else f"{name}-node-0-0-*"
    dirs = control_plane.pod_dirs(namespace, pattern)
    container = backend_of(backend).container
    return [(d / "logs" / f"{container}.log").read_text() for d in dirs if (d / "logs" / f"{container}.log").exists()]
