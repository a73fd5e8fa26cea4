"""A gated hub model on the local control plane, served by a local stand-in for the Hugging Face
Hub's file API (kubetune_dev.hub_standin: no hub is reachable here), mirrored once into S3.

A 2-node job names the model by its hub id, its token by a Secret, and the chart names the mirror
(models.mirrorUri) and the stand-in (models.hubEndpoint). Its rank-0 pod is deleted twice mid-run:
three starts of two nodes, six models stages, and the stand-in serves each file exactly once.

Each delete targets the pod (name and UID) whose own trainer log has reached the step, and lands
well before the last step: a resumed pod trains a few steps a second here, and a delete that
arrives after the run's end restarts nothing (CI once saw two starts of a Succeeded job).
"""
from __future__ import annotations

import json
import secrets

import pytest
import yaml
from kubernetes import client

from kubetune_api.contract import TrainerLog
from kubetune_dev.hub_standin import HubStandIn
from kubetune_trainer.models.tiny_models import write_tiny_model
from tests.e2e.conftest import install_chart, uninstall_chart
from tests.e2e.jobs import BUCKET, example_job, kubectl, phase
from tests.e2e.test_preemption import PodHistory, trainer_logs, wait_until_finished
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

MODEL = "standin-org/tiny-sd15"
TOKEN = "hf_" + secrets.token_hex(8)
# Two restarts, each past a checkpoint, the second 26 steps before the end: the trainer runs on a
# few steps after the step is seen (log poll, delete, SIGTERM at the next step boundary).
MAX_STEPS, EVERY = 40, 4
RESTART_AT = (EVERY + 2, 3 * EVERY + 2)


def wait_for_pod_step(control_plane, api_client, pods: PodHistory, namespace: str, name: str, step: int,
                      done: set[str]) -> tuple[str, str]:
    """(name, uid) of the newest rank-0 pod, not one of DONE (UIDs already deleted), once its own
    trainer log reports STEP or later. Its log, not status.progress: the status lags by a progress
    poll and, after a restart, still holds the previous pod's step until the new pod is read."""
    def reached():
        if phase(api_client, namespace, name) in ("Succeeded", "Failed"):
            pytest.fail(f"finished before step {step} was seen; rank-0 pods: {pods.pods(name, 0)}")
        current = [(pod, uid) for pod, uid in pods.pods(name, 0) if uid not in done][-1:]
        if not current:
            return None
        pod, uid = current[0]
        log = control_plane.kubelet_state / "pods" / f"{namespace}_{pod}_{uid}" / "logs" / f"{pods.container}.log"
        steps = TrainerLog.parse_steps(log.read_text()) if log.is_file() else []
        return (pod, uid) if steps and steps[-1][0] >= step else None

    return eventually(reached, timeout=400, interval=0.25, message=f"a new rank-0 pod of {name} at step {step}")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The hub stand-in on 127.0.0.1 serving the tiny SD1.5 as a gated model; stopped after the module."""
    with HubStandIn() as server:
        server.publish(MODEL, write_tiny_model("sd15", tmp_path_factory.mktemp("hub") / "sd15"), token=TOKEN)
        yield server


@pytest.fixture(scope="module")
def mirror_release(control_plane, hub):
    mirror = f"s3://{BUCKET}/hub-mirror-{secrets.token_hex(3)}"
    install_chart(control_plane, "pytorchjob", "--set", f"models.mirrorUri={mirror}",
                  "--set", f"models.hubEndpoint={hub.endpoint}")
    yield mirror
    uninstall_chart(control_plane)


@pytest.mark.parametrize("backend", ["pytorchjob"], indirect=True)
def test_a_2_node_job_restarted_twice_downloads_each_file_from_the_hub_stand_in_once(
        control_plane, api_client, core, backend, mirror_release, job_namespace, inputs_in_s3, s3, hub):
    """Over a minute: a 2-node job started three times (two restarts at checkpointed steps), since what it shows
    is that a restart downloads nothing again."""
    core.create_namespaced_secret(job_namespace, {"metadata": {"name": "hf-token"}, "stringData": {"HF_TOKEN": TOKEN}})
    name = "hub-model"
    manifest = example_job(inputs_in_s3, name, f"runs/{name}", maxSteps=MAX_STEPS, batchSize=1)
    manifest["spec"]["model"].update(pretrained=MODEL, revision="main", hubTokenSecret="hf-token")
    manifest["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0}
    manifest["spec"]["checkpoints"].update(everySteps=EVERY, keepLast=2)
    pods = PodHistory(core, job_namespace, backend)
    try:
        kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
        deleted: set[str] = set()
        for step in RESTART_AT:
            pod, uid = wait_for_pod_step(control_plane, api_client, pods, job_namespace, name, step, deleted)
            core.delete_namespaced_pod(pod, job_namespace,
                                       body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)))
            deleted.add(uid)
        final = wait_until_finished(api_client, job_namespace, name)
        logs = trainer_logs(control_plane, job_namespace, name, 0, pods)
        # Each node's trainer started three times, as three pods (the controller re-creates a lost
        # pod, it restarts no container in place): the first two stopped mid-run with 143, the last
        # finished the run. The kubelet reports a deleted pod's exit too, a moment after the job ends.
        for node in (0, 1):
            eventually(lambda: len(pods.exit_codes(name, node)) == 3 and all(pods.exit_codes(name, node)),
                       timeout=30, message=lambda: f"node {node}'s three pods ended: {pods.exit_codes(name, node)} "
                       f"(job {final['status']['phase']})")
    finally:
        pods.stop()
    assert final["status"]["phase"] == "Succeeded", (final["status"], logs[-1][-3000:])
    for node in (0, 1):
        assert pods.exit_codes(name, node) == [{143}, {143}, {0}], (node, pods.pods(name, node))
        assert pods.max_restarts(name, node) == 0, node

    commit = hub.models[MODEL].refs["main"]
    served = hub.downloads_of(MODEL)
    assert served and set(served.values()) == {1}, served
    assert set(served) == set(hub.models[MODEL].commits[commit])
    prefix = f"{mirror_release.removeprefix(f's3://{BUCKET}/')}/hub/{MODEL}/{commit}/"
    mirrored = {o["Key"][len(prefix):] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    assert set(served) <= mirrored
    record = json.loads(s3.get_object(Bucket=BUCKET, Key=f"runs/{name}/{job_namespace}/{name}/hub-revisions/"
                                      f"{final['metadata']['uid']}.json")["Body"].read())
    assert record["spec.model.pretrained"]["commit"] == commit
    assert all(TOKEN not in log for log in logs), "the token is never logged"


@pytest.mark.parametrize("backend", ["pytorchjob"], indirect=True)
def test_a_gated_model_without_its_token_fails_in_one_line(
        control_plane, api_client, core, backend, mirror_release, job_namespace, inputs_in_s3, hub):
    name = "hub-gated"
    manifest = example_job(inputs_in_s3, name, f"runs/{name}")
    manifest["spec"]["model"].update(pretrained=MODEL)  # no hubTokenSecret
    pods = PodHistory(core, job_namespace, backend)
    try:
        kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
        final = wait_until_finished(api_client, job_namespace, name)
        log = trainer_logs(control_plane, job_namespace, name, 0, pods)[-1]
    finally:
        pods.stop()
    assert final["status"]["phase"] == "Failed", final["status"]
    assert pods.exit_codes(name, 0)[-1] == {2}, "bad input: exit 2, not retried"
    refusal = [line for line in log.splitlines() if "is gated or private" in line]
    assert len(refusal) == 1 and "Traceback" not in log, log[-3000:]
    assert refusal[0].startswith(f"kubetune models: spec.model.pretrained: {MODEL} is gated or private")
    assert "(401) without a token" in refusal[0] and "spec.model.hubTokenSecret" in refusal[0]
