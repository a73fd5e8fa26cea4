"""A TrainingSweep's MLflow parent run, as the operator and `kubetune sweep` keep it
(kubetune_api.mlflow_sweeps, the tracking server's REST API), read back through the MLflow client
from a real local server; and each trial's TrainingJob naming it as its parent."""
from __future__ import annotations

import pytest

from kubetune_api.sweep import TrainingSweep
from kubetune_api.mlflow_sweeps import MlflowUnavailable, end_sweep_run, start_sweep_run, sweep_run_params
from kubetune_operator.sweep_state import plan
from kubetune_operator.sweeps import trial_job


def test_the_parent_run_is_named_after_the_sweep_and_ends_with_its_best_value(mlflow_server):
    from mlflow.tracking import MlflowClient

    params = sweep_run_params(sweep_spec(None))
    first = start_sweep_run(mlflow_server.uri, "sweeps-e", "team-a", "lr-rank", params)
    second = start_sweep_run(mlflow_server.uri, "sweeps-e", "team-a", "other", {})  # the experiment is reused
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(first)
    assert run.info.run_name == "lr-rank" and run.data.tags["kubetune.dev/sweep"] == "team-a/lr-rank"
    assert run.data.params["sweep.parameters.adapter.rank"] == '{"choice": [4, 8]}'
    assert run.data.params["sweep.maxTrials"] == "2" and run.data.params["sweep.objective.goal"] == "minimize"
    assert run.info.status == "RUNNING"
    assert client.get_run(second).info.experiment_id == run.info.experiment_id
    assert client.get_experiment(run.info.experiment_id).name == "sweeps-e"

    values = {0: 0.5, 1: 0.125, 2: 0.25, 3: float("nan")}  # a diverged trial's NaN is left out
    end_sweep_run(mlflow_server.uri, first, succeeded=True, metric="loss", values=values, best=(1, "lr-rank-1"))
    ended = client.get_run(first)
    assert ended.info.status == "FINISHED" and ended.data.metrics["best/loss"] == 0.125
    assert ended.data.tags["kubetune.best_trial"] == "lr-rank-1"
    history = client.get_metric_history(first, "trial/loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 0.125), (2, 0.25)]
    end_sweep_run(mlflow_server.uri, second, succeeded=False, metric="loss", values={}, best=None)
    assert client.get_run(second).info.status == "FAILED"


def test_an_unreachable_server_is_one_clear_error():
    with pytest.raises(MlflowUnavailable, match="127.0.0.1:9"):
        start_sweep_run("http://127.0.0.1:9", "e", "ns", "s", {})  # port 9 (discard): nothing listens


def sweep_spec(tracking: dict | None):
    template = {"model": {"family": "sd15", "pretrained": "org/model"}, "data": {"layout": "captions", "uri": "s3://data/set"},
                "training": {"maxSteps": 10}, "checkpoints": {"uri": "s3://out/runs"}}
    if tracking:
        template["tracking"] = tracking
    return TrainingSweep.model_validate({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "lr"},
        "spec": {"template": {"spec": template}, "parameters": {"adapter.rank": {"choice": [4, 8]}},
                 "objective": {"metric": "loss"}, "maxTrials": 2}}).spec


class Body(dict):
    metadata = {"name": "lr", "namespace": "ns", "uid": "u"}


def test_each_trial_is_logged_as_a_child_of_the_sweeps_run():
    tracked = sweep_spec({"mlflow": {"uri": "http://mlflow.mlops.svc:5000", "experiment": "pets"}})
    job = trial_job(Body(), tracked, plan("lr", "ns", tracked, {}, {}).create[0], parent_run="0123abcd")
    assert job["spec"]["tracking"]["mlflow"] == {"uri": "http://mlflow.mlops.svc:5000", "experiment": "pets",
                                                 "parentRunId": "0123abcd"}
    untracked = sweep_spec(None)
    job = trial_job(Body(), untracked, plan("lr", "ns", untracked, {}, {}).create[0], parent_run="0123abcd")
    assert "tracking" not in job["spec"]


def test_an_unreachable_server_is_asked_again_only_after_a_minute(caplog):
    import logging

    from kubetune_operator import sweeps

    mlflow = {"uri": "http://127.0.0.1:9", "experiment": "e"}  # port 9 (discard): nothing listens
    logger, spec = logging.getLogger("test.sweeps"), sweep_spec(None)
    with caplog.at_level(logging.WARNING, logger="test.sweeps"):
        assert sweeps.parent_run_of(mlflow, "ns", "away", spec, logger) is None
        assert sweeps.parent_run_of(mlflow, "ns", "away", spec, logger) is None  # within the minute: not asked
    assert len([r for r in caplog.records if "no MLflow parent run yet" in r.getMessage()]) == 1
    sweeps._parent_run_retry_at[("ns", "away")] = 0.0  # the minute has passed
    with caplog.at_level(logging.WARNING, logger="test.sweeps"):
        assert sweeps.parent_run_of(mlflow, "ns", "away", spec, logger) is None
    assert len([r for r in caplog.records if "no MLflow parent run yet" in r.getMessage()]) == 2
