"""Status that ends true: what `kubectl get tj` shows once a job finished (kubetune_operator.status)."""
from __future__ import annotations

import pytest

from kubetune_api.spec_status import TrainingJobStatus
from kubetune_operator.status import final_progress, finished_patch, status_from_metrics

SPEC = {"checkpoints": {"uri": "s3://b/runs"}, "training": {"maxSteps": 60}}
EARLY_STOP = {**SPEC, "validation": {"earlyStoppingPatience": 3}}
# What the last poll saw of a 60-step job, 26 steps in (measured: the table showed this after Succeeded).
STALE = {"step": 26, "totalSteps": 60, "percent": 43.3, "loss": 0.2, "etaSeconds": 12.5}


@pytest.mark.parametrize("spec,status,phase,expected", [
    # Succeeded: the trainer ran its planned steps, whatever the last poll saw.
    (SPEC, {"progress": STALE}, "Succeeded",
     {"step": 60, "totalSteps": 60, "percent": 100.0, "loss": 0.2, "etaSeconds": None}),
    # A job so short that no poll saw it: the planned steps come from the spec.
    (SPEC, {}, "Succeeded", {"step": 60, "totalSteps": 60, "percent": 100.0, "etaSeconds": None}),
    # The trainer's plan (totalSteps) wins over maxSteps where it was seen.
    (SPEC, {"progress": {**STALE, "totalSteps": 50}}, "Succeeded",
     {"step": 50, "totalSteps": 50, "percent": 100.0, "loss": 0.2, "etaSeconds": None}),
    # Early stopping may end a run sooner: the last step seen stands, finished at 100%.
    (EARLY_STOP, {"progress": STALE}, "Succeeded",
     {"step": 26, "totalSteps": 60, "percent": 100.0, "loss": 0.2, "etaSeconds": None}),
    (EARLY_STOP, {}, "Succeeded", None),
    # Failed: the last step reached, and no ETA (nothing is coming).
    (SPEC, {"progress": STALE}, "Failed", {"step": 26, "totalSteps": 60, "percent": 43.3, "loss": 0.2,
                                             "etaSeconds": None}),
    (SPEC, {}, "Failed", None),
    (SPEC, {"progress": STALE}, "Running", None),
    (SPEC, {"progress": STALE}, "Suspended", None),
], ids=["succeeded-stale", "succeeded-unseen", "succeeded-plan", "early-stop", "early-stop-unseen", "failed",
        "failed-unseen", "running", "suspended"])
def test_the_final_progress_is_what_is_true_at_the_end(spec, status, phase, expected):
    assert final_progress(spec, status, phase) == expected


def test_a_success_patch_carries_the_final_progress_and_checkpoint():
    status = {"progress": STALE, "outputUri": "s3://b/runs/team-a/x/v0", "latestCheckpoint": "s3://b/.../checkpoint-20"}
    patch = finished_patch(SPEC, status, "Succeeded")
    assert patch["progress"]["step"] == 60 and patch["progress"]["etaSeconds"] is None
    assert patch["latestCheckpoint"] == "s3://b/runs/team-a/x/v0/checkpoint-60"
    assert patch["reportUri"] == "s3://b/runs/team-a/x/v0/report.html"
    failed = finished_patch(SPEC, status, "Failed")
    assert set(failed) == {"progress"}, "a failed run keeps the newest checkpoint it reported, and has no report"
    unplaced = finished_patch(SPEC, {"progress": STALE}, "Succeeded")
    assert "reportUri" not in unplaced, "no run directory was ever reported: no report to name"


def test_a_poll_sets_progress_run_directory_and_checkpoint_from_the_gauges():
    samples = {"step": 25, "planned_steps": 100, "loss": 0.5, "run_version": 1, "last_checkpoint_step": 20}
    assert status_from_metrics(samples, "s3://b/runs", "team-a", "x") == {
        "progress": {"step": 25, "totalSteps": 100, "percent": 25.0, "loss": 0.5},
        "outputUri": "s3://b/runs/team-a/x/v1",
        "latestCheckpoint": "s3://b/runs/team-a/x/v1/checkpoint-20",
    }
    assert status_from_metrics({"loss": 1.0}, "s3://b/runs", "team-a", "x") == {}, "not serving yet: nothing"


def test_a_poll_sets_the_latest_validation_from_its_gauges():
    samples = {"step": 25, "planned_steps": 100, "validation_step": 20, "validation_loss": 0.123456789,
               "validation_accuracy": 0.75, "validation_f1": 2 / 3}
    validation = status_from_metrics(samples, "s3://b/runs", "team-a", "x")["validation"]
    assert validation == {"step": 20, "metrics": {"loss": 0.123457, "accuracy": 0.75, "f1": 0.666667}}
    assert TrainingJobStatus.model_validate({"validation": validation}).validation.metrics["loss"] == 0.123457, \
        "the status schema takes it"


def test_no_validation_yet_sets_none_and_values_json_cannot_carry_are_left_out():
    assert "validation" not in status_from_metrics({"step": 5, "planned_steps": 100}, "s3://b/runs", "team-a", "x")
    samples = {"validation_step": 10, "validation_loss": float("nan"), "validation_accuracy": float("inf"),
               "validation_f1": 0.5}
    assert status_from_metrics(samples, "s3://b/runs", "team-a", "x") == {
        "validation": {"step": 10, "metrics": {"f1": 0.5}}}
