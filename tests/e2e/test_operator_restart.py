"""The operator restarted in the middle of a sweep and of a running job (issue 29, deliver 6).

A TrainingJob and a TrainingSweep run side by side, queued by Kueue (so that Workloads exist too),
while the operator is taken away twice: first its process is SIGKILLed (a crash: the kubelet starts
the container again in the same pod) while the job is between two checkpoints and two trials run
with a third still to come; then, the moment the sweep creates that third trial, it is SIGKILLed
again and its pod force-deleted (a node lost: a new pod is scheduled). The operator is one
level-triggered reconcile, so its successor must find what exists rather than redo it:
  * nothing is created twice: every TrainingJob, ConfigMap, child job and Workload seen before a
    restart keeps its UID, and there is exactly one of each per job at the end;
  * nothing is lost: the job's trainer runs on through both restarts (one run, never resumed) and
    succeeds, the sweep's three trials all finish and its best is recorded once;
  * status converges: phase, progress, checkpoint and conditions of each job, the sweep's trials,
    counts and best.

One backend (TrainJob, the chart's default): the restarts exercise the operator, not the backend.
"""
from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import client

from kubetune_dev import container_runtime
from kubetune_dev.podrunner import real_container_name
from kubetune_operator.naming import config_map_name
from tests.e2e.jobs import (OPERATOR_NAMESPACE, children, get_job, kubectl, operator_log, rank0_pod_logs)
from tests.e2e.test_kueue import KUEUE, LOCAL_QUEUE, queue, queued_job  # noqa: F401  (queue: a fixture)
from tests.e2e.test_sweeps import get_sweep, sweep_manifest, wait_until_finished
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

OPERATOR_SELECTOR = "app.kubernetes.io/name=kubetune-operator"
JOB, SWEEP = "steady", "restarts"
JOB_STEPS, JOB_EVERY = 200, 4  # still running while two trials train and report, whatever their load time
TRIAL_STEPS = 24  # a window of several readings in which both first trials run
TRIALS = [f"{SWEEP}-{n}" for n in range(3)]


@pytest.fixture(scope="module")
def backend() -> str:
    return "trainjob"


def operator_pod(core) -> client.V1Pod:
    """The operator's running pod (the chart's `helm test` pod carries the label too, without the container)."""
    def running():
        pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector=OPERATOR_SELECTOR).items
        return next((p for p in pods if not p.metadata.deletion_timestamp and p.status.phase == "Running"
                     and any(c.name == "operator" for c in p.spec.containers)), None)

    return eventually(running, timeout=120, interval=0.5, message="the operator pod running")


def restarts(pod: client.V1Pod) -> int:
    return next(s.restart_count for s in pod.status.container_statuses or [] if s.name == "operator")


def kill_operator_process(control_plane, core) -> client.V1Pod:
    """SIGKILL the operator container's process, as a crash (or the OOM killer) would: no shutdown at all."""
    pod = operator_pod(core)
    container_runtime.kill(real_container_name(pod.metadata.to_dict(), "operator"), "KILL")
    return pod


def owned_objects(api_client, core, backend: str, namespace: str) -> dict[tuple[str, str], str]:
    """{(kind, name of the TrainingJob it belongs to): uid} for every TrainingJob, trainer ConfigMap,
    child job and Kueue Workload of NAMESPACE; fails on two of one kind for one job (created twice)."""
    custom = client.CustomObjectsApi(api_client)
    found: dict[tuple[str, str], str] = {}

    def add(kind: str, job: str, uid: str) -> None:
        assert (kind, job) not in found, f"two {kind}s for {job}: created twice"
        found[(kind, job)] = uid

    for job in custom.list_namespaced_custom_object("kubetune.dev", "v1alpha1", namespace, "trainingjobs")["items"]:
        add("TrainingJob", job["metadata"]["name"], job["metadata"]["uid"])
    for config_map in core.list_namespaced_config_map(namespace).items:
        owner = next((r for r in config_map.metadata.owner_references or [] if r.kind == "TrainingJob"), None)
        if owner is not None:
            assert config_map.metadata.name == config_map_name(owner.name)
            add("ConfigMap", owner.name, config_map.metadata.uid)
    for child in children(api_client, backend, namespace):
        add("child", child["metadata"]["name"], child["metadata"]["uid"])
    for workload in custom.list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]:
        add("Workload", workload["metadata"]["ownerReferences"][0]["name"], workload["metadata"]["uid"])
    return found


def assert_kept(before: dict, after: dict, moment: str) -> None:
    changed = {key: (uid, after.get(key)) for key, uid in before.items() if after.get(key) != uid}
    assert not changed, f"replaced or lost after the restart {moment} (kind, job): (uid before, uid after): {changed}"


def trial_job_exists(api_client, namespace: str, name: str) -> bool:
    try:
        get_job(api_client, namespace, name)
        return True
    except client.exceptions.ApiException as err:
        if err.status == 404:
            return False
        raise


def step_of(job: dict) -> int:
    return ((job.get("status") or {}).get("progress") or {}).get("step", 0)


def between_checkpoints(job: dict) -> bool:
    """Running, past its first step, and with unsaved steps since its latest checkpoint."""
    status = job.get("status") or {}
    latest = status.get("latestCheckpoint") or "checkpoint-0"
    saved = int(latest.rsplit("-", 1)[1])
    return status.get("phase") == "Running" and saved < step_of(job) < JOB_STEPS


def read_by_the_sweep(sweep: dict) -> set[int]:
    """Trials the sweep records as running with at least one reading of the objective."""
    return {t["number"] for t in (sweep.get("status") or {}).get("trials") or []
            if t["state"] == "running" and t.get("intermediate")}


def events(core, namespace: str, kind: str, name: str, reason: str) -> list[str]:
    """The messages of the events with REASON about KIND NAME, one per occurrence."""
    found = core.list_namespaced_event(namespace, field_selector=f"involvedObject.kind={kind},"
                                                                 f"involvedObject.name={name},reason={reason}").items
    return [e.message for e in found for _ in range(e.count or 1)]


def test_an_operator_killed_mid_job_and_mid_sweep_creates_nothing_twice_and_loses_nothing(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3, queue):
    """Over a minute: a job and a three-trial sweep on the queue while the operator is killed twice; the job's
    200 steps keep it running across both restarts."""
    queue(cpus=3)  # the job and two trials at once
    job = queued_job(inputs_in_s3, JOB, maxSteps=JOB_STEPS)
    job["spec"]["checkpoints"]["everySteps"] = JOB_EVERY
    sweep = sweep_manifest(SWEEP, inputs_in_s3, {"adapter.rank": {"choice": [2, 4, 8]}}, objective={"metric": "loss"},
                           algorithm="grid", maxTrials=3, parallelTrials=2)
    template = sweep["spec"]["template"]["spec"]
    template["training"]["maxSteps"] = TRIAL_STEPS
    template["checkpoints"]["everySteps"] = 2
    template["resources"]["cpu"] = "1"
    template["scheduling"] = {"queueName": LOCAL_QUEUE}
    for manifest in (job, sweep):
        kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def log():
        return "operator log:\n" + operator_log(control_plane, core)

    # Restart 1, a crash: the job between checkpoints, two trials running and read, the third not made yet.
    eventually(lambda: between_checkpoints(get_job(api_client, job_namespace, JOB))
               and read_by_the_sweep(get_sweep(api_client, job_namespace, SWEEP)) == {0, 1},
               timeout=600, interval=0.5, message=lambda: "the job between checkpoints while trials 0 and 1 run; "
               f"sweep: {json.dumps(get_sweep(api_client, job_namespace, SWEEP).get('status'))[-1500:]}\n{log()}")
    before_crash = owned_objects(api_client, core, backend, job_namespace)
    assert {name for kind, name in before_crash if kind == "TrainingJob"} == {JOB, *TRIALS[:2]}
    seen = step_of(get_job(api_client, job_namespace, JOB))
    crashed = kill_operator_process(control_plane, core)
    back = eventually(lambda: restarts(operator_pod(core)) > restarts(crashed) and operator_pod(core),
                      timeout=120, interval=0.5, message="the kubelet restarted the killed operator")
    assert back.metadata.uid == crashed.metadata.uid, "a crash restarts the container, in the same pod"

    # Restart 2, the node lost: the operator killed and its pod force-deleted as soon as the sweep creates its
    # third trial (the sweep's status, the trial's ConfigMap and child may be being written then).
    eventually(lambda: trial_job_exists(api_client, job_namespace, TRIALS[2]), timeout=600, interval=0.1,
               message=lambda: f"the sweep's third trial created\n{log()}")
    lost = kill_operator_process(control_plane, core)  # at once, not at the kubelet's next look
    core.delete_namespaced_pod(lost.metadata.name, OPERATOR_NAMESPACE, body=client.V1DeleteOptions(
        grace_period_seconds=0))
    before_loss = owned_objects(api_client, core, backend, job_namespace)  # the new operator needs seconds to start
    assert_kept(before_crash, before_loss, "after the crash")
    assert lost.metadata.uid == back.metadata.uid and operator_pod(core).metadata.uid != lost.metadata.uid

    # Everything finishes.
    finished = wait_until_finished(api_client, control_plane, core, job_namespace, SWEEP, timeout=900)
    eventually(lambda: (get_job(api_client, job_namespace, JOB).get("status") or {}).get("phase")
               in ("Succeeded", "Failed"), timeout=600, interval=1, message=lambda: f"{JOB} finished\n{log()}")

    # Nothing created twice: one of each per job, the same objects as before each restart.
    after = owned_objects(api_client, core, backend, job_namespace)
    jobs = [JOB, *TRIALS]
    assert sorted(after) == sorted((kind, name) for kind in ("TrainingJob", "ConfigMap", "child", "Workload")
                                   for name in jobs), sorted(after)
    assert_kept(before_loss, after, "of a lost node")
    for name in jobs:
        assert len(events(core, job_namespace, "TrainingJob", name, "Created")) <= 1, f"{name}'s child announced twice"
    assert len(events(core, job_namespace, "TrainingJob", JOB, "Created")) == 1
    # ... and nothing the restarted operator rebuilt differs from what the first one built.
    for name in jobs:
        drift = [c for c in get_job(api_client, job_namespace, name)["status"]["conditions"]
                 if c["type"] == "ChildMatchesSpec"]
        assert not drift and not events(core, job_namespace, "TrainingJob", name, "EditedOutsideKubetune"), drift

    # Nothing lost: each trainer ran once, straight through (never restarted, never resumed), in run v0.
    for name in jobs:
        logs = rank0_pod_logs(control_plane, backend, job_namespace, name)
        assert len(logs) == 1 and "resumed from" not in logs[0], (name, [text[-1500:] for text in logs])

    # Status converges: the job.
    status = get_job(api_client, job_namespace, JOB)["status"]
    assert status["phase"] == "Succeeded", (json.dumps(status), log())
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == JOB_STEPS > seen
    assert status["progress"]["percent"] == 100.0 and "loss" in status["progress"]
    assert status["outputUri"].endswith(f"/{JOB}/v0") and status["latestCheckpoint"] == \
        f"{status['outputUri']}/checkpoint-{JOB_STEPS}", json.dumps(status)
    conditions = {c["type"]: (c["status"], c.get("reason")) for c in status["conditions"]}
    assert conditions["Succeeded"][0] == "True" and conditions["Running"][0] == "False", conditions
    assert conditions["Queued"] == ("False", "Admitted"), conditions
    assert status["observedGeneration"] == get_job(api_client, job_namespace, JOB)["metadata"]["generation"]

    # ... each trial and the sweep: every trial finished once, the best recorded once.
    sweep_status = finished["status"]
    assert sweep_status["phase"] == "Succeeded", json.dumps(sweep_status)
    assert (sweep_status["trialsDone"], sweep_status["running"], sweep_status["failed"]) == ("3/3", 0, 0)
    trials = sweep_status["trials"]
    assert [(t["number"], t["job"], t["state"]) for t in trials] == [(n, TRIALS[n], "succeeded") for n in range(3)]
    assert [t["parameters"]["adapter.rank"] for t in trials] == [2, 4, 8]
    for trial in trials:
        trial_status = get_job(api_client, job_namespace, trial["job"])["status"]
        assert trial_status["phase"] == "Succeeded" and trial_status["progress"]["step"] == TRIAL_STEPS
        assert trial["outputUri"] == trial_status["outputUri"] and trial_status["outputUri"].endswith("/v0")
        assert trial["value"] is not None
    best = min(trials, key=lambda t: t["value"])
    assert sweep_status["best"] == {"trial": best["number"], "job": best["job"], "value": best["value"],
                                    "parameters": best["parameters"], "outputUri": best["outputUri"]}
    assert events(core, job_namespace, "TrainingSweep", SWEEP, "SweepSucceeded") == [sweep_status["message"]]
    created = events(core, job_namespace, "TrainingSweep", SWEEP, "TrialCreated")
    assert len(created) == len(set(created)) <= 3, created
