"""Every transition of a TrainingJob, through the pure decide(spec, status, observed): no cluster, no fakes.

Each case gives what exists (status, ConfigMap, child, Workload, gauges, pods' report) and checks the
actions, the one status patch and the events. Level-triggered: deciding again from the state the
decision leads to changes nothing and says nothing twice.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json

import pytest

from kubetune_api.contract import final_report, read_final_report
from kubetune_api.spec import TrainingJob
from kubetune_operator import backend_check, claims, credentials, decision, volume_policy
from kubetune_operator.backends import BACKENDS
from kubetune_operator.decision import CreateChild, DeleteChild, Observed, PatchChildStatus, PatchWorkload, decide
from kubetune_operator.network_policy import NetworkPolicySettings
from kubetune_operator.preemption_cost import BoostSettings
from kubetune_operator.settings import Settings
from kubetune_operator.trainer_config import build_config_map, job_from_config_map

TRAINJOB, PYTORCHJOB = BACKENDS["trainjob"], BACKENDS["pytorchjob"]
TRAINJOB_SETTINGS = Settings(backend="trainjob", backends=("trainjob",))
NOW = "2026-11-27T12:00:00Z"


def cpu_spec(example_manifest, **changes) -> dict:
    spec = copy.deepcopy(example_manifest["spec"])
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["training"] = {**spec["training"], "mixedPrecision": "no"}
    spec.update(changes)
    return spec


def typed(spec: dict) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "sd15", "namespace": "team-a"}, "spec": spec})


def seen(settings: Settings = TRAINJOB_SETTINGS, **found) -> Observed:
    return Observed(name="sd15", namespace="team-a", uid="uid-1", generation=2, settings=settings, now=NOW, **found)


def child_of(spec: dict, backend=TRAINJOB, state: dict | None = None, suspend: bool | None = None) -> dict:
    child = backend.build(typed(spec), "uid-1", TRAINJOB_SETTINGS)
    child["metadata"]["uid"] = "child-uid"
    if suspend is not None:
        child["spec"].update(backend.suspend_patch(suspend)["spec"])
    child["status"] = state or {}
    return child


def started(spec: dict) -> dict:
    return build_config_map(typed(spec))["data"]


def kinds(actions) -> list[str]:
    return [type(action).__name__ for action in actions]


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def said(decided: decision.Decision) -> list[tuple[str, str]]:
    """(type, reason) of every event a decision says: after its actions, then after its status write."""
    return [(e.type, e.reason) for e in decided.action_events + decided.events]


def converged(spec: dict, status: dict, observed: Observed, decided: decision.Decision) -> decision.Decision:
    """Decide again from the status the first decision wrote: nothing new to write or say."""
    after = {key: value for key, value in {**status, **decided.status}.items() if value is not None}
    return decide(spec, after, observed)


# ---- a new job ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suspend,phase", [(False, "Pending"), (True, "Suspended")])
def test_a_new_job_gets_its_config_and_child_and_says_so_once(example_manifest, suspend, phase):
    spec = cpu_spec(example_manifest, suspend=suspend)
    decided = decide(spec, {}, seen())
    assert kinds(decided.actions) == ["CreateConfigMap", "CreateChild"]
    assert decided.actions[1].obj["kind"] == "TrainJob" and decided.actions[1].obj["spec"]["suspend"] is suspend
    assert (decided.status["phase"], decided.status["backend"], decided.status["observedGeneration"]) == \
        (phase, "trainjob", 2)
    assert condition(decided.status, "BackendReady")["reason"] == "ChildCreated"
    assert said(decided) == [("Normal", "Created")]
    assert decided.retry_after is None and decided.error is None


def test_a_network_policy_comes_before_the_child_when_the_chart_asks_for_one(example_manifest):
    policy = NetworkPolicySettings("kubetune-system", {"app": "kubetune"}, [], [])
    settings = dataclasses.replace(TRAINJOB_SETTINGS, network_policy=policy)
    assert kinds(decide(cpu_spec(example_manifest), {}, seen(settings)).actions) == \
        ["CreateConfigMap", "CreateNetworkPolicy", "CreateChild"]


def test_an_invalid_spec_is_an_error_and_nothing_is_created(example_manifest):
    decided = decide(cpu_spec(example_manifest, training={"maxSteps": -1}), {}, seen())
    assert decided.actions == [] and decided.error.startswith("invalid spec: ") and "maxSteps" in decided.error


@pytest.mark.parametrize("problem,change,reason,permanent", [
    (backend_check.Problem("TrainJobAPIMissing", "the TrainJob API is not installed"), {}, "TrainJobAPIMissing", False),
    (None, {"backend": "pytorchjob"}, "BackendNotEnabled", False),
    (None, {"scheduling": {"priorityClassName": "high"}}, "UnsupportedByBackend", True),
], ids=["prerequisite-missing", "backend-not-enabled", "field-unsupported"])
def test_a_backend_that_cannot_run_the_job_is_a_condition_one_warning_and_a_wait(example_manifest, problem, change,
                                                                                   reason, permanent):
    spec, observed = cpu_spec(example_manifest, **change), seen(backend_problem=problem)
    decided = decide(spec, {}, observed)
    assert decided.actions == []
    found = condition(decided.status, "BackendReady")
    assert (found["status"], found["reason"], decided.status["phase"]) == ("False", reason, "Pending")
    assert said(decided) == [("Warning", reason)]
    assert (decided.error is not None) is permanent and (decided.retry_after is None) is permanent
    again = converged(spec, {}, observed, decided)
    assert again.status == {} and said(again) == [], "the same gap again: no second event"


def test_an_image_off_the_list_is_refused_until_the_spec_names_an_allowed_one(example_manifest):
    settings = dataclasses.replace(TRAINJOB_SETTINGS, allowed_image_prefixes=("ghcr.io/team",))
    spec = cpu_spec(example_manifest, image="docker.io/x/y:1")
    decided = decide(spec, {}, seen(settings))
    assert decided.actions == [] and decided.error.startswith("spec.image: 'docker.io/x/y:1'")
    assert condition(decided.status, "ImageAllowed")["reason"] == "ImageNotAllowed"
    assert said(decided) == [("Warning", "ImageNotAllowed")]
    assert said(converged(spec, {}, seen(settings), decided)) == []
    allowed = decide(cpu_spec(example_manifest, image="ghcr.io/team/trainer:2"), decided.status, seen(settings))
    assert kinds(allowed.actions) == ["CreateConfigMap", "CreateChild"]
    assert condition(allowed.status, "ImageAllowed")["status"] == "True"


# ---- the child's state ----------------------------------------------------------------------------------

RUNNING = {"jobsStatus": [{"name": "node", "active": 1}]}
COMPLETE = {"conditions": [{"type": "Complete", "status": "True", "reason": "AllJobsCompleted",
                            "lastTransitionTime": "2026-11-27T12:30:00Z"}]}


def test_a_child_that_runs_makes_the_job_running_once(example_manifest):
    spec = cpu_spec(example_manifest)
    observed = seen(config_map=started(spec), child=child_of(spec, state=RUNNING))
    status = {"phase": "Pending", "backend": "trainjob"}
    decided = decide(spec, status, observed)
    assert decided.actions == [] and decided.status["phase"] == "Running" and decided.status["startTime"] == NOW
    assert said(decided) == [("Normal", "Running")]
    again = converged(spec, status, observed, decided)
    assert again.status == {} and said(again) == []


def test_a_finished_child_writes_the_final_step_and_the_report_once(example_manifest):
    spec = cpu_spec(example_manifest)
    stale = {"step": 26, "totalSteps": 60, "percent": 43.3, "loss": 0.2, "etaSeconds": 12.5}
    status = {"phase": "Running", "backend": "trainjob", "progress": stale, "outputUri": "s3://b/runs/v0"}
    observed = seen(config_map=started(spec), child=child_of(spec, state=COMPLETE))
    decided = decide(spec, status, observed)
    assert decided.status["phase"] == "Succeeded" and decided.status["completionTime"] == "2026-11-27T12:30:00Z"
    assert decided.status["progress"] == {"step": 60, "totalSteps": 60, "percent": 100.0, "loss": 0.2,
                                          "etaSeconds": None}
    assert decided.status["reportUri"] == "s3://b/runs/v0/report.html"
    assert decided.status["latestCheckpoint"].startswith("s3://b/runs/v0/")
    (report,) = decided.actions
    assert isinstance(report, PatchChildStatus) and report.body["status"]["trainerStatus"]["progressPercentage"] == 100
    assert said(decided) == [("Normal", "Succeeded")]
    finished = {**status, **decided.status}
    assert decide(spec, finished, observed) == decision.Decision(TRAINJOB), "finished is final"


def test_the_last_reading_of_a_short_run_counts_before_it_is_marked_finished(example_manifest):
    spec = cpu_spec(example_manifest, validation={"everySteps": 5, "prompts": ["a corgi"], "earlyStoppingPatience": 2})
    gauges = {"step": 40, "planned_steps": 60, "loss": 0.1, "last_checkpoint_step": 40, "run_version": 0}
    observed = seen(config_map=started(spec), child=child_of(spec, state=COMPLETE), gauges=gauges)
    decided = decide(spec, {"phase": "Running", "backend": "trainjob"}, observed)
    assert decided.status["phase"] == "Succeeded" and decided.status["progress"]["step"] == 40, \
        "an early-stopped run ends where its last reading says, read in the same pass"


def test_a_run_that_ended_before_any_look_saw_it_running_keeps_its_final_report(example_manifest):
    """A sweep trial shorter than a poll: no reading while it ran, only what rank 0 left in its
    termination message. Its validation is the trial's objective, so it must reach the status."""
    spec = cpu_spec(example_manifest, validation={"everySteps": 5, "prompts": ["a corgi"]})
    report = read_final_report(final_report({"step": 60, "planned_steps": 60, "loss": 0.05, "run_version": 2,
                                             "last_checkpoint_step": 60, "validation_step": 60,
                                             "validation_loss": 0.25}))
    status = {"phase": "Pending", "backend": "trainjob"}
    never_seen = decide(spec, status, seen(config_map=started(spec), child=child_of(spec, state=COMPLETE)))
    assert "validation" not in never_seen.status, "without the report there is nothing to rank the trial by"
    decided = decide(spec, status, seen(config_map=started(spec), child=child_of(spec, state=COMPLETE),
                                        final_report=report))
    assert decided.status["phase"] == "Succeeded"
    assert decided.status["validation"] == {"step": 60, "metrics": {"loss": 0.25}}
    assert decided.status["progress"] == {"step": 60, "totalSteps": 60, "percent": 100.0, "loss": 0.05,
                                          "etaSeconds": None}
    assert decided.status["outputUri"].endswith("/v2") and decided.status["latestCheckpoint"].startswith(
        decided.status["outputUri"])


def test_the_final_report_outranks_the_last_poll(example_manifest):
    spec = cpu_spec(example_manifest, validation={"everySteps": 5, "prompts": ["a corgi"]})
    polled = {"step": 55, "planned_steps": 60, "loss": 0.2, "validation_step": 50, "validation_loss": 0.4}
    ended = {**polled, "step": 60, "loss": 0.1, "validation_step": 60, "validation_loss": 0.3}
    decided = decide(spec, {"phase": "Running", "backend": "trainjob"},
                     seen(config_map=started(spec), child=child_of(spec, state=COMPLETE), gauges=polled,
                          final_report=ended))
    assert decided.status["validation"] == {"step": 60, "metrics": {"loss": 0.3}}
    assert decided.status["progress"]["loss"] == 0.1


@pytest.mark.parametrize("message", [None, "", "Error: out of memory", "[1, 2]", '{"kubetuneFinalGauges": "x"}',
                                     '{"other": {"step": 3}}'])
def test_a_termination_message_that_is_not_a_final_report_is_none(message):
    assert read_final_report(message) is None


def test_a_final_report_drops_what_json_cannot_carry_and_fits_kubernetes_limit():
    gauges = {"step": 7, "loss": float("nan"), "eta_seconds": float("inf"),
              **{f"validation_metric_{i}": 0.123456789 for i in range(40)}}
    text = final_report(gauges)
    assert len(text.encode()) <= 4096
    back = read_final_report(text)
    assert back["step"] == 7.0 and "loss" not in back and "eta_seconds" not in back and len(back) == 41


def test_progress_is_read_while_running_and_copied_to_the_trainjob(example_manifest):
    spec = cpu_spec(example_manifest)
    observed = seen(config_map=started(spec), child=child_of(spec, state=RUNNING),
                    gauges={"step": 30, "planned_steps": 60})
    status = {"phase": "Running", "backend": "trainjob", "startTime": NOW}
    status = {**status, **decide(spec, status, seen(config_map=started(spec), child=child_of(spec, state=RUNNING))).status}
    decided = decide(spec, status, observed)
    assert decided.status == {"progress": {"step": 30, "totalSteps": 60, "percent": 50.0}}
    assert kinds(decided.actions) == ["PatchChildStatus"]
    assert converged(spec, status, observed, decided).actions == [], "the same reading: nothing to copy again"


# ---- spec changes of a started job ------------------------------------------------------------------

def test_suspend_and_resume_patch_the_child_and_record_it_in_the_config(example_manifest):
    spec = cpu_spec(example_manifest)
    running = child_of(spec, state=RUNNING)
    decided = decide(cpu_spec(example_manifest, suspend=True), {"phase": "Running", "backend": "trainjob"},
                     seen(config_map=started(spec), child=running))
    assert kinds(decided.actions) == ["PatchChild", "PatchConfigMap"]
    assert decided.actions[0].body == {"spec": {"suspend": True}}
    assert job_from_config_map(decided.actions[1].data).spec.suspend is True
    assert said(decided) == [("Normal", "Suspended")]
    # Applied: the config says suspended, so the same spec again does nothing.
    again = decide(cpu_spec(example_manifest, suspend=True), {"phase": "Suspended", "backend": "trainjob"},
                   seen(config_map=decided.actions[1].data, child=child_of(spec, suspend=True)))
    assert again.actions == [] and said(again) == []
    resumed = decide(spec, {"phase": "Suspended", "backend": "trainjob"},
                     seen(config_map=decided.actions[1].data, child=child_of(spec, suspend=True)))
    assert kinds(resumed.actions) == ["PatchConfigMap", "PatchChild"] and said(resumed) == [("Normal", "Resumed")]


def test_a_frozen_field_changed_is_refused_once_and_the_refusal_ends_when_put_back(example_manifest):
    spec = cpu_spec(example_manifest)
    observed = seen(config_map=started(spec), child=child_of(spec, state=RUNNING))
    changed = cpu_spec(example_manifest, adapter={**spec["adapter"], "rank": 32})
    decided = decide(changed, {"phase": "Running", "backend": "trainjob"}, observed)
    found = condition(decided.status, "SpecChangeRefused")
    assert (found["status"], found["reason"]) == ("True", "ImmutableSpec") and "spec.adapter.rank" in found["message"]
    assert decided.actions == [] and said(decided) == [("Warning", "SpecChangeRefused")]
    assert "observedGeneration" not in decided.status
    assert said(converged(changed, {"phase": "Running", "backend": "trainjob"}, observed, decided)) == []
    # A size change while it runs is refused too; both are said, and suspend still works meanwhile.
    bigger = cpu_spec(example_manifest, adapter={**spec["adapter"], "rank": 32},
                      resources={"nodes": 2, "gpusPerNode": 0})
    both = condition(decide(bigger, {"phase": "Running", "backend": "trainjob"}, observed).status, "SpecChangeRefused")["message"]
    assert "spec.adapter.rank" in both and "suspend first" in both and "from 1x1 process to 2x1 processes" in both
    suspending = decide(cpu_spec(example_manifest, adapter={**spec["adapter"], "rank": 32}, suspend=True),
                        {"phase": "Running", "backend": "trainjob"}, observed)
    assert kinds(suspending.actions) == ["PatchChild", "PatchConfigMap"]
    back = decide(spec, {"phase": "Running", "backend": "trainjob", **decided.status}, observed)
    assert condition(back.status, "SpecChangeRefused")["status"] == "False"


def test_a_suspended_trainjob_is_replaced_at_its_new_size(example_manifest):
    old = cpu_spec(example_manifest, suspend=True, resources={"nodes": 2, "gpusPerNode": 0})
    new = cpu_spec(example_manifest, suspend=True, resources={"nodes": 1, "gpusPerNode": 0})
    config, child = started(old), child_of(old, suspend=True)
    # First: the old TrainJob goes (foreground: with its JobSet and pods); looked at again shortly.
    first = decide(new, {"phase": "Suspended", "backend": "trainjob"}, seen(config_map=config, child=child))
    assert first.actions == [DeleteChild("sd15", "child-uid")] and first.retry_after == 2.0
    # While it is being deleted: wait, delete nothing twice.
    deleting = copy.deepcopy(child)
    deleting["metadata"]["deletionTimestamp"] = NOW
    assert decide(new, {"phase": "Suspended", "backend": "trainjob"}, seen(config_map=config, child=deleting)).actions == []
    # Gone: created at the new size, then the config says so.
    gone = decide(new, {"phase": "Suspended", "backend": "trainjob"}, seen(config_map=config))
    assert kinds(gone.actions) == ["CreateChild", "PatchConfigMap"]
    assert gone.actions[0].obj["spec"]["trainer"]["numNodes"] == 1 and gone.actions[0].obj["spec"]["suspend"] is True
    assert job_from_config_map(gone.actions[1].data).spec.resources.nodes == 1
    assert ("Normal", "Resized") in said(gone)


def test_a_suspended_pytorchjob_is_resized_in_place(example_manifest):
    settings = Settings()
    old = cpu_spec(example_manifest, suspend=True, resources={"nodes": 2, "gpusPerNode": 0})
    new = cpu_spec(example_manifest, suspend=True, resources={"nodes": 1, "gpusPerNode": 0})
    decided = decide(new, {"phase": "Suspended", "backend": "pytorchjob"},
                     seen(settings, config_map=started(old), child=child_of(old, PYTORCHJOB, suspend=True)))
    assert kinds(decided.actions) == ["PatchChild", "PatchConfigMap"] and isinstance(decided.actions[0].body, list)


# ---- bad input: a child deleted by hand, a backend whose CRDs went away -----------------------------------

def test_a_child_deleted_by_hand_is_created_again_from_what_the_trainer_runs(example_manifest):
    spec = cpu_spec(example_manifest)
    decided = decide(spec, {"phase": "Running", "backend": "trainjob"}, seen(config_map=started(spec)))
    assert kinds(decided.actions) == ["CreateChild"] and decided.error is None


def test_a_backend_whose_crds_disappear_mid_run_is_a_condition_naming_them_not_a_crash(example_manifest):
    spec = cpu_spec(example_manifest)
    missing = backend_check.missing(TRAINJOB.prerequisites(TRAINJOB_SETTINGS)[0])
    status = {"phase": "Running", "backend": "trainjob"}
    decided = decide(spec, status, seen(config_map=started(spec), backend_problem=missing))
    found = condition(decided.status, "BackendReady")
    assert (found["status"], found["reason"]) == ("False", "TrainJobAPIMissing")
    assert "trainjobs.trainer.kubeflow.org" in found["message"]
    assert decided.actions == [] and decided.retry_after == 30.0 and decided.error is None
    assert decided.status.get("phase") is None, "the run is not lost: it resumes once the API is back"
    back = decide(spec, {**status, **decided.status}, seen(config_map=started(spec)))
    assert kinds(back.actions) == ["CreateChild"]


# ---- Kueue ----------------------------------------------------------------------------------------------

PENDING_WORKLOAD = {"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                               "message": "couldn't assign flavors: insufficient quota"}]}}


@pytest.mark.parametrize("labels,scheduling", [
    ({}, {"queueName": "jobs"}),
    ({"kueue.x-k8s.io/queue-name": "jobs"}, {}),
], ids=["spec.scheduling.queueName", "kueue-label"])
def test_a_job_waiting_in_a_queue_says_why_however_it_was_queued(example_manifest, labels, scheduling):
    spec = cpu_spec(example_manifest, scheduling=scheduling)
    as_applied = decision.with_label_queue(spec, labels)
    observed = seen(labels=labels, config_map=started(as_applied), child=child_of(as_applied, suspend=True),
                    workload=PENDING_WORKLOAD)
    decided = decide(spec, {"phase": "Suspended", "backend": "trainjob"}, observed)
    found = condition(decided.status, "Queued")
    assert (found["status"], found["reason"]) == ("True", "Waiting")
    assert found["message"] == "waiting in queue 'jobs': couldn't assign flavors: insufficient quota"
    assert said(decided) == [("Normal", "Queued")]
    assert "SpecChangeRefused" not in str(decided.status), "the label is the field: no change to refuse"


def test_the_kueue_label_reaches_the_child_as_its_queue(example_manifest):
    labels = {"kueue.x-k8s.io/queue-name": "jobs"}
    decided = decide(cpu_spec(example_manifest), {}, seen(labels=labels))
    child = next(a.obj for a in decided.actions if isinstance(a, CreateChild))
    assert child["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "jobs"


@pytest.mark.parametrize("spec_queue,label,refused", [
    ("jobs", "jobs", False), ("jobs", None, False), (None, "jobs", False), ("jobs", "other", True)])
def test_a_queue_named_two_ways_must_agree(example_manifest, spec_queue, label, refused):
    spec = cpu_spec(example_manifest, scheduling={"queueName": spec_queue} if spec_queue else {})
    message = decision.queue_disagreement(spec, {"kueue.x-k8s.io/queue-name": label} if label else {})
    assert (message is not None) is refused
    if refused:
        assert "metadata.labels[kueue.x-k8s.io/queue-name] is 'other'" in message
        assert "spec.scheduling.queueName is 'jobs'" in message


# ---- saved and unsaved work; Kueue's priority boost from it --------------------------------------------------

def unix(timestamp: str) -> float:
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def running_with(example_manifest, gauges: dict, settings: Settings = TRAINJOB_SETTINGS, workload: dict | None = None,
                 state: dict = RUNNING):
    spec = cpu_spec(example_manifest, scheduling={"queueName": "jobs"})
    return spec, seen(settings, config_map=started(spec), child=child_of(spec, state=state), gauges=gauges,
                      workload=workload)


def test_the_last_checkpoint_and_the_unsaved_work_come_from_the_trainers_gauges(example_manifest):
    gauges = {"step": 30, "planned_steps": 60, "last_checkpoint_step": 20,
              "last_checkpoint_time_seconds": unix(NOW) - 300, "unsaved_since_seconds": unix(NOW) - 240.5}
    spec, observed = running_with(example_manifest, gauges)
    status = {"phase": "Running", "backend": "trainjob", "startTime": NOW}
    decided = decide(spec, status, observed)
    assert decided.status["lastCheckpoint"] == {"step": 20, "time": "2026-11-27T11:55:00Z"}
    assert decided.status["unsavedWork"] == {"steps": 10, "seconds": 240}, "since the checkpoint's state was taken"


def test_a_resumed_run_keeps_the_time_of_the_checkpoint_it_started_from(example_manifest):
    gauges = {"step": 22, "planned_steps": 60, "last_checkpoint_step": 20, "last_checkpoint_time_seconds": 0,
              "unsaved_since_seconds": unix(NOW) - 10}
    spec, observed = running_with(example_manifest, gauges)
    shown = {"phase": "Running", "backend": "trainjob", "startTime": NOW,
             "lastCheckpoint": {"step": 20, "time": "2026-11-27T10:00:00Z"}}
    decided = decide(spec, shown, observed)
    assert "lastCheckpoint" not in decided.status, "the same checkpoint, written before this attempt"
    assert decided.status["unsavedWork"] == {"steps": 2, "seconds": 10}, "only this attempt's work is unsaved"
    other = decide(spec, {**shown, "lastCheckpoint": {"step": 10, "time": "2026-11-27T09:00:00Z"}}, observed)
    assert other.status["lastCheckpoint"] == {"step": 20, "time": None}, "a time of another step is not this one's"


def test_unsaved_work_is_removed_once_the_job_stops_running(example_manifest):
    spec, observed = running_with(example_manifest, None, state={})
    observed = dataclasses.replace(observed, child=child_of(spec, suspend=True))
    decided = decide(spec, {"phase": "Running", "backend": "trainjob", "startTime": NOW,
                            "unsavedWork": {"steps": 5, "seconds": 50}}, observed)
    assert decided.status["phase"] == "Suspended" and decided.status["unsavedWork"] is None


BOOSTING = dataclasses.replace(TRAINJOB_SETTINGS, kueue_workloads=True, preemption_cost=BoostSettings(
    enabled=True, max_boost=99, seconds_per_point=60, interval_seconds=60))
ADMITTED = [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}]
EVICTED = [{"type": "Evicted", "status": "True", "reason": "Preempted"},
           {"type": "QuotaReserved", "status": "False", "reason": "Pending"}]


def workload(annotations: dict | None = None, conditions: list = ADMITTED) -> dict:
    return {"metadata": {"name": "trainjob-sd15-1a2b3", "resourceVersion": "41", "annotations": annotations or {}},
            "status": {"conditions": conditions}}


def ours(boost: int, at: str) -> dict:
    return {**({"kueue.x-k8s.io/priority-boost": str(boost)} if boost else {}),
            "kubetune.dev/priority-boost": json.dumps({"boost": boost, "at": at})}


def unsaved_for(seconds: float) -> dict:
    return {"step": 30, "planned_steps": 60, "last_checkpoint_step": 20, "unsaved_since_seconds": unix(NOW) - seconds}


def boost_written(decided: decision.Decision) -> str | None | bool:
    """The boost a decision writes on the Workload ("" for none left), or False: no write."""
    patches = [a for a in decided.actions if isinstance(a, PatchWorkload)]
    if not patches:
        return False
    (patch,) = patches
    assert patch.name == "trainjob-sd15-1a2b3" and patch.resource_version == "41", "guarded by what was read"
    annotations = patch.body["metadata"]["annotations"]
    assert json.loads(annotations["kubetune.dev/priority-boost"])["at"] == NOW, "and records when, for the interval"
    return annotations["kueue.x-k8s.io/priority-boost"] or ""


@pytest.mark.parametrize("unsaved_seconds,annotations,conditions,written,shown", [
    (600, {}, ADMITTED, "10", 10),  # one point per minute of unsaved work
    (10**6, {}, ADMITTED, "99", 99),  # bounded: never up to the next priority class
    (20, {}, ADMITTED, False, 0),  # under a point: nothing to write
    (720, ours(10, "2026-11-27T11:59:30Z"), ADMITTED, False, 10),  # written 30 s ago: waits for the interval
    (720, ours(10, "2026-11-27T11:58:00Z"), ADMITTED, "12", 12),  # the interval has passed
    (720, ours(12, "2026-11-27T11:59:59Z"), ADMITTED, False, 12),  # as it should be: no write
    (None, ours(10, "2026-11-27T11:59:50Z"), EVICTED, "", 0),  # preempted: no boost in the queue, at once
    (None, ours(10, "2026-11-27T11:00:00Z"), [*ADMITTED, {"type": "Finished", "status": "True"}], False, 10),
], ids=["proportional", "bounded", "below-one-point", "too-soon", "after-interval", "unchanged", "evicted",
        "finished-no-write"])
def test_the_priority_boost_follows_the_unsaved_work_bounded_and_seldom(example_manifest, unsaved_seconds, annotations,
                                                                        conditions, written, shown):
    gauges = unsaved_for(unsaved_seconds) if unsaved_seconds is not None else None
    spec, observed = running_with(example_manifest, gauges, BOOSTING, workload(annotations, conditions))
    decided = decide(spec, {"phase": "Running", "backend": "trainjob", "startTime": NOW}, observed)
    assert boost_written(decided) == written
    assert decided.status.get("priorityBoost", 0) == shown
    assert condition(decided.status, "PriorityBoost")["reason"] == "FromUnsavedWork"


def test_a_priority_boost_set_by_someone_else_is_kept_and_said_once(example_manifest):
    spec, observed = running_with(example_manifest, unsaved_for(3600), BOOSTING,
                                  workload({"kueue.x-k8s.io/priority-boost": "500"}))
    status = {"phase": "Running", "backend": "trainjob", "startTime": NOW}
    decided = decide(spec, status, observed)
    assert boost_written(decided) is False, "theirs is not overwritten"
    found = condition(decided.status, "PriorityBoost")
    assert (found["status"], found["reason"]) == ("False", "SetByOthers") and "'500'" in found["message"]
    assert ("Warning", "PriorityBoostKept") in said(decided)
    again = converged(spec, status, observed, decided)
    assert boost_written(again) is False and ("Warning", "PriorityBoostKept") not in said(again), "said once"
    changed = workload({"kueue.x-k8s.io/priority-boost": "7", **{k: v for k, v in ours(5, NOW).items()
                                                                 if k.startswith("kubetune")}})
    assert boost_written(decide(spec, status, dataclasses.replace(observed, workload=changed))) is False, \
        "our record says 5: a 7 there is someone else's"


@pytest.mark.parametrize("env,named", [
    ({"KUBETUNE_KUEUE_MAX_PRIORITY_BOOST": "0"}, "kueue.maxPriorityBoost"),
    ({"KUBETUNE_KUEUE_SECONDS_PER_BOOST_POINT": "soon"}, "kueue.secondsPerBoostPoint"),
    ({"KUBETUNE_KUEUE_BOOST_INTERVAL_SECONDS": "-1"}, "kueue.boostIntervalSeconds"),
])
def test_a_bad_preemption_cost_setting_stops_the_operator_naming_its_helm_value(env, named):
    with pytest.raises(ValueError, match=f"Helm value {named}"):
        BoostSettings.from_env(env)


def test_without_preemption_cost_the_workload_is_never_written(example_manifest):
    off = dataclasses.replace(BOOSTING, preemption_cost=BoostSettings())
    spec, observed = running_with(example_manifest, unsaved_for(3600), off, workload())
    decided = decide(spec, {"phase": "Running", "backend": "trainjob", "startTime": NOW}, observed)
    assert boost_written(decided) is False and "priorityBoost" not in decided.status
    assert condition(decided.status, "PriorityBoost") is None


# ---- credentials: from what the pods report, never from a Secret ------------------------------------------

def waiting_pod(message: str, reason: str = "CreateContainerConfigError") -> dict:
    return {"status": {"containerStatuses": [{"name": "trainer", "state": {"waiting": {"reason": reason,
                                                                                       "message": message}}}]}}


@pytest.mark.parametrize("message", ['secret "not-there" not found', "secret team-a/not-there not found"],
                         ids=["kubelet", "local-kubelet"])
def test_a_missing_credentials_secret_is_learned_from_the_pod_and_names_the_field(example_manifest, message):
    spec = cpu_spec(example_manifest, s3={"credentialsSecret": "not-there"})
    problem = credentials.missing_secret_message([waiting_pod(message)], spec, "team-a")
    assert problem.startswith("spec.s3.credentialsSecret: Secret 'not-there' does not exist in namespace 'team-a'; "
                              "create it with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    observed = seen(config_map=started(spec), child=child_of(spec), credentials_problem=problem)
    status = {"phase": "Pending", "backend": "trainjob"}
    decided = decide(spec, status, observed)
    found = condition(decided.status, "CredentialsReady")
    assert (found["status"], found["reason"], found["message"]) == ("False", "SecretNotFound", problem)
    assert said(decided) == [("Warning", "SecretNotFound")]
    assert said(converged(spec, status, observed, decided)) == []


def test_other_waiting_reasons_are_not_a_credentials_problem(example_manifest):
    spec = cpu_spec(example_manifest, s3={"credentialsSecret": "creds"})
    assert credentials.missing_secret_message([waiting_pod("pulling", "ContainerCreating")], spec, "team-a") is None
    assert credentials.missing_secret_message([], spec, "team-a") is None


# ---- claims of spec.volumes: from what the scheduler says, never from a claim -------------------------------

def unscheduled_pod(message: str) -> dict:
    return {"status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                           "reason": "Unschedulable", "message": message}]}}


def test_a_missing_or_unbound_claim_is_learned_from_the_scheduler_and_names_the_volume(example_manifest):
    spec = cpu_spec(example_manifest)  # volumes data (claim datasets) and checkpoints (claim checkpoints)
    problem = claims.claim_problem([unscheduled_pod('0/3 nodes are available: persistentvolumeclaim "datasets" '
                                                    'not found. preemption: 0/3 nodes are available')], spec, "team-a")
    assert problem == ("ClaimNotFound", "spec.volumes[data].persistentVolumeClaim.claimName: PersistentVolumeClaim "
                       "'datasets' does not exist in namespace 'team-a'; create it (the trainer pods wait for it and "
                       "start once it exists and is bound)")
    observed = seen(config_map=started(spec), child=child_of(spec), claim_problem=problem)
    status = {"phase": "Pending", "backend": "trainjob"}
    decided = decide(spec, status, observed)
    found = condition(decided.status, "VolumesReady")
    assert (found["status"], found["reason"], found["message"]) == ("False", "ClaimNotFound", problem[1])
    assert said(decided) == [("Warning", "ClaimNotFound")]
    assert said(converged(spec, status, observed, decided)) == []

    unbound = claims.claim_problem([unscheduled_pod("0/1 nodes are available: pod has unbound immediate "
                                                    "PersistentVolumeClaims.")], spec, "team-a")
    assert unbound[0] == "ClaimNotBound" and "(claims: checkpoints, datasets)" in unbound[1]
    assert claims.claim_problem([waiting_pod("pulling", "ContainerCreating")], spec, "team-a") is None


@pytest.mark.parametrize("source,level,refused", [
    ({"hostPath": {"path": "/mnt/datasets"}}, "baseline", True),
    ({"hostPath": {"path": "/mnt/datasets"}}, "restricted", True),
    ({"nfs": {"server": "nfs.lab", "path": "/datasets"}}, "restricted", True),
    ({"nfs": {"server": "nfs.lab", "path": "/datasets"}}, "baseline", False),
    ({"hostPath": {"path": "/mnt/datasets"}}, "privileged", False),
    ({"hostPath": {"path": "/mnt/datasets"}}, None, False),
])
def test_a_volume_the_namespaces_pod_security_level_refuses_waits_named_and_starts_once_allowed(
        example_manifest, source, level, refused):
    """PodSecurity admission would refuse the pods, which the Job controller only records as events: the job
    waits without a child, naming the volume, until the spec or the namespace's level allows it."""
    spec = cpu_spec(example_manifest)
    spec["volumes"] = [{"name": "data", "mountPath": "/data", "readOnly": True, **source}, spec["volumes"][1]]
    assert volume_policy.names_checked_source(spec)
    decided = decide(spec, {}, seen(pod_security_level=level))
    if not refused:
        assert kinds(decided.actions) == ["CreateConfigMap", "CreateChild"]
        return
    wire = next(iter(source))
    assert decided.actions == [] and decided.error is None and decided.retry_after == decision.VOLUME_POLICY_RETRY_SECONDS
    found = condition(decided.status, volume_policy.CONDITION)
    assert (found["status"], found["reason"]) == ("False", "VolumeRefusedByPodSecurity")
    assert found["message"].startswith(f"spec.volumes[data].{wire}: namespace 'team-a' enforces the {level!r} "
                                       "Pod Security Standard") and "PersistentVolumeClaim" in found["message"]
    assert decided.status["phase"] == "Pending" and said(decided) == [("Warning", "VolumeRefusedByPodSecurity")]
    assert said(converged(spec, {}, seen(pod_security_level=level), decided)) == []
    allowed = decide(spec, decided.status, seen(pod_security_level="privileged"))  # the admin relabelled it
    assert kinds(allowed.actions) == ["CreateConfigMap", "CreateChild"]
    assert condition(allowed.status, volume_policy.CONDITION)["status"] == "True"


def test_only_a_spec_with_a_volume_some_level_refuses_makes_the_operator_read_its_namespace(example_manifest):
    assert not volume_policy.names_checked_source(cpu_spec(example_manifest))  # claims pass every level
    assert not volume_policy.names_checked_source({})


@pytest.mark.parametrize("backend,settings,edit,field", [
    (TRAINJOB, TRAINJOB_SETTINGS, lambda c: c["spec"]["trainer"].update(image="evil:1"), "spec.trainer.image"),
    (PYTORCHJOB, Settings(), lambda c: c["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=3),
     "spec.pytorchReplicaSpecs.Master.replicas"),
], ids=["trainjob-image", "pytorchjob-replicas"])
def test_a_child_edited_by_hand_is_reported_once_not_reverted(example_manifest, backend, settings, edit, field):
    spec = cpu_spec(example_manifest)
    child = child_of(spec, backend, state=RUNNING if backend is TRAINJOB else {
        "conditions": [{"type": "Running", "status": "True", "reason": "Running"}]})
    edit(child)
    status = {"phase": "Running", "backend": backend.name}
    observed = seen(settings, config_map=started(spec), child=child)
    decided = decide(spec, status, observed)
    found = condition(decided.status, "ChildMatchesSpec")
    assert (found["status"], found["reason"]) == ("False", "EditedOutsideKubetune") and field in found["message"]
    assert decided.actions == [], "reported, not reverted: a running child's pods are not restarted behind the user"
    assert said(decided) == [("Warning", "EditedOutsideKubetune")]
    assert said(converged(spec, status, observed, decided)) == []
    put_back = decide(spec, {**status, **decided.status}, seen(settings, config_map=started(spec),
                                                               child=child_of(spec, backend, state=child["status"])))
    assert condition(put_back.status, "ChildMatchesSpec")["status"] == "True"


def test_a_child_as_built_raises_no_drift(example_manifest):
    spec = cpu_spec(example_manifest)
    decided = decide(spec, {"phase": "Running", "backend": "trainjob"},
                     seen(config_map=started(spec), child=child_of(spec, state=RUNNING)))
    assert condition(decided.status, "ChildMatchesSpec") is None


# ---- generation on the cluster (`kubetune generate --on-cluster`) ----------------------------------------

RUN_URI = "s3://bucket/runs/team-a/sd15/v0"
SUCCEEDED = {"phase": "Succeeded", "backend": "trainjob", "outputUri": RUN_URI}


def drawing_spec(example_manifest) -> dict:
    spec = cpu_spec(example_manifest)
    spec["checkpoints"] = {**spec["checkpoints"], "uri": "s3://bucket/runs"}
    return spec


def generation_request(**changes) -> str:
    from kubetune_api.generation_request import GenerationRequest

    return GenerationRequest(**{"id": "abc123", "run": RUN_URI, "step": "final", "prompts": ("a red circle",),
                                **changes}).to_annotation()


def asked(annotation: str, job: dict | None = None, refused: str | None = None, **found) -> Observed:
    from kubetune_operator.generation_jobs import SeenGeneration

    return seen(generation_request=SeenGeneration(annotation, job=job, refused=refused), **found)


def generation_job(rendered: dict, *conditions: dict, **state) -> dict:
    """The rendered Job as the API server returns it later, with its status."""
    return {**copy.deepcopy(rendered), "status": {"conditions": list(conditions), **state}}


def first_draw(example_manifest) -> tuple[dict, decision.Decision]:
    spec = drawing_spec(example_manifest)
    return spec, decide(spec, SUCCEEDED, asked(generation_request()))


def test_a_request_on_a_finished_job_creates_its_generation_job_once_and_says_so(example_manifest):
    spec, decided = first_draw(example_manifest)
    (create,) = decided.actions
    assert isinstance(create, decision.CreateGenerationJob) and create.request_id == "abc123"
    assert (create.obj["kind"], create.obj["metadata"]["name"]) == ("Job", "sd15-generate-abc123")
    assert create.obj["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["--run", RUN_URI]
    assert decided.status == {"generations": [{"id": "abc123", "phase": "Running", "job": "sd15-generate-abc123",
                                               "uri": f"{RUN_URI}/generated/final-abc123"}]}
    assert said(decided) == [("Normal", "Generating")] and decided.events == [], "said once the Job is created"
    assert "phase" not in decided.status, "finished is final for the training"
    # Created: the Job as observed next, still drawing: the same entry, nothing created again or said.
    made = generation_job(create.obj)
    again = decide(spec, {**SUCCEEDED, **decided.status}, asked(generation_request(), job=made))
    assert again.actions == [] and again.status == {} and said(again) == []


@pytest.mark.parametrize("conditions,state,expected", [
    ((), {"startTime": "2026-11-27T12:01:00Z"}, {"phase": "Running", "startTime": "2026-11-27T12:01:00Z"}),
    (({"type": "Complete", "status": "True"},), {"startTime": "2026-11-27T12:01:00Z",
                                                  "completionTime": "2026-11-27T12:03:00Z"},
     {"phase": "Succeeded", "startTime": "2026-11-27T12:01:00Z", "completionTime": "2026-11-27T12:03:00Z"}),
    (({"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too long"},), {},
     {"phase": "Failed", "message": "DeadlineExceeded: too long (kubectl logs -n team-a job/sd15-generate-abc123)"}),
], ids=["running", "succeeded", "failed"])
def test_the_generation_jobs_state_is_its_status_entry_until_answered(example_manifest, conditions, state, expected):
    spec, first = first_draw(example_manifest)
    status = {**SUCCEEDED, **first.status}
    observed = asked(generation_request(), job=generation_job(first.actions[0].obj, *conditions, **state))
    decided = decide(spec, status, observed)
    assert decided.actions == [] and said(decided) == []
    assert decided.status == {"generations": [{"id": "abc123", "job": "sd15-generate-abc123",
                                               "uri": f"{RUN_URI}/generated/final-abc123", **expected}]}
    assert converged(spec, status, observed, decided).status == {}
    if expected["phase"] != "Running":  # answered: its Job gone after its TTL is not drawn again
        answered = {**status, **decided.status}
        assert decide(spec, answered, asked(generation_request())) == decision.Decision(TRAINJOB)


@pytest.mark.parametrize("annotation,refused,spec_change,message", [
    ("{not json", None, {}, "annotation kubetune.dev/generate: not a generation request"),
    (generation_request(run="s3://bucket/runs/team-b/other/v0"), None, {},
     "annotation kubetune.dev/generate: run s3://bucket/runs/team-b/other/v0 is not a run of this job"),
    (generation_request(), "403 Forbidden", {}, "annotation kubetune.dev/generate: 403 Forbidden"),
    (generation_request(), None, {"training": {"maxSteps": -1}}, "annotation kubetune.dev/generate: invalid spec: "),
], ids=["unreadable", "another-jobs-run", "job-refused-by-the-api-server", "invalid-spec"])
def test_a_refused_request_is_answered_failed_with_one_warning_and_no_job(example_manifest, annotation, refused,
                                                                           spec_change, message):
    spec = {**drawing_spec(example_manifest), **spec_change}
    observed = asked(annotation, refused=refused)
    decided = decide(spec, SUCCEEDED, observed)
    assert decided.actions == []
    (entry,) = decided.status["generations"]
    assert entry["phase"] == "Failed" and entry["message"].startswith(message)
    assert entry["id"] == ("invalid" if annotation == "{not json" else "abc123"), "the id the CLI waits for"
    assert said(decided) == [("Warning", "GenerationRefused")]
    assert converged(spec, SUCCEEDED, observed, decided) == decision.Decision(TRAINJOB), "answered once"


def test_a_request_on_a_running_job_is_drawn_beside_its_training(example_manifest):
    spec = drawing_spec(example_manifest)
    status = {"phase": "Running", "backend": "trainjob", "startTime": NOW}
    observed = asked(generation_request(step="4"), config_map=started(spec), child=child_of(spec, state=RUNNING),
                     gauges={"step": 30, "planned_steps": 60})
    decided = decide(spec, status, observed)
    assert kinds(decided.actions) == ["PatchChildStatus", "CreateGenerationJob"]
    assert decided.status["progress"]["step"] == 30 and decided.status["generations"][0]["phase"] == "Running"
    # Older answers are kept beside the new one (the latest ten).
    older = {"id": "old1", "phase": "Succeeded", "uri": f"{RUN_URI}/generated/final-old1"}
    kept = decide(spec, {**status, "generations": [older]}, observed)
    assert [e["id"] for e in kept.status["generations"]] == ["old1", "abc123"]
