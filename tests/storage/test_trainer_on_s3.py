"""The trainer reads its model and data from s3:// and writes checkpoints and the LoRA there."""
from __future__ import annotations

import json
import re
import sys

import pytest
from click.testing import CliRunner

from kubetune_cli.main import cli

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import parse_s3
from tests.trainer.conftest import (captions_data, family_job, run_trainer, tiny_job, tiny_sd15,  # noqa: F401
                                    trainer_env, write_manifest)
from tests.trainer.test_distributed import train
from tests import warm_python

pytestmark = pytest.mark.slow


def upload_dir(local, uri):
    s3.upload_files(sorted(p for p in local.rglob("*") if p.is_file()), local, parse_s3(uri))


def test_training_from_and_to_s3_then_resuming_on_a_fresh_machine(bucket, tiny_job, tiny_sd15, captions_data,
                                                                  tmp_path, monkeypatch):
    upload_dir(tiny_sd15, f"s3://{bucket}/models/sd15")
    upload_dir(captions_data, f"s3://{bucket}/data/shapes")
    manifest = tiny_job(maxSteps=4)
    manifest["spec"]["model"]["pretrained"] = f"s3://{bucket}/models/sd15"
    manifest["spec"]["data"]["uri"] = f"s3://{bucket}/data/shapes"
    manifest["spec"]["checkpoints"].update(uri=f"s3://{bucket}/runs", everySteps=2, keepLast=1)
    monkeypatch.setenv("KUBETUNE_RUN_ID", "uid-of-the-trainingjob")  # the pod's restart continues the run
    first_machine = tmp_path / "machine-1"
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(first_machine / "cache"))
    monkeypatch.setenv("KUBETUNE_STAGING_DIR", str(first_machine / "staging"))
    first_machine.mkdir()
    run_trainer(manifest, first_machine)

    run = parse_s3(f"s3://{bucket}/runs/default/tiny/v0")
    objects = s3.list_objects(run)
    assert "pytorch_lora_weights.safetensors" in objects
    assert "checkpoint-4/manifest.json" in objects
    assert not any(k.startswith("checkpoint-2/") for k in objects), "keepLast: 1 prunes the bucket too"
    assert any(k.startswith("logs/events.out.tfevents") for k in objects)
    assert json.loads(s3.read_text(run.child("run.json")))["finished"] is True

    # What a user sees from a laptop: the run, its complete checkpoint, the final weights.
    listing = CliRunner().invoke(cli, ["checkpoints", "ls", f"s3://{bucket}/runs/default/tiny"])
    assert listing.exit_code == 0, listing.output
    assert f"s3://{bucket}/runs/default/tiny/v0/checkpoint-4" in listing.output and "final" in listing.output
    pulled = CliRunner().invoke(cli, ["checkpoints", "pull", f"s3://{bucket}/runs/default/tiny", "--step", "final",
                                      "-o", str(tmp_path / "pulled")])
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "pulled" / "pytorch_lora_weights.safetensors").is_file()
    # The run's report beside its weights, and one written here from the bucket (its records fetched, not its weights).
    assert "report.html" in objects
    page = tmp_path / "report.html"
    reported = CliRunner().invoke(cli, ["report", f"s3://{bucket}/runs/default/tiny", "--out", str(page)])
    assert reported.exit_code == 0, reported.output
    assert 'id="training-curves"' in page.read_text() and f"s3://{bucket}/runs/default/tiny/v0/checkpoint-4" in page.read_text()

    # A restarted pod lands on another machine: nothing local, everything from the bucket.
    second_machine = tmp_path / "machine-2"
    second_machine.mkdir()
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(second_machine / "cache"))
    monkeypatch.setenv("KUBETUNE_STAGING_DIR", str(second_machine / "staging"))
    manifest["spec"]["training"]["maxSteps"] = 6
    result = run_trainer(manifest, second_machine)
    assert "resumed from" in result.stderr and "at step 4" in result.stderr
    manifest_6 = json.loads(s3.client().get_object(Bucket=bucket, Key="runs/default/tiny/v0/checkpoint-6/manifest.json")["Body"].read())
    assert manifest_6["step"] == 6
    assert "s3://" in result.stderr and "pytorch_lora_weights.safetensors" in result.stderr


def test_a_local_run_reaches_s3_through_the_endpoint_its_spec_names(bucket, tiny_job, tiny_sd15, tmp_path,
                                                                    monkeypatch):
    """kubetune train on a laptop honours spec.s3.endpointUrl and region as a pod does."""
    import os

    upload_dir(tiny_sd15, f"s3://{bucket}/models/spec-endpoint")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the manifest knows where S3 is
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KUBETUNE_STAGING_DIR", str(tmp_path / "staging"))
    manifest = tiny_job(maxSteps=1)
    manifest["spec"]["model"]["pretrained"] = f"s3://{bucket}/models/spec-endpoint"
    manifest["spec"]["s3"] = {"endpointUrl": endpoint, "region": "us-east-1", "pathStyle": True}
    path = tmp_path / "job.yaml"
    path.write_text(__import__("yaml").safe_dump(manifest))
    result = CliRunner().invoke(cli, ["train", "-f", str(path)])
    assert result.exit_code == 0, result.output
    assert "AWS_ENDPOINT_URL" not in os.environ, "the spec's endpoint applied to the run only"


def test_embeddings_one_node_cached_from_an_s3_model_are_hit_by_another_node_that_fetched_it_again(
        bucket, tiny_sd15, captions_data, tmp_path):
    """The operator's cache stage runs on every node of a job, and a preempted job comes back on
    other nodes (fresh emptyDirs): each fetches the model again, so an encoder's identity must not
    change with where or when this node's copy was written."""
    upload_dir(tiny_sd15, f"s3://{bucket}/models/cached")
    manifest = family_job("sd15", "captions", f"s3://{bucket}/models/cached", captions_data, tmp_path / "out",
                          data={"cache": {"enabled": True, "uri": f"s3://{bucket}/embeddings"}})

    def node(name: str) -> dict:
        (tmp_path / name).mkdir()
        return {"KUBETUNE_CACHE_DIR": str(tmp_path / name / "cache")}

    cache_stage = [sys.executable, "-m", "kubetune_cli.main", "train", "-f", str(write_manifest(manifest, tmp_path)),
                   "--nproc", "2", "--cache-only"]
    staged = warm_python.run(cache_stage, env={**trainer_env(), **node("node-1")}, timeout=600)
    assert staged.returncode == 0, staged.stderr[-4000:]
    log = train(manifest, tmp_path / "node-2", nproc=2, extra_env=node("node-2"))
    assert re.search(r"embedding cache: [1-9]\d* hits, 0 misses", log), log[-3000:]
