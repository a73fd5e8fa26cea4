"""`kubetune generate JOB --on-cluster`: the same drawing as a Kubernetes Job on the cluster's GPUs.

The CLI cannot render the trainer's pod (the operator's settings decide its image, environment and
security context), so it asks the operator: it writes a GenerationRequest into the TrainingJob's
annotation (contract.GENERATE_ANNOTATION), the operator runs it as a batch Job owned by the job
(kubetune_operator.generation_jobs) and answers in status.generations, which this waits on. The
images land beside the run in S3, <outputUri>/generated/<label>/; --out downloads them.
"""
from __future__ import annotations

import secrets
import time
from pathlib import Path

import click

from kubetune_api.contract import API_GROUP, API_VERSION, GENERATE_ANNOTATION, GENERATION_LABEL, GENERATIONS_STATUS
from kubetune_api.contract import PLURAL
from kubetune_api.failures import FAILED
from kubetune_api.generation_request import GenerationRequest

POLL_SECONDS = 2.0


def new_request_id() -> str:
    """Time-ordered and unique enough to name a Job and a folder: seconds since 2020 and 4 random hex digits."""
    return f"{int(time.time()) - 1577836800:x}{secrets.token_hex(2)}"


def cluster_apis():
    from kubernetes import client, config

    api_client = config.new_client_from_config()
    return client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)


def ask(custom, namespace: str, name: str, request: GenerationRequest) -> None:
    """The request onto the TrainingJob (a merge patch of one annotation: nothing else of it changes)."""
    custom.patch_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name,
                                          {"metadata": {"annotations": {GENERATE_ANNOTATION: request.to_annotation()}}})


def answer(custom, namespace: str, name: str, request_id: str) -> dict | None:
    job = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
    entries = (job.get("status") or {}).get(GENERATIONS_STATUS) or []
    return next((e for e in entries if e.get("id") == request_id), None)


def wait_for(custom, namespace: str, name: str, request_id: str, timeout: float) -> dict | None:
    """The finished status.generations entry of the request, or None when TIMEOUT passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = answer(custom, namespace, name, request_id)
        if entry and entry.get("phase") in ("Succeeded", "Failed"):
            return entry
        time.sleep(POLL_SECONDS)
    return None


def pod_said(core, namespace: str, request_id: str) -> str:
    """The drawing pod's termination message (its one-line error), where the cluster has one."""
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=f"{GENERATION_LABEL}={request_id}").items
    except Exception:  # noqa: BLE001  (a user who may not list pods still gets the Job's own message)
        return ""
    for pod in pods:
        for status in (pod.status.container_statuses or []) if pod.status else []:
            terminated = status.state.terminated if status.state else None
            if terminated and terminated.message:
                return terminated.message.strip().splitlines()[-1]
    return ""


def download(uri: str, out: Path) -> int:
    from kubetune_trainer.storage.tree import open_tree

    tree = open_tree(uri)
    return len(tree.fetch(sorted(tree.files()), out))


def generate_on_cluster(command: str, name: str, namespace: str, run, step: int | str, compare: bool,
                        prompts: tuple[str, ...], steps: int | None, guidance: float | None, seed: int | None,
                        count: int | None, out: Path | None, wait: bool, timeout: float) -> None:
    from kubernetes.client.exceptions import ApiException

    from kubetune_cli.runs import storage_errors
    from kubetune_cli.trained import fail

    request = GenerationRequest(id=new_request_id(), run=run.uri, step=str(step), compare=compare, prompts=prompts,
                                steps=steps, guidance=guidance, seed=seed, count=count)
    custom, core = cluster_apis()
    try:
        ask(custom, namespace, name, request)
    except ApiException as err:
        fail(command, f"--on-cluster: cannot annotate TrainingJob {namespace}/{name} ({err.status} {err.reason}); "
                      "you need patch on trainingjobs.kubetune.dev", FAILED)
    click.echo(f"asked the operator for generation {request.id} of {namespace}/{name} ({request.label})")
    if not wait:
        click.echo(f"images will be at {request.out}/ (follow: kubectl get tj {name} -n {namespace} "
                   f"-o jsonpath='{{.status.{GENERATIONS_STATUS}}}')")
        return
    entry = wait_for(custom, namespace, name, request.id, timeout)
    if entry is None:
        fail(command, f"--on-cluster: generation {request.id} did not finish within --timeout {timeout:g} s; it "
                      f"goes on: its images will be at {request.out}/ (kubectl get tj {name} -n {namespace})", FAILED)
    if entry["phase"] == "Failed":
        said = pod_said(core, namespace, request.id)
        fail(command, f"--on-cluster: generation {request.id} failed: {said or entry.get('message', 'no message')}",
             FAILED)
    click.echo(f"generated: {entry['uri']}/")
    if out is not None:
        with storage_errors(entry["uri"]):
            fetched = download(entry["uri"], out)
        click.echo(f"downloaded {fetched} file(s) into {out}")
