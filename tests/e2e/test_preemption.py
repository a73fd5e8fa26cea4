"""Preemption, elastic resume and resizing of a 2-node x 2-process CPU job on the local control plane.

A lost pod (preemption, eviction, node failure) stops the whole job: every rank takes a last
checkpoint together and exits 143, which the PyTorchJob's ExitCode policy retries; the pods the
training operator re-creates continue the same run version. A suspended job may change its size
and resumes from the same checkpoint on the new number of processes.
"""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
import yaml
from kubernetes import client, watch

from tests.e2e.jobs import BUCKET, example_job, get_job, kubectl, operator_log, phase
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

MAX_STEPS, EVERY = 40, 5
PAST_FIRST_CHECKPOINT = 8  # the step at which a test stops the job


def two_by_two(inputs: dict, name: str) -> dict:
    """The example on 2 CPU pods x 2 processes; batchSize 1 per process keeps the global batch at 4."""
    manifest = example_job(inputs, name, f"runs/{name}", maxSteps=MAX_STEPS, batchSize=1)
    manifest["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0}
    manifest["spec"]["distributed"] = {"processesPerNode": 2}
    manifest["spec"]["checkpoints"].update(everySteps=EVERY, keepLast=2)
    return manifest


class PodHistory:
    """Every state of a namespace's pods, as a controller watching them sees it (a pod deleted
    and re-created under the same name is a new UID)."""

    def __init__(self, core: client.CoreV1Api, namespace: str):
        self.events: list[dict] = []
        self._watch = watch.Watch()
        self._stopping = False
        self._thread = threading.Thread(target=self._follow, args=(core, namespace), daemon=True)
        self._thread.start()

    def _follow(self, core, namespace) -> None:
        try:
            self._record(core, namespace)
        except Exception:
            if not self._stopping:  # else: the connection closed as the test ended, as expected
                raise

    def _record(self, core, namespace) -> None:
        for event in self._watch.stream(core.list_namespaced_pod, namespace):
            pod = event["object"]
            container = next((s for s in pod.status.container_statuses or [] if s.name == "pytorch"), None)
            terminated = container.state.terminated if container and container.state else None
            self.events.append({"type": event["type"], "name": pod.metadata.name, "uid": pod.metadata.uid,
                                "phase": pod.status.phase, "restarts": container.restart_count if container else 0,
                                "exit_code": terminated.exit_code if terminated else None})

    def stop(self) -> None:
        self._stopping = True
        self._watch.stop()

    def uids(self, name: str) -> list[str]:
        """The pods of that name in order of creation."""
        return list(dict.fromkeys(e["uid"] for e in self.events if e["name"] == name))

    def exit_codes(self, name: str) -> list[set[int]]:
        """Per pod of that name, in order: the exit codes its trainer container reported."""
        return [{e["exit_code"] for e in self.events if e["uid"] == uid and e["exit_code"] is not None}
                for uid in self.uids(name)]

    def max_restarts(self, name: str) -> int:
        return max((e["restarts"] for e in self.events if e["name"] == name), default=0)


@pytest.fixture
def pods(core, job_namespace):
    history = PodHistory(core, job_namespace)
    yield history
    history.stop()


def trainer_logs(control_plane, namespace: str, pod: str, history: PodHistory) -> list[str]:
    """The trainer's log of every pod of that name, oldest first."""
    return [(control_plane.kubelet_state / "pods" / f"{namespace}_{pod}_{uid}" / "logs" / "pytorch.log").read_text()
            for uid in history.uids(pod)]


def wait_for_step(api_client, core, control_plane, namespace: str, name: str, step: int) -> int:
    """Wait until status.progress reports STEP or later; the step seen."""
    def reached():
        status = get_job(api_client, namespace, name).get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            pytest.fail(f"finished before step {step} was seen: {status}")
        seen = (status.get("progress") or {}).get("step", 0)
        return seen if seen >= step else None

    return eventually(reached, timeout=400, interval=0.5,
                      message=lambda: f"step {step}; operator log:\n" + operator_log(control_plane, core))


def wait_until_finished(api_client, namespace: str, name: str) -> dict:
    return eventually(lambda: phase(api_client, namespace, name) in ("Succeeded", "Failed")
                      and get_job(api_client, namespace, name), timeout=600, interval=2,
                      message=f"TrainingJob {name} finished")


def assert_one_run_to_the_end(s3, namespace: str, name: str) -> None:
    """The run reached the last step in version v0 and no other version was started."""
    run = f"runs/{name}/{namespace}/{name}/v0"
    state = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{run}/checkpoint-{MAX_STEPS}/trainer_state.json")["Body"]
                       .read())
    assert state["position"]["step"] == MAX_STEPS
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{name}/")["Contents"]}
    assert f"{run}/pytorch_lora_weights.safetensors" in keys
    assert not any(key.startswith(f"runs/{name}/{namespace}/{name}/v1/") for key in keys), "a second run started"


def stopped_and_resumed(first_log: str, resumed_log: str) -> tuple[int, int]:
    """The step a trainer checkpointed after SIGTERM and the step the run's main process resumed at."""
    stopped = re.search(r"stopped by (?:SIGTERM|another process.s stop request \(SIGTERM\)) after step (\d+)", first_log)
    resumed = re.search(r"resumed from \S+ at step (\d+)", resumed_log)
    assert stopped, first_log[-3000:]
    assert resumed, resumed_log[-3000:]
    return int(stopped.group(1)), int(resumed.group(1))


def test_a_2x2_job_whose_master_pod_is_deleted_continues_its_run(
        control_plane, api_client, core, operator_release, job_namespace, inputs_in_s3, s3, pods):
    lose_a_pod_mid_run("master", control_plane, api_client, core, job_namespace, inputs_in_s3, s3, pods)


def test_a_2x2_job_whose_worker_pod_is_deleted_continues_its_run(
        control_plane, api_client, core, operator_release, job_namespace, inputs_in_s3, s3, pods):
    lose_a_pod_mid_run("worker", control_plane, api_client, core, job_namespace, inputs_in_s3, s3, pods)


def lose_a_pod_mid_run(lost: str, control_plane, api_client, core, job_namespace, inputs_in_s3, s3, pods) -> None:
    """A pod deleted mid-run: both nodes checkpoint and exit 143 (the deleted one on SIGTERM, the other
    because its ranks agree to stop with them), both are re-created, and the run ends in the same
    version having lost no step beyond the last checkpoint."""
    name = f"lost-{lost}"
    started = time.monotonic()
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(two_by_two(inputs_in_s3, name)))
    seen = wait_for_step(api_client, core, control_plane, job_namespace, name, PAST_FIRST_CHECKPOINT)
    core.delete_namespaced_pod(f"{name}-{lost}-0", job_namespace)

    final = wait_until_finished(api_client, job_namespace, name)
    master_logs = trainer_logs(control_plane, job_namespace, f"{name}-master-0", pods)
    worker_logs = trainer_logs(control_plane, job_namespace, f"{name}-worker-0", pods)
    assert final["status"]["phase"] == "Succeeded", (final["status"], master_logs[-1][-3000:], worker_logs[-1][-3000:])
    assert_one_run_to_the_end(s3, job_namespace, name)

    # Each node stopped once with 143 (the kubelet reports a deleted pod's exit too) and was
    # re-created by the training operator as a new pod: no container restarts in place.
    for pod in (f"{name}-master-0", f"{name}-worker-0"):
        eventually(lambda: len(pods.exit_codes(pod)) == 2 and pods.exit_codes(pod)[1], timeout=30,
                   message=lambda: f"{pod} ended twice: {pods.exit_codes(pod)}")
        assert pods.exit_codes(pod) == [{143}, {0}], pod
        assert pods.max_restarts(pod) == 0
    # Both nodes stopped at the same step boundary; the new pods resumed there.
    signalled, other = (worker_logs, master_logs) if lost == "worker" else (master_logs, worker_logs)
    stopped, resumed = stopped_and_resumed(signalled[0], master_logs[1])  # rank 0 (the master) logs the resume
    assert re.search(rf"stopped\b.* after step {stopped};", other[0]), other[0][-3000:]
    assert resumed == stopped and resumed >= seen - EVERY, (seen, stopped, resumed)
    print(f"\n{name}: {time.monotonic() - started:.0f} s; step {seen} seen, stopped after {stopped}, "
          f"resumed at {resumed}")


def test_a_suspended_2x2_job_resized_to_1x2_resumes_its_run_on_2_processes(
        control_plane, api_client, core, operator_release, job_namespace, inputs_in_s3, s3, pods):
    name = "resized"
    started = time.monotonic()
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(two_by_two(inputs_in_s3, name)))
    wait_for_step(api_client, core, control_plane, job_namespace, name, PAST_FIRST_CHECKPOINT)

    # Suspend: the pods take a last checkpoint and go.
    kubectl(control_plane, "patch", "tj", name, "-n", job_namespace, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    eventually(lambda: phase(api_client, job_namespace, name) == "Suspended"
               and not core.list_namespaced_pod(job_namespace, label_selector=f"kubetune.dev/trainingjob={name}").items,
               timeout=180, interval=1, message="Suspended with no pods left")

    assert pods.exit_codes(f"{name}-master-0") == [{143}] and pods.exit_codes(f"{name}-worker-0") == [{143}]

    # Resize while suspended: the child and the trainer config follow, with an Event saying so.
    kubectl(control_plane, "patch", "tj", name, "-n", job_namespace, "--type=merge",
            "-p", '{"spec": {"resources": {"nodes": 1}}}')
    jobs = client.CustomObjectsApi(api_client)

    def child_resized():
        child = jobs.get_namespaced_custom_object("kubeflow.org", "v1", job_namespace, "pytorchjobs", name)["spec"]
        return set(child["pytorchReplicaSpecs"]) == {"Master"} and child["nprocPerNode"] == "2" and child

    child = eventually(child_resized, timeout=60, message=lambda: "child resized; operator log:\n"
                       + operator_log(control_plane, core))
    assert child["runPolicy"]["suspend"] is True, "resizing does not resume"
    config = yaml.safe_load(core.read_namespaced_config_map(f"{name}-config", job_namespace).data["trainingjob.yaml"])
    assert config["spec"]["resources"]["nodes"] == 1 and config["spec"]["distributed"]["processesPerNode"] == 2
    events = json.loads(kubectl(control_plane, "get", "events", "-n", job_namespace, "--field-selector",
                                f"involvedObject.name={name},involvedObject.kind=TrainingJob,reason=Resized",
                                "-o", "json").stdout)["items"]
    assert [e["message"] for e in events] == [
        "resized from 2x2 processes to 1x2 processes; the run continues from its latest checkpoint"]

    # Resume: one pod of 2 processes continues the same run from the checkpoint 4 processes wrote.
    kubectl(control_plane, "patch", "tj", name, "-n", job_namespace, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    final = wait_until_finished(api_client, job_namespace, name)
    master_logs = trainer_logs(control_plane, job_namespace, f"{name}-master-0", pods)
    assert final["status"]["phase"] == "Succeeded", (final["status"], master_logs[-1][-3000:])
    assert_one_run_to_the_end(s3, job_namespace, name)
    assert len(master_logs) == 2 and len(pods.uids(f"{name}-worker-0")) == 1, "no worker after the resize"
    stopped, resumed = stopped_and_resumed(master_logs[0], master_logs[1])
    assert resumed == stopped
    assert "the checkpoint was written by 4 process(es), this run has 2" in master_logs[1], master_logs[1][-3000:]
    assert "training resized: 40 steps, 2 process(es)" in master_logs[1], master_logs[1][-3000:]
    print(f"\n{name}: {time.monotonic() - started:.0f} s; stopped after {stopped}, resumed at {resumed}")
