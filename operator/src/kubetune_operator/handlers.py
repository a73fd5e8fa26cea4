"""kopf handlers: admission, and triggers of the one reconcile (reconcile.py).

kopf keeps three jobs here: the admission webhook (refuse what the trainer would refuse), the
triggers (a TrainingJob created, resumed, changed or asked for a generation, one of its child jobs
changed, and one timer for what changes without an event: progress, Kueue's Workload, the pods'
state, a generation Job's state; look_again.py, fed by the active_jobs index), and the phase counts.
Each trigger runs the same level-triggered reconcile, which decides from what exists, so which
trigger fired never matters. The watched child kinds are read from the settings at import: kopf
registers handlers there.
"""
from __future__ import annotations

import asyncio
import copy
import logging

import kopf
from pydantic import ValidationError

from kubetune_api.contract import API_GROUP, API_VERSION, GENERATE_ANNOTATION, KIND, PLURAL
from kubetune_api import cluster_paths
from kubetune_api.manifest import describe_errors
from kubetune_api.spec import TrainingJob
from kubetune_operator import (backend_check, decision, fit_check, generation_jobs, image_policy, kube, metrics,
                               naming, progress_inbox, status, volume_policy)
from kubetune_operator.backends import BACKENDS, backend_name
from kubetune_operator.look_again import LookAgain
from kubetune_operator.reconcile import created_here, rank0_addresses, reconcile
from kubetune_operator.webhook import configure_server as configure_webhook

log = logging.getLogger("kubetune.operator")
# Tasks the operator starts itself; held here because the event loop keeps only weak references.
_BACKGROUND_TASKS: set[asyncio.Task] = set()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, active_jobs: kopf.Index, **_) -> None:
    kube.load_kubernetes_config()
    # TrainingJobs need no finalizer (no handler acts on their deletion, the one timer is not kopf's):
    # kopf removes the one older operators put on them. TrainingSweeps keep theirs, for their timer.
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    # Events come from the reconcile (kopf.event is not level-filtered), not from kopf's own log lines.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # Handlers are synchronous (the Kubernetes client): enough threads for bursts of new jobs.
    settings.execution.max_workers = 16
    timer = LookAgain(active_jobs, kube.settings().progress_interval_seconds, look_again, settings.execution.executor)
    _BACKGROUND_TASKS.add(asyncio.get_running_loop().create_task(timer.run(), name="look-again"))
    if kube.settings().webhook_address:
        # The certificate is kept fresh (rotated or reloaded) for as long as the operator runs, by
        # a task on kopf's own event loop: the one whose server uses it.
        keeper = configure_webhook(settings, kube.settings())
        _BACKGROUND_TASKS.add(asyncio.get_running_loop().create_task(keeper.run(), name="webhook-certificate"))
    if kube.settings().progress_inbox_address:
        # Trainers push their progress here (progress_inbox.py); served on kopf's loop like the webhook.
        progress_inbox.INBOX = progress_inbox.ProgressInbox(rank0_addresses, kube.settings().progress_interval_seconds)
        await progress_inbox.INBOX.serve(kube.settings().progress_inbox_address, kube.settings().progress_inbox_port)


def typed_job(body: kopf.Body) -> TrainingJob:
    """The object as the typed model (raises pydantic's ValidationError)."""
    return TrainingJob.model_validate({
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {"name": body.metadata.name, "namespace": body.metadata.namespace},
        "spec": dict(body.get("spec") or {}),
    })


@kopf.on.validate(API_GROUP, API_VERSION, PLURAL, id="validate", operations=["CREATE"], ignore_failures=True)
def validate_new_job(body: kopf.Body, warnings: list[str], **_) -> None:
    """Admission: refuse what the trainer would refuse (and a queue named two ways that disagree);
    warn (not refuse: the estimate is coarse) about a job that will not fit its GPUs.

    CREATE only: updates of a started job are governed by the reconcile (SpecChangeRefused), and
    kopf's own metadata patches (finalizers) must never be refused. No Secret is looked at: a
    missing credentials Secret is reported by the job's pods (CredentialsReady).
    """
    settings = kube.settings()
    try:
        job = typed_job(body)
    except ValidationError as err:
        metrics.ADMISSION_REJECTIONS.labels("invalid_spec").inc()
        raise kopf.AdmissionError("; ".join(describe_errors(err)), code=422) from None
    unmounted = cluster_paths.refusals(job.spec)
    if unmounted:  # the CRD's CEL says the same; this covers an API server that skipped it (or an older CRD)
        metrics.ADMISSION_REJECTIONS.labels("invalid_spec").inc()
        raise kopf.AdmissionError("; ".join(unmounted), code=422)
    disagree = decision.queue_disagreement(dict(body.get("spec") or {}), dict(body.metadata.labels or {}))
    if disagree:
        metrics.ADMISSION_REJECTIONS.labels("queue").inc()
        raise kopf.AdmissionError(disagree, code=422)
    image_refused = image_policy.refusal(job.spec.image, settings.allowed_image_prefixes, settings.trainer_image)
    if image_refused:
        metrics.ADMISSION_REJECTIONS.labels("image_not_allowed").inc()
        raise kopf.AdmissionError(image_refused, code=422)
    if volume_policy.names_checked_source(dict(body.get("spec") or {})):
        volume_refused = volume_policy.refusal(job.spec.volumes, job.metadata.namespace,
                                               kube.pod_security_level(job.metadata.namespace))
        if volume_refused:
            metrics.ADMISSION_REJECTIONS.labels("volume_refused").inc()
            raise kopf.AdmissionError(volume_refused, code=422)
    backend = BACKENDS[backend_name(dict(body.get("spec") or {}), {}, settings.backend)]
    refused = backend_check.unsupported(job, backend, settings)
    if refused:
        metrics.ADMISSION_REJECTIONS.labels("backend").inc()
        raise kopf.AdmissionError(refused.message, code=422)
    # A backend not enabled yet is admitted: the job waits (BackendReady) and starts once it is.
    disabled = backend_check.not_enabled(backend, settings)
    if disabled:
        warnings.append(f"{backend_check.CONDITION}: {disabled.message}")
    too_big = fit_check.fit_warning(job, settings.default_gpu_memory)
    if too_big:
        warnings.append(too_big)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
def count_by_phase(type: str | None, body: kopf.Body, uid: str, namespace: str | None = None, name: str | None = None,
                   **_) -> None:
    """Keep kubetune_operator_trainingjobs{phase} up to date (see metrics.PhaseCounts for why so); a
    deleted job's pushed progress is forgotten with it."""
    deleted = type == "DELETED"
    metrics.TRAININGJOBS.observe(uid, (body.get("status") or {}).get("phase"),
                                 deleting=deleted or bool(body.metadata.get("deletionTimestamp")))
    if deleted and progress_inbox.INBOX is not None and name:
        progress_inbox.INBOX.forget(namespace, name)


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec", id="job_spec_changed")
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field=("metadata", "annotations", GENERATE_ANNOTATION),
                id="generation_asked")
def job_changed(name: str, namespace: str, body: kopf.Body, **_) -> None:
    """The job is new, the operator (re)started, its spec changed or it was asked for a generation
    (`kubetune generate --on-cluster`, finished job or not): reconcile it, from the body kopf holds."""
    reconcile(namespace, name, job_seen=copy.deepcopy(dict(body)))


@kopf.index(API_GROUP, API_VERSION, PLURAL)
def training_jobs(namespace: str, name: str, uid: str, **_) -> dict:
    """Every TrainingJob's UID by (namespace, name), kept in memory from the watch kopf runs anyway:
    a child's event reconciles its owner only while that very TrainingJob exists."""
    return {(namespace, name): uid}


def child_changed(body: kopf.Body, namespace: str, type: str, training_jobs: kopf.Index, **_) -> None:
    """A child job changed: reconcile the TrainingJob that owns it, with the child as delivered. Not when
    that TrainingJob is gone, or the name now belongs to a new one (the old child is garbage being
    collected), nor for the very version a reconcile created: no API call then."""
    if type == "DELETED":
        return
    owner = next((ref for ref in body.metadata.get("ownerReferences", []) if ref.get("kind") == KIND), None)
    if owner is None or owner.get("uid") not in training_jobs.get((namespace, owner["name"]), ()):
        return
    if created_here(namespace, body):  # the version a reconcile created: decided already
        return
    try:
        reconcile(namespace, owner["name"], child_seen=copy.deepcopy(dict(body)))
    except kopf.PermanentError as err:  # already in the job's status; kopf's job handlers report it
        log.debug("%s/%s: %s", namespace, owner["name"], err)


for _backend in BACKENDS.values():
    # Only enabled backends are watched: the operator has RBAC for those only.
    if kube.settings().backend_enabled(_backend.name):
        kopf.on.event(_backend.group, _backend.version, _backend.plural, labels={naming.JOB_LABEL: kopf.PRESENT},
                      id=f"child_changed_{_backend.name}")(child_changed)


def still_active(spec: kopf.Spec, body: kopf.Body, **_) -> bool:
    """Jobs whose state changes without an event of theirs: running (progress), waiting in a queue
    (Kueue's Workload), pods waiting for a Secret, drawing (a generation Job's state: its Job is read,
    not watched). Finished and suspended-by-author jobs are left alone, unless they draw."""
    job_status = body.get("status") or {}
    return ((job_status.get("phase") not in status.FINISHED and not spec.get("suspend"))
            or generation_jobs.pending(dict(body.metadata.annotations), job_status))


@kopf.index(API_GROUP, API_VERSION, PLURAL, when=still_active)
def active_jobs(namespace: str, name: str, **_) -> dict:
    """The jobs the one timer visits (look_again.py): names only, kept from the watch kopf runs anyway;
    a job leaves the index as soon as it stops matching still_active."""
    return {(namespace, name): True}


def look_again(namespace: str, name: str) -> None:
    """The one timer's visit: the same reconcile, for what no event announces."""
    try:
        reconcile(namespace, name)
    except (kopf.PermanentError, kopf.TemporaryError) as err:  # said in the job's status; next interval again
        log.debug("%s/%s: %s", namespace, name, err)
