"""The operator's TrainingSweep reconcile (kubetune_operator.sweep_state.plan): which trials it
creates, follows, stops and records, and that a restart (lost status, or lost trial objects) loses
nothing. Pure: the TrainingJobs are described as the operator would read them."""
from __future__ import annotations

import copy
import json

import pytest
from kubernetes.client.rest import ApiException

from kubetune_api.search import suggest
from kubetune_api.sweep import TrainingSweep
from kubetune_operator.sweep_state import TrialJob, plan, records_to_trials
from kubetune_operator.sweeps import observe, trial_job

TEMPLATE = {"model": {"family": "sd15", "pretrained": "org/model"}, "data": {"layout": "captions", "uri": "s3://data/set"},
            "training": {"maxSteps": 100}, "checkpoints": {"uri": "s3://out/runs"}}
PARAMETERS = {"training.learningRate": {"logUniform": [1e-5, 1e-3]}, "adapter.rank": {"choice": [4, 8, 16]}}


def sweep(**spec):
    return TrainingSweep.model_validate({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "lr"},
        "spec": {"template": {"spec": TEMPLATE}, "parameters": PARAMETERS, "objective": {"metric": "loss"},
                 "maxTrials": 6, "parallelTrials": 2, **spec}}).spec


def job(number, status, phase="Running", step=None, loss=None, **fields):
    parameters = next(r for r in status["trials"] if r["number"] == number)["parameters"]
    return TrialJob(number, parameters, phase=phase, step=step, recent_loss=loss, **fields)


def test_a_new_sweep_records_and_creates_parallel_trials_with_the_searchs_parameters():
    spec = sweep()
    decided = plan("lr", "ns", spec, {}, {})
    assert [t.number for t in decided.create] == [0, 1]
    assert [t.parameters for t in decided.create] == [suggest(spec, []), suggest(spec, decided.create[:1])]
    status = decided.status
    assert status["phase"] == "Running" and status["trialsDone"] == "0/6" and status["running"] == 2
    assert [(r["job"], r["state"]) for r in status["trials"]] == [("lr-0", "running"), ("lr-1", "running")]
    assert decided.events == []  # TrialCreated is the act's, sent once it created the TrainingJob


def test_readings_become_intermediate_values_and_a_finished_trial_makes_room_for_the_next():
    spec = sweep()
    status = plan("lr", "ns", spec, {}, {}).status
    status = plan("lr", "ns", spec, status, {0: job(0, status, step=10, loss=0.5), 1: job(1, status, step=10, loss=0.7)}).status
    assert status["trials"][0]["intermediate"] == {"10": 0.5}
    jobs = {0: job(0, status, "Succeeded", step=20, loss=0.3, output_uri="s3://out/runs/ns/lr-0/v0"),
            1: job(1, status, step=20, loss=0.6)}
    decided = plan("lr", "ns", spec, status, jobs)
    first = decided.status["trials"][0]
    assert first["state"] == "succeeded" and first["value"] == 0.3  # its last reading: the trainer's mean of its latest steps
    assert first["outputUri"] == "s3://out/runs/ns/lr-0/v0"
    assert [t.number for t in decided.create] == [2]
    assert decided.status["best"] == {"trial": 0, "job": "lr-0", "value": first["value"],
                                      "parameters": first["parameters"], "outputUri": "s3://out/runs/ns/lr-0/v0"}
    assert decided.status["trialsDone"] == "1/6"


def test_a_restart_with_its_status_lost_adopts_the_trial_jobs_and_creates_nothing_twice():
    spec = sweep()
    status = plan("lr", "ns", spec, {}, {}).status
    jobs = {0: job(0, status, step=5, loss=0.4), 1: job(1, status, step=5, loss=0.5)}
    decided = plan("lr", "ns", spec, {}, jobs)  # the status never written
    assert decided.create == []
    assert [r["parameters"] for r in decided.status["trials"]] == [r["parameters"] for r in status["trials"]]


def test_a_restart_with_its_status_lost_keeps_which_trial_a_pbt_copy_continues():
    # Found by reading the restart path: trials are created before the sweep's status is written, so
    # an operator stopped in between adopts the trials from their TrainingJobs, and a PBT copy's
    # exploitedFrom was lost then (it was in status only). It travels on the trial's TrainingJob now.
    spec = sweep(algorithm="pbt", parameters={"training.learningRate": {"logUniform": [1e-5, 1e-3]}},
                 maxTrials=4, parallelTrials=2, pbt={"stepsPerGeneration": 10, "quantile": 0.5,
                                                      "resampleProbability": 0})
    status = plan("lr", "ns", spec, {}, {}).status
    first = {0: job(0, status, "Succeeded", step=10, loss=0.2, output_uri="s3://out/runs/ns/lr-0/v0"),
             1: job(1, status, "Succeeded", step=10, loss=0.9, output_uri="s3://out/runs/ns/lr-1/v0")}
    decided = plan("lr", "ns", spec, status, first)
    [copy] = [t for t in decided.create if t.exploited_from is not None]
    assert copy.exploited_from == 0 and decided.status["trials"][copy.number]["exploitedFrom"] == 0

    class Body(dict):
        metadata = {"name": "lr", "namespace": "ns", "uid": "u-1"}

    created = {t.number: observe(trial_job(Body(), spec, t)) for t in decided.create}
    adopted = plan("lr", "ns", spec, status, {**first, **created})  # the status with the new trials never written
    assert adopted.create == []
    def kept(trials):
        return [(t["number"], t["parameters"], t["state"], t.get("exploitedFrom")) for t in trials]

    assert kept(adopted.status["trials"]) == kept(decided.status["trials"])
    assert adopted.status["trials"][copy.number]["exploitedFrom"] == 0


def test_a_recorded_trial_whose_job_is_missing_is_created_again_with_the_same_parameters():
    spec = sweep()
    status = plan("lr", "ns", spec, {}, {}).status
    decided = plan("lr", "ns", spec, status, {0: job(0, status)})
    assert [(t.number, t.parameters) for t in decided.create] == [(1, status["trials"][1]["parameters"])]


def test_failed_trials_are_recorded_and_the_sweep_fails_past_max_failed_fraction():
    spec = sweep(maxFailedFraction=0.3)  # more than 1.8 of 6 trials: the second failure ends it
    status = plan("lr", "ns", spec, {}, {}).status
    decided = plan("lr", "ns", spec, status, {0: job(0, status, "Failed", message="CUDA out of memory"), 1: job(1, status)})
    assert decided.status["trials"][0]["reason"] == "CUDA out of memory"
    assert decided.status["phase"] == "Running" and [t.number for t in decided.create] == [2]
    status = decided.status
    decided = plan("lr", "ns", spec, status, {0: job(0, status, "Failed"), 1: job(1, status),
                                        2: job(2, status, "Failed", message="diverged")})
    assert decided.status["phase"] == "Failed" and "2 of 6 trials failed" in decided.status["message"]
    assert decided.stop == [1] and decided.create == []
    assert decided.status["trials"][1]["state"] == "stopped"
    assert ("Warning", "SweepFailed") == decided.events[-1][:2]


def test_the_median_rule_stops_a_clearly_worse_trial_and_keeps_it_suspended():
    spec = sweep(earlyStopping={"rule": "median", "minSteps": 10}, parallelTrials=3)
    status = plan("lr", "ns", spec, {}, {}).status
    readings = {0: 0.2, 1: 0.25, 2: 0.9}
    decided = plan("lr", "ns", spec, status, {n: job(n, status, step=10, loss=v) for n, v in readings.items()})
    assert decided.stop == [2]
    stopped = decided.status["trials"][2]
    assert stopped["state"] == "stopped" and stopped["value"] == 0.9 and "median" in stopped["reason"]
    assert [t.number for t in decided.create] == [3]  # its place goes to the next trial
    status = decided.status
    jobs = {n: job(n, status, step=12, loss=v) for n, v in readings.items()}
    assert plan("lr", "ns", spec, status, jobs).stop == [2]  # asked again until its job says Suspended
    jobs[2] = job(2, status, "Suspended", step=12, loss=0.9)
    assert plan("lr", "ns", spec, status, jobs).stop == []


def test_a_stop_already_announced_on_the_trial_is_asked_again_but_not_announced_again():
    spec = sweep(earlyStopping={"rule": "median", "minSteps": 10}, parallelTrials=3)
    status = plan("lr", "ns", spec, {}, {}).status
    readings = {0: 0.2, 1: 0.25, 2: 0.9}
    jobs = {n: job(n, status, step=10, loss=v) for n, v in readings.items()}
    first = plan("lr", "ns", spec, status, jobs)
    assert first.reported == {2: "stopped"} and [e[1] for e in first.events] == ["TrialStopped"]
    jobs[2] = job(2, status, step=10, loss=0.9, reported="stopped")  # marked; the new status was lost
    again = plan("lr", "ns", spec, status, jobs)
    assert again.stop == [2] and again.events == [] and again.reported == {}


def test_a_restart_with_its_status_lost_keeps_a_stopped_trial_stopped_and_gives_its_place_to_the_next():
    # Found reading the restart path: adopted as running, a trial the median rule had suspended held
    # its place among parallelTrials for ever (its job never runs again) and the sweep never finished.
    spec = sweep(earlyStopping={"rule": "median", "minSteps": 10}, parallelTrials=3)
    status = plan("lr", "ns", spec, {}, {}).status
    readings = {0: 0.2, 1: 0.25, 2: 0.9}
    stopped = plan("lr", "ns", spec, status, {n: job(n, status, step=10, loss=v) for n, v in readings.items()})
    jobs = {n: job(n, stopped.status, step=30, loss=v) for n, v in readings.items()}  # the others went on
    jobs[2] = job(2, stopped.status, "Suspended", step=10, loss=0.9, reported="stopped")
    decided = plan("lr", "ns", spec, {}, jobs)  # the sweep's status lost (restored from a backup without it)
    adopted = decided.status["trials"][2]
    assert (adopted["state"], adopted["value"], adopted["intermediate"]) == ("stopped", 0.9, {"10": 0.9})
    assert "median" in adopted["reason"] and decided.events == [] and decided.stop == []
    assert [t.number for t in decided.create] == [3] and decided.status["running"] == 3
    jobs[2] = job(2, stopped.status, "Running", step=10, loss=0.9, reported="stopped")  # not suspended yet
    assert plan("lr", "ns", spec, {}, jobs).stop == [2]


def test_the_median_rule_does_not_judge_a_trial_against_its_twin_alone_while_a_third_has_not_reported():
    # The e2e's sweep: two trials of the same good model and a clearly worse one whose pods started
    # later. Trial 1's noisy reading a hair above trial 0's does not stop it; once trial 2
    # reports, the median lies between the twins and it, and only trial 2 is stopped.
    spec = sweep(earlyStopping={"rule": "median", "minSteps": 3}, parallelTrials=3, maxTrials=3)
    status = plan("lr", "ns", spec, {}, {}).status
    early = {0: job(0, status, step=4, loss=0.30), 1: job(1, status, step=4, loss=0.31), 2: job(2, status)}
    decided = plan("lr", "ns", spec, status, early)
    assert decided.stop == [] and [t["state"] for t in decided.status["trials"]] == ["running"] * 3
    status = decided.status
    later = {**early, 2: job(2, status, step=4, loss=0.9)}
    assert plan("lr", "ns", spec, status, later).stop == [2]


def test_the_sweep_succeeds_when_every_trial_finished_and_names_the_best():
    spec = sweep(maxTrials=2)
    status = plan("lr", "ns", spec, {}, {}).status
    decided = plan("lr", "ns", spec, status, {0: job(0, status, "Succeeded", step=9, loss=0.4),
                                        1: job(1, status, "Succeeded", step=9, loss=0.2)})
    assert decided.status["phase"] == "Succeeded" and decided.status["trialsDone"] == "2/2"
    assert decided.status["best"]["trial"] == 1 and "best: trial 1" in decided.status["message"]
    assert ("Normal", "SweepSucceeded") == decided.events[-1][:2]


def test_a_validation_objective_is_read_from_the_jobs_validation_status():
    spec = TrainingSweep.model_validate({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "lr"},
        "spec": {"template": {"spec": {**TEMPLATE, "validation": {"everySteps": 5, "heldOutFraction": 0.2}}},
                 "parameters": PARAMETERS, "objective": {"metric": "validation_loss"}, "maxTrials": 2}}).spec
    status = plan("lr", "ns", spec, {}, {}).status
    decided = plan("lr", "ns", spec, status, {0: job(0, status, "Succeeded", step=10, loss=9.0, validation_step=10,
                                               validation={"loss": 0.125})})
    assert decided.status["trials"][0]["value"] == 0.125  # the validation loss, not the training loss


def test_trial_jobs_carry_what_a_restart_needs_and_read_back():
    spec = sweep()
    trial = plan("lr", "ns", spec, {}, {}).create[0]
    body = {"metadata": {"name": "lr", "namespace": "team-a", "uid": "u-1"}}

    class Body(dict):
        metadata = body["metadata"]

    made = trial_job(Body(body), spec, trial)
    assert made["metadata"]["name"] == "lr-0" and made["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert made["metadata"]["labels"] == {"kubetune.dev/sweep": "lr", "kubetune.dev/trial": "0"}
    assert made["spec"]["adapter"]["rank"] == trial.parameters["adapter.rank"]
    assert made["spec"]["training"]["learningRate"] == trial.parameters["training.learningRate"]
    made["status"] = {"phase": "Failed", "progress": {"step": 3, "loss": 0.9, "recentLoss": 0.5}, "outputUri": "s3://o",
                      "conditions": [{"type": "Failed", "status": "True", "message": "out of memory"}]}
    seen = observe(made)
    assert (seen.number, seen.parameters, seen.phase, seen.message, seen.step, seen.output_uri) == (
        0, json.loads(made["metadata"]["annotations"]["kubetune.dev/trial-parameters"]), "Failed", "out of memory", 3,
        "s3://o")
    assert seen.recent_loss == 0.5, "the objective is the trainer's recent mean, not the latest step's loss"
    assert records_to_trials(plan("lr", "ns", spec, {}, {}).status["trials"])[0].parameters == trial.parameters


def test_a_thousand_trial_sweep_stays_far_below_the_api_servers_object_size_limit():
    from kubetune_api.search import Trial
    from kubetune_operator.sweep_state import kept_steps, trial_record

    assert kept_steps(list(range(1, 1001)), 20)[-1] == 1000 and len(kept_steps(list(range(1, 1001)), 20)) == 20
    assert kept_steps([5, 10], 20) == [5, 10]
    parameters = {"training.learningRate": 0.000123456789, "adapter.rank": 16}
    records = [trial_record("a-long-sweep-name", Trial(n, parameters, "succeeded", 0.123456789,
                                                       {s: 1 / s for s in range(1, 1001)},
                                                       output_uri=f"s3://bucket/prefix/namespace/a-long-sweep-name-{n}/v0"))
               for n in range(1000)]
    assert all(len(r["intermediate"]) == 20 and "1000" in r["intermediate"] for r in records)
    assert len(json.dumps({"trials": records})) < 1024 * 1024  # the limit is 1.5 MiB


# ---- the act (sweeps.run_sweep): events follow what happened -------------------------------------

class FakeTrainingJobs:
    """The API server's TrainingJobs, as run_sweep reads, creates and patches them."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.hidden: set[str] = set()  # left out of a LIST: created by someone else since

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector):
        return {"items": [copy.deepcopy(j) for name, j in self.jobs.items() if name not in self.hidden]}

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        if body["metadata"]["name"] in self.jobs:
            raise ApiException(status=409)
        self.jobs[body["metadata"]["name"]] = copy.deepcopy(body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return copy.deepcopy(self.jobs[name])

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        job = self.jobs[name]
        job["metadata"].setdefault("annotations", {}).update((body.get("metadata") or {}).get("annotations") or {})
        job["spec"].update(body.get("spec") or {})


@pytest.fixture
def cluster(monkeypatch):
    """A sweep of 2 parallel trials, its TrainingJobs in FakeTrainingJobs, its events recorded;
    yields tick(status) -> the status that tick would write."""
    import kopf

    from kubetune_operator import kube, sweeps

    api, sent = FakeTrainingJobs(), []
    monkeypatch.setattr(sweeps, "custom_api", lambda: api)
    # The sweep's events and its one status write, as kube would send them to the API server.
    monkeypatch.setattr(kube, "post_event", lambda body, type_, reason, message: sent.append((reason, message)))
    written: dict = {}
    monkeypatch.setattr(kube, "patch_status", lambda namespace, name, version, fields, plural: written.update(fields)
                        or True)
    sweep = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep",
             "metadata": {"name": "lr", "namespace": "ns", "uid": "u-1", "resourceVersion": "7"},
             "spec": {"template": {"spec": TEMPLATE}, "parameters": PARAMETERS, "objective": {"metric": "loss"},
                      "maxTrials": 6, "parallelTrials": 2}}

    def tick(status: dict) -> dict:
        written.clear()
        sweeps.run_sweep(body=kopf.Body({**sweep, "status": status}))
        return {**status, **written}

    tick.api, tick.events = api, sent
    return tick


def test_a_restart_before_the_status_is_written_repeats_no_trial_event(cluster):
    status = cluster({})
    assert [m for r, m in cluster.events if r == "TrialCreated"] and len(cluster.events) == 2
    cluster.api.jobs["lr-0"]["status"] = {"phase": "Succeeded", "progress": {"step": 10, "recentLoss": 0.25}}
    cluster(status)  # trial 0's end and trial 2's creation; the operator stops before this status is written
    assert [(r, m.split(":")[0]) for r, m in cluster.events[2:]] == [
        ("TrialFinished", "trial 0 (lr-0) succeeded"), ("TrialCreated", "trial 2")]

    restarted = cluster(status)  # the trial exists, the status does not list it; trial 0 still "running" there
    assert len(cluster.events) == 4, cluster.events[4:]
    assert cluster.api.jobs["lr-0"]["metadata"]["annotations"]["kubetune.dev/trial-reported"] == "succeeded"
    assert [(t["number"], t["state"]) for t in restarted["trials"]] == [(0, "succeeded"), (1, "running"),
                                                                        (2, "running")]
    assert restarted["trials"][0]["value"] == 0.25


def test_a_trial_found_already_there_at_creation_gets_no_trial_created_event(cluster):
    status = cluster({})
    cluster.api.jobs["lr-0"]["status"] = {"phase": "Failed"}
    cluster.api.hidden.add("lr-2")
    cluster.api.jobs["lr-2"] = {"metadata": {"name": "lr-2", "ownerReferences": [{"uid": "u-1"}]}, "spec": {}}
    cluster(status)  # trial 2 is due; another operator (an old replica) created it since this one listed
    assert [(r, m.split(":")[0]) for r, m in cluster.events[2:]] == [
        ("TrialFinished", "trial 0 (lr-0) failed")]


def test_a_status_write_raced_by_another_change_is_decided_again_from_the_sweep_read_again(cluster, monkeypatch):
    """The one status write is guarded by the resourceVersion the plan was decided from: refused once
    (the sweep changed meanwhile), the sweep is read again and decided again; the trials created by the
    first decision are found there, so no TrialCreated is sent twice."""
    import kopf

    from kubetune_operator import kube, sweeps

    versions, statuses = [], []

    def patch_status(namespace, name, version, fields, plural):
        versions.append(version)
        statuses.append(fields)
        return len(versions) > 1  # the first write lost the race

    monkeypatch.setattr(kube, "patch_status", patch_status)
    reread = []
    monkeypatch.setattr(sweeps, "read_sweep", lambda namespace, name: reread.append(name) or kopf.Body(
        {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep",
         "metadata": {"name": "lr", "namespace": "ns", "uid": "u-1", "resourceVersion": "8"},
         "spec": {"template": {"spec": TEMPLATE}, "parameters": PARAMETERS, "objective": {"metric": "loss"},
                  "maxTrials": 6, "parallelTrials": 2}, "status": {}}))
    cluster({})
    assert versions == ["7", "8"] and reread == ["lr"]
    assert [t["number"] for t in statuses[1]["trials"]] == [0, 1]
    assert [r for r, _ in cluster.events] == ["TrialCreated", "TrialCreated"]
    assert sorted(cluster.api.jobs) == ["lr-0", "lr-1"]


def test_the_mlflow_parent_run_is_recorded_in_status_before_any_trial_names_it(cluster, monkeypatch):
    from kubetune_operator import kube, sweeps

    tracked = {**TEMPLATE, "tracking": {"mlflow": {"uri": "http://mlflow.local:5000"}}}
    started, writes = [], []
    monkeypatch.setattr(sweeps, "parent_run_of", lambda *args, **kwargs: started.append(1) or "run-1")
    monkeypatch.setattr(kube, "patch_status", lambda namespace, name, version, fields, plural: writes.append(
        (version, fields, sorted(cluster.api.jobs))) or True)
    body = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep",
            "metadata": {"name": "lr", "namespace": "ns", "uid": "u-1", "resourceVersion": "7"},
            "spec": {"template": {"spec": tracked}, "parameters": PARAMETERS, "objective": {"metric": "loss"},
                     "maxTrials": 6, "parallelTrials": 2}}
    import kopf

    monkeypatch.setattr(sweeps, "read_sweep", lambda namespace, name: kopf.Body(
        {**body, "metadata": {**body["metadata"], "resourceVersion": "8"}, "status": {"mlflowParentRunId": "run-1"}}))
    sweeps.run_sweep(body=kopf.Body({**body, "status": {}}))
    assert writes[0] == ("7", {"mlflowParentRunId": "run-1"}, []), "recorded before any trial exists"
    assert writes[1][0] == "8" and [t["number"] for t in writes[1][1]["trials"]] == [0, 1]
    assert "mlflowParentRunId" not in writes[1][1]
    assert started == [1]
    parents = {cluster.api.jobs[name]["spec"]["tracking"]["mlflow"]["parentRunId"] for name in ("lr-0", "lr-1")}
    assert parents == {"run-1"}
