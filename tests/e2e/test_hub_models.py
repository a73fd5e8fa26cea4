"""A gated hub model on the local control plane, served by a local stand-in for the Hugging Face
Hub's file API (kubetune_dev.hub_standin: no hub is reachable here), mirrored once into S3.

A 2-node job names the model by its hub id, its token by a Secret, and the chart names the mirror
(models.mirrorUri) and the stand-in (models.hubEndpoint). Its rank-0 pod is deleted twice mid-run:
three starts of two nodes, six models stages, and the stand-in serves each file exactly once.
"""
from __future__ import annotations

import json
import secrets

import pytest
import yaml

from kubetune_dev.hub_standin import HubStandIn
from kubetune_trainer.tiny_models import write_tiny_model
from tests.e2e.conftest import install_chart, uninstall_chart
from tests.e2e.jobs import BUCKET, example_job, kubectl
from tests.e2e.test_preemption import PodHistory, trainer_logs, wait_for_step, wait_until_finished

pytestmark = pytest.mark.e2e

MODEL = "standin-org/tiny-sd15"
TOKEN = "hf_" + secrets.token_hex(8)
MAX_STEPS, EVERY = 24, 4


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
    core.create_namespaced_secret(job_namespace, {"metadata": {"name": "hf-token"}, "stringData": {"HF_TOKEN": TOKEN}})
    name = "hub-model"
    manifest = example_job(inputs_in_s3, name, f"runs/{name}", maxSteps=MAX_STEPS, batchSize=1)
    manifest["spec"]["model"].update(pretrained=MODEL, revision="main", hubTokenSecret="hf-token")
    manifest["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0}
    manifest["spec"]["checkpoints"].update(everySteps=EVERY, keepLast=2)
    pods = PodHistory(core, job_namespace, backend)
    try:
        kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
        for step in (EVERY + 2, 3 * EVERY + 2):  # two restarts, each past a checkpoint
            wait_for_step(api_client, core, control_plane, job_namespace, name, step)
            core.delete_namespaced_pod(pods.pods(name, 0)[-1][0], job_namespace)
        final = wait_until_finished(api_client, job_namespace, name)
        logs = trainer_logs(control_plane, job_namespace, name, 0, pods)
    finally:
        pods.stop()
    assert final["status"]["phase"] == "Succeeded", (final["status"], logs[-1][-3000:])
    assert len(pods.pods(name, 0)) == 3 and len(pods.pods(name, 1)) == 3, "each node started three times"

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
