"""spec.tracking.mlflow against a real MLflow tracking server (kubetune_dev.mlflow_server, artifacts
served through it into the local S3 server): a tiny SD1.5 run logs its parameters, a metric entry per
logged step and its final weights; a run whose server is down trains anyway with one warning; a
local sweep's trials are child runs of one parent run named after the sweep."""
from __future__ import annotations

import re
import secrets
import subprocess
from pathlib import Path

import pytest

from kubetune_api.ports import free_listen_port
from kubetune_trainer.storage import s3
from tests.trainer.conftest import (captions_data, family_job, run_dir, tiny_sd15, trainer_command,  # noqa: F401
                                    trainer_env, write_manifest)

pytestmark = pytest.mark.slow

STEP_LINE = re.compile(r"step (\d+)/\d+ loss ([0-9.]+)")


def experiment_name(request) -> str:
    return f"{request.node.name[:40]}-{secrets.token_hex(3)}"


def train_without_s3_credentials(manifest: dict, directory: Path) -> subprocess.CompletedProcess:
    """The trainer with no AWS settings at all: whatever it logs to MLflow goes through the server."""
    env = {key: value for key, value in trainer_env().items() if not key.startswith(("AWS_", "MLFLOW_"))}
    return subprocess.run(trainer_command(write_manifest(manifest, directory)), env=env, capture_output=True,
                          text=True, timeout=900)


def test_a_run_logs_its_parameters_each_logged_step_and_its_final_weights(
        mlflow_server, tiny_sd15, captions_data, tmp_path, request):
    from mlflow import MlflowClient

    experiment = experiment_name(request)
    out = tmp_path / "out"
    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, out,
                          training={"maxSteps": 3, "logEverySteps": 2},
                          validation={"everySteps": 2, "heldOutFraction": 0.25},
                          s3={"credentialsSecret": "team-s3-keys"},
                          tracking={"mlflow": {"uri": mlflow_server.uri, "experiment": experiment}})
    result = train_without_s3_credentials(manifest, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in "\n".join(line for line in result.stderr.splitlines() if "MLflow" in line), result.stderr

    client = MlflowClient(mlflow_server.uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    [run] = client.search_runs([found.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["training.learningRate"] == "0.01" and params["adapter.rank"] == "4"
    assert params["training.logEverySteps"] == "2"
    assert not [key for key in params if key.startswith(("s3.", "tracking."))]
    assert "team-s3-keys" not in str(params) + str(run.data.tags)
    assert run.data.tags["kubetune.run_uri"] == str(run_dir(out))

    logged = [(int(step), float(loss)) for step, loss in STEP_LINE.findall(result.stderr)]
    assert [step for step, _ in logged] == [2, 3], "logEverySteps 2 of 3 steps: step 2 and the last"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [2, 3], "one entry per logged step"
    for metric, (_, loss) in zip(sorted(history, key=lambda m: m.step), logged):
        assert metric.value == pytest.approx(loss, abs=1e-5)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/lr")] == [2, 3]
    validated = sorted(m.step for m in client.get_metric_history(run.info.run_id, "validation/loss"))
    assert validated == [0, 2, 3], "the base model's before the first step, then every 2 and the last"

    downloaded = Path(client.download_artifacts(run.info.run_id, "weights/pytorch_lora_weights.safetensors",
                                                str(tmp_path / "downloaded")))
    assert downloaded.read_bytes() == (run_dir(out) / "pytorch_lora_weights.safetensors").read_bytes()
    keys = [item["Key"] for item in s3.client().list_objects_v2(Bucket=mlflow_server.bucket).get("Contents", [])]
    stored = [key for key in keys if key.startswith("mlflow/")
              and key.endswith(f"/{run.info.run_id}/artifacts/weights/pytorch_lora_weights.safetensors")]
    assert stored, f"the server put the artifact in its S3 store: {keys}"


def test_a_run_whose_server_is_down_trains_and_warns_once(tiny_sd15, captions_data, tmp_path):
    down = f"http://127.0.0.1:{free_listen_port()}"  # nothing listens there
    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          tracking={"mlflow": {"uri": down, "experiment": "nowhere"}})
    result = train_without_s3_credentials(manifest, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (run_dir(tmp_path / "out") / "pytorch_lora_weights.safetensors").is_file()
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line or "Retrying" in line]
    assert len(warnings) == 1, "\n".join(warnings)
    # The tracker's first failed try if it came during training; on a loaded machine it may not have
    # by the end of this 3-step run (importing MLflow), and then the end of the run says it.
    assert (f"MLflow: cannot log to {down}" in warnings[0] and "training goes on" in warnings[0]) or \
        f"MLflow: stopped waiting for {down}" in warnings[0], warnings[0]
    assert "Traceback" not in result.stderr


def test_a_sweeps_trials_are_child_runs_of_one_run_named_after_it(mlflow_server, tiny_sd15, captions_data, tmp_path,
                                                                  request):
    from mlflow import MlflowClient

    import yaml

    from tests.trainer.test_local_sweep import kubetune_sweep, rows, write_sweep

    experiment = experiment_name(request)
    name = "ranks-" + secrets.token_hex(3)
    path = write_sweep(tmp_path, tiny_sd15, captions_data, name, {"adapter.rank": {"choice": [2, 4]}},
                       algorithm="grid", maxTrials=2, parallelTrials=1)
    document = yaml.safe_load(path.read_text())
    template = document["spec"]["template"]["spec"]
    template["training"]["maxSteps"] = 2
    template["tracking"] = {"mlflow": {"uri": mlflow_server.uri, "experiment": experiment}}
    path.write_text(yaml.safe_dump(document))
    result = kubetune_sweep(path, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [state for _, state, _ in rows(result.stdout)] == ["succeeded", "succeeded"], result.stdout

    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id])
    [parent] = [run for run in runs if run.info.run_name == name]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["sweep.parameters.adapter.rank"] == '{"choice": [2, 4]}'
    assert parent.data.tags["kubetune.best_trial"] in (f"{name}-0", f"{name}-1")
    assert client.get_metric_history(parent.info.run_id, "best/loss"), "the sweep's result on its run"
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(run.info.run_name for run in children) == [f"{name}-0", f"{name}-1"]
    assert sorted(run.data.params["adapter.rank"] for run in children) == ["2", "4"]
    assert all(run.info.status == "FINISHED" and run.data.tags["kubetune.dev/sweep"] == name for run in children)
    assert len(runs) == 3, "the parent and its two trials, nothing else"
