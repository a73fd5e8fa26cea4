"""kopf handlers: short glue between the API server and the pure builders.

Each handler reads, builds, applies idempotently and patches status; the decisions live in
trainer_config, pod_template, backends, backend_check, spec_change and status, which are plain
functions. A job's backend (PyTorchJob or TrainJob) is looked up once per call by name; nothing
here names a Kubeflow label, container or environment variable.
"""
from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import time
import urllib.request

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kubetune_api.contract import API_GROUP, API_VERSION, OPERATOR_READ_QUERY, PLURAL, TRAINER_METRIC_PREFIX
from kubetune_api.manifest import describe_errors
from kubetune_api.spec import TrainingJob
from kubetune_operator import (backend_check, fit_check, image_policy, metrics, naming, network_policy, queueing,
                               spec_change, status)
from kubetune_operator.backends import BACKENDS, Backend, backend_name
from kubetune_operator.backends.base import observed_state
from kubetune_operator.settings import Settings
from kubetune_operator.trainer_config import build_config_map, job_from_config_map
from kubetune_operator.webhook import configure_server as configure_webhook

SETTINGS = Settings.from_env()
log = logging.getLogger("kubetune.operator")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@functools.cache
def core_api() -> client.CoreV1Api:
    """One client per process: connections are pooled and reused across handler calls."""
    return client.CoreV1Api()


@functools.cache
def custom_api() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(core_api().api_client)


@functools.cache
def networking_api() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(core_api().api_client)


def backend_of(spec: dict, status_: dict | None) -> Backend:
    """The job's backend: the one it started with, else the one it asks for, else the default."""
    return BACKENDS[backend_name(dict(spec or {}), dict(status_ or {}), SETTINGS.backend)]


def load_kubernetes_config() -> None:
    """In a pod: the service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def typed_job(body: kopf.Body) -> TrainingJob:
    """The object as the typed model (raises pydantic's ValidationError)."""
    return TrainingJob.model_validate({
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {"name": body.metadata.name, "namespace": body.metadata.namespace},
        "spec": dict(body.get("spec") or {}),
    })


def parse_job(body: kopf.Body) -> TrainingJob:
    """The typed job; a spec the schema let through but the model refuses is a permanent error."""
    try:
        return typed_job(body)
    except ValidationError as err:
        raise kopf.PermanentError("invalid spec: " + "; ".join(describe_errors(err))) from None


def create_owned(obj: dict, owner_uid: str, create, read_owner_uids) -> bool:
    """Create, or accept an existing object only if this TrainingJob owns it (restarts, re-runs).

    Returns whether it was created now.
    """
    try:
        create(obj)
        return True
    except ApiException as err:
        if err.status != 409:
            raise
    if owner_uid not in read_owner_uids():
        raise kopf.TemporaryError(
            f"{obj['kind']} {obj['metadata']['name']} exists and belongs to something else "
            "(an older TrainingJob of the same name still being deleted?)", delay=10)
    return False


# Asked of the API server instead of the whole object: only the metadata comes back.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def read_secret_metadata(namespace: str, name: str) -> None:
    """GET Secret NAME as metadata only, so its values never reach the operator (ApiException 404
    when it does not exist). RBAC is still `get secrets`: a rule cannot name the Secrets jobs will pick."""
    core_api().api_client.call_api(
        "/api/v1/namespaces/{namespace}/secrets/{name}", "GET", path_params={"namespace": namespace, "name": name},
        header_params={"Accept": METADATA_ONLY}, auth_settings=["BearerToken"], _preload_content=False,
        _return_http_data_only=True)


def missing_secret(job: TrainingJob) -> str | None:
    """Why spec.s3.credentialsSecret cannot be used, or None when it exists (or none is named)."""
    secret = job.spec.s3.credentials_secret
    if not secret:
        return None
    try:
        read_secret_metadata(job.metadata.namespace, secret)
    except ApiException as err:
        if err.status == 404:
            return (f"spec.s3.credentialsSecret: Secret {secret!r} does not exist in namespace "
                    f"{job.metadata.namespace!r}; create it with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        if err.status == 403:  # a namespace this operator does not watch (operator.watchNamespaces): not ours
            return None
        raise
    return None


def check_secret(job: TrainingJob) -> None:
    problem = missing_secret(job)
    if problem:
        raise kopf.TemporaryError(problem, delay=15)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_) -> None:
    load_kubernetes_config()
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    # Events come from the handlers (kopf.event is not level-filtered), not from kopf's own log lines.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # Handlers are synchronous (the Kubernetes client): enough threads for bursts of new jobs.
    settings.execution.max_workers = 16
    if SETTINGS.webhook_address:
        # The certificate is kept fresh (rotated or reloaded) for as long as the operator runs, by
        # a task on kopf's own event loop: the one whose server uses it. (Start-up blocks nothing
        # yet, so the one API call configure_webhook makes may block here.)
        keeper = configure_webhook(settings, SETTINGS)
        _BACKGROUND_TASKS.add(asyncio.get_running_loop().create_task(keeper.run(), name="webhook-certificate"))


# Tasks the operator starts itself; held here because the event loop keeps only weak references.
_BACKGROUND_TASKS: set[asyncio.Task] = set()


@kopf.on.validate(API_GROUP, API_VERSION, PLURAL, id="validate", operations=["CREATE"], ignore_failures=True)
def validate_new_job(body: kopf.Body, warnings: list[str], **_) -> None:
    """Admission: refuse what the trainer would refuse, and a credentials Secret that is not there;
    warn (not refuse: the estimate is coarse) about a job that will not fit its GPUs.

    CREATE only: updates of a started job are governed by spec_changed, and kopf's own metadata
    patches (finalizers) must never be refused, e.g. while a job is deleted after its Secret.
    """
    try:
        job = typed_job(body)
    except ValidationError as err:
        metrics.ADMISSION_REJECTIONS.labels("invalid_spec").inc()
        raise kopf.AdmissionError("; ".join(describe_errors(err)), code=422) from None
    problem = missing_secret(job)
    if problem:
        metrics.ADMISSION_REJECTIONS.labels("missing_secret").inc()
        raise kopf.AdmissionError(problem, code=422)
    image_refused = image_policy.refusal(job.spec.image, SETTINGS.allowed_image_prefixes, SETTINGS.trainer_image)
    if image_refused:
        metrics.ADMISSION_REJECTIONS.labels("image_not_allowed").inc()
        raise kopf.AdmissionError(image_refused, code=422)
    backend = backend_of(body.get("spec"), None)
    refused = backend_check.unsupported(job, backend, SETTINGS)
    if refused:
        metrics.ADMISSION_REJECTIONS.labels("backend").inc()
        raise kopf.AdmissionError(refused.message, code=422)
    # A backend not enabled yet is admitted: the job waits (BackendReady) and starts once it is.
    disabled = backend_check.not_enabled(backend, SETTINGS)
    if disabled:
        warnings.append(f"{backend_check.CONDITION}: {disabled.message}")
    too_big = fit_check.fit_warning(job, SETTINGS.default_gpu_memory)
    if too_big:
        warnings.append(too_big)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
def count_by_phase(type: str | None, body: kopf.Body, uid: str, **_) -> None:
    """Keep kubetune_operator_trainingjobs{phase} up to date (see metrics.PhaseCounts for why so)."""
    if type == "DELETED":
        metrics.TRAININGJOBS.forget(uid)
    else:
        metrics.TRAININGJOBS.observe(uid, (body.get("status") or {}).get("phase"),
                                     deleting=bool(body.metadata.get("deletionTimestamp")))


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
def reconcile(body: kopf.Body, uid: str, patch: kopf.Patch, **_) -> None:
    """Make sure the ConfigMap and the child job exist; both are owned by the TrainingJob."""
    if (body.get("status") or {}).get("phase") in status.FINISHED:
        return
    with metrics.RECONCILE_SECONDS.time():
        try:
            ensure_children(body, uid, patch)
        except kopf.TemporaryError:
            metrics.RECONCILES.labels("retry").inc()
            raise
        except Exception:
            metrics.RECONCILES.labels("error").inc()
            raise
    metrics.RECONCILES.labels("ok").inc()


def ensure_children(body: kopf.Body, uid: str, patch: kopf.Patch) -> None:
    """Create what is missing; accept what exists and is ours (a repeat event, a restart)."""
    job = parse_job(body)
    backend = backend_of(body.get("spec"), body.get("status"))
    check_backend(body, job, backend)
    check_image(body, job)
    check_secret(job)
    namespace = job.metadata.namespace
    core = core_api()

    config_map = build_config_map(job)
    kopf.adopt(config_map, owner=body)
    create_owned(config_map, uid,
                 lambda obj: core.create_namespaced_config_map(namespace, obj),
                 lambda: [ref.uid for ref in core.read_namespaced_config_map(
                     config_map["metadata"]["name"], namespace).metadata.owner_references or []])
    if SETTINGS.network_policy is not None:  # before the child: its pods start fenced in
        policy = network_policy.trainer_network_policy(job, SETTINGS.network_policy, SETTINGS.trainer_metrics_port)
        kopf.adopt(policy, owner=body)
        networking = networking_api()
        create_owned(policy, uid, lambda obj: networking.create_namespaced_network_policy(namespace, obj),
                     lambda: [ref.uid for ref in networking.read_namespaced_network_policy(
                         policy["metadata"]["name"], namespace).metadata.owner_references or []])
    child, child_created = create_child(body, uid, backend, job)
    if child_created:  # said once, whoever writes the first phase (this handler or the child's state)
        kopf.event(body, type="Normal", reason="Created", message=f"{backend.kind} {child['metadata']['name']} created")

    def created(found: dict) -> dict:
        current, fields = found.get("status") or {}, {}
        conditions = backend_check.conditions(current, None, backend, child["metadata"]["name"], now())
        conditions = fit_check.fits_gpu_conditions({"conditions": conditions}, job, SETTINGS.default_gpu_memory,
                                                   now()) or conditions
        if any(c.get("type") == image_policy.CONDITION for c in conditions):  # refused before: passes now
            conditions = status.set_condition(conditions, image_policy.CONDITION, "True", "Allowed",
                                              "spec.image is allowed", now())
        if conditions != (current.get("conditions") or []):
            fields["conditions"] = conditions
        if not current.get("backend"):
            fields["backend"] = backend.name
        if not current.get("phase"):  # the child's own state may have been written first: never undo it
            fields["phase"] = "Suspended" if job.spec.suspend else "Pending"
            fields["observedGeneration"] = body.metadata.get("generation")
        return fields

    update_status(namespace, job.metadata.name, created)


# A status write retried this often when other handlers keep changing the object meanwhile.
STATUS_WRITE_ATTEMPTS = 5


def update_status(namespace: str, name: str, change) -> dict:
    """Read-modify-write of a TrainingJob's status: CHANGE(the TrainingJob as it is now) returns the
    status fields to set (None deletes), and the patch carries the resourceVersion they were computed
    from, so a write by another handler in between (the child's state, a poll) makes this start over
    instead of being overwritten. Returns the fields written ({} when nothing changed)."""
    custom = custom_api()
    for _ in range(STATUS_WRITE_ATTEMPTS):
        job = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
        fields = change(job)
        if not fields:
            return {}
        try:
            custom.patch_namespaced_custom_object_status(
                API_GROUP, API_VERSION, namespace, PLURAL, name,
                {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": fields})
            return fields
        except ApiException as err:
            if err.status != 409:
                raise
    raise kopf.TemporaryError(f"the status of {name} kept changing while it was written", delay=1)


def create_child(body: kopf.Body, uid: str, backend: Backend, job: TrainingJob) -> tuple[dict, bool]:
    """Create the child job, or accept the one this TrainingJob already owns; returns what was built
    and whether it was created now."""
    namespace, custom = job.metadata.namespace, custom_api()
    child = backend.build(job, uid, SETTINGS)
    kopf.adopt(child, owner=body)
    created = create_owned(child, uid,
                           lambda obj: custom.create_namespaced_custom_object(backend.group, backend.version, namespace,
                                                                              backend.plural, obj),
                           lambda: [ref["uid"] for ref in custom.get_namespaced_custom_object(
                               backend.group, backend.version, namespace, backend.plural,
                               child["metadata"]["name"])["metadata"].get("ownerReferences", [])])
    if created:
        metrics.CHILD_JOBS_CREATED.labels(backend.kind).inc()
    return child, created


# Prerequisites seen present recently: one look per this many seconds, not one per job.
PREREQUISITE_CACHE_SECONDS = 30.0
_present_since: dict[tuple[str, str, str | None], float] = {}


def missing_prerequisite(backend: Backend, namespace: str) -> backend_check.Problem | None:
    """Ask the API server for what the backend needs; the first thing missing, or None. An API is
    looked for in the job's NAMESPACE: with operator.watchNamespaces the operator may list the child
    jobs there only."""
    custom = custom_api()
    for need in backend.prerequisites(SETTINGS):
        key = (need.group, need.plural, need.name)
        if time.monotonic() - _present_since.get(key, float("-inf")) < PREREQUISITE_CACHE_SECONDS:
            continue
        try:
            if need.name:
                custom.get_cluster_custom_object(need.group, need.version, need.plural, need.name)
            else:  # the API is served when listing works (an empty list included)
                custom.list_namespaced_custom_object(need.group, need.version, namespace, need.plural, limit=1)
        except ApiException as err:
            if err.status == 404:
                return backend_check.missing(need)
            if err.status == 403:
                return backend_check.forbidden(need, backend)
            raise
        _present_since[key] = time.monotonic()
    return None


def check_backend(body: kopf.Body, job: TrainingJob, backend: Backend) -> None:
    """Stop here, visibly, while the backend cannot run the job: a BackendReady=False condition and a
    Warning event when the reason is new; retried (or, for a refused field, not) until it can."""
    problem = (backend_check.not_enabled(backend, SETTINGS) or backend_check.unsupported(job, backend, SETTINGS)
               or missing_prerequisite(backend, job.metadata.namespace))
    if problem is None:
        return

    def waiting(found: dict) -> dict:
        current, fields = found.get("status") or {}, {}
        conditions = backend_check.conditions(current, problem, backend, "", now())
        if conditions != (current.get("conditions") or []):
            fields["conditions"] = conditions
        if not current.get("phase"):
            fields["phase"] = "Pending"  # not lost: waiting, and saying for what
        if not current.get("backend"):
            fields["backend"] = backend.name  # the one it waits for, also after a change of the default
        return fields

    if "conditions" in update_status(job.metadata.namespace, job.metadata.name, waiting):
        kopf.warn(body, reason=problem.reason, message=problem.message)
    if problem.permanent:
        raise kopf.PermanentError(problem.message)
    raise kopf.TemporaryError(problem.message, delay=30)


def check_image(body: kopf.Body, job: TrainingJob) -> None:
    """The image allow-list again at reconcile (admission fails open): ImageAllowed=False, a Warning
    event and no child until the spec names an allowed image."""
    refused = image_policy.refusal(job.spec.image, SETTINGS.allowed_image_prefixes, SETTINGS.trainer_image)
    if refused is None:
        return

    def refusing(found: dict) -> dict:
        current, fields = found.get("status") or {}, {}
        conditions = status.set_condition(list(current.get("conditions") or []), image_policy.CONDITION, "False",
                                          "ImageNotAllowed", refused, now())
        if conditions != (current.get("conditions") or []):
            fields["conditions"] = conditions
        if not current.get("phase"):
            fields["phase"] = "Pending"
        return fields

    if "conditions" in update_status(job.metadata.namespace, job.metadata.name, refusing):
        kopf.warn(body, reason="ImageNotAllowed", message=refused)
    raise kopf.PermanentError(refused)


def read_child(backend: Backend, namespace: str, job_name: str) -> dict | None:
    try:
        return custom_api().get_namespaced_custom_object(backend.group, backend.version, namespace, backend.plural,
                                                        naming.child_name(job_name))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def patch_child(backend: Backend, job_name: str, namespace: str, body: dict | list) -> None:
    """A merge patch (dict) or a JSON patch (list) of the child job; a failed JSON patch `test`
    (the child changed meanwhile, e.g. was resumed) is retried, so that the decision is made again."""
    try:
        custom_api().patch_namespaced_custom_object(
            backend.group, backend.version, namespace, backend.plural, naming.child_name(job_name), body,
            _content_type="application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json")
    except ApiException as err:
        if err.status == 422 and isinstance(body, list):
            raise kopf.TemporaryError(f"the child job changed while it was patched: {err.reason}", delay=2) from None
        raise


def replace_child(body: kopf.Body, backend: Backend, child: dict | None, job: TrainingJob) -> None:
    """Give a suspended child a new size by deleting it and creating it again (backends whose child
    cannot change size in place). Foreground deletion: the new child is created only once the old one
    and everything it owns are gone, so two never share a name. Retried until then."""
    if child is not None:
        if not child["metadata"].get("deletionTimestamp"):
            custom_api().delete_namespaced_custom_object(
                backend.group, backend.version, body.metadata.namespace, backend.plural, child["metadata"]["name"],
                body=client.V1DeleteOptions(propagation_policy="Foreground",
                                            preconditions=client.V1Preconditions(uid=child["metadata"]["uid"])))
        raise kopf.TemporaryError(f"the suspended {backend.kind} is being replaced at the new size", delay=2)
    create_child(body, body.metadata.uid, backend, job)


@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec")
def spec_changed(body: kopf.Body, old: dict, new: dict, patch: kopf.Patch, **_) -> None:
    """Suspend/resume is applied, and the job's size while no pod runs; any other change to a started
    run is refused, visibly (spec_change.decide says which is which)."""
    namespace, name = body.metadata.namespace, body.metadata.name
    core = core_api()
    try:
        config_map = core.read_namespaced_config_map(naming.config_map_name(name), namespace)
    except ApiException as err:
        if err.status != 404:
            raise
        # Never started (e.g. waiting for its backend, or refused): the new spec is simply the spec.
        ensure_children(body, body.metadata.uid, patch)
        return
    backend = backend_of(body.get("spec"), body.get("status"))
    child = read_child(backend, namespace, name)
    # No child, or one being deleted, runs no pods: as good as suspended.
    suspended = child is None or bool(child["metadata"].get("deletionTimestamp")) or backend.is_suspended(child)
    change = spec_change.decide(dict(old or {}), dict(new or {}), job_from_config_map(config_map.data), suspended)
    if change.refused:
        update_status(namespace, name, lambda found: {"conditions": status.set_condition(
            list((found.get("status") or {}).get("conditions") or []), "SpecChangeRefused", "True", "ImmutableSpec",
            change.refused, now())})
        kopf.warn(body, reason="SpecChangeRefused", message=change.refused)
        return
    if change.suspend is True and child is not None:
        patch_child(backend, name, namespace, backend.suspend_patch(True))
    if change.resized:
        # Child first, config second: a failure in between leaves the config's old size, so the
        # retry (kopf repeats a failed handler) still sees the gap and resizes again.
        resize = backend.resize_patch(child, change.resized, body.metadata.uid, SETTINGS) if child else None
        if resize is not None:
            patch_child(backend, name, namespace, resize)
        else:
            replace_child(body, backend, child, change.resized)
        core.patch_namespaced_config_map(config_map.metadata.name, namespace,
                                         {"data": build_config_map(change.resized)["data"]})
        kopf.event(body, type="Normal", reason="Resized", message=change.resize_message)
    if change.suspend is False:
        patch_child(backend, name, namespace, backend.suspend_patch(False))
    if change.suspend is not None:
        kopf.event(body, type="Normal", reason="Suspended" if change.suspend else "Resumed",
                   message="pods stopped; the run continues from its latest checkpoint when resumed"
                   if change.suspend else "resuming from the latest checkpoint")
    patch.status["observedGeneration"] = body.metadata.get("generation")


def follow_children(backend: Backend):
    """The handler that mirrors BACKEND's child jobs into their TrainingJobs (one per enabled backend)."""

    def child_changed(body: kopf.Body, namespace: str, type: str, **_) -> None:
        if type == "DELETED":
            return
        owner = next((ref for ref in body.metadata.get("ownerReferences", []) if ref.get("kind") == "TrainingJob"),
                     None)
        if owner is None:
            return
        state, seen = observed_state(backend, dict(body)), {}

        def mirrored(job: dict) -> dict:
            if job["metadata"]["uid"] != owner["uid"]:  # a new TrainingJob of the same name: not ours
                return {}
            seen["job"], current = job, job.get("status") or {}
            fields, seen["events"] = status.status_for_child(current, state, now())
            if fields.get("phase") in status.FINISHED:
                fields.update(status.finished_patch(job["spec"], current, fields["phase"]))
            return fields

        try:
            fields = update_status(namespace, owner["name"], mirrored)
        except ApiException as err:
            if err.status == 404:  # the TrainingJob is gone; its children follow
                return
            raise
        if fields.get("progress"):
            report_progress(backend, namespace, owner["name"], fields["progress"])
        for event in seen["events"] if fields else []:  # the events of the transition written
            kopf.event(seen["job"], type=event.type, reason=event.reason, message=event.message)

    return child_changed


for _backend in BACKENDS.values():
    # Only enabled backends are watched: the operator has RBAC for those only.
    if SETTINGS.backend_enabled(_backend.name):
        kopf.on.event(_backend.group, _backend.version, _backend.plural, labels={naming.JOB_LABEL: kopf.PRESENT},
                      id=f"child_changed_{_backend.name}")(follow_children(_backend))


def rank0_pod_ip(namespace: str, job_name: str, backend: Backend) -> str | None:
    pods = core_api().list_namespaced_pod(namespace, label_selector=backend.rank0_pod_selector(job_name))
    running = [p for p in pods.items if p.status.phase == "Running" and p.status.pod_ip]
    return running[0].status.pod_ip if running else None


def report_progress(backend: Backend, namespace: str, job_name: str, progress: dict) -> None:
    """Also show progress where the child's own API has a place for it (TrainJob: status.trainerStatus)."""
    child_patch = backend.progress_patch(progress, now()) if SETTINGS.trainjob_report_progress else None
    if child_patch is None:
        return
    try:
        custom_api().patch_namespaced_custom_object_status(backend.group, backend.version, namespace, backend.plural,
                                                           naming.child_name(job_name), child_patch)
    except ApiException as err:  # a courtesy copy: never fail the TrainingJob's own status over it
        log.debug("progress not reported on the %s: %s", backend.kind, err.reason)


def in_kueue(spec: kopf.Spec, body: kopf.Body, **_) -> bool:
    """A job Kueue holds: in a queue, not finished, not suspended by its author (then it is not waiting)."""
    return (bool((spec.get("scheduling") or {}).get("queueName")) and not spec.get("suspend")
            and (body.get("status") or {}).get("phase") not in status.FINISHED)


def read_workload(namespace: str, child_uid: str) -> dict | None:
    """Kueue's Workload of the child job (Kueue labels it with the job's UID), or None: none yet, Kueue
    not installed, or reading Workloads not granted (the chart's kueue.enabled is false)."""
    if not SETTINGS.kueue_workloads:
        return None
    group, version, plural = queueing.WORKLOADS
    try:
        found = custom_api().list_namespaced_custom_object(
            group, version, namespace, plural, label_selector=f"{queueing.WORKLOAD_JOB_UID_LABEL}={child_uid}")
    except ApiException as err:
        if err.status in (403, 404):
            log.debug("Kueue Workloads not readable in %s: %s", namespace, err.reason)
            return None
        raise
    return found["items"][0] if found["items"] else None


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=SETTINGS.progress_interval_seconds, idle=0, when=in_kueue)
def follow_queue(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body, **_) -> None:
    """Say in the Queued condition where a queued job stands: waiting (and Kueue's reason), preempted,
    admitted. The child's own state only says suspended; Kueue's Workload says why."""
    backend = backend_of(spec, body.get("status"))
    child = read_child(backend, namespace, name)
    if child is None:
        return
    state = queueing.queue_state(spec["scheduling"]["queueName"], backend.is_suspended(child),
                                 read_workload(namespace, child["metadata"]["uid"]))
    if state is None:
        return
    before = {}

    def queued(job: dict) -> dict:
        current = list((job.get("status") or {}).get("conditions") or [])
        before["reason"] = next((c.get("reason") for c in current if c.get("type") == queueing.CONDITION), None)
        conditions = status.set_condition(current, queueing.CONDITION, state.status, state.reason, state.message, now())
        return {"conditions": conditions} if conditions != current else {}

    if update_status(namespace, name, queued) and before["reason"] != state.reason:
        kind, reason = queueing.event_for(state)
        kopf.event(body, type=kind, reason=reason, message=state.message)


def read_trainer_gauges(address: str, port: int) -> dict[str, float]:
    # Marked as the operator's, so that a finishing trainer waits for this read, not Prometheus'.
    with urllib.request.urlopen(f"http://{address}:{port}/metrics?{OPERATOR_READ_QUERY}", timeout=3) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(f"{TRAINER_METRIC_PREFIX}_"):
            for sample in family.samples:
                samples[sample.name.removeprefix(f"{TRAINER_METRIC_PREFIX}_")] = sample.value
    return samples


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=SETTINGS.progress_interval_seconds, idle=0,
            when=lambda status, **_: (status or {}).get("phase") == "Running")
def poll_progress(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body, logger: logging.Logger,
                  **_) -> None:
    """Copy step, loss, ETA and the newest checkpoint from the rank-0 trainer's metrics into status."""
    backend = backend_of(spec, body.get("status"))
    address = rank0_pod_ip(namespace, name, backend)
    if address is None:
        return
    try:
        samples = read_trainer_gauges(address, SETTINGS.trainer_metrics_port)
    except OSError as err:  # not listening yet, or restarting: try again next tick
        logger.debug("no progress from %s yet: %s", address, err)
        return
    fields = status.status_from_metrics(samples, spec["checkpoints"]["uri"], namespace, name)
    if not fields:
        return
    # Only while still Running, tested by the API server in the same request: a reading taken just
    # before the job finished must not overwrite the final progress the finish wrote.
    operations = [{"op": "test", "path": "/status/phase", "value": "Running"}] + [
        {"op": "add", "path": f"/status/{key}", "value": value} for key, value in fields.items()]
    try:
        custom_api().patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, name, operations,
                                                           _content_type="application/json-patch+json")
    except ApiException as err:
        if err.status == 422:
            logger.debug("%s finished while its progress was read", name)
            return
        raise
    if "progress" in fields:
        report_progress(backend, namespace, name, fields["progress"])
