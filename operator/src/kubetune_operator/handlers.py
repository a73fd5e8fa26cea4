"""kopf handlers: short glue between the API server and the pure builders.

Each handler reads, builds, applies idempotently and patches status; the decisions live in
trainer_config, pod_template, backends and status, which are plain functions.
"""
from __future__ import annotations

import datetime
import functools
import logging
import urllib.request
from pathlib import Path

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kubetune_api.manifest import describe_errors
from kubetune_api.spec import API_GROUP, API_VERSION, TrainingJob
from kubetune_operator import fit_check, metrics, naming, spec_change, status
from kubetune_operator.backends import PyTorchJobBackend
from kubetune_operator.settings import Settings
from kubetune_operator.trainer_config import build_config_map, job_from_config_map
from kubetune_operator.webhook import configure_server as configure_webhook

PLURAL = "trainingjobs"
BACKEND = PyTorchJobBackend()
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


def missing_secret(job: TrainingJob) -> str | None:
    """Why spec.s3.credentialsSecret cannot be used, or None when it exists (or none is named)."""
    secret = job.spec.s3.credentials_secret
    if not secret:
        return None
    try:
        core_api().read_namespaced_secret(secret, job.metadata.namespace)
    except ApiException as err:
        if err.status == 404:
            return (f"spec.s3.credentialsSecret: Secret {secret!r} does not exist in namespace "
                    f"{job.metadata.namespace!r}; create it with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        raise
    return None


def check_secret(job: TrainingJob) -> None:
    problem = missing_secret(job)
    if problem:
        raise kopf.TemporaryError(problem, delay=15)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
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
        configure_webhook(settings, SETTINGS.webhook_address, SETTINGS.webhook_port, Path(SETTINGS.webhook_cert_dir))


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
    check_secret(job)
    namespace = job.metadata.namespace
    core, custom = core_api(), custom_api()

    config_map = build_config_map(job)
    kopf.adopt(config_map, owner=body)
    create_owned(config_map, uid,
                 lambda obj: core.create_namespaced_config_map(namespace, obj),
                 lambda: [ref.uid for ref in core.read_namespaced_config_map(
                     config_map["metadata"]["name"], namespace).metadata.owner_references or []])

    child = BACKEND.build(job, uid, SETTINGS)
    kopf.adopt(child, owner=body)
    created = create_owned(child, uid,
                 lambda obj: custom.create_namespaced_custom_object(BACKEND.group, BACKEND.version, namespace,
                                                                    BACKEND.plural, obj),
                 lambda: [ref["uid"] for ref in custom.get_namespaced_custom_object(
                     BACKEND.group, BACKEND.version, namespace, BACKEND.plural,
                     child["metadata"]["name"])["metadata"].get("ownerReferences", [])])
    if created:
        metrics.CHILD_JOBS_CREATED.labels(BACKEND.kind).inc()
    fits = fit_check.fits_gpu_conditions(body.get("status") or {}, job, SETTINGS.default_gpu_memory, now())
    if fits is not None:
        patch.status["conditions"] = fits
    if not (body.get("status") or {}).get("phase"):
        patch.status["phase"] = "Suspended" if job.spec.suspend else "Pending"
        patch.status["observedGeneration"] = body.metadata.get("generation")
        kopf.event(body, type="Normal", reason="Created", message=f"{BACKEND.kind} {child['metadata']['name']} created")


def patch_child(job_name: str, namespace: str, body: dict | list) -> None:
    """A merge patch (dict) or a JSON patch (list) of the child job; a failed JSON patch `test`
    (the child changed meanwhile, e.g. was resumed) is retried, so that the decision is made again."""
    try:
        custom_api().patch_namespaced_custom_object(
            BACKEND.group, BACKEND.version, namespace, BACKEND.plural, naming.child_name(job_name), body,
            _content_type="application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json")
    except ApiException as err:
        if err.status == 422 and isinstance(body, list):
            raise kopf.TemporaryError(f"the child job changed while it was patched: {err.reason}", delay=2) from None
        raise


@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec")
def spec_changed(body: kopf.Body, old: dict, new: dict, patch: kopf.Patch, **_) -> None:
    """Suspend/resume is applied, and the job's size while no pod runs; any other change to a started
    run is refused, visibly (spec_change.decide says which is which)."""
    namespace, name = body.metadata.namespace, body.metadata.name
    core, custom = core_api(), custom_api()
    config_map = core.read_namespaced_config_map(naming.config_map_name(name), namespace)
    child = custom.get_namespaced_custom_object(BACKEND.group, BACKEND.version, namespace, BACKEND.plural,
                                                naming.child_name(name))
    change = spec_change.decide(dict(old or {}), dict(new or {}), job_from_config_map(config_map.data),
                                BACKEND.is_suspended(child))
    if change.refused:
        conditions = status.set_condition(list((body.get("status") or {}).get("conditions") or []),
                                          "SpecChangeRefused", "True", "ImmutableSpec", change.refused, now())
        patch.status["conditions"] = conditions
        kopf.warn(body, reason="SpecChangeRefused", message=change.refused)
        return
    if change.suspend is True:
        patch_child(name, namespace, BACKEND.suspend_patch(True))
    if change.resized:
        # Child first, config second: a failure in between leaves the config's old size, so the
        # retry (kopf repeats a failed handler) still sees the gap and resizes again.
        patch_child(name, namespace, BACKEND.resize_patch(child, change.resized, body.metadata.uid, SETTINGS))
        core.patch_namespaced_config_map(config_map.metadata.name, namespace,
                                         {"data": build_config_map(change.resized)["data"]})
        kopf.event(body, type="Normal", reason="Resized", message=change.resize_message)
    if change.suspend is False:
        patch_child(name, namespace, BACKEND.suspend_patch(False))
    if change.suspend is not None:
        kopf.event(body, type="Normal", reason="Suspended" if change.suspend else "Resumed",
                   message="pods stopped; the run continues from its latest checkpoint when resumed"
                   if change.suspend else "resuming from the latest checkpoint")
    patch.status["observedGeneration"] = body.metadata.get("generation")


@kopf.on.event(BACKEND.group, BACKEND.version, BACKEND.plural, labels={naming.JOB_LABEL: kopf.PRESENT})
def child_changed(body: kopf.Body, namespace: str, type: str, **_) -> None:
    """Mirror the child job's state into the owning TrainingJob's status."""
    if type == "DELETED":
        return
    owner = next((ref for ref in body.metadata.get("ownerReferences", []) if ref.get("kind") == "TrainingJob"), None)
    if owner is None:
        return
    custom = custom_api()
    try:
        job = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, owner["name"])
    except ApiException as err:
        if err.status == 404:
            return
        raise
    if job["metadata"]["uid"] != owner["uid"]:
        return
    patch, events = status.status_for_child(job.get("status") or {}, BACKEND.read_state(dict(body)), now())
    if not patch:
        return
    if patch.get("phase") == "Succeeded":
        final = status.final_checkpoint(job["spec"], job.get("status") or {})
        if final:
            patch["latestCheckpoint"] = final
    custom.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, owner["name"],
                                                 {"status": patch})
    for event in events:
        kopf.event(job, type=event.type, reason=event.reason, message=event.message)


def master_pod_ip(namespace: str, job_name: str) -> str | None:
    pods = core_api().list_namespaced_pod(
        namespace, label_selector=f"training.kubeflow.org/job-name={naming.child_name(job_name)},"
                                  "training.kubeflow.org/replica-type=master")
    running = [p for p in pods.items if p.status.phase == "Running" and p.status.pod_ip]
    return running[0].status.pod_ip if running else None


def read_trainer_gauges(address: str, port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=3) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kubetune_trainer_"):
            for sample in family.samples:
                samples[sample.name.removeprefix("kubetune_trainer_")] = sample.value
    return samples


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=SETTINGS.progress_interval_seconds, idle=0,
            when=lambda status, **_: (status or {}).get("phase") == "Running")
def poll_progress(name: str, namespace: str, spec: kopf.Spec, patch: kopf.Patch, logger: logging.Logger,
                  **_) -> None:
    """Copy step, loss, ETA and the newest checkpoint from the rank-0 trainer's metrics into status."""
    address = master_pod_ip(namespace, name)
    if address is None:
        return
    try:
        samples = read_trainer_gauges(address, SETTINGS.trainer_metrics_port)
    except OSError as err:  # not listening yet, or restarting: try again next tick
        logger.debug("no progress from %s yet: %s", address, err)
        return
    progress = status.progress_from_metrics(samples)
    if progress:
        patch.status["progress"] = progress
    output_uri = status.output_uri_from_metrics(samples, spec["checkpoints"]["uri"], namespace, name)
    if output_uri:
        patch.status["outputUri"] = output_uri
    latest = status.latest_checkpoint_from_metrics(samples, output_uri)
    if latest:
        patch.status["latestCheckpoint"] = latest
