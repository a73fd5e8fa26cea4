"""A TrainingSweep's parent run in MLflow, through the tracking server's REST API: the one way the
operator (no MLflow client in its image) and `kubetune sweep` (local trials) keep it.

The run is named after the sweep, tagged with it and its search space as parameters; every
trial's spec names it (spec.tracking.mlflow.parentRunId), so trials are logged as its child runs.
At the end it gets each trial's objective (trial/<metric>, step = trial number), the best's
(best/<metric>, tag kubetune.best_trial = the trial's name) and the sweep's outcome as its status.

Callers decide what an unreachable server means (MlflowUnavailable): neither the operator nor the
CLI lets it hold a sweep up; trials started meanwhile are logged as top-level runs.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request

from kubetune_api.contract import SWEEP_LABEL
from kubetune_api.sweep import TrainingSweepSpec

TIMEOUT_SECONDS = 5
# The server's limits on one log-batch request and on a value's length.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000


class MlflowUnavailable(Exception):
    """The tracking server could not be reached or refused the request."""


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def sweep_run_params(spec: TrainingSweepSpec) -> dict[str, str]:
    """The sweep's settings and search space, as the parent run's parameters."""
    params = {"sweep.algorithm": spec.algorithm, "sweep.objective.metric": spec.objective.metric,
              "sweep.objective.goal": "minimize" if spec.objective.minimize else "maximize",
              "sweep.maxTrials": str(spec.max_trials), "sweep.parallelTrials": str(spec.parallel_trials),
              "sweep.seed": str(spec.seed)}
    params.update({f"sweep.parameters.{path}": json.dumps(d.model_dump(by_alias=True, exclude_none=True))
                   for path, d in spec.parameters.items()})
    return params


def start_sweep_run(uri: str, experiment: str, namespace: str, sweep: str, params: dict[str, str]) -> str:
    """A new run named after the sweep, tagged with it, with PARAMS; its id."""
    created = _call(uri, "POST", "runs/create", {
        "experiment_id": experiment_id(uri, experiment), "run_name": sweep, "start_time": _now(),
        "tags": [{"key": SWEEP_LABEL, "value": f"{namespace}/{sweep}"},  # the trials' label, as a tag
                 {"key": "kubetune.kind", "value": "TrainingSweep"}]})
    run_id = created["run"]["info"]["run_id"]
    items = [{"key": key, "value": clip(value, MAX_PARAM_VALUE)} for key, value in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        _call(uri, "POST", "runs/log-batch", {"run_id": run_id, "params": items[start:start + MAX_PARAMS_PER_BATCH]})
    return run_id


def end_sweep_run(uri: str, run_id: str, succeeded: bool, metric: str, values: dict[int, float],
                  best: tuple[int, str] | None) -> None:
    """Log each trial's objective (VALUES by trial number) and the BEST trial's (number, name), then
    end the run FINISHED or FAILED."""
    now = _now()
    values = {number: value for number, value in values.items() if math.isfinite(value)}  # JSON has no NaN
    metrics = [{"key": f"trial/{metric}", "value": value, "timestamp": now, "step": number}
               for number, value in sorted(values.items())]
    tags = []
    if best is not None and best[0] in values:
        number, name = best
        metrics.append({"key": f"best/{metric}", "value": values[number], "timestamp": now, "step": number})
        tags.append({"key": "kubetune.best_trial", "value": clip(name, MAX_TAG_VALUE)})
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        _call(uri, "POST", "runs/log-batch", {"run_id": run_id, "metrics": metrics[start:start + MAX_METRICS_PER_BATCH]})
    if tags:
        _call(uri, "POST", "runs/log-batch", {"run_id": run_id, "tags": tags})
    _call(uri, "POST", "runs/update", {"run_id": run_id, "status": "FINISHED" if succeeded else "FAILED",
                                        "end_time": now})


def experiment_id(uri: str, name: str) -> str:
    """The id of experiment NAME, created when missing."""
    try:
        return _experiment_by_name(uri, name)
    except LookupError:
        pass
    try:
        return _call(uri, "POST", "experiments/create", {"name": name})["experiment_id"]
    except MlflowUnavailable:  # created meanwhile by a trial or another sweep
        return _experiment_by_name(uri, name)


def _experiment_by_name(uri: str, name: str) -> str:
    found = _call(uri, "GET", f"experiments/get-by-name?experiment_name={urllib.parse.quote(name)}")["experiment"]
    if found.get("lifecycle_stage") == "deleted":
        raise MlflowUnavailable(f"the MLflow experiment {name!r} is deleted: restore it or name another in "
                                "spec.tracking.mlflow.experiment")
    return found["experiment_id"]


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


def _now() -> int:
    return int(time.time() * 1000)
