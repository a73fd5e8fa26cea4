"""Preemption, elastic resume and resizing of a 2-node x 2-process CPU job on the local control plane.

A lost pod (preemption, eviction, node failure) stops the whole job: every rank takes a last
checkpoint together and exits 143, which the child job retries (a PyTorchJob's ExitCode policy; a
TrainJob's runtime restarts its JobSet); the re-created pods continue the same run version. A
suspended job may change its size and resumes from the same checkpoint on the new number of
processes. One job per backend goes through all of it (LOST_NODES: a PyTorchJob also loses the node that
is not rank 0's).
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest
import yaml
from kubernetes import client, watch

from kubetune_dev.podrunner import POD_DIR_LABEL
from tests.e2e.jobs import BUCKET, backend_of, example_job, get_child, get_job, kubectl, operator_log, phase
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

# Stopped at step 8 or later, again 8 or more steps after each resume, suspended 3 or more after the
# last resume. A stop lands 5-8 steps after the step the test saw (measured: 8 seen, stopped after 13;
# 23 seen, 29; suspended at 37): ~40 steps used, ~20 of margin before the end.
MAX_STEPS, EVERY = 60, 5
PAST_FIRST_CHECKPOINT = 8  # steps after a (re)start at which the test stops the job: past a checkpoint


def two_by_two(inputs: dict, name: str, image: str) -> dict:
    """The example on 2 CPU pods x 2 processes; batchSize 1 per process keeps the global batch at 4. Its pods
    run as real containers of IMAGE (our trainer image: the dev cluster runs `localhost/` images in podman)."""
    manifest = example_job(inputs, name, f"runs/{name}", maxSteps=MAX_STEPS, batchSize=1)
    manifest["spec"]["image"] = image
    manifest["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0}
    manifest["spec"]["distributed"] = {"processesPerNode": 2}
    manifest["spec"]["checkpoints"].update(everySteps=EVERY, keepLast=2)
    return manifest


def trainer_containers(control_plane, namespace: str, image: str) -> list[dict]:
    """The running containers of IMAGE that this dev cluster's kubelet started for pods of NAMESPACE (tests/images
    may run the same image beside it): their user and whether their root is read-only."""
    ids = subprocess.run(["podman", "ps", "--quiet", "--filter", f"ancestor={image}", "--filter",
                          f"label={POD_DIR_LABEL}={control_plane.kubelet_state / 'pods'}",
                          "--filter", f"name=_{namespace}_"], capture_output=True, text=True, check=True,
                         timeout=60).stdout.split()
    if not ids:
        return []
    inspected = json.loads(subprocess.run(["podman", "inspect", *ids], capture_output=True, text=True, check=True,
                                          timeout=60).stdout)
    return [{"user": c["Config"]["User"], "read_only": c["HostConfig"]["ReadonlyRootfs"]} for c in inspected]


def node_rank(pod, backend: str) -> int | None:
    """Which node of its job a pod is, from the labels its Kubeflow controller sets."""
    labels = pod.metadata.labels or {}
    if backend == "pytorchjob":  # the Master is node 0, Worker i is node i + 1
        replica = labels.get("training.kubeflow.org/replica-type")
        index = labels.get("training.kubeflow.org/replica-index")
        return None if replica is None or index is None else (0 if replica == "master" else int(index) + 1)
    index = labels.get("batch.kubernetes.io/job-completion-index")  # TrainJob: the node Job's pod index
    return None if index is None else int(index)


class PodHistory:
    """Every state of a namespace's pods, as a controller watching them sees it, by node rank (a
    pod re-created for the same node is a new UID, under the same name or, in a JobSet, a new one)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, backend: str):
        self.events: list[dict] = []
        self.backend, self.container = backend, backend_of(backend).container
        self._watch = watch.Watch()
        self._stopping = False
        self.failure: Exception | None = None  # the watch ended early: what it saw is incomplete
        self._thread = threading.Thread(target=self._follow, args=(core, namespace), daemon=True)
        self._thread.start()

    def _follow(self, core, namespace) -> None:
        try:
            self._record(core, namespace)
        except Exception as err:
            if not self._stopping:  # else: the connection closed as the test ended, as expected
                self.failure = err  # a daemon thread's exception reaches no test: pods() reports it
                raise

    def _record(self, core, namespace) -> None:
        for event in self._watch.stream(core.list_namespaced_pod, namespace):
            pod = event["object"]
            container = next((s for s in pod.status.container_statuses or [] if s.name == self.container), None)
            terminated = container.state.terminated if container and container.state else None
            self.events.append({"type": event["type"], "name": pod.metadata.name, "uid": pod.metadata.uid,
                                "job": (pod.metadata.labels or {}).get("kubetune.dev/trainingjob"),
                                "node": node_rank(pod, self.backend),
                                "phase": pod.status.phase, "restarts": container.restart_count if container else 0,
                                "exit_code": terminated.exit_code if terminated else None})

    def stop(self) -> None:
        self._stopping = True
        self._watch.stop()

    def pods(self, job: str, node: int) -> list[tuple[str, str]]:
        """(name, uid) of the pods that ran node NODE of JOB, in order of creation."""
        if self.failure is not None:
            raise AssertionError(f"the pod watch ended early, pods after it are missing: {self.failure!r}")
        return list(dict.fromkeys((e["name"], e["uid"]) for e in self.events if e["job"] == job and e["node"] == node))

    def exit_codes(self, job: str, node: int) -> list[set[int]]:
        """Per pod of that node, in order: the exit codes its trainer container reported."""
        return [{e["exit_code"] for e in self.events if e["uid"] == uid and e["exit_code"] is not None}
                for _, uid in self.pods(job, node)]

    def max_restarts(self, job: str, node: int) -> int:
        return max((e["restarts"] for e in self.events if e["job"] == job and e["node"] == node), default=0)


@pytest.fixture
def pods(core, job_namespace, backend):
    history = PodHistory(core, job_namespace, backend)
    yield history
    history.stop()


def trainer_logs(control_plane, namespace: str, job: str, node: int, history: PodHistory) -> list[str]:
    """The trainer's log of every pod that ran node NODE of JOB, oldest first."""
    return [(control_plane.kubelet_state / "pods" / f"{namespace}_{pod}_{uid}" / "logs" / f"{history.container}.log")
            .read_text() for pod, uid in history.pods(job, node)]


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


# What the job loses, in order. A PyTorchJob's controller re-creates a lost replica itself, so it
# loses node 0's pod (its Master) and then node 1's (a Worker); a JobSet restarts all of a TrainJob's
# nodes whichever pod failed, so losing node 1 would take a TrainJob the way losing node 0 does.
LOST_NODES = {"pytorchjob": (0, 1), "trainjob": (0,)}


def test_a_2x2_job_that_loses_pods_then_is_resized_to_1x2_continues_one_run_to_the_end(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3, s3, pods,
        built_images):
    """One job carries each story in turn (one job instead of one per story: each costs four trainer
    processes' start and a run to the end, ~80-120 s on the test machine; this test takes ~2-2.5 min):

    * a node's pod deleted mid-run: both nodes checkpoint and exit 143 (the deleted one on SIGTERM, the
      other because its ranks agree to stop with them), both are re-created, and the run goes on in
      the same version from the step they stopped at, having lost nothing;
    * then suspended: the pods take a last checkpoint and go; resized while suspended to 1 node x 2
      processes, the child and the trainer config follow with an Event saying so; resumed, one pod of
      2 processes continues the same run from the checkpoint 4 processes wrote, to the end.

    Its pods are REAL CONTAINERS of our trainer image, under the securityContext the operator renders: the
    SIGTERMs, the rendezvous between two pods' four processes and the exit codes all go through podman.
    """
    name = "preempted"
    lost_nodes = LOST_NODES[backend]
    started = time.monotonic()
    manifest = two_by_two(inputs_in_s3, name, built_images["trainer"])
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    wait_for_step(api_client, core, control_plane, job_namespace, name, 1)
    running = trainer_containers(control_plane, job_namespace, built_images["trainer"])
    assert [(c["user"], c["read_only"]) for c in running] == [("10001:10001", True)] * 2, \
        f"both nodes' pods train in containers of the image, as 10001 on a read-only root: {running}"
    resumed = 0
    for lost in lost_nodes:
        resumed = lose_a_pod_mid_run(lost, resumed, control_plane, api_client, core, job_namespace, name, pods)
    suspend_resize_and_resume(resumed, backend, control_plane, api_client, core, job_namespace, name, pods)

    final = wait_until_finished(api_client, job_namespace, name)
    rank0_logs = trainer_logs(control_plane, job_namespace, name, 0, pods)
    assert final["status"]["phase"] == "Succeeded", (final["status"], rank0_logs[-1][-3000:])
    assert_one_run_to_the_end(s3, job_namespace, name)
    # Each stop was the whole pod's (143; the kubelet reports a deleted pod's exit too), and each node
    # was re-created by its controller as a new pod: no container restarts in place. After the resize
    # only node 0 runs, to the end.
    stops = len(lost_nodes) + 1
    for node in (0, 1):
        ended = stops + 1 if node == 0 else stops
        eventually(lambda: len(pods.exit_codes(name, node)) == ended and all(pods.exit_codes(name, node)),
                   timeout=30, message=lambda: f"node {node} ended {ended} times: {pods.exit_codes(name, node)}")
        assert pods.exit_codes(name, node) == [{143}] * stops + ([{0}] if node == 0 else []), node
        assert pods.max_restarts(name, node) == 0
    assert len(pods.pods(name, 1)) == stops, "no second node after the resize"
    stopped, resumed = stopped_and_resumed(rank0_logs[-2], rank0_logs[-1])
    assert resumed == stopped
    assert "the checkpoint was written by 4 process(es), this run has 2" in rank0_logs[-1], rank0_logs[-1][-3000:]
    assert f"training {name}: {MAX_STEPS} steps, 2 process(es)" in rank0_logs[-1], rank0_logs[-1][-3000:]
    print(f"\n{name}: {time.monotonic() - started:.0f} s")


def lose_a_pod_mid_run(lost: int, resumed: int, control_plane, api_client, core, namespace: str, name: str,
                       pods: PodHistory) -> int:
    """Past a checkpoint after step RESUMED, node LOST's pod deleted: both nodes stop at one step
    boundary and their new pods resume there. Returns that step."""
    seen = wait_for_step(api_client, core, control_plane, namespace, name, resumed + PAST_FIRST_CHECKPOINT)
    rounds = len(pods.pods(name, 0))  # the pods running now are each node's ROUNDS-th
    assert len(pods.pods(name, 1)) == rounds, [pods.pods(name, node) for node in (0, 1)]
    core.delete_namespaced_pod(pods.pods(name, lost)[-1][0], namespace)

    def resumed_logs():
        """Both nodes' logs once their stopped pods have ended and rank 0's new pod has resumed."""
        if not all(len(pods.exit_codes(name, node)) >= rounds and pods.exit_codes(name, node)[rounds - 1]
                   and len(pods.pods(name, node)) > rounds for node in (0, 1)):
            return None
        try:
            logs = {node: trainer_logs(control_plane, namespace, name, node, pods) for node in (0, 1)}
        except FileNotFoundError:  # a new pod's container has not started yet
            return None
        return logs if len(logs[0]) > rounds and "resumed from" in logs[0][rounds] else None

    logs = eventually(resumed_logs, timeout=300, interval=1, message=lambda: f"node {lost}'s pod deleted at step "
                      f"{seen}: both nodes stopped and rank 0 resumed; pods {[pods.pods(name, n) for n in (0, 1)]}, "
                      f"exit codes {[pods.exit_codes(name, n) for n in (0, 1)]}")
    signalled, other = logs[lost][rounds - 1], logs[1 - lost][rounds - 1]
    stopped, resumed = stopped_and_resumed(signalled, logs[0][rounds])  # rank 0 (node 0) logs the resume
    assert re.search(rf"stopped\b.* after step {stopped};", other), other[-3000:]
    assert resumed == stopped and resumed >= seen - EVERY, (seen, stopped, resumed)
    print(f"\n{name}: node {lost}'s pod deleted; step {seen} seen, stopped after {stopped}, resumed at {resumed}")
    return resumed


def suspend_resize_and_resume(resumed: int, backend: str, control_plane, api_client, core, namespace: str, name: str,
                              pods: PodHistory) -> None:
    wait_for_step(api_client, core, control_plane, namespace, name, resumed + 3)
    running = {node: len(pods.pods(name, node)) for node in (0, 1)}  # each node's pod now is its RUNNING-th

    # Suspend: the pods take a last checkpoint and go.
    kubectl(control_plane, "patch", "tj", name, "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    eventually(lambda: phase(api_client, namespace, name) == "Suspended"
               and not core.list_namespaced_pod(namespace, label_selector=f"kubetune.dev/trainingjob={name}").items,
               timeout=180, interval=1, message="Suspended with no pods left")
    for node in (0, 1):
        eventually(lambda: len(pods.exit_codes(name, node)) == running[node] and pods.exit_codes(name, node)[-1],
                   timeout=30, message=lambda: f"node {node}'s suspended pod ended: {pods.exit_codes(name, node)}")
        assert pods.exit_codes(name, node)[-1] == {143}, node

    # Resize while suspended: the child (patched, or for a TrainJob replaced) and the trainer config
    # follow, with an Event saying so.
    kubectl(control_plane, "patch", "tj", name, "-n", namespace, "--type=merge",
            "-p", '{"spec": {"resources": {"nodes": 1}}}')

    def child_resized():
        child = get_child(api_client, backend, namespace, name)
        if not child:
            return None
        spec = child["spec"]
        if backend == "pytorchjob":
            done = set(spec["pytorchReplicaSpecs"]) == {"Master"} and spec["nprocPerNode"] == "2"
        else:
            done = spec["trainer"]["numNodes"] == 1 and spec["trainer"]["numProcPerNode"] == 2
        return done and child

    child = eventually(child_resized, timeout=120, message=lambda: "child resized; operator log:\n"
                       + operator_log(control_plane, core))
    assert backend_of(backend).is_suspended(child), "resizing does not resume"

    # The operator changes the child first and the config second (a failure in between leaves a gap
    # the retry sees), then says so in the Event: once the Event is there, both have followed. A
    # replaced TrainJob can be seen a moment before its config is patched.
    def resized_events():
        return json.loads(kubectl(control_plane, "get", "events", "-n", namespace, "--field-selector",
                                  f"involvedObject.name={name},involvedObject.kind=TrainingJob,reason=Resized",
                                  "-o", "json").stdout)["items"]

    events = eventually(resized_events, timeout=60, message="a Resized event")
    config = yaml.safe_load(core.read_namespaced_config_map(f"{name}-config", namespace).data["trainingjob.yaml"])
    assert config["spec"]["resources"]["nodes"] == 1 and config["spec"]["distributed"]["processesPerNode"] == 2
    assert [e["message"] for e in events] == [
        "resized from 2x2 processes to 1x2 processes; the run continues from its latest checkpoint"]

    # Resume: one pod of 2 processes continues the same run.
    kubectl(control_plane, "patch", "tj", name, "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": false}}')
