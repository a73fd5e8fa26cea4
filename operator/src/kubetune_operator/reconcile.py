"""One level-triggered reconcile of a TrainingJob: observe, decide, act.

Every trigger (the job created, resumed, changed or asked for a generation, its child job changed,
the timer) runs the same `reconcile(namespace, name)`: read the TrainingJob as it is now and
everything it owns (a generation request's Job included) into one Observed value, let
decision.decide (pure) say what to do, do it through kube.py, and write the one status patch,
guarded by the resourceVersion it was decided from. A write raced by another trigger
is decided again from the fresh object, never overwritten; the actions are idempotent, so repeating
them changes nothing.
"""
from __future__ import annotations

import logging
import threading

import kopf

from kubetune_api.contract import GENERATE_ANNOTATION, read_final_report
from kubetune_api.generation_request import BadGenerationRequest, GenerationRequest
from kubetune_operator import (claims, credentials, decision, generation_jobs, kube, metrics, naming,
                               progress_inbox, volume_policy)
from kubetune_operator.backends import BACKENDS, backend_name
from kubetune_operator.backends.base import observed_state
from kubetune_operator.decision import Observed
from kubetune_operator.settings import Settings
from kubetune_operator.status import FINISHED

log = logging.getLogger("kubetune.operator")

CREATED = "Created"  # the event of a child created now (decision._create_child)
# A status write raced this often by other triggers is given up (and retried by kopf).
ATTEMPTS = 5


def observe(job: dict, settings: Settings, child_seen: dict | None = None, as_delivered: bool = False) -> Observed:
    """Everything decide needs about JOB (the TrainingJob as just read), read from the API server;
    CHILD_SEEN: its child job as a watch event just delivered it (not read again).

    AS_DELIVERED: JOB is the body a watch event delivered. Where its status is still empty, no
    reconcile has acted on it (the status write is each reconcile's last act), so its ConfigMap and
    child are taken to be missing without asking: the creates that follow accept this job's own
    objects where an interrupted reconcile did make them (kube.create_owned), and the next
    reconcile reads them. Two reads fewer on the path from a new job to its child."""
    metadata, spec, status = job["metadata"], dict(job.get("spec") or {}), dict(job.get("status") or {})
    namespace, name = metadata["namespace"], metadata["name"]
    base = dict(name=name, namespace=namespace, uid=metadata["uid"], generation=metadata.get("generation"),
                settings=settings, now=kube.now(), labels=dict(metadata.get("labels") or {}),
                generation_request=_requested_generation(job))
    if status.get("phase") in FINISHED:
        return Observed(**base)  # nothing left to decide but a generation
    backend = BACKENDS[backend_name(spec, status, settings.backend)]
    enabled = settings.backend_enabled(backend.name)
    never_acted_on = as_delivered and not status
    if child_seen is not None and enabled and child_seen.get("kind") == backend.kind:
        child = child_seen
    else:
        child = kube.read_child(backend, namespace, name, metadata["uid"]) if enabled and not never_acted_on else None
    read = None if never_acted_on else kube.read_config_map(namespace, name, metadata["uid"])
    config_map, config_map_version = read or (None, None)
    found: dict = {"config_map": config_map, "config_map_version": config_map_version, "child": child}
    if child is None and enabled:
        if found["config_map"] is not None:  # started, and its child is gone: its API may have gone with it
            kube.forget_prerequisites()
        found["backend_problem"] = kube.missing_prerequisite(backend, namespace, settings)
        if found["config_map"] is None and volume_policy.names_checked_source(spec):  # before it starts: its volumes
            found["pod_security_level"] = kube.pod_security_level(namespace)
    if child is not None:
        queue = decision.queue_name(spec, base["labels"])
        if queue and not spec.get("suspend"):
            found["workload"] = kube.read_workload(namespace, child["metadata"]["uid"], settings.kueue_workloads)
        if status.get("phase") == "Running":
            found["gauges"] = progress(namespace, name, backend, settings)
        if observed_state(backend, child).phase in FINISHED:  # once: a finished job is not observed again
            found["final_report"] = _final_report(namespace, name, backend)
        # No reading from the trainer (e.g. a TrainJob counts a pod waiting for its Secret as active):
        # what its pods say, where the job names a Secret or a claim.
        names_some = credentials.secret_fields(spec) or claims.claim_fields(spec)
        if not found.get("gauges") and names_some and not backend.is_suspended(child):
            pods = kube.job_pods(namespace, naming.child_name(name))
            found["credentials_problem"] = credentials.missing_secret_message(pods, spec, namespace)
            found["claim_problem"] = claims.claim_problem(pods, spec, namespace)
    return Observed(**base, **found)


def progress(namespace: str, name: str, backend, settings: Settings) -> dict | None:
    """The running trainer's gauges: pushed to the inbox within two intervals, else read from its
    /metrics (an older trainer, no inbox, or the first interval after an operator restart)."""
    return progress_inbox.fresh(namespace, name) or _gauges(namespace, name, backend, settings)


def _running_rank0_addresses(namespace: str, name: str, backend) -> list[str]:
    """The addresses of the job's rank-0 pods that run now (one, but for a restart's moment)."""
    return [pod.status.pod_ip for pod in kube.trainer_pods(namespace, name, backend)
            if pod.status.phase == "Running" and pod.status.pod_ip]


def _gauges(namespace: str, name: str, backend, settings: Settings) -> dict | None:
    running = _running_rank0_addresses(namespace, name, backend)
    if not running:
        return None
    try:
        return kube.read_trainer_gauges(running[0], settings.trainer_metrics_port)
    except OSError as err:  # not listening yet, or restarting: the next look gets it
        log.debug("no progress from %s yet: %s", name, err)
        return None


def rank0_addresses(namespace: str, name: str) -> set[str]:
    """The addresses of the job's running rank-0 pods, whichever enabled backend runs it: who may push
    its progress (progress_inbox)."""
    settings = kube.settings()
    return {address for backend in BACKENDS.values() if settings.backend_enabled(backend.name)
            for address in _running_rank0_addresses(namespace, name, backend)}


def _final_report(namespace: str, name: str, backend) -> dict | None:
    """The gauges rank 0 left in its termination message as it ended (contract.final_report), from
    the newest rank-0 pod that has one; None when none did (an older trainer, a crash, pods gone)."""
    pods = sorted(kube.trainer_pods(namespace, name, backend), key=lambda p: p.metadata.creation_timestamp,
                  reverse=True)
    for pod in pods:
        for container in pod.status.container_statuses or []:
            ended = container.state.terminated if container.state else None
            report = read_final_report(ended.message) if ended else None
            if report:
                return report
    return None


# ---- generation on the cluster: observed --------------------------------------------------------------

# What the API server answered when a generation Job could not be created (or read) for good, by
# (TrainingJob UID, request id): observed by act, answered in status by the next decision. Only
# refusals are kept, the oldest forgotten first; once answered, status holds the answer.
_generation_refusals: dict[tuple[str, str], str] = {}
KEPT_REFUSALS = 1000


def _requested_generation(job: dict) -> generation_jobs.SeenGeneration | None:
    """The job's generation request while it has no finished answer, with its Job (read only then)."""
    metadata = job["metadata"]
    if not generation_jobs.pending(metadata.get("annotations"), job.get("status")):
        return None
    annotation = metadata["annotations"][GENERATE_ANNOTATION]
    try:
        request_id = GenerationRequest.from_annotation(annotation).id
    except BadGenerationRequest:
        return generation_jobs.SeenGeneration(annotation)  # refused by decide: no Job to look for
    refused = _generation_refusals.get((metadata["uid"], request_id))
    if refused is not None:
        return generation_jobs.SeenGeneration(annotation, refused=refused)
    try:
        found = kube.read_generation_job(metadata["namespace"], generation_jobs.job_name(metadata["name"], request_id),
                                         metadata["uid"])
    except kube.Refused as err:
        return generation_jobs.SeenGeneration(annotation, refused=str(err))
    return generation_jobs.SeenGeneration(annotation, job=found)


def _create_generation_job(job: dict, action: decision.CreateGenerationJob) -> bool | None:
    """Whether the Job was created now; None when the API server refuses it for good (remembered)."""
    kopf.adopt(action.obj, owner=job)
    try:
        return kube.create_generation_job(action.obj, job["metadata"]["uid"])
    except kube.Refused as err:
        _generation_refusals[(job["metadata"]["uid"], action.request_id)] = str(err)
        while len(_generation_refusals) > KEPT_REFUSALS:
            _generation_refusals.pop(next(iter(_generation_refusals)))
        return None


# ---- child versions this operator wrote itself ------------------------------------------------------------

# (namespace, name, resourceVersion) of each child created by a reconcile: the watch event announcing
# that very version brings nothing the reconcile did not decide from (it created the child and
# wrote the status that follows), so it is not reconciled again. Bounded: an entry whose event was
# missed is dropped oldest first.
_children_created: dict[tuple[str, str, str], None] = {}
_children_created_lock = threading.Lock()  # written and read from kopf's handler threads
KEPT_CREATED = 10_000


def created_here(namespace: str, child: dict) -> bool:
    """Whether CHILD (in NAMESPACE) is, unchanged, the version a reconcile created (each answered once)."""
    metadata = child["metadata"]
    with _children_created_lock:
        return _children_created.pop((namespace, metadata["name"], metadata.get("resourceVersion")), False) is None


def _remember_created(obj: dict, resource_version: str) -> None:
    with _children_created_lock:
        _children_created[(obj["metadata"]["namespace"], obj["metadata"]["name"], resource_version)] = None
        while len(_children_created) > KEPT_CREATED:
            _children_created.pop(next(iter(_children_created)))


def act(job: dict, decided: decision.Decision) -> bool:
    """Do what was decided; False when the status changed meanwhile or a generation Job was refused
    (decide again)."""
    metadata = job["metadata"]
    namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    backend, child_created, generation_created = decided.backend, False, False
    for action in decided.actions:
        if isinstance(action, decision.CreateConfigMap):
            kopf.adopt(action.obj, owner=job)
            kube.create_config_map(action.obj, uid)
        elif isinstance(action, decision.CreateNetworkPolicy):
            kopf.adopt(action.obj, owner=job)
            kube.create_network_policy(action.obj, uid)
        elif isinstance(action, decision.CreateChild):
            kopf.adopt(action.obj, owner=job)
            created_version = kube.create_child(backend, action.obj, uid)
            child_created = created_version is not None
            if child_created:
                _remember_created(action.obj, created_version)
                metrics.CHILD_JOBS_CREATED.labels(backend.kind).inc()
        elif isinstance(action, decision.PatchChild):
            kube.patch_child(backend, name, namespace, action.body)
        elif isinstance(action, decision.DeleteChild):
            kube.delete_child(backend, namespace, action.name, action.uid)
        elif isinstance(action, decision.PatchConfigMap):
            if not kube.patch_config_map(namespace, name, action.resource_version, action.data):
                return False  # another reconcile changed it first, and said so: decided again
        elif isinstance(action, decision.CreateGenerationJob):
            generation_created = _create_generation_job(job, action)
        elif isinstance(action, decision.PatchWorkload):
            kube.patch_workload(namespace, action.name, action.resource_version, action.body)
    for event in decided.action_events:
        # A child or generation Job that existed already was announced when it was created.
        if (event.reason != CREATED or child_created) and (event.reason != decision.GENERATING or generation_created):
            kube.post_event(job, event.type, event.reason, event.message)
    if generation_created is None:
        return False  # refused: decided again, the refusal now observed and answered in status
    if decided.status and not kube.patch_status(namespace, name, metadata["resourceVersion"], decided.status):
        return False
    for action in decided.actions:  # courtesy copies, once the TrainingJob's own status holds the news
        if isinstance(action, decision.PatchChildStatus):
            kube.patch_child_status(backend, namespace, name, action.body)
    for event in decided.events:
        kube.post_event(job, event.type, event.reason, event.message)
    return True


def reconcile(namespace: str, name: str, job_seen: dict | None = None, child_seen: dict | None = None) -> None:
    """Observe, decide, act for TrainingJob NAMESPACE/NAME; raises kopf's errors for kopf's retries.

    JOB_SEEN, CHILD_SEEN: the TrainingJob or its child as the watch event that triggered this just
    delivered it, taken for the first decision instead of reading it again (a busy API server
    answers each read in hundreds of milliseconds: benchmarks/RESULTS.md). Safe because the status
    write is guarded by the resourceVersion it was decided from, and a newer version of either
    comes with an event of its own."""
    with metrics.RECONCILE_SECONDS.time():
        try:
            decided = _reconcile(namespace, name, job_seen, child_seen)
        except kopf.TemporaryError:
            metrics.RECONCILES.labels("retry").inc()
            raise
        except Exception:
            metrics.RECONCILES.labels("error").inc()
            raise
    if decided is not None and decided.error:
        metrics.RECONCILES.labels("error").inc()
        raise kopf.PermanentError(decided.error)
    if decided is not None and decided.retry_after is not None:
        metrics.RECONCILES.labels("retry").inc()
        raise kopf.TemporaryError("waiting (see the job's conditions)", delay=decided.retry_after)
    metrics.RECONCILES.labels("ok").inc()


def _reconcile(namespace: str, name: str, job_seen: dict | None, child_seen: dict | None) -> decision.Decision | None:
    settings = kube.settings()
    for attempt in range(ATTEMPTS):
        job = job_seen if attempt == 0 and job_seen is not None else kube.read_training_job(namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return None  # gone or going: its children follow (owner references)
        first = attempt == 0
        decided = decision.decide(job.get("spec") or {}, job.get("status"),
                                  observe(job, settings, child_seen if first else None, first and job_seen is not None))
        if act(job, decided):
            return decided
    raise kopf.TemporaryError(f"the status of {name} kept changing while it was written", delay=1)
