"""Images drawn on the cluster: `kubetune generate --on-cluster` asks, a batch Job draws, status answers.

The CLI cannot render the trainer pod (its image, environment and security context come from this
operator's Settings), so it records a request on the TrainingJob (the contract's GENERATE_ANNOTATION,
a kubetune_api.generation_request.GenerationRequest) and the one reconcile answers it:

  observe  the request while it has no finished answer (pending), and its Job (reconcile.py, kube.py);
  decide   the Job to create (render_generation_job: the job's image, credentials by reference and
           security context, one process, one GPU when the job trains on GPUs, running
           `python -m kubetune_trainer.results.generation_pod` with the request's arguments; owned by the
           TrainingJob, so it goes when the job goes) and the status.generations entry
           (generation_status: Running, Succeeded or Failed, with the URI of the images), which the
           CLI waits on (decision._generation);
  act      the Job created through kube.py, the entry written with the one status patch.

Everything here is pure: no I/O, no clock.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kubetune_api import layout
from kubetune_api.contract import GENERATE_ANNOTATION, GENERATION_COMMAND, GENERATION_LABEL, GENERATIONS_STATUS
from kubetune_api.generation_request import BadGenerationRequest, GenerationRequest
from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.pod_template import ContainerShape, pod_template, resources
from kubetune_operator.settings import Settings

CONTAINER = "generate"
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


INVALID_ID = "invalid"  # the id an annotation without a usable one is answered under
ID_MAX_LENGTH = 64  # what status.generations[].id holds (kubetune_api.spec_status.Generation)


@dataclass(frozen=True)
class SeenGeneration:
    """A request without a finished answer, as the reconcile found it."""

    annotation: str  # the request as the annotation holds it (perhaps not a readable one)
    job: dict | None = None  # its Job as the API returns it (camelCase); None: not created yet
    refused: str | None = None  # the API server's refusal to read or create its Job, e.g. "403 Forbidden"


def request_id(annotation: str) -> str:
    """The id a request is answered under: its own, even where the rest of it is unreadable (the CLI
    waits for that id), or INVALID_ID where there is none that status can hold."""
    try:
        raw = json.loads(annotation or "")
    except ValueError:
        return INVALID_ID
    found = raw.get("id") if isinstance(raw, dict) else None
    return found if isinstance(found, str) and 0 < len(found) <= ID_MAX_LENGTH else INVALID_ID


def answered(annotation: str, entries: list[dict] | None) -> bool:
    """Whether status.generations holds the request's final answer (Succeeded or Failed)."""
    wanted = request_id(annotation)
    return any(e.get("id") == wanted and e.get("phase") in FINISHED for e in entries or [])


def pending(annotations: dict | None, status: dict | None) -> bool:
    """Whether the TrainingJob carries a request with no finished answer yet: the reconcile looks at
    (and the timer visits) such a job, whatever its own phase."""
    annotation = (annotations or {}).get(GENERATE_ANNOTATION)
    return bool(annotation) and not answered(annotation, (status or {}).get(GENERATIONS_STATUS))


def checked_request(annotation: str, job: TrainingJob) -> GenerationRequest:
    """The request, where the operator may act on it for JOB; else BadGenerationRequest, in one line.
    The pod writes with the job's credentials, so it draws from and writes beside the job's own runs only."""
    request = GenerationRequest.from_annotation(annotation)
    problem = request.belongs_to(layout.job_root(job.spec.checkpoints.uri, job.metadata.namespace,
                                                 job.metadata.name))
    if problem:
        raise BadGenerationRequest(problem)
    return request


def refused_entry(annotation: str, reason: str) -> dict:
    """The answer to a request refused for good (unreadable, outside the job's runs, a Job the API server
    will not take): Failed, so the CLI stops waiting and says why."""
    message = f"annotation {GENERATE_ANNOTATION}: {reason}".splitlines()[0]
    return {"id": request_id(annotation), "phase": "Failed", "message": message}


def announcement(request: GenerationRequest, rendered: dict) -> str:
    """The Generating event's message."""
    return f"job {rendered['metadata']['name']} draws {request.label} into {request.out}"
