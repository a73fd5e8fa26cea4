"""Real Kueue queues TrainingJobs: the operator labels the child PyTorchJob with the TrainingJob's
queue (spec.scheduling.queueName) and Kueue's own PyTorchJob integration holds, admits and preempts
it (suspend / unsuspend). Preempted work checkpoints on SIGTERM and continues when readmitted."""
from __future__ import annotations

import re
import time

import pytest
import yaml
from kubernetes import client

from tests.e2e.jobs import example_job, get_job, kubectl, operator_log, phase
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

KUEUE = ("kueue.x-k8s.io", "v1beta2")
LOCAL_QUEUE = "training"


@pytest.fixture(scope="module")
def backend() -> str:
    """The child job kind Kueue queues here (the operator's default backend)."""
    return "pytorchjob"


@pytest.fixture
def queue(api_client, job_namespace):
    """Make a ResourceFlavor, a ClusterQueue of CPU quota and the LocalQueue `training`."""
    custom = client.CustomObjectsApi(api_client)
    made = []

    def make(cpus: int, preemption: dict | None = None) -> str:
        name = f"{job_namespace}-cq"
        custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
            "apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": name}})
        spec = {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
            {"name": name, "resources": [{"name": "cpu", "nominalQuota": str(cpus)}]}]}]}
        if preemption:
            spec["preemption"] = preemption
        custom.create_cluster_custom_object(*KUEUE, "clusterqueues", {
            "apiVersion": "/".join(KUEUE), "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec})
        custom.create_namespaced_custom_object(*KUEUE, job_namespace, "localqueues", {
            "apiVersion": "/".join(KUEUE), "kind": "LocalQueue", "metadata": {"name": LOCAL_QUEUE},
            "spec": {"clusterQueue": name}})
        made.append(name)
        return name

    yield make
    for name in made:
        custom.delete_cluster_custom_object(*KUEUE, "clusterqueues", name)
        custom.delete_cluster_custom_object(*KUEUE, "resourceflavors", name)


def queued_job(inputs: dict, name: str, **training) -> dict:
    """The example on one CPU (what Kueue counts against the quota), in the LocalQueue."""
    manifest = example_job(inputs, name, f"runs/{name}", **training)
    manifest["spec"]["resources"]["cpu"] = "1"
    manifest["spec"]["scheduling"] = {**manifest["spec"].get("scheduling", {}), "queueName": LOCAL_QUEUE}
    return manifest


def workloads(api_client, namespace: str) -> dict[str, dict]:
    """Kueue's Workloads of the namespace, by the name of the PyTorchJob each belongs to."""
    items = client.CustomObjectsApi(api_client).list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]
    return {w["metadata"]["ownerReferences"][0]["name"]: w for w in items}


def condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def admitted(workload: dict) -> bool:
    return (condition(workload, "Admitted") or {}).get("status") == "True"


def trainer_pods_running(core, namespace: str) -> set[str]:
    pods = core.list_namespaced_pod(namespace, label_selector="kubetune.dev/trainingjob").items
    return {p.metadata.labels["kubetune.dev/trainingjob"] for p in pods if p.status.phase == "Running"}


def test_four_jobs_on_a_queue_for_two_run_two_at_a_time_and_all_succeed(
        control_plane, api_client, core, operator_release, job_namespace, inputs_in_s3, queue):
    cluster_queue = queue(cpus=2)
    names = [f"queued-{i}" for i in range(4)]
    for name in names:
        kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-",
                input=yaml.safe_dump(queued_job(inputs_in_s3, name, maxSteps=8)))

    # Two are admitted; the other two wait in the queue, suspended, with no pod.
    eventually(lambda: sum(admitted(w) for w in workloads(api_client, job_namespace).values()) == 2
               and len(workloads(api_client, job_namespace)) == 4, timeout=120, interval=1,
               message=lambda: f"two of four admitted; operator log:\n{operator_log(control_plane, core)}")
    waiting = sorted(n for n, w in workloads(api_client, job_namespace).items() if not admitted(w))
    assert len(waiting) == 2
    for name in waiting:
        workload = workloads(api_client, job_namespace)[name]
        assert workload["spec"]["queueName"] == LOCAL_QUEUE
        reserved = condition(workload, "QuotaReserved")
        assert reserved["status"] == "False" and "insufficient unused quota for cpu" in reserved["message"], reserved
        assert f"in flavor {cluster_queue}" in reserved["message"]
        eventually(lambda: phase(api_client, job_namespace, name) in ("Suspended", "Pending"), timeout=60,
                   message=f"{name} shown as waiting")
        assert name not in trainer_pods_running(core, job_namespace)

    # As the first ones finish, the others are admitted; never more than two at once.
    most_at_once = 0
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        most_at_once = max(most_at_once, len(trainer_pods_running(core, job_namespace)),
                           sum(admitted(w) for w in workloads(api_client, job_namespace).values()))
        phases = {name: phase(api_client, job_namespace, name) for name in names}
        if all(p in ("Succeeded", "Failed") for p in phases.values()):
            break
        time.sleep(1)
    assert phases == dict.fromkeys(names, "Succeeded"), (phases, operator_log(control_plane, core))
    assert most_at_once == 2
    for name in names:
        assert get_job(api_client, job_namespace, name)["status"]["progress"]["step"] == 8


@pytest.fixture
def priority_classes(api_client):
    scheduling = client.SchedulingV1Api(api_client)
    names = {"e2e-low": 100, "e2e-high": 1000}
    for name, value in names.items():
        scheduling.create_priority_class({"metadata": {"name": name}, "value": value,
                                          "description": "kubetune e2e: Kueue preemption"})
    yield names
    for name in names:
        scheduling.delete_priority_class(name)


def pod_logs(control_plane, namespace: str, pod: str) -> list[str]:
    """The trainer log of every pod of that name, oldest first (a preempted pod is re-created)."""
    dirs = sorted(control_plane.kubelet_state.glob(f"pods/{namespace}_{pod}_*"), key=lambda d: d.stat().st_mtime)
    return [(d / "logs" / "pytorch.log").read_text() for d in dirs if (d / "logs" / "pytorch.log").exists()]


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_from_its_checkpoint(
        control_plane, api_client, core, operator_release, job_namespace, inputs_in_s3, queue, priority_classes):
    queue(cpus=1, preemption={"withinClusterQueue": "LowerPriority"})
    every, max_steps = 5, 30
    low = queued_job(inputs_in_s3, "low", maxSteps=max_steps)
    low["spec"]["checkpoints"]["everySteps"] = every
    low["spec"]["scheduling"]["priorityClassName"] = "e2e-low"
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(low))

    def step_of(name: str) -> int:
        return ((get_job(api_client, job_namespace, name).get("status") or {}).get("progress") or {}).get("step", 0)
    seen = eventually(lambda: step_of("low") >= every + 3 and step_of("low"), timeout=400, interval=0.5,
                      message=lambda: f"low past its first checkpoint; operator log:\n{operator_log(control_plane, core)}")

    # A higher-priority job arrives at a full queue: Kueue evicts the running one to admit it.
    high = queued_job(inputs_in_s3, "high", maxSteps=8)
    high["spec"]["scheduling"]["priorityClassName"] = "e2e-high"
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(high))
    eventually(lambda: (condition(workloads(api_client, job_namespace).get("low", {}), "Preempted") or {})
               .get("status") == "True", timeout=120, interval=1, message="low preempted")
    eventually(lambda: phase(api_client, job_namespace, "low") == "Suspended", timeout=120, interval=1,
               message="low shown Suspended while preempted")

    for name in ("high", "low"):
        eventually(lambda: phase(api_client, job_namespace, name) in ("Succeeded", "Failed"), timeout=600, interval=2,
                   message=lambda: f"{name} finished; operator log:\n{operator_log(control_plane, core)}")
    logs = pod_logs(control_plane, job_namespace, "low-master-0")
    assert phase(api_client, job_namespace, "high") == "Succeeded"
    assert phase(api_client, job_namespace, "low") == "Succeeded", logs[-1][-3000:]
    assert step_of("low") == max_steps

    # The preempted pod took a last checkpoint on SIGTERM; its successor resumed there, in the same run.
    assert len(logs) == 2, [log[-500:] for log in logs]
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", logs[0])
    resumed = re.search(r"resumed from (\S+) at step (\d+)", logs[1])
    assert stopped and resumed, (logs[0][-2000:], logs[1][-2000:])
    assert int(resumed.group(2)) == int(stopped.group(1)) >= seen
    assert "/v0/checkpoint-" in resumed.group(1), "the same run version continues"
    # At most one checkpoint interval is trained twice (here none: the SIGTERM checkpoint is the newest).
    assert seen - int(resumed.group(2)) <= every
