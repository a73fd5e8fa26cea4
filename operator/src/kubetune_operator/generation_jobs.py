"""Images drawn on the cluster: `kubetune generate --on-cluster` asks, a batch Job draws, status answers.

The CLI cannot render the trainer pod (its image, environment and security context come from this
operator's Settings), so it records a request on the TrainingJob (the contract's GENERATE_ANNOTATION,
a kubetune_api.generation_request.GenerationRequest) and the operator:

  1. renders a batch/v1 Job from the trainer's pod template (render_generation_job: the job's image,
     credentials by reference and security context, one process, one GPU when the job trains on GPUs)
     whose container runs `python -m kubetune_trainer.generation` with the request's arguments; the
     Job is owned by the TrainingJob, so it goes when the job goes;
  2. reports the Job's state in status.generations (generation_status: Running, Succeeded or Failed,
     with the URI of the images), which the CLI waits on.

The two pure functions carry the logic; `follow_generation` is the one kopf handler, a timer on
TrainingJobs with a request not yet finished: observe (annotation, status entry, Job), act.
"""
from __future__ import annotations

import functools
import json

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kubetune_api import layout
from kubetune_api.contract import (API_GROUP, API_VERSION, GENERATE_ANNOTATION, GENERATION_COMMAND,
                                   GENERATION_LABEL, GENERATIONS_STATUS, PLURAL)
from kubetune_api.generation_request import BadGenerationRequest, GenerationRequest
from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.pod_template import ContainerShape, pod_template, resources
from kubetune_operator.settings import Settings

SETTINGS = Settings.from_env()

CONTAINER = "generate"
POLL_SECONDS = 5.0
# A finished Job is removed after a day (status.generations keeps its answer); one that draws for
# longer than this is stopped: a real model draws a handful of images in minutes.
FINISHED_JOB_TTL_SECONDS = 24 * 3600
DEADLINE_SECONDS = 6 * 3600
KEPT_ENTRIES = 10  # status.generations keeps the latest requests only
FINISHED = ("Succeeded", "Failed")


def job_name(training_job: str, request_id: str) -> str:
    return f"{naming.child_name(training_job)}-generate-{request_id}"  # 40 + 10 + 12 <= 63


def generation_resources(job: TrainingJob, settings: Settings) -> dict:
    """One drawing process: the job's requests as one process of it would have them, one GPU at most."""
    spec = job.spec
    single = spec.model_copy(update={
        "resources": spec.resources.model_copy(update={"gpus_per_node": min(spec.resources.gpus_per_node, 1)}),
        "distributed": spec.distributed.model_copy(update={"processes_per_node": None})})
    return resources(job.model_copy(update={"spec": single}), settings)


def render_generation_job(job: TrainingJob, job_uid: str, settings: Settings, request: GenerationRequest) -> dict:
    """The batch/v1 Job that draws REQUEST from JOB's run (owner reference: added by the caller)."""
    template = pod_template(job, job_uid, settings, ContainerShape(CONTAINER), serves_metrics=False)
    container = template["spec"]["containers"][0]
    container.pop("ports", None)  # no metrics server, no rendezvous
    container.update(command=list(GENERATION_COMMAND), args=request.args(),
                     resources=generation_resources(job, settings),
                     terminationMessagePolicy="FallbackToLogsOnError")  # the one-line error, for status
    labels = {**naming.labels(job.metadata.name), GENERATION_LABEL: request.id}
    # Not the job's queue labels: Kueue would take the Job over (suspend it until admitted), and a
    # short draw from a finished run is not a training workload.
    template["metadata"]["labels"] = dict(labels)
    template["spec"]["restartPolicy"] = "Never"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(job.metadata.name, request.id), "namespace": job.metadata.namespace,
                     "labels": labels, "annotations": {GENERATE_ANNOTATION: request.to_annotation()}},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": FINISHED_JOB_TTL_SECONDS,
                 "activeDeadlineSeconds": DEADLINE_SECONDS, "template": template},
    }


def generation_status(job_obj: dict) -> dict:
    """The status.generations entry for a generation Job as it stands (a dict as the API returns it)."""
    metadata = job_obj.get("metadata") or {}
    request = GenerationRequest.from_annotation((metadata.get("annotations") or {})[GENERATE_ANNOTATION])
    status = job_obj.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    entry = {"id": request.id, "phase": "Running", "uri": request.out, "job": metadata.get("name")}
    if "Complete" in conditions:
        entry["phase"] = "Succeeded"
    elif "Failed" in conditions:
        failed = conditions["Failed"]
        entry["phase"] = "Failed"
        entry["message"] = (f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".rstrip(": ")
                            + f" (kubectl logs -n {metadata.get('namespace')} job/{metadata.get('name')})")
    if status.get("startTime"):
        entry["startTime"] = status["startTime"]
    if entry["phase"] in FINISHED and status.get("completionTime"):
        entry["completionTime"] = status["completionTime"]
    return entry


def merged_entries(entries: list[dict], entry: dict) -> list[dict]:
    """status.generations with ENTRY in place of the one of its id (appended when new), latest kept."""
    others = [e for e in entries if e.get("id") != entry["id"]]
    return (others + [entry])[-KEPT_ENTRIES:]


def requested(annotations: dict) -> GenerationRequest | None:
    text = (annotations or {}).get(GENERATE_ANNOTATION)
    return GenerationRequest.from_annotation(text) if text else None


def pending(body: kopf.Body, **_) -> bool:
    """Whether the job's request has no finished answer yet (the timer runs only then)."""
    entries = (body.get("status") or {}).get(GENERATIONS_STATUS) or []
    try:
        request = requested(dict(body.metadata.annotations))
        request_id = request.id if request else None
    except BadGenerationRequest:
        request_id = _request_id(body) or "invalid"  # answered once, as Failed
    return request_id is not None and not any(e.get("id") == request_id and e.get("phase") in FINISHED
                                              for e in entries)


# ---- the handler: observe, act ----------------------------------------------------------------------

@functools.cache
def batch_api() -> client.BatchV1Api:
    return client.BatchV1Api()


def typed(body: kopf.Body) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                                       "metadata": {"name": body.metadata.name, "namespace": body.metadata.namespace},
                                       "spec": dict(body.get("spec") or {})})


def read_or_create(body: kopf.Body, uid: str, request: GenerationRequest) -> dict:
    """The request's Job, created now from the pod template when it does not exist yet."""
    namespace, name = body.metadata.namespace, job_name(body.metadata.name, request.id)
    api = batch_api()
    as_dict = api.api_client.sanitize_for_serialization  # camelCase, as the API returns it
    try:
        return as_dict(api.read_namespaced_job(name, namespace))
    except ApiException as err:
        if err.status != 404:
            raise
    rendered = render_generation_job(typed(body), uid, SETTINGS, request)
    kopf.adopt(rendered, owner=body)
    try:
        created = api.create_namespaced_job(namespace, rendered)
    except ApiException as err:
        if err.status != 409:
            raise
        created = api.read_namespaced_job(name, namespace)
    kopf.info(body, reason="Generating", message=f"job {name} draws {request.label} into {request.out}")
    return as_dict(created)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=POLL_SECONDS, idle=0,
            annotations={GENERATE_ANNOTATION: kopf.PRESENT}, when=pending, id="generation")
def follow_generation(body: kopf.Body, uid: str, patch: kopf.Patch, **_) -> None:
    entries = list((body.get("status") or {}).get(GENERATIONS_STATUS) or [])
    try:
        request = requested(dict(body.metadata.annotations))
        problem = request.belongs_to(layout.job_root(body["spec"]["checkpoints"]["uri"], body.metadata.namespace,
                                                     body.metadata.name))
        if problem:
            raise BadGenerationRequest(problem)
        job_obj = read_or_create(body, uid, request)
        entry = generation_status(job_obj)
    except (BadGenerationRequest, ValidationError, ApiException) as err:
        if isinstance(err, ApiException) and err.status not in (403, 422):
            raise  # the API server away or busy: the next tick tries again
        # Refused for good (bad request; no right to create Jobs; a Job the API server will not take):
        # answered as Failed, so the CLI stops waiting and says why.
        reason = f"{err.status} {err.reason}" if isinstance(err, ApiException) else err
        message = f"annotation {GENERATE_ANNOTATION}: {reason}".splitlines()[0]
        entry = {"id": _request_id(body) or "invalid", "phase": "Failed", "message": message}
        kopf.warn(body, reason="GenerationRefused", message=message)
    if entry not in entries:
        patch.status[GENERATIONS_STATUS] = merged_entries(entries, entry)


def _request_id(body: kopf.Body) -> str | None:
    try:
        raw = json.loads(body.metadata.annotations.get(GENERATE_ANNOTATION) or "")
        return raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    except ValueError:
        return None
