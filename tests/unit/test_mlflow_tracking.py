"""spec.tracking.mlflow without a server: the field's validation (Python and the API server's CEL
agree), what a run logs as parameters and tags (no secrets), and the tracker's batching and its
single warning, against a stand-in MLflow client. tests/storage/test_mlflow_tracking.py trains
against a real server."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from kubetune_api.manifest import ManifestError, apply_overrides, parse_manifest

TRACKING = {"mlflow": {"uri": "http://mlflow.mlops.svc:5000", "experiment": "pets"}}

GOOD_URIS = ["http://mlflow.mlops.svc:5000", "https://mlflow.example.com", "https://mlflow.example.com/team/mlflow/",
             "http://127.0.0.1:5000", "http://[fd00::1]:5000"]
BAD_URIS = ["mlflow.mlops.svc:5000", "mlflow", "file:///tmp/mlruns", "sqlite:///mlflow.db", "databricks",
            "ftp://mlflow:21", "http://", "http://mlflow:5000?token=x", "http://mlflow:5000/#runs",
            "http://mlflow:5000/a b", "http://mlflow:5000\n", "http://-mlflow:5000", "http:/mlflow:5000"]


def with_tracking(manifest: dict, **mlflow) -> dict:
    manifest["spec"]["tracking"] = {"mlflow": {**TRACKING["mlflow"], **mlflow}}
    return manifest


def test_a_job_with_mlflow_tracking_validates(example_manifest):
    job = parse_manifest(with_tracking(example_manifest, parentRunId="0123456789abcdef0123456789abcdef"))
    assert job.spec.tracking.mlflow.uri == "http://mlflow.mlops.svc:5000"
    assert job.spec.tracking.mlflow.experiment == "pets"
    assert job.spec.tracking.mlflow.parent_run_id == "0123456789abcdef0123456789abcdef"
    example_manifest["spec"]["tracking"] = {}
    assert parse_manifest(example_manifest).spec.tracking.mlflow is None


@pytest.mark.parametrize("uri", GOOD_URIS)
def test_a_tracking_servers_uri_is_accepted(example_manifest, uri):
    assert parse_manifest(with_tracking(example_manifest, uri=uri)).spec.tracking.mlflow.uri == uri


@pytest.mark.parametrize("uri", BAD_URIS)
def test_a_malformed_uri_is_refused_naming_the_field(example_manifest, uri):
    with pytest.raises(ManifestError) as caught:
        parse_manifest(with_tracking(example_manifest, uri=uri))
    assert ("spec.tracking.mlflow.uri must be an MLflow tracking server's http(s)://host[:port][/path]"
            in str(caught.value))


def test_credentials_in_the_uri_are_refused_and_not_repeated(example_manifest):
    with pytest.raises(ManifestError) as caught:
        parse_manifest(with_tracking(example_manifest, uri="https://alice:hunter2@mlflow.example.com"))
    message = str(caught.value)
    assert "spec.tracking.mlflow.uri must not carry credentials" in message
    assert "hunter2" not in message, "the error must not repeat the password"


@pytest.mark.parametrize("field,value,words", [
    ("experiment", "", "spec.tracking.mlflow.experiment"),
    ("experiment", " pets", "spec.tracking.mlflow.experiment"),
    ("parentRunId", "not a run id!", "spec.tracking.mlflow.parentRunId"),
    ("runName", "x", "unknown field"),
])
def test_the_other_fields_are_checked_too(example_manifest, field, value, words):
    with pytest.raises(ManifestError, match=words):
        parse_manifest(with_tracking(example_manifest, **{field: value}))


def test_a_trainer_refuses_a_malformed_uri_before_training(example_manifest, tmp_path):
    """The trainer's own validation (exit 2, the job is wrong) names the field."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_tracking(example_manifest, uri="mlflow:5000")))
    result = subprocess.run([sys.executable, "-m", "kubetune_trainer", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "spec.tracking.mlflow.uri must be an MLflow tracking server's" in result.stderr


@pytest.mark.parametrize("uri", GOOD_URIS + BAD_URIS + ["http://a@b:5000", "http://mlflow:5000/a'b"])
def test_the_uri_rules_cel_agrees_with_its_python(uri):
    from kubetune_api.spec_resources import MlflowUri, check_mlflow_uri
    from tests.unit.test_rules import cel_holds, python_accepts

    [rule] = next(m.json_schema_extra for m in MlflowUri.__metadata__
                  if getattr(m, "json_schema_extra", None))["x-kubernetes-validations"]
    assert cel_holds(rule["rule"], uri) == python_accepts(check_mlflow_uri, uri), uri


def test_the_crd_carries_the_uri_rule():
    from tests.unit.test_crd import spec_schema

    mlflow = spec_schema()["properties"]["spec"]["properties"]["tracking"]["properties"]["mlflow"]
    assert mlflow["required"] == ["uri"]
    [rule] = mlflow["properties"]["uri"]["x-kubernetes-validations"]
    assert rule["message"].startswith("spec.tracking.mlflow.uri must be")


# ---- what a run logs -------------------------------------------------------------------------------

def test_parameters_are_the_training_fields_by_path_without_cluster_settings_or_secrets(example_manifest):
    from kubetune_trainer.telemetry.tracking import run_params

    example_manifest["spec"]["s3"] = {"credentialsSecret": "team-s3-keys", "endpointUrl": "http://minio.storage:9000"}
    example_manifest["spec"]["scheduling"] = {"serviceAccountName": "trainer-irsa", "serviceAccountToken": True}
    job = parse_manifest(with_tracking(example_manifest))
    params = run_params(job.spec)
    assert params["training.learningRate"] == str(job.spec.training.learning_rate)
    assert params["adapter.rank"] == str(job.spec.adapter.rank)
    assert params["model.family"] == "sd15"
    assert params["training.optimizer"] == "adamw", "defaults are logged too: runs compare on every field"
    assert not [key for key in params if key.split(".")[0] in ("s3", "scheduling", "tracking", "runPolicy")]
    assert not [value for value in params.values() if "team-s3-keys" in value or "trainer-irsa" in value]
    assert all(len(value) <= 6000 for value in params.values())


def test_a_field_named_like_a_secret_is_never_a_parameter():
    from kubetune_trainer.telemetry.tracking import _flatten

    into: dict[str, str] = {}
    _flatten("model", {"family": "sd15", "hubToken": "hf_x", "auth": {"password": "p", "user": "u"},
                       "aws_secret_access_key": "k"}, into)
    assert into == {"model.family": "sd15", "model.auth.user": "u"}


def test_tags_name_the_run_and_its_parent(example_manifest):
    from kubetune_trainer.telemetry.tracking import PARENT_TAG, RUN_URI_TAG, run_tags

    example_manifest["metadata"]["labels"] = {"kubetune.dev/sweep": "lr"}
    job = parse_manifest(with_tracking(example_manifest, parentRunId="abc123"))
    tags = run_tags(job, "team", "s3://bucket/runs/team/pets/v2", 2)
    assert tags[PARENT_TAG] == "abc123"
    assert tags[RUN_URI_TAG] == "s3://bucket/runs/team/pets/v2"
    assert tags["kubetune.dev/sweep"] == "lr" and tags["kubetune.run_version"] == "2"
    assert PARENT_TAG not in run_tags(parse_manifest(with_tracking(example_manifest)), "team", "x", 0)


def test_a_debug_run_logs_nothing_to_mlflow(example_manifest):
    from kubetune_cli.debug import debug_overrides

    job = parse_manifest(with_tracking(example_manifest))
    debug = parse_manifest(apply_overrides(with_tracking(example_manifest), debug_overrides(job, Path("/tmp/debug"))))
    assert debug.spec.tracking.mlflow is None


# ---- the tracker, against a stand-in client ---------------------------------------------------------

class FakeClient:
    """Records what MlflowClient would have sent; `down` makes every call fail like a refused connection."""

    instances: list["FakeClient"] = []

    def __init__(self, tracking_uri):
        self.uri, self.batches, self.artifacts, self.ended = tracking_uri, [], [], None
        self.down = FakeClient.down_at_start
        self.lock = threading.Lock()
        FakeClient.instances.append(self)

    def _call(self):
        if self.down:
            raise ConnectionError("Connection refused")

    def get_experiment_by_name(self, name):
        self._call()
        return None

    def create_experiment(self, name):
        self._call()
        return "7"

    def search_runs(self, experiment_ids, filter_string, max_results):
        self._call()
        self.searched = filter_string
        return FakeClient.earlier_runs

    def update_run(self, run_id, status):
        self._call()
        self.updated = (run_id, status)

    def create_run(self, experiment_id, run_name, tags):
        from types import SimpleNamespace

        self._call()
        self.run = (experiment_id, run_name, tags)
        return SimpleNamespace(info=SimpleNamespace(run_id="run-1"), data=SimpleNamespace(params={}))

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self._call()
        with self.lock:
            self.batches.append((list(metrics), list(params)))

    def log_artifact(self, run_id, path, artifact_path):
        self._call()
        self.artifacts.append((Path(path).name, artifact_path))

    def set_terminated(self, run_id, status):
        self._call()
        self.ended = status


@pytest.fixture
def fake_mlflow(monkeypatch):
    import mlflow.tracking

    from kubetune_trainer.telemetry import tracking

    FakeClient.instances, FakeClient.down_at_start, FakeClient.earlier_runs = [], False, []
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FakeClient)
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.2)
    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.2)
    return FakeClient


def new_tracker(example_manifest):
    from kubetune_trainer.telemetry.tracking import MlflowTracker

    job = parse_manifest(with_tracking(example_manifest))
    return MlflowTracker(job.spec.tracking.mlflow, "pets", {"training.learningRate": "0.0001", "adapter.rank": "8"},
                         {"kubetune.job": "pets", "kubetune.run_uri": "s3://bucket/runs/team/pets/v0"})


def test_metrics_go_in_batches_of_at_most_a_thousand_and_the_weights_at_the_end(fake_mlflow, example_manifest,
                                                                                 tmp_path):
    tracker = new_tracker(example_manifest)
    for step in range(1, 1251):
        tracker.log_metrics(step, {"train/loss": 1.0 / step, "train/lr": 1e-4})
    (tmp_path / "unet").mkdir()
    weights = [tmp_path / "pytorch_lora_weights.safetensors", tmp_path / "unet" / "model.safetensors"]
    tracker.log_artifacts(weights, tmp_path)
    tracker.close("FINISHED")
    client = fake_mlflow.instances[0]
    sent = [metrics for metrics, _ in client.batches if metrics]
    assert all(len(batch) <= 1000 for batch in sent) and len(sent) >= 3
    assert sum(len(batch) for batch in sent) == 2500, "every value once"
    steps = [m.step for batch in sent for m in batch if m.key == "train/loss"]
    assert steps == list(range(1, 1251)), "in order"
    assert [p.key for _, params in client.batches for p in params] == ["training.learningRate", "adapter.rank"]
    assert client.artifacts == [("pytorch_lora_weights.safetensors", "weights"), ("model.safetensors", "weights/unet")]
    assert client.ended == "FINISHED" and client.run[1] == "pets"


def test_validation_samples_are_sent_while_the_run_goes_on_under_samples_step(fake_mlflow, example_manifest, tmp_path,
                                                                             monkeypatch):
    from kubetune_trainer.telemetry import tracking

    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.1)
    tracker = new_tracker(example_manifest)
    folder = tmp_path / "samples" / "step-0000002"
    folder.mkdir(parents=True)
    clips = [folder / "0.mp4", folder / "0.gif"]
    for clip in clips:
        clip.write_bytes(b"clip")
    tracker.log_artifacts(clips, tmp_path / "samples", under="samples")
    client = fake_mlflow.instances[0]
    deadline = time.monotonic() + 10
    while len(client.artifacts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.artifacts == [("0.mp4", "samples/step-0000002"), ("0.gif", "samples/step-0000002")]
    assert client.ended is None, "sent before the run ends"
    tracker.close("FINISHED")
    assert client.ended == "FINISHED" and len(client.artifacts) == 2, "each file once"


def test_a_server_that_is_down_is_warned_about_once_and_gets_everything_when_back(
        fake_mlflow, example_manifest, caplog):
    fake_mlflow.down_at_start = True
    with caplog.at_level(logging.INFO, logger="kubetune.trainer"):
        tracker = new_tracker(example_manifest)
        for step in range(1, 4):
            tracker.log_metrics(step, {"train/loss": 0.5})
            time.sleep(0.5)  # several retries fail meanwhile
        fake_mlflow.instances[0].down = False
        tracker.close("FINISHED")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "MLflow: cannot log to http://mlflow.mlops.svc:5000" in warnings[0].getMessage()
    assert "Connection refused" in warnings[0].getMessage()
    client = fake_mlflow.instances[0]
    assert [m.step for metrics, _ in client.batches for m in metrics] == [1, 2, 3], "kept, then sent"
    assert client.ended == "FINISHED"
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_a_server_that_stays_down_costs_the_end_of_the_run_little(fake_mlflow, example_manifest, caplog, monkeypatch):
    from kubetune_trainer.telemetry import tracking

    fake_mlflow.down_at_start = True
    with caplog.at_level(logging.INFO, logger="kubetune.trainer"):
        tracker = new_tracker(example_manifest)
        tracker.log_metrics(1, {"train/loss": 0.5})
        time.sleep(0.3)
        started = time.monotonic()
        tracker.close("FINISHED")
    assert time.monotonic() - started < tracking.CLOSE_SECONDS_UNREACHABLE
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert any("could not finish logging to http://mlflow.mlops.svc:5000" in r.getMessage() for r in caplog.records)


class RecordingTracker:
    def __init__(self):
        self.metrics, self.artifacts, self.closed = [], [], []

    def log_metrics(self, step, values):
        self.metrics.append((step, dict(values)))

    def log_artifacts(self, files, root, under="weights"):
        self.artifacts.append(([Path(f).name for f in files], root) if under == "weights"
                              else ([str(Path(f).relative_to(root)) for f in files], under))

    def close(self, status, wait=True, timeout=None):
        self.closed.append((status, wait))


def test_the_reporter_hands_the_tracker_logged_steps_validations_and_the_weights(tmp_path):
    from kubetune_trainer.telemetry.reporting import Reporter

    tracker = RecordingTracker()
    reporter = Reporter(True, total_steps=5, start_step=0, log_dir=None, log_every=2, samples_per_step=4,
                        namespace="team", job_name="pets", tracker=tracker)
    for step in range(1, 6):
        reporter.step(step, loss=1.0 / step, lr=1e-4, epoch=0)
    reporter.validation(4, {"loss": 0.3})
    reporter.samples([tmp_path / "samples" / "step-0000004" / "0.mp4"], tmp_path)
    reporter.final_weights([tmp_path / "pytorch_lora_weights.safetensors"], tmp_path)
    reporter.close(wait=False)
    reporter.close()
    assert [step for step, values in tracker.metrics if "train/loss" in values] == [2, 4, 5], \
        "every logEverySteps-th step and the last"
    assert tracker.metrics[2] == (5, {"train/loss": 0.2, "train/lr": 1e-4})
    assert (4, {"validation/loss": 0.3}) in tracker.metrics
    assert tracker.artifacts == [(["step-0000004/0.mp4"], "samples"), (["pytorch_lora_weights.safetensors"], tmp_path)]
    assert tracker.closed == [("FINISHED", False), ("FINISHED", True)]


def test_only_the_main_process_reports_to_the_tracker():
    from kubetune_trainer.telemetry.reporting import Reporter

    tracker = RecordingTracker()
    reporter = Reporter(False, 5, 0, None, 1, 4, tracker=tracker)
    reporter.step(1, loss=0.5, lr=1e-4, epoch=0)
    reporter.validation(1, {"loss": 0.5})
    reporter.close("FAILED")
    assert tracker.metrics == [] and tracker.closed == []


def test_a_restarted_pod_continues_its_runs_unfinished_mlflow_run(fake_mlflow, example_manifest):
    from types import SimpleNamespace

    def earlier(run_id, status):
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=status),
                               data=SimpleNamespace(params={"training.learningRate": "0.0001"}))

    fake_mlflow.earlier_runs = [earlier("finished-run", "FINISHED"), earlier("killed-run", "KILLED")]
    tracker = new_tracker(example_manifest)
    tracker.log_metrics(7, {"train/loss": 0.5})
    tracker.close("FINISHED")
    client = fake_mlflow.instances[0]
    assert client.searched == "tags.`kubetune.run_uri` = 's3://bucket/runs/team/pets/v0'"
    assert client.updated == ("killed-run", "RUNNING") and not hasattr(client, "run"), "no new run"
    assert [p.key for _, params in client.batches for p in params] == ["adapter.rank"], "only what it lacked"
    assert tracker.run_id == "killed-run" and client.ended == "FINISHED"
