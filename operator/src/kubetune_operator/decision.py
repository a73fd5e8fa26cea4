"""What to do about a TrainingJob, decided from everything observed: one pure function.

`decide(spec, status, observed)` returns the actions (create, patch or replace the child, write the
ConfigMap, report progress on the child) and ONE status patch with the events that explain it. It is
level-triggered: it compares what exists with what the spec asks for, never an event with the one
before, so a repeated, late or missed event changes nothing, and a restarted operator converges.
reconcile.py observes and acts; this module performs no I/O and reads no clock.

The transitions, in order:
  finished            nothing, ever again (Succeeded and Failed are final)
  never started       spec invalid / backend not ready / image refused: a condition and a Warning
                      event, no child; else ConfigMap (+ NetworkPolicy) and child created
  started             the spec against what the trainer runs (its ConfigMap): suspend, resume and
                      resize applied (a suspended child that cannot resize is replaced), any other
                      change refused in SpecChangeRefused; a child gone (deleted by hand, its API
                      gone with its CRDs) is created again once its backend is there
  child               its state mirrored into phase/conditions (finished: the final progress)
  progress            the rank-0 trainer's gauges into status.progress & co. while Running, and its
                      final report (termination message) once the child finished
  queue               Kueue's Workload into the Queued condition while the job waits in a queue
  generation          a `kubetune generate --on-cluster` request, finished job or not (drawing from a
                      finished run is the main use): its batch Job created once, its state in
                      status.generations, a refused request answered Failed with one Warning
  preemption cost     with kueue.preemptionCost, Kueue's priority boost on the Workload from the job's
                      unsaved work (preemption_cost.py); someone else's boost is kept and reported
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pydantic import ValidationError

from kubetune_api.contract import API_GROUP, API_VERSION, GENERATIONS_STATUS, KIND
from kubetune_api.generation_request import BadGenerationRequest
from kubetune_api.manifest import describe_errors
from kubetune_api.spec import TrainingJob
from kubetune_operator import (backend_check, claims, credentials, fit_check, generation_jobs, image_policy,
                               naming, network_policy, preemption_cost, queueing, spec_change, status, volume_policy)
from kubetune_operator.backends import BACKENDS, Backend, backend_name
from kubetune_operator.backends.base import observed_state
from kubetune_operator.settings import Settings
from kubetune_operator.status import FINISHED, Event
from kubetune_operator.trainer_config import build_config_map, job_from_config_map

# How long to wait before looking again at what cannot be done yet.
BACKEND_RETRY_SECONDS = 30.0
# How soon a job whose volumes its namespace refuses looks at the namespace's level again.
VOLUME_POLICY_RETRY_SECONDS = 60.0
REPLACE_RETRY_SECONDS = 2.0
SPEC_CHANGE_CONDITION = "SpecChangeRefused"
DRIFT_CONDITION = "ChildMatchesSpec"


@dataclass(frozen=True)
class Observed:
    """Everything the reconcile looked at, as one value."""

    name: str
    namespace: str
    uid: str
    generation: int | None
    settings: Settings
    now: str
    labels: dict = field(default_factory=dict)
    config_map: dict | None = None  # the trainer ConfigMap's data; None: the job never started
    config_map_version: str | None = None  # its resourceVersion: what a change of it is decided from
    child: dict | None = None  # the child job of the job's backend; None: none (or its API is gone)
    backend_problem: backend_check.Problem | None = None  # a prerequisite missing (looked for without a child)
    workload: dict | None = None  # Kueue's Workload of the child
    gauges: dict | None = None  # the rank-0 trainer's gauges (names without the prefix), while Running
    # The same gauges as rank 0 left them in its termination message when it ended (once the child
    # finished): the last reading, also of a run that ended before any poll saw it running.
    final_report: dict | None = None
    credentials_problem: str | None = None  # a credentials Secret the job's pods cannot use
    claim_problem: tuple[str, str] | None = None  # (reason, message): a claim the job's pods wait for
    generation_request: generation_jobs.SeenGeneration | None = None  # one not answered yet, and its Job
    # The Pod Security Standard the namespace enforces, read before a child exists where the spec has a volume
    # some level refuses (volume_policy); None otherwise.
    pod_security_level: str | None = None


# ---- actions: what act() does, in order ---------------------------------------------------------------

@dataclass(frozen=True)
class CreateConfigMap:
    obj: dict


@dataclass(frozen=True)
class CreateNetworkPolicy:
    obj: dict


@dataclass(frozen=True)
class CreateChild:
    obj: dict


@dataclass(frozen=True)
class PatchChild:
    body: dict | list  # merge patch (dict) or JSON patch (list)


@dataclass(frozen=True)
class DeleteChild:
    name: str
    uid: str


@dataclass(frozen=True)
class PatchConfigMap:
    """The trainer ConfigMap's new data, only if it is still at RESOURCE_VERSION: two reconciles that
    both saw the old size would otherwise both resize and both say so (else decided again)."""
    data: dict
    resource_version: str | None


@dataclass(frozen=True)
class PatchChildStatus:
    body: dict


@dataclass(frozen=True)
class CreateGenerationJob:
    obj: dict  # the batch Job that draws a `kubetune generate --on-cluster` request
    request_id: str


@dataclass(frozen=True)
class PatchWorkload:
    """A merge patch of Kueue's Workload, only if it is still at RESOURCE_VERSION (else decided again)."""
    name: str
    resource_version: str
    body: dict


@dataclass
class Decision:
    backend: Backend
    actions: list = field(default_factory=list)
    status: dict = field(default_factory=dict)  # one merge patch of status; None removes a field
    events: list[Event] = field(default_factory=list)  # said once the status patch is written
    # Said once the actions are done, whether or not the status write after them is raced (a pass
    # decided again finds them done and says nothing): what was created, resized, suspended.
    action_events: list[Event] = field(default_factory=list)
    retry_after: float | None = None  # look again after this many seconds (something is not there yet)
    error: str | None = None  # no retry helps until the spec changes


class _Draft:
    """The status as it will be (current + patch), built up by the steps below."""

    def __init__(self, current: dict, now: str):
        self.current, self.patch, self.now = current, {}, now

    def get(self, key: str):
        return self.patch[key] if key in self.patch else self.current.get(key)

    def view(self) -> dict:
        return {**self.current, **self.patch}

    def set(self, key: str, value) -> None:
        if self.current.get(key) != value or key in self.patch:
            self.patch[key] = value

    def update(self, fields: dict) -> None:
        for key, value in fields.items():
            self.set(key, value)

    def set_default(self, key: str, value) -> None:
        if not self.get(key):
            self.set(key, value)

    def condition(self, type_: str, state: str, reason: str, message: str) -> bool:
        """Set condition TYPE_; whether anything changed."""
        before = list(self.get("conditions") or [])
        after = status.set_condition(before, type_, state, reason, message, self.now)
        if after != before:
            self.set("conditions", after)
        return after != before

    def condition_reason(self, type_: str) -> str | None:
        return next((c.get("reason") for c in self.get("conditions") or [] if c.get("type") == type_), None)


def queue_name(spec: dict, labels: dict) -> str | None:
    """The LocalQueue a job asks for: spec.scheduling.queueName, or Kueue's own label on the job."""
    return ((spec.get("scheduling") or {}).get("queueName") or (labels or {}).get(queueing.QUEUE_LABEL)) or None


def queue_disagreement(spec: dict, labels: dict) -> str | None:
    """Why the label and spec.scheduling.queueName cannot both be honoured, or None."""
    in_spec, in_label = (spec.get("scheduling") or {}).get("queueName"), (labels or {}).get(queueing.QUEUE_LABEL)
    if in_spec and in_label and in_spec != in_label:
        return (f"metadata.labels[{queueing.QUEUE_LABEL}] is {in_label!r} but spec.scheduling.queueName is "
                f"{in_spec!r}: they are the same request; set one of them (or both to the same queue)")
    return None


def with_label_queue(spec: dict, labels: dict) -> dict:
    """SPEC with the queue label's LocalQueue as spec.scheduling.queueName, where the spec names none:
    Kueue's documented way to queue a job is the label, and it must mean what the field means."""
    label = (labels or {}).get(queueing.QUEUE_LABEL)
    if not label or (spec.get("scheduling") or {}).get("queueName"):
        return spec
    return {**spec, "scheduling": {**(spec.get("scheduling") or {}), "queueName": label}}


def decide(spec: dict, status_: dict | None, observed: Observed) -> Decision:
    current = dict(status_ or {})
    spec = with_label_queue(dict(spec or {}), observed.labels)
    settings = observed.settings
    backend = BACKENDS[backend_name(spec, current, settings.backend)]
    decision = Decision(backend)
    draft = _Draft(current, observed.now)
    if current.get("phase") in FINISHED:
        return _generation_only(spec, observed, draft, decision)  # finished is final for training
    if observed.config_map is None:
        runs = _start(spec, observed, backend, draft, decision)
    else:
        runs = _follow_spec(spec, observed, backend, draft, decision)
    if runs is not None and decision.error is None and decision.retry_after is None:
        _created_status(runs, observed, backend, draft)
    _credentials(observed, draft, decision)
    _claims(observed, draft, decision)
    created = next((action.obj for action in decision.actions if isinstance(action, CreateChild)), None)
    if observed.child is not None or created is not None:
        # A child created now is shown as it is created (suspended or not, queued or not), in this
        # one status write: its creation's own watch event is not reconciled again (reconcile.py).
        seen = observed if observed.child is not None else replace(observed, child=created)
        _progress(spec, seen, draft)
        _mirror_child(spec, seen, backend, draft, decision)
        _queue(spec, seen, backend, draft, decision)
    _generation(spec, observed, draft, decision)
    if draft.get("phase") != "Running" and draft.get("unsavedWork"):
        draft.set("unsavedWork", None)  # nothing in flight; a stopping trainer writes a last checkpoint
    if observed.workload is not None and observed.settings.preemption_cost.enabled:
        _preemption_cost(observed, draft, decision)
    decision.status = draft.patch
    return decision


def _typed(spec: dict, observed: Observed) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                                       "metadata": {"name": observed.name, "namespace": observed.namespace},
                                       "spec": spec})


def _blocked(problem: backend_check.Problem, backend: Backend, draft: _Draft, decision: Decision) -> None:
    """The backend cannot run the job now: BackendReady=False, a Warning once per reason, no child."""
    if draft.condition(backend_check.CONDITION, "False", problem.reason, problem.message):
        decision.events.append(Event("Warning", problem.reason, problem.message))
    draft.set_default("phase", "Pending")  # not lost: waiting, and saying for what
    draft.set_default("backend", backend.name)  # the one it waits for, also after a change of the default
    if problem.permanent:
        decision.error = problem.message
    else:
        decision.retry_after = BACKEND_RETRY_SECONDS


def _start(spec: dict, observed: Observed, backend: Backend, draft: _Draft, decision: Decision) -> TrainingJob | None:
    """A job that never started: check what stops it, else create its ConfigMap, policy and child."""
    try:
        job = _typed(spec, observed)
    except ValidationError as err:
        decision.error = "invalid spec: " + "; ".join(describe_errors(err))
        return None
    settings = observed.settings
    problem = (backend_check.not_enabled(backend, settings) or backend_check.unsupported(job, backend, settings)
               or observed.backend_problem)
    if problem is not None:
        _blocked(problem, backend, draft, decision)
        return None
    refused = image_policy.refusal(job.spec.image, settings.allowed_image_prefixes, settings.trainer_image)
    if refused is not None:
        if draft.condition(image_policy.CONDITION, "False", "ImageNotAllowed", refused):
            decision.events.append(Event("Warning", "ImageNotAllowed", refused))
        draft.set_default("phase", "Pending")
        # With a phase, a job without status.backend is taken for one from before backends existed.
        draft.set_default("backend", backend.name)
        decision.error = refused
        return None
    refused = volume_policy.refusal(job.spec.volumes, observed.namespace, observed.pod_security_level)
    if refused is not None:  # not final: the namespace's level may change, and the job then starts
        if draft.condition(volume_policy.CONDITION, "False", volume_policy.REASON, refused):
            decision.events.append(Event("Warning", volume_policy.REASON, refused))
        draft.set_default("phase", "Pending")
        draft.set_default("backend", backend.name)
        decision.retry_after = VOLUME_POLICY_RETRY_SECONDS
        return None
    decision.actions.append(CreateConfigMap(build_config_map(job)))
    if observed.child is None:
        _create_child(job, observed, backend, decision)
    return job


def _create_child(job: TrainingJob, observed: Observed, backend: Backend, decision: Decision) -> None:
    settings = observed.settings
    if settings.network_policy is not None:  # before the child: its pods start fenced in
        decision.actions.append(CreateNetworkPolicy(network_policy.trainer_network_policy(
            job, settings.network_policy, settings.trainer_metrics_port)))
    child = backend.build(job, observed.uid, settings)
    decision.actions.append(CreateChild(child))
    decision.action_events.append(Event("Normal", "Created", f"{backend.kind} {child['metadata']['name']} created"))


def _created_status(job: TrainingJob, observed: Observed, backend: Backend, draft: _Draft) -> None:
    """What a job whose children exist (or are being created) shows before its child says more."""
    draft.condition(backend_check.CONDITION, "True", "ChildCreated",
                    f"{backend.kind} {naming.child_name(observed.name)} ({backend.name} backend)")
    fits = fit_check.fits_gpu_conditions({"conditions": draft.get("conditions") or []}, job,
                                         observed.settings.default_gpu_memory, observed.now)
    if fits is not None:
        draft.set("conditions", fits)
    if draft.condition_reason(image_policy.CONDITION) == "ImageNotAllowed":  # refused before: passes now
        draft.condition(image_policy.CONDITION, "True", "Allowed", "spec.image is allowed")
    if draft.condition_reason(volume_policy.CONDITION) == volume_policy.REASON:
        draft.condition(volume_policy.CONDITION, "True", "Allowed", "the namespace's Pod Security Standard allows "
                        "spec.volumes")
    draft.set_default("backend", backend.name)
    if not draft.get("phase"):  # the child's own state may have been written first: never undo it
        draft.set("phase", "Suspended" if job.spec.suspend else "Pending")
        draft.set("observedGeneration", observed.generation)


def _follow_spec(spec: dict, observed: Observed, backend: Backend, draft: _Draft,
                 decision: Decision) -> TrainingJob | None:
    """A started job: its spec against what the trainer runs; suspend, resume, resize; a lost child."""
    try:
        applied = job_from_config_map(observed.config_map)
    except Exception as err:  # noqa: BLE001 (a ConfigMap edited by hand into nonsense: say so, touch nothing)
        decision.error = (f"the trainer ConfigMap of {observed.name} cannot be read ({type(err).__name__}); "
                          "delete it and the operator writes it again from the spec")
        return None
    child = observed.child
    deleting = child is not None and bool(child["metadata"].get("deletionTimestamp"))
    suspended = child is None or deleting or backend.is_suspended(child)
    change = spec_change.against_applied(applied, spec, suspended)
    if change.refused:
        if draft.condition(SPEC_CHANGE_CONDITION, "True", "ImmutableSpec", change.refused):
            decision.events.append(Event("Warning", SPEC_CHANGE_CONDITION, change.refused))
    elif draft.condition_reason(SPEC_CHANGE_CONDITION) == "ImmutableSpec":
        draft.condition(SPEC_CHANGE_CONDITION, "False", "SpecMatches",
                        "the spec matches what the job runs (a refused change was put back)")
    runs = applied
    if change.suspend is True and child is not None and not deleting:
        decision.actions.append(PatchChild(backend.suspend_patch(True)))
    if change.resized is not None:
        # Child first, config second: a failure in between leaves the config's old size, so the next
        # reconcile still sees the gap and resizes again.
        resize = backend.resize_patch(child, change.resized, observed.uid, observed.settings) if child else None
        if resize is not None:
            decision.actions.append(PatchChild(resize))
        elif child is not None:
            # Replaced: deleted in the foreground; the new one is created once the old one is gone.
            if not deleting:
                decision.actions.append(DeleteChild(child["metadata"]["name"], child["metadata"]["uid"]))
            decision.retry_after = REPLACE_RETRY_SECONDS
            return None
        else:
            _create_child(change.resized, observed, backend, decision)
        runs = change.resized
        decision.actions.append(PatchConfigMap(build_config_map(runs)["data"], observed.config_map_version))
        decision.action_events.append(Event("Normal", "Resized", change.resize_message))
    elif change.suspend is not None:
        runs = spec_change.with_suspend(applied, change.suspend)
        decision.actions.append(PatchConfigMap(build_config_map(runs)["data"], observed.config_map_version))
    if change.suspend is False and child is not None and not deleting:
        decision.actions.append(PatchChild(backend.suspend_patch(False)))
    if change.suspend is not None:
        decision.action_events.append(Event("Normal", "Suspended" if change.suspend else "Resumed",
                                     "pods stopped; the run continues from its latest checkpoint when resumed"
                                     if change.suspend else "resuming from the latest checkpoint"))
    if not change.refused:
        draft.set("observedGeneration", observed.generation)
    if child is not None and not deleting and change.resized is None:
        _drift(runs, observed, backend, draft, decision)
    if child is None and change.resized is None:
        # Deleted by hand, or gone with its backend's CRDs: created again once the backend is there;
        # the trainer resumes from its latest checkpoint.
        if observed.backend_problem is not None:
            _blocked(observed.backend_problem, backend, draft, decision)
            return None
        _create_child(runs, observed, backend, decision)
    return runs


def _drift(runs: TrainingJob, observed: Observed, backend: Backend, draft: _Draft, decision: Decision) -> None:
    """A child edited by hand is reported (ChildMatchesSpec=False, one Warning), not reverted: putting
    back the image or size of a running child restarts its pods (or, for a TrainJob, is refused while
    it runs), so the choice between keeping the edit and a restart from the last checkpoint is left
    to the user, with the way to each."""
    wanted = backend.owned_fields(backend.build(runs, observed.uid, observed.settings))
    found = backend.owned_fields(observed.child)
    edited = [f"{path} is {found.get(path)!r} (kubetune wrote {value!r})" for path, value in wanted.items()
              if found.get(path) != value]
    if edited:
        message = (f"the {backend.kind} {observed.child['metadata']['name']} was changed outside kubetune: "
                   f"{'; '.join(edited)}. kubetune does not revert a running child (that restarts its pods); "
                   f"put the fields back, or delete the {backend.kind} to have it created again from the spec "
                   "(the run continues from its latest checkpoint)")
        if draft.condition(DRIFT_CONDITION, "False", "EditedOutsideKubetune", message):
            decision.events.append(Event("Warning", "EditedOutsideKubetune", message))
    elif draft.condition_reason(DRIFT_CONDITION) == "EditedOutsideKubetune":
        draft.condition(DRIFT_CONDITION, "True", "AsBuilt", "the child job is as kubetune built it")


def _progress(spec: dict, observed: Observed, draft: _Draft) -> None:
    """The rank-0 trainer's gauges while the job runs (progress, output URI, checkpoint, validation),
    and its final report once it ended, whatever phase the last look saw (a short run may end before
    any look saw it Running): the report is newer than any poll."""
    samples = observed.final_report or (observed.gauges if draft.get("phase") == "Running" else None)
    if samples:
        draft.update(status.status_from_metrics(samples, (spec.get("checkpoints") or {}).get("uri", ""),
                                                observed.namespace, observed.name))
        draft.update(status.saved_work_from_metrics(samples, observed.now, draft.get("lastCheckpoint")))


def _mirror_child(spec: dict, observed: Observed, backend: Backend, draft: _Draft, decision: Decision) -> None:
    fields, events = status.status_for_child(draft.view(), observed_state(backend, observed.child), observed.now)
    draft.update(fields)
    if fields.get("phase") in FINISHED:
        draft.update(status.finished_patch(spec, draft.view(), fields["phase"]))
    decision.events.extend(events)
    if "progress" in draft.patch:
        child_patch = backend.progress_patch(draft.patch["progress"], observed.now, observed.settings)
        if child_patch is not None:
            decision.actions.append(PatchChildStatus(child_patch))


def _queue(spec: dict, observed: Observed, backend: Backend, draft: _Draft, decision: Decision) -> None:
    """Say in the Queued condition where a queued job stands: waiting (and Kueue's reason), preempted,
    admitted. The child's own state only says suspended; Kueue's Workload says why."""
    queue = queue_name(spec, observed.labels)
    if not queue or spec.get("suspend") or draft.get("phase") in FINISHED:
        return  # not held by Kueue (suspended by its author is not waiting)
    state = queueing.queue_state(queue, backend.is_suspended(observed.child), observed.workload)
    if state is None:
        return
    before = draft.condition_reason(queueing.CONDITION)
    if draft.condition(queueing.CONDITION, state.status, state.reason, state.message) and before != state.reason:
        kind, reason = queueing.event_for(state)
        decision.events.append(Event(kind, reason, state.message))


def _preemption_cost(observed: Observed, draft: _Draft, decision: Decision) -> None:
    """Kueue's priority boost on the Workload from the unsaved work, or someone else's kept (said once)."""
    unsaved = draft.get("unsavedWork") if draft.get("phase") == "Running" else None
    workload = observed.workload
    planned = preemption_cost.plan(workload, (unsaved or {}).get("seconds"), observed.now,
                                   observed.settings.preemption_cost)
    if planned.foreign is not None:
        message = preemption_cost.foreign_message(planned.foreign)
        if draft.condition(preemption_cost.CONDITION, "False", "SetByOthers", message):
            decision.events.append(Event("Warning", "PriorityBoostKept", message))
        if draft.get("priorityBoost") is not None:
            draft.set("priorityBoost", None)
        return
    draft.condition(preemption_cost.CONDITION, "True", "FromUnsavedWork",
                    "kubetune keeps Kueue's priority boost on this job's Workload in proportion to its unsaved work")
    if planned.patch is not None:
        decision.actions.append(PatchWorkload(workload["metadata"]["name"],
                                              workload["metadata"].get("resourceVersion", ""), planned.patch))
    draft.set("priorityBoost", planned.boost)


def _credentials(observed: Observed, draft: _Draft, decision: Decision) -> None:
    """A Secret the trainer pods cannot use, as they report it: CredentialsReady=False and a Warning
    once; True again once the job runs (the operator never reads a Secret itself)."""
    problem = (credentials.REASON, observed.credentials_problem) if observed.credentials_problem else None
    _pods_waiting(credentials.CONDITION, problem, (credentials.REASON,),
                  "the trainer pods started with their Secrets", draft, decision)


def _claims(observed: Observed, draft: _Draft, decision: Decision) -> None:
    """A claim of spec.volumes the pods wait for, as the scheduler says: VolumesReady=False naming it
    and a Warning once; True again once the job runs (the operator never reads a claim itself)."""
    _pods_waiting(claims.CONDITION, observed.claim_problem, (claims.NOT_FOUND, claims.NOT_BOUND),
                  "the trainer pods started with their volumes", draft, decision)


def _pods_waiting(condition: str, problem: tuple[str, str] | None, reasons: tuple[str, ...], started: str,
                  draft: _Draft, decision: Decision) -> None:
    """CONDITION False with the (reason, message) the pods wait for, said once as a Warning; True once running."""
    if problem is not None:
        reason, message = problem
        if draft.condition(condition, "False", reason, message):
            decision.events.append(Event("Warning", reason, message))
    elif draft.condition_reason(condition) in reasons and draft.get("phase") == "Running":
        draft.condition(condition, "True", "InUse", started)


# ---- generation on the cluster (`kubetune generate --on-cluster`, generation_jobs.py) ----------------------

GENERATING, GENERATION_REFUSED = "Generating", "GenerationRefused"  # the events


def _generation_only(spec: dict, observed: Observed, draft: _Draft, decision: Decision) -> Decision:
    """A finished job: late events of its training change nothing, but its run is drawn from."""
    _generation(spec, observed, draft, decision)
    decision.status = draft.patch
    return decision


def _generation(spec: dict, observed: Observed, draft: _Draft, decision: Decision) -> None:
    """A request without a finished answer: refused (answered Failed, one Warning), or its Job created
    once (Generating, said when created), then the Job's state as its status.generations entry."""
    seen = observed.generation_request
    entries = list(draft.get(GENERATIONS_STATUS) or [])
    if seen is None or generation_jobs.answered(seen.annotation, entries):
        return
    try:
        job = _typed(spec, observed)
        request = generation_jobs.checked_request(seen.annotation, job)
    except ValidationError as err:
        refused = "invalid spec: " + "; ".join(describe_errors(err))
    except BadGenerationRequest as err:
        refused = str(err)
    else:
        refused = seen.refused  # the API server's answer to reading or creating the Job
    if refused is not None:
        entry = generation_jobs.refused_entry(seen.annotation, refused)
        if entry not in entries:
            decision.events.append(Event("Warning", GENERATION_REFUSED, entry["message"]))
    elif seen.job is None:
        rendered = generation_jobs.render_generation_job(job, observed.uid, observed.settings, request)
        decision.actions.append(CreateGenerationJob(rendered, request.id))
        decision.action_events.append(Event("Normal", GENERATING, generation_jobs.announcement(request, rendered)))
        entry = generation_jobs.generation_status(rendered)
    else:
        entry = generation_jobs.generation_status(seen.job)
    if entry not in entries:
        draft.set(GENERATIONS_STATUS, generation_jobs.merged_entries(entries, entry))
