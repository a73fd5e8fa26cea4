"""Hub models mirrored into S3 once, against a local stand-in for the Hugging Face Hub's file API
(kubetune_dev.hub_standin; no hub is reachable here) and the real S3 server of the session.

The stand-in serves a tiny model written with write_tiny_model and counts each file's downloads.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from click.testing import CliRunner

from kubetune_api.hub import HubInput
from kubetune_api.spec import TrainingJob
from kubetune_dev.hub_standin import HubStandIn
from kubetune_trainer.models import hub_stage
from kubetune_trainer.errors import ConfigError, InputsInFlux
from kubetune_trainer.storage import hub, s3
from kubetune_trainer.storage.uri import parse_s3
from kubetune_trainer.models.tiny_models import write_tiny_model

TOKEN = "hf_standin_token"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # Configs only: these tests move files, they never load them.
    return write_tiny_model("sd15", tmp_path_factory.mktemp("hub-model") / "sd15", full_size=True, config_only=True)


@pytest.fixture
def stand_in(tiny_model, tmp_path, monkeypatch):
    """The hub stand-in on 127.0.0.1 with org/tiny (open) and org/gated (needs TOKEN); stopped after."""
    with HubStandIn() as server:
        server.publish("org/tiny", tiny_model)
        server.publish("org/gated", tiny_model, token=TOKEN)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
        yield server


def model_files(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_model_from_the_stand_in_is_mirrored_once(stand_in, tiny_model, bucket, tmp_path):
    item = HubInput("spec.model.pretrained", "org/tiny", "main", "spec.model.revision")
    commit = hub.resolve_commit(item, None)
    uri = hub.mirror(item, commit, f"s3://{bucket}/models", None, tmp_path / "staging")
    again = hub.mirror(item, commit, f"s3://{bucket}/models", None, tmp_path / "staging")

    assert uri == again == f"s3://{bucket}/models/hub/org/tiny/{commit}"
    assert set(s3.list_objects(parse_s3(uri))) == model_files(tiny_model) | {hub.MARKER}
    assert stand_in.downloads_of("org/tiny") == {name: 1 for name in model_files(tiny_model)}


def test_concurrent_downloaders_download_each_file_once(stand_in, tiny_model, bucket, tmp_path):
    item = HubInput("spec.model.pretrained", "org/tiny", "main", "spec.model.revision")
    commit = hub.resolve_commit(item, None)
    results, errors = [], []

    def one_pod(index: int) -> None:
        try:
            results.append(hub.mirror(item, commit, f"s3://{bucket}/m", None, tmp_path / f"pod-{index}"))
        except Exception as err:  # pragma: no cover - reported by the assertion below
            errors.append(err)

    pods = [threading.Thread(target=one_pod, args=(i,)) for i in range(4)]
    for pod in pods:
        pod.start()
    for pod in pods:
        pod.join(timeout=120)
    assert not errors and len(set(results)) == 1 and len(results) == 4
    assert stand_in.downloads_of("org/tiny") == {name: 1 for name in model_files(tiny_model)}


def test_a_dead_downloaders_lock_is_taken_over(stand_in, bucket, tmp_path, monkeypatch):
    item = HubInput("spec.model.pretrained", "org/tiny", "main")
    commit = hub.resolve_commit(item, None)
    lock = hub.lock_of(f"s3://{bucket}/m", "org/tiny", commit)
    s3.write_text(lock, "a pod that died")
    monkeypatch.setenv("KUBETUNE_HUB_LOCK_STALE_SECONDS", "1")
    time.sleep(2.1)  # S3 times are whole seconds
    uri = hub.mirror(item, commit, f"s3://{bucket}/m", None, tmp_path / "staging")
    assert hub.is_mirrored(uri) and s3.read_text(lock) is None


@pytest.mark.parametrize("token, status", [(None, 401), ("hf_wrong", 403)])
def test_a_gated_model_without_its_token_fails_in_one_line_naming_the_token_field(stand_in, token, status):
    item = HubInput("spec.model.vae", "org/gated", "main")
    with pytest.raises(ConfigError) as refused:
        hub.resolve_commit(item, token)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("spec.model.vae: org/gated is gated or private")
    assert f"({status})" in message and "spec.model.hubTokenSecret" in message
    assert hub.resolve_commit(item, TOKEN) == stand_in.models["org/gated"].refs["main"]


def test_a_missing_revision_is_named(stand_in):
    item = HubInput("spec.model.pretrained", "org/tiny", "v9", "spec.model.revision")
    with pytest.raises(ConfigError, match=r"^spec.model.revision: revision 'v9' not found in org/tiny"):
        hub.resolve_commit(item, None)


def test_a_hub_out_of_reach_is_one_retryable_line(monkeypatch):
    from kubetune_api.ports import free_listen_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_listen_port()}")  # nothing listens there
    with pytest.raises(InputsInFlux, match=r"^spec.model.pretrained: cannot reach the hub at http://127.0.0.1:\d+ "):
        hub.resolve_commit(HubInput("spec.model.pretrained", "org/tiny", "main"), None)


def job_of(manifest: dict, bucket: str) -> TrainingJob:
    manifest["metadata"].update(name="hubjob", namespace="ns")
    manifest["spec"]["model"].update(pretrained="org/tiny", revision="main", mirrorUri=f"s3://{bucket}/mirror")
    manifest["spec"]["checkpoints"] = {"uri": f"s3://{bucket}/ckpt"}
    return TrainingJob.model_validate(manifest)


def test_a_branch_is_resolved_at_the_runs_first_start_and_recorded(stand_in, tiny_model, bucket, monkeypatch,
                                                                    example_manifest):
    job = job_of(example_manifest, bucket)
    monkeypatch.setenv("KUBETUNE_RUN_ID", "uid-1")
    first = hub_stage.place_hub_models(job, None, hub.JOB_TOKEN_HINT)
    pinned = stand_in.models["org/tiny"].refs["main"]
    assert first == {"spec.model.pretrained": f"s3://{bucket}/mirror/hub/org/tiny/{pinned}"}
    record = json.loads(s3.read_text(parse_s3(f"s3://{bucket}/ckpt/ns/hubjob/hub-revisions/uid-1.json")))
    assert record["spec.model.pretrained"] == {"repo": "org/tiny", "revision": "main", "commit": pinned}

    moved = stand_in.publish("org/tiny", tiny_model)  # the branch moves on while the run goes on
    assert moved != pinned
    assert hub_stage.place_hub_models(job, None, hub.JOB_TOKEN_HINT) == first  # a restart: the run's commit
    monkeypatch.setenv("KUBETUNE_RUN_ID", "uid-2")  # a new run of the job takes the branch as it is now
    assert hub_stage.place_hub_models(job, None, hub.JOB_TOKEN_HINT)["spec.model.pretrained"].endswith(moved)


def test_kubetune_models_mirror_does_it_ahead_of_time(stand_in, tiny_model, bucket):
    from kubetune_cli.main import cli

    done = CliRunner().invoke(cli, ["models", "mirror", "org/tiny", "--revision", "main", "--to", f"s3://{bucket}/m"])
    commit = stand_in.models["org/tiny"].refs["main"]
    assert done.exit_code == 0, done.output
    assert f"s3://{bucket}/m/hub/org/tiny/{commit}" in done.output
    assert hub.is_mirrored(f"s3://{bucket}/m/hub/org/tiny/{commit}")

    gated = CliRunner().invoke(cli, ["models", "mirror", "org/gated", "--to", f"s3://{bucket}/m"])
    assert gated.exit_code == 2 and gated.output.count("\n") == 1
    assert "org/gated is gated or private" in gated.output and "HF_TOKEN" in gated.output
    local = CliRunner().invoke(cli, ["models", "mirror", "org/tiny", "--to", "/tmp/mirror"])
    assert local.exit_code == 2 and "--to:" in local.output


def test_a_local_run_without_a_mirror_reads_the_pinned_commit_from_the_hub_cache(stand_in, tiny_model,
                                                                                 example_manifest):
    example_manifest["spec"]["model"].update(pretrained="org/tiny", revision="main")
    placed = hub_stage.hub_locations(TrainingJob.model_validate(example_manifest))  # no run id, no mirror
    commit = stand_in.models["org/tiny"].refs["main"]
    folder = placed["spec.model.pretrained"]
    assert folder.startswith(os.environ["HF_HOME"]) and folder.endswith(f"/snapshots/{commit}")
    assert model_files(type(tiny_model)(folder)) == model_files(tiny_model)
