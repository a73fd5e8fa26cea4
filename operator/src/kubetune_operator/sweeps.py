"""TrainingSweeps: admission, and one observe → plan → act reconcile per timer tick, as TrainingJobs'.

Each tick observes the sweep's trial TrainingJobs (children it owns, labelled with the sweep and the
trial number), lets sweep_state.plan (pure) say what to do, creates and suspends TrainingJobs
accordingly, and writes the sweep's status in one merge patch guarded by the resourceVersion it was
decided from (kube.patch_status): a write raced by another change is decided again from the fresh
sweep. Events go through kube.post_event, the TrainingJobs' path, and say what this tick did:
TrialCreated for a TrainingJob created now, a trial's end once (marked on the trial before the event is
sent). A trial is a TrainingJob like any other: the operator's TrainingJob reconcile runs it, and its
status (progress, validation) is what the sweep reads.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import kopf
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kubetune_api.contract import (API_GROUP, API_VERSION, KIND, PLURAL, SWEEP_KIND, SWEEP_LABEL, SWEEP_PLURAL,
                                   TRIAL_EXPLOITED_FROM_ANNOTATION, TRIAL_LABEL, TRIAL_PARAMETERS_ANNOTATION,
                                   TRIAL_REPORTED_ANNOTATION)
from kubetune_api.manifest import describe_errors
from kubetune_api.mlflow_sweeps import MlflowUnavailable, end_sweep_run, start_sweep_run, sweep_run_params
from kubetune_api.search import Trial
from kubetune_api.sweep import TrainingSweep, TrainingSweepSpec, trial_spec, with_value
from kubetune_operator import kube, metrics
from kubetune_operator.kube import create_owned, custom_api
from kubetune_operator.kube import settings as operator_settings
from kubetune_operator.sweep_state import Plan, TrialJob, created_event, plan, trial_job_name

log = logging.getLogger("kubetune.operator.sweeps")
FINISHED = ("Succeeded", "Failed")
# Status keys a plan may leave out: removed (merge patch null) when they no longer apply.
OPTIONAL_STATUS = ("best", "message")
# A status write raced this often by other changes is given up (and tried again at the next tick).
ATTEMPTS = 5


def typed_sweep(body: kopf.Body) -> TrainingSweep:
    return TrainingSweep.model_validate({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                                         "metadata": dict(body.metadata), "spec": dict(body.spec)})


@kopf.on.validate(API_GROUP, API_VERSION, SWEEP_PLURAL, id="validate-sweep", operations=["CREATE"],
                  ignore_failures=True)
def validate_new_sweep(body: kopf.Body, **_) -> None:
    """Admission: what kubetune validate refuses (parameters that name no field or break its bounds,
    an objective the family does not report, maxTrials below parallelTrials), named by field."""
    try:
        typed_sweep(body)
    except ValidationError as err:
        metrics.ADMISSION_REJECTIONS.labels("invalid_sweep").inc()
        raise kopf.AdmissionError("; ".join(describe_errors(err)), code=422) from None


def trial_job(sweep: kopf.Body, spec: TrainingSweepSpec, trial: Trial, parent_run: str | None = None) -> dict:
    """The TrainingJob of one trial: the template with its parameters, owned by and labelled with the
    sweep; with MLflow tracking, a child run of the sweep's PARENT_RUN."""
    name = sweep.metadata["name"]
    job_spec = trial_spec(spec, trial.parameters)
    if parent_run and (job_spec.get("tracking") or {}).get("mlflow"):
        job_spec = with_value(job_spec, "tracking.mlflow.parentRunId", parent_run)
    annotations = {TRIAL_PARAMETERS_ANNOTATION: json.dumps(trial.parameters, sort_keys=True)}
    if trial.exploited_from is not None:
        annotations[TRIAL_EXPLOITED_FROM_ANNOTATION] = str(trial.exploited_from)
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
        "metadata": {
            "name": trial_job_name(name, trial.number),
            "namespace": sweep.metadata["namespace"],
            "labels": {SWEEP_LABEL: name, TRIAL_LABEL: str(trial.number)},
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": SWEEP_KIND, "name": name,
                                 "uid": sweep.metadata["uid"], "controller": True}],
        },
        "spec": job_spec,
    }


def observe(job: dict) -> TrialJob:
    """What the sweep reads off a trial's TrainingJob."""
    status = job.get("status") or {}
    progress, validation = status.get("progress") or {}, status.get("validation") or {}
    phase = status.get("phase")
    annotations = job["metadata"].get("annotations") or {}
    exploited_from = annotations.get(TRIAL_EXPLOITED_FROM_ANNOTATION)
    message = next((c.get("message", "") for c in status.get("conditions") or []
                    if c.get("type") == phase and c.get("status") == "True"), "")
    return TrialJob(
        number=int(job["metadata"]["labels"][TRIAL_LABEL]),
        parameters=json.loads(annotations.get(TRIAL_PARAMETERS_ANNOTATION, "{}")),
        exploited_from=None if exploited_from is None else int(exploited_from),
        phase=phase, message=message, step=progress.get("step"),
        recent_loss=progress.get("recentLoss"),
        validation_step=validation.get("step"), validation=validation.get("metrics") or {},
        output_uri=status.get("outputUri"), reported=annotations.get(TRIAL_REPORTED_ANNOTATION))


def read_trials(namespace: str, sweep: str, uid: str) -> dict[int, TrialJob]:
    """The sweep's trial TrainingJobs (only those it owns: a same-named older sweep's are not its own)."""
    listed = custom_api().list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,
                                                        label_selector=f"{SWEEP_LABEL}={sweep}")
    trials = {}
    for job in listed.get("items", []):
        owners = {ref.get("uid") for ref in job["metadata"].get("ownerReferences") or []}
        if uid in owners and TRIAL_LABEL in (job["metadata"].get("labels") or {}):
            observed = observe(job)
            trials[observed.number] = observed
    return trials


def create_trial(sweep: kopf.Body, spec: TrainingSweepSpec, trial: Trial, parent_run: str | None) -> bool:
    """Create the trial's TrainingJob; whether it was created now (False: it was there, ours)."""
    job = trial_job(sweep, spec, trial, parent_run)
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    api = custom_api()

    def owners() -> set[str]:
        existing = api.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
        return {ref.get("uid") for ref in existing["metadata"].get("ownerReferences") or []}

    return create_owned(job, sweep.metadata["uid"],
                        lambda obj: api.create_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,
                                                                        obj),
                        owners)


def patch_trial(namespace: str, sweep: str, number: int, body: dict) -> None:
    try:
        custom_api().patch_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,
                                                    trial_job_name(sweep, number), body)
    except ApiException as err:
        if err.status != 404:  # deleted meanwhile: nothing left to stop or mark
            raise


def stop_trial(namespace: str, sweep: str, number: int) -> None:
    """Suspend a trial's TrainingJob: its trainer checkpoints and exits, as on preemption."""
    patch_trial(namespace, sweep, number, {"spec": {"suspend": True}})


def mark_reported(namespace: str, sweep: str, number: int, state: str) -> None:
    """Note on the trial's TrainingJob that its end STATE is announced (before the event is sent: a
    restart in between loses that one event rather than sending it twice)."""
    patch_trial(namespace, sweep, number, {"metadata": {"annotations": {TRIAL_REPORTED_ANNOTATION: state}}})


@dataclass
class SweepDecision:
    """What one reconcile of a sweep does: the plan's actions (none for an invalid sweep), its status
    and events; AGAIN: decide once more after the status write (a parent run recorded first)."""

    status: dict
    spec: TrainingSweepSpec | None = None  # None: the sweep is invalid
    plan: Plan = field(default_factory=Plan)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    again: bool = False


def observe_and_plan(sweep: kopf.Body, parent_run_started: str | None) -> tuple[SweepDecision, str | None]:
    """Observe SWEEP's trials and decide; also the MLflow parent run of this reconcile (started now where
    the sweep tracks to MLflow and status names none: recorded in status before any trial names it, so
    that a restart finds it rather than starting a second)."""
    metadata, current = sweep.metadata, dict(sweep.status)
    namespace, name = metadata["namespace"], metadata["name"]
    try:
        spec = typed_sweep(sweep).spec
    except ValidationError as err:  # admitted while the webhook was away
        message = "invalid: " + "; ".join(describe_errors(err))
        return SweepDecision(status={"phase": "Failed", "message": message},
                             events=[("Warning", "InvalidSweep", message)]), None
    mlflow = (spec.template.spec.get("tracking") or {}).get("mlflow")
    parent_run = current.get("mlflowParentRunId")
    if mlflow and not parent_run and not mlflow.get("parentRunId"):
        parent_run = parent_run_started or parent_run_of(mlflow, namespace, name, spec, logger=log)
        if parent_run:
            return SweepDecision(status={"mlflowParentRunId": parent_run}, spec=spec, again=True), parent_run
    decided = plan(name, namespace, spec, current, read_trials(namespace, name, metadata["uid"]))
    return SweepDecision(status=decided.status, spec=spec, plan=decided, events=decided.events), parent_run


def act(sweep: kopf.Body, decided: SweepDecision, parent_run: str | None) -> bool:
    """Do what was decided, then the one guarded status write; False when the sweep changed meanwhile
    (decide again)."""
    metadata, current = sweep.metadata, dict(sweep.status)
    namespace, name = metadata["namespace"], metadata["name"]
    actions = decided.plan
    for number, state in actions.reported.items():
        mark_reported(namespace, name, number, state)
    for kind, reason, message in decided.events:
        kube.post_event(sweep, kind, reason, message)
    for trial in actions.create:
        if create_trial(sweep, decided.spec, trial, parent_run):
            kube.post_event(sweep, *created_event(trial))
    for number in actions.stop:
        stop_trial(namespace, name, number)
    if parent_run and decided.spec and decided.status.get("phase") in FINISHED:
        end_parent_run(decided.spec.template.spec["tracking"]["mlflow"], parent_run, name, decided.status,
                       decided.spec.objective.metric)
    changed = {key: value for key, value in decided.status.items() if current.get(key) != value}
    if not decided.again:  # a plan's status is whole: what it leaves out no longer applies
        changed.update({key: None for key in OPTIONAL_STATUS if key in current and key not in decided.status})
    if changed and not kube.patch_status(namespace, name, metadata["resourceVersion"], changed, plural=SWEEP_PLURAL):
        return False
    return not decided.again


def read_sweep(namespace: str, name: str) -> kopf.Body | None:
    try:
        return kopf.Body(custom_api().get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, SWEEP_PLURAL,
                                                                   name))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def reconcile_sweep(sweep_seen: kopf.Body) -> None:
    """Observe, plan, act for one sweep, from SWEEP_SEEN (as the timer delivered it) and then, where its
    status write was raced, from the sweep read again."""
    namespace, name = sweep_seen.metadata["namespace"], sweep_seen.metadata["name"]
    parent_run = None
    for attempt in range(ATTEMPTS):
        sweep = sweep_seen if attempt == 0 else read_sweep(namespace, name)
        if sweep is None or sweep.metadata.get("deletionTimestamp"):
            return  # gone or going: its trials follow (owner references)
        if sweep.status.get("phase") in FINISHED:
            return
        decided, parent_run = observe_and_plan(sweep, parent_run)
        if act(sweep, decided, parent_run):
            return
    raise kopf.TemporaryError(f"the status of sweep {name} kept changing while it was written", delay=1)


@kopf.timer(API_GROUP, API_VERSION, SWEEP_PLURAL, interval=operator_settings().sweep_interval_seconds,
            when=lambda status, **_: (status or {}).get("phase") not in FINISHED)
def run_sweep(body: kopf.Body, **_) -> None:
    """One step of the sweep: follow its trials, stop the clearly worse, start the next, record all."""
    with metrics.SWEEP_RECONCILE_SECONDS.time():
        reconcile_sweep(body)


# An unreachable tracking server is asked again at most this often per sweep (not every sweep step:
# each try can wait TIMEOUT_SECONDS per request, and each failure logs a warning).
PARENT_RUN_RETRY_SECONDS = 60.0
_parent_run_retry_at: dict[tuple[str, str], float] = {}


def parent_run_of(mlflow: dict, namespace: str, name: str, spec: TrainingSweepSpec, logger) -> str | None:
    """Start the sweep's MLflow parent run: its id (None while the server is away)."""
    if time.monotonic() < _parent_run_retry_at.get((namespace, name), 0.0):
        return None
    try:
        run_id = start_sweep_run(mlflow["uri"], mlflow.get("experiment", "kubetune"), namespace, name,
                                 sweep_run_params(spec))
    except MlflowUnavailable as err:
        _parent_run_retry_at[(namespace, name)] = time.monotonic() + PARENT_RUN_RETRY_SECONDS
        logger.warning("sweep %s/%s: no MLflow parent run yet (trials start as top-level runs; asked again in "
                       "%.0f s): %s", namespace, name, PARENT_RUN_RETRY_SECONDS, err)
        return None
    _parent_run_retry_at.pop((namespace, name), None)
    return run_id


def end_parent_run(mlflow: dict, run_id: str, sweep: str, status: dict, metric: str) -> None:
    values = {t["number"]: t["value"] for t in status["trials"] if t.get("value") is not None}
    best = (status.get("best") or {}).get("trial")
    try:
        end_sweep_run(mlflow["uri"], run_id, status["phase"] == "Succeeded", metric, values,
                      None if best is None else (best, trial_job_name(sweep, best)))
    except (MlflowUnavailable, LookupError) as err:
        log.warning("MLflow parent run %s not ended: %s", run_id, err)
