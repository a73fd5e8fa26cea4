"""A TrainingSweep's parent run in MLflow, through the tracking server's REST API (no MLflow client
in the operator): created once, its id kept in the sweep's status and given to every trial
(spec.tracking.mlflow.parentRunId), so the trials are logged as its child runs; ended with the
sweep, with each trial's objective and the best as metrics.

An unreachable server never holds a sweep up: the caller records the error and tries again on its
next step, and trials created meanwhile are logged as top-level runs.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

TIMEOUT_SECONDS = 5


class MlflowUnavailable(Exception):
    """The tracking server could not be reached or refused the request."""


def _call(uri: str, method: str, path: str, body: dict | None = None) -> dict:
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/{path}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        if err.code == 404 and "RESOURCE_DOES_NOT_EXIST" in detail:
            raise LookupError(detail) from None
        raise MlflowUnavailable(f"{method} {url}: HTTP {err.code} {detail}") from None
    except (OSError, ValueError) as err:
        raise MlflowUnavailable(f"{method} {url}: {err}") from None


def experiment_id(uri: str, name: str) -> str:
    """The id of experiment NAME, created when missing."""
    try:
        return _call(uri, "GET", f"experiments/get-by-name?experiment_name={urllib.parse.quote(name)}")[
            "experiment"]["experiment_id"]
    except LookupError:
        pass
    try:
        return _call(uri, "POST", "experiments/create", {"name": name})["experiment_id"]
    except MlflowUnavailable:  # created meanwhile by a trial or another sweep
        return _call(uri, "GET", f"experiments/get-by-name?experiment_name={urllib.parse.quote(name)}")[
            "experiment"]["experiment_id"]


def start_parent_run(uri: str, experiment: str, namespace: str, sweep: str) -> str:
    """A new run named after the sweep, tagged with it; its id."""
    created = _call(uri, "POST", "runs/create", {
        "experiment_id": experiment_id(uri, experiment), "run_name": sweep, "start_time": int(time.time() * 1000),
        "tags": [{"key": "kubetune.dev/sweep", "value": f"{namespace}/{sweep}"}]})
    return created["run"]["info"]["run_id"]


def end_parent_run(uri: str, run_id: str, succeeded: bool, metric: str, values: dict[int, float],
                   best: int | None) -> None:
    """Record each trial's objective (trial/<metric>, step = trial number) and the best trial's
    (best/<metric>, tag kubetune.best_trial) on the sweep's parent run, as `kubetune sweep` does, and
    end the run."""
    now = int(time.time() * 1000)
    metrics = [{"key": f"trial/{metric}", "value": value, "timestamp": now, "step": number}
               for number, value in sorted(values.items())]
    tags = []
    if best is not None:
        metrics.append({"key": f"best/{metric}", "value": values[best], "timestamp": now, "step": 0})
        tags.append({"key": "kubetune.best_trial", "value": str(best)})
    if metrics:
        _call(uri, "POST", "runs/log-batch", {"run_id": run_id, "metrics": metrics, "tags": tags})
    _call(uri, "POST", "runs/update", {"run_id": run_id, "status": "FINISHED" if succeeded else "FAILED",
                                        "end_time": now})
