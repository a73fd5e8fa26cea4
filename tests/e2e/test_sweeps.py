"""TrainingSweeps on the local control plane: the operator runs each trial as a TrainingJob it owns,
records every trial and the best in the sweep's status, and stops a clearly worse trial early.

The operator runs as a pod of the chart, each trial's trainer as the pods of its child job (one
backend, PyTorchJob: trials are TrainingJobs, and the TrainingJob e2e tests cover both backends).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from safetensors.torch import load_file, save_file

from kubetune_trainer.models.tiny_models import write_tiny_model
from kubetune_api.search import next_trial
from kubetune_api.sweep import TrainingSweep
from tests.e2e.jobs import (BUCKET, example_job, get_job, kubectl, operator_log, os_env, printed_columns,
                            rank0_pod_logs)
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e
# The trials' length comes mostly from a checkpoint after every step or two (save and S3 upload, about
# 0.5 s on an idle machine) rather than from steps: a one-process trainer's step costs 0.12 s idle but
# several seconds beside the other pytest worker, a checkpoint hardly more.


@pytest.fixture(scope="module")
def backend() -> str:
    return "pytorchjob"


def sweep_manifest(name: str, inputs: dict, parameters: dict, **spec) -> dict:
    template = example_job(inputs, name, f"runs/{name}")["spec"]
    template["checkpoints"]["uri"] = f"s3://{BUCKET}/sweeps"
    return {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": name},
            "spec": {"template": {"spec": template}, "parameters": parameters, **spec}}


def get_sweep(api_client, namespace: str, name: str) -> dict:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        "kubetune.dev", "v1alpha1", namespace, "trainingsweeps", name)


def wait_until_finished(api_client, control_plane, core, namespace: str, name: str, timeout: float) -> dict:
    def finished():
        sweep = get_sweep(api_client, namespace, name)
        return (sweep.get("status") or {}).get("phase") in ("Succeeded", "Failed") and sweep

    return eventually(finished, timeout=timeout, interval=2, message=lambda: (
        f"sweep {name} finished; status: {json.dumps(get_sweep(api_client, namespace, name).get('status'))[-3000:]}"
        "\noperator log:\n" + operator_log(control_plane, core)))


@pytest.fixture(scope="module")
def mlflow(control_plane):
    """An MLflow tracking server beside the control plane (SQLite, artifacts in its S3 server)."""
    with control_plane.mlflow_server() as server:
        yield server


def test_a_random_sweep_runs_four_trials_two_at_a_time_names_the_best_and_logs_them_to_mlflow(
        control_plane, api_client, core, operator_release, job_namespace, inputs_in_s3, mlflow, tmp_path):
    """Over a minute: four trials, each a trainer pod, two at a time, logging to a real MLflow server."""
    manifest = sweep_manifest("lr-rank", inputs_in_s3, {
        "training.learningRate": {"logUniform": [1.0e-4, 1.0e-2]}, "adapter.rank": {"choice": [2, 4, 8]}},
        objective={"metric": "loss"}, algorithm="random", maxTrials=4, parallelTrials=2)
    template = manifest["spec"]["template"]["spec"]
    # A trial's value is the trainer's mean of its last steps' losses (status.progress.recentLoss, also
    # in the report its pod leaves): however few polls catch it running, so short trials will do.
    template["training"]["maxSteps"] = 4
    template["tracking"] = {"mlflow": {"uri": mlflow.uri, "experiment": "e2e-sweeps"}}
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    # Never more than two trials at once.
    most_running = 0

    def done():
        nonlocal most_running
        status = get_sweep(api_client, job_namespace, "lr-rank").get("status") or {}
        most_running = max(most_running, status.get("running", 0))
        return status.get("phase") in ("Succeeded", "Failed")

    eventually(done, timeout=900, interval=1, message=lambda: "the sweep finished; operator log:\n"
               + operator_log(control_plane, core))
    status = get_sweep(api_client, job_namespace, "lr-rank")["status"]
    assert status["phase"] == "Succeeded", json.dumps(status)
    assert most_running == 2 and status["trialsDone"] == "4/4"
    trials = status["trials"]
    assert [t["number"] for t in trials] == list(range(4)) and {t["state"] for t in trials} == {"succeeded"}
    for trial in trials:
        job = get_job(api_client, job_namespace, trial["job"])
        assert job["metadata"]["ownerReferences"][0]["kind"] == "TrainingSweep"
        assert job["spec"]["adapter"]["rank"] == trial["parameters"]["adapter.rank"]
        assert job["spec"]["training"]["learningRate"] == pytest.approx(trial["parameters"]["training.learningRate"])
        assert job["status"]["phase"] == "Succeeded"
    best = min(trials, key=lambda t: t["value"])
    assert status["best"]["trial"] == best["number"] and status["best"]["value"] == best["value"]

    table = kubectl(control_plane, "get", "tsw", "lr-rank", "-n", job_namespace).stdout.splitlines()
    row = printed_columns(table[0], table[1])
    assert (row["PHASE"], row["TRIALS"], row["BEST-TRIAL"]) == ("Succeeded", "4/4", best["job"]), table

    # The best trial's LoRA, found through the cluster by its TrainingJob's name.
    cli = [str(Path(sys.executable).parent / "kubetune"), "checkpoints", "pull", best["job"],
           "-n", job_namespace, "--step", "final", "-o", str(tmp_path / "best")]
    pulled = subprocess.run(cli, env={**os_env(), **control_plane.env()}, capture_output=True, text=True, timeout=120)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert (tmp_path / "best" / "pytorch_lora_weights.safetensors").is_file()

    # MLflow: one parent run named after the sweep, each trial a child run with its values and LoRA.
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(mlflow.uri)
    parent = runs.get_run(status["mlflowParentRunId"])
    assert parent.info.run_name == "lr-rank" and parent.info.status == "FINISHED"
    assert parent.data.tags["kubetune.dev/sweep"] == f"{job_namespace}/lr-rank"
    assert parent.data.metrics["best/loss"] == pytest.approx(status["best"]["value"])
    experiment = runs.get_experiment_by_name("e2e-sweeps")
    children = runs.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(run.info.run_name for run in children) == sorted(t["job"] for t in trials)
    for run in children:
        trial = next(t for t in trials if t["job"] == run.info.run_name)
        assert run.data.params["adapter.rank"] == str(trial["parameters"]["adapter.rank"])
        assert run.info.status == "FINISHED" and runs.get_metric_history(run.info.run_id, "train/loss")
        weights = [a.path for a in runs.list_artifacts(run.info.run_id, "weights")]
        assert "weights/pytorch_lora_weights.safetensors" in weights, weights


@pytest.fixture(scope="module")
def worse_model_in_s3(s3, tmp_path_factory) -> str:
    """The tiny SD1.5 with its UNet's output scaled up 30 times: its noise predictions, and so its
    training loss, are far worse than the plain model's from the first step."""
    model = write_tiny_model("sd15", tmp_path_factory.mktemp("worse") / "model")
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    for name in ("conv_out.weight", "conv_out.bias"):
        tensors[name] = tensors[name] * 30
    save_file(tensors, weights)
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        s3.upload_file(str(path), BUCKET, f"models/sd15-worse/{path.relative_to(model)}")
    return f"s3://{BUCKET}/models/sd15-worse"


def test_the_median_rule_stops_a_clearly_worse_trial(control_plane, api_client, core, operator_release,
                                                     job_namespace, inputs_in_s3, worse_model_in_s3):
    good = inputs_in_s3["model"]
    manifest = sweep_manifest("early", inputs_in_s3, {"model.pretrained": {"choice": [good, good, worse_model_in_s3]}},
                              objective={"metric": "loss"}, algorithm="grid", maxTrials=3, parallelTrials=3,
                              earlyStopping={"rule": "median", "minSteps": 3})
    # Long enough that the worse trial is stopped well before its end: 24 steps with a checkpoint every
    # 2 train longer on an idle machine than 40 with one every 20 did.
    max_steps = 24
    manifest["spec"]["template"]["spec"]["training"].update(maxSteps=max_steps)
    manifest["spec"]["template"]["spec"]["checkpoints"]["everySteps"] = 2
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    status = wait_until_finished(api_client, control_plane, core, job_namespace, "early", timeout=900)["status"]
    states = {t["number"]: t["state"] for t in status["trials"]}
    assert states == {0: "succeeded", 1: "succeeded", 2: "stopped"}, json.dumps(status)
    stopped = status["trials"][2]
    assert "median" in stopped["reason"] and max(int(s) for s in stopped["intermediate"]) < max_steps
    worse_job = get_job(api_client, job_namespace, "early-2")
    assert worse_job["spec"]["suspend"] is True, "a stopped trial is suspended: it checkpoints and frees its pods"
    assert eventually(lambda: get_job(api_client, job_namespace, "early-2")["status"]["phase"] == "Suspended",
                      timeout=120, message="the stopped trial suspended")
    assert status["best"]["trial"] in (0, 1)
    events = core.list_namespaced_event(job_namespace, field_selector="involvedObject.name=early").items
    assert any(e.reason == "TrialStopped" for e in events), [e.reason for e in events]


def test_population_based_training_copies_a_strong_trials_checkpoint_into_a_weak_line(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3):
    # Two members, two generations of 10 steps (enough for the progress polls to read each trial's
    # loss: status.progress.recentLoss, the mean of its latest 5 steps, so that no single step the
    # polls catch decides the ranking). Offset noise 0.9 makes the loss far higher, so the member
    # drawn with it is the weak one and continues from the other's checkpoint-10.
    manifest = sweep_manifest("pbt", inputs_in_s3, {"training.noiseOffset": {"choice": [0.0, 0.9]}},
                              objective={"metric": "loss"}, algorithm="pbt", maxTrials=4, parallelTrials=2,
                              pbt={"stepsPerGeneration": 10, "quantile": 0.5, "resampleProbability": 0})
    manifest["spec"]["template"]["spec"]["checkpoints"]["everySteps"] = 100
    manifest["spec"]["seed"] = next(seed for seed in range(100) if draws_both_offsets(manifest, seed))
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    status = wait_until_finished(api_client, control_plane, core, job_namespace, "pbt", timeout=900)["status"]
    assert status["phase"] == "Succeeded" and [t["state"] for t in status["trials"]] == ["succeeded"] * 4, \
        json.dumps(status)
    [copy] = [t for t in status["trials"] if "exploitedFrom" in t]
    strong = status["trials"][copy["exploitedFrom"]]
    assert copy["number"] in (2, 3) and strong["number"] in (0, 1)
    assert strong["parameters"]["training.noiseOffset"] == 0.0, "the low-loss member is the strong one"
    checkpoint = f"{strong['outputUri']}/checkpoint-10"
    job = get_job(api_client, job_namespace, copy["job"])
    assert job["spec"]["checkpoints"]["resumeFrom"] == checkpoint and job["spec"]["training"]["maxSteps"] == 20
    log = "".join(rank0_pod_logs(control_plane, backend, job_namespace, copy["job"]))
    assert f"resumed from {checkpoint} at step 10" in log, log[-3000:]


def draws_both_offsets(manifest: dict, seed: int) -> bool:
    """Whether generation 0 gets one member with each offset (so that one is clearly weaker)."""
    spec = TrainingSweep.model_validate({**manifest, "spec": {**manifest["spec"], "seed": seed}}).spec
    first = next_trial(spec, [])
    return first.parameters != next_trial(spec, [first]).parameters


def test_kubectl_apply_refuses_a_sweep_over_a_field_that_does_not_exist(control_plane, operator_release,
                                                                       job_namespace, inputs_in_s3):
    manifest = sweep_manifest("typo", inputs_in_s3, {"training.learningRat": {"logUniform": [1e-5, 1e-3]}},
                              objective={"metric": "loss"}, maxTrials=2)
    refused = kubectl(control_plane, "apply", "--dry-run=server", "-n", job_namespace, "-f", "-",
                      input=yaml.safe_dump(manifest), check=False)
    assert refused.returncode != 0
    assert "spec.parameters[training.learningRat]" in refused.stderr and "learningRate" in refused.stderr, \
        refused.stderr
    # The schema alone (no webhook needed): maxTrials below parallelTrials.
    manifest = sweep_manifest("small", inputs_in_s3, {"adapter.rank": {"choice": [4, 8]}},
                              objective={"metric": "loss"}, maxTrials=1, parallelTrials=2)
    refused = kubectl(control_plane, "apply", "--dry-run=server", "-n", job_namespace, "-f", "-",
                      input=yaml.safe_dump(manifest), check=False)
    assert refused.returncode != 0 and "spec.maxTrials is below spec.parallelTrials" in refused.stderr, refused.stderr
