"""spec.tracking.mlflow: the run as an MLflow run, beside TensorBoard and Prometheus.

The main process logs, through `MlflowTracker`:
  - parameters: the job's spec flattened to manifest paths (training.learningRate, adapter.rank, ...),
    defaults included, without the sections that configure the cluster rather than the training
    (s3, scheduling, runPolicy, tracking, ...) and without any field named like a secret;
  - metrics: train/loss and train/lr at each logged step (spec.training.logEverySteps), and
    validation/<metric> at each validation;
  - the validation samples (images; a video family's clips as .mp4 and .gif), as artifacts under
    samples/step-NNNNNNN/, sent while the run goes on;
  - the final weights, as artifacts under weights/.

Logging never slows or stops training. Values are buffered in memory and sent by one background
thread with log_batch (every FLUSH_SECONDS, or sooner once a batch is full); the run is created
and its parameters logged by that thread too. A server that cannot be reached is warned about
once; the buffer is kept and sent when it answers again. At the end of the run the buffer is
flushed and the weights uploaded: with the server started with --serve-artifacts the run's
artifact location is mlflow-artifacts:/, so the upload goes through the server and the trainer
needs no credentials of the artifact store.

A restarted pod of the same run (same run directory) continues its unfinished MLflow run; a new
version of the job (e.g. resumeFrom: latest) is a new MLflow run. A sweep's trials are child runs of its
parent run (spec.tracking.mlflow.parentRunId; kubetune_api.mlflow_sweeps creates one).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from kubetune_api.mlflow_sweeps import (MAX_METRICS_PER_BATCH, MAX_PARAM_VALUE, MAX_PARAMS_PER_BATCH, MAX_TAG_VALUE,
                                        clip)
from kubetune_api.spec_resources import MlflowSpec
from kubetune_api.spec import TrainingJob, TrainingJobSpec

log = logging.getLogger("kubetune.trainer")

# Sections of the spec that say where and how the job runs on the cluster, not what it trains; never
# logged as parameters (spec.s3 and spec.scheduling name Secrets and service accounts).
SECTIONS_NOT_LOGGED = ("s3", "scheduling", "runPolicy", "tracking", "suspend", "backend")
# A field whose name says it holds or names a secret is never logged, whichever section it is in.
SECRET_WORDS = ("secret", "password", "passwd", "token", "credential", "apikey", "accesskey", "privatekey")

RUN_URI_TAG = "kubetune.run_uri"     # the run's directory: one MLflow run per run directory
PARENT_TAG = "mlflow.parentRunId"    # MLflow's own tag for nested runs (its UI shows the tree)
WEIGHTS_ARTIFACT_PATH = "weights"

FLUSH_SECONDS = 10.0                 # buffered metrics are sent at least this often
RETRY_SECONDS = 30.0                 # first pause after a failure; doubled up to MAX_RETRY_SECONDS
MAX_RETRY_SECONDS = 300.0
MAX_BUFFERED = 100_000               # metric values kept while the server is unreachable (the oldest go first)
CLOSE_SECONDS = 900.0                # the most the end of a run waits for the last metrics and the weights
CLOSE_SECONDS_UNREACHABLE = 5.0      # ... while the server is silent: it failed the last attempt, or never
                                     # answered at all (one that accepts connections and never replies)
ABORT_SECONDS = 20.0                 # ... when the run failed or was stopped (within the pod's grace period)

# MLflow's HTTP client retries a refused connection 7 times with growing pauses (minutes): the
# tracker retries by itself, so each attempt is kept short. A value the user set is kept.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}
THREAD_NAME = "kubetune-mlflow"

# --- what is logged -------------------------------------------------------------------------------

def run_params(spec: TrainingJobSpec) -> dict[str, str]:
    """The job's hyperparameters: every set field of the spec by its manifest path, as text."""
    document = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    params: dict[str, str] = {}
    for section, value in document.items():
        if section not in SECTIONS_NOT_LOGGED:
            _flatten(section, value, params)
    return params


def _flatten(path: str, value: Any, into: dict[str, str]) -> None:
    if _secret_like(path.rsplit(".", 1)[-1]):
        return
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            _flatten(f"{path}.{key}", inner, into)
    elif isinstance(value, dict):
        return  # an empty section
    else:
        text = value if isinstance(value, str) else json.dumps(value)
        into[path] = clip(text, MAX_PARAM_VALUE)


def _secret_like(name: str) -> bool:
    folded = name.lower().replace("_", "").replace("-", "")
    return any(word in folded for word in SECRET_WORDS)


def run_tags(job: TrainingJob, namespace: str, run_uri: str, version: int) -> dict[str, str]:
    """Where the run is: its job, namespace, version and directory, its labels (a sweep's trial
    carries kubetune.dev/sweep), and its parent run."""
    tags = {"kubetune.job": job.metadata.name, "kubetune.namespace": namespace,
            "kubetune.family": job.spec.model.family, "kubetune.run_version": str(version), RUN_URI_TAG: run_uri}
    tags.update({key: value for key, value in job.metadata.labels.items() if not _secret_like(key)})
    parent = job.spec.tracking.mlflow and job.spec.tracking.mlflow.parent_run_id
    if parent:
        tags[PARENT_TAG] = parent
    return {key: clip(value, MAX_TAG_VALUE) for key, value in tags.items()}


def tracker_for(job: TrainingJob, namespace: str, run_uri: str, version: int) -> "MlflowTracker | None":
    """The tracker of a run whose spec asks for one (main process only), else None."""
    settings = job.spec.tracking.mlflow
    if settings is None:
        return None
    return MlflowTracker(settings, job.metadata.name, run_params(job.spec), run_tags(job, namespace, run_uri, version))


# --- the tracker ----------------------------------------------------------------------------------

class _OwnThreadOnly(logging.Filter):
    """Drops the records the tracker's thread makes on a library logger (urllib3's "Retrying ..."
    lines for a server that is down): the tracker says so itself, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD_NAME


def _quiet_http_retries() -> None:
    for name in ("urllib3.connectionpool", "urllib3.util.retry"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OwnThreadOnly) for f in logger.filters):
            logger.addFilter(_OwnThreadOnly())
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


_OS_ERROR = re.compile(r"\[Errno -?\d+\] [^'\")\]]+")


def _short(error: BaseException) -> str:
    """The gist of an error: the OS's reason for a failed connection (buried in urllib3's long
    message), else the message's first 300 characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    reason = _OS_ERROR.search(text)
    if reason and "Max retries exceeded" in text:
        return f"cannot connect: {reason.group(0).strip()}"
    return text if len(text) <= 300 else text[:297] + "..."


class MlflowTracker:
    """One MLflow run, fed from the training thread without waiting: log_metrics() and
    log_artifacts() only queue; the background thread talks to the server."""

    def __init__(self, settings: MlflowSpec, run_name: str, params: dict[str, str], tags: dict[str, str]):
        self.uri, self.experiment = settings.uri, settings.experiment
        self.run_name, self.params, self.tags = run_name, params, tags
        self.run_id: str | None = None
        self._client = None
        self._metrics: list[tuple[str, float, int, int]] = []  # (key, value, time in ms, step), oldest first
        self._dropped = 0
        self._artifacts: list[tuple[Path, str]] = []
        self._status: str | None = None   # set by close(): the run's final status
        self._failing = False
        self._warned = False
        self._pause = RETRY_SECONDS
        self._done = threading.Event()
        self._condition = threading.Condition()
        _quiet_http_retries()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # --- from the training thread ---

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        with self._condition:
            self._metrics.extend((key, float(value), now, step) for key, value in values.items())
            if len(self._metrics) > MAX_BUFFERED:
                excess = len(self._metrics) - MAX_BUFFERED
                del self._metrics[:excess]
                self._dropped += excess
            if len(self._metrics) >= MAX_METRICS_PER_BATCH:
                self._condition.notify()

    def log_artifacts(self, files: list[Path], root: Path, under: str = WEIGHTS_ARTIFACT_PATH) -> None:
        """Upload FILES (under ROOT, keeping their folders) under the run's artifact folder UNDER (the
        weights by default): sent with the next batch of metrics, the final weights at the end."""
        with self._condition:
            for path in files:
                folder = Path(path).parent.relative_to(root)
                where = under if folder == Path(".") else f"{under}/{folder.as_posix()}"
                self._artifacts.append((Path(path), where))

    def close(self, status: str = "FINISHED", wait: bool = True, timeout: float | None = None) -> None:
        """End the run with STATUS (FINISHED, FAILED, KILLED) after sending what is buffered; with
        WAIT, return once that is done or TIMEOUT (default: by the server's last answer) passed."""
        with self._condition:
            if self._status is None:
                self._status = status
            self._condition.notify()
        if not wait:
            return
        started = time.monotonic()
        while not self._done.wait(0.1):
            waited = time.monotonic() - started
            # Silence is judged as the wait goes: a server that answers its first call late gets the
            # long bound from then on, one that never answers is left after a few seconds.
            limit = timeout if timeout is not None else (
                CLOSE_SECONDS_UNREACHABLE if self._silent() else CLOSE_SECONDS)
            if waited >= limit:
                # A warning if none was given: the background thread may not have met the server's
                # silence before the run ended (its first try still importing MLflow, or still waiting).
                level = logging.WARNING if self._first_warning() else logging.INFO
                log.log(level, "MLflow: stopped waiting for %s after %.0f s; what was not sent yet is not logged",
                        self.uri, waited)
                return

    def _silent(self) -> bool:
        """The server failed the last attempt, or has not answered the first call (the run's creation)
        yet: no reason to believe the end of the run will reach it."""
        return self._failing or self.run_id is None

    # --- the background thread ---

    def _run(self) -> None:
        first = True  # the run is created (and its parameters logged) at once
        try:
            while True:
                with self._condition:
                    pause = 0.0 if first else self._pause if self._failing else FLUSH_SECONDS
                    first = False
                    deadline = time.monotonic() + pause
                    while (self._status is None and time.monotonic() < deadline
                           and (self._failing or len(self._metrics) < MAX_METRICS_PER_BATCH)):
                        self._condition.wait(deadline - time.monotonic())
                    final = self._status is not None
                try:
                    self._sync(final)
                except Exception as err:  # noqa: BLE001 - whatever the server or the network did
                    self._failed(err)
                    if final:
                        log.info("MLflow: could not finish logging to %s at the end of the run (%s); some of this "
                                 "run's parameters, metrics or weights are missing there", self.uri, _short(err))
                        return
                    continue
                self._recovered()
                if final:
                    return
        finally:
            self._done.set()

    def _sync(self, final: bool) -> None:
        if self.run_id is None:
            self._start_run()
        self._send_metrics()
        self._send_artifacts()
        if final:
            self._client.set_terminated(self.run_id, self._status)
            if self._dropped:
                log.info("MLflow: %d metric values were dropped while %s could not be reached", self._dropped,
                         self.uri)

    def _start_run(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = self._client = self._client or MlflowClient(tracking_uri=self.uri)
        experiment_id = experiment_id_of(client, self.experiment)
        run = self._existing_run(client, experiment_id)
        if run is None:
            run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            logged: dict[str, str] = {}
        else:  # a restarted pod of the same run: continue its MLflow run
            client.update_run(run.info.run_id, status="RUNNING")
            logged = run.data.params
        changed = sorted(key for key, value in self.params.items() if key in logged and logged[key] != value)
        if changed:
            log.info("MLflow: run %s keeps its first values of %s (MLflow parameters cannot change)",
                     run.info.run_id, ", ".join(changed))
        params = [Param(key, value) for key, value in self.params.items() if key not in logged]
        for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(run.info.run_id, params=params[start:start + MAX_PARAMS_PER_BATCH])
        self.run_id = run.info.run_id
        log.info("MLflow: logging to run %s of experiment %r at %s", self.run_id, self.experiment, self.uri)

    def _existing_run(self, client, experiment_id: str):
        """The MLflow run an earlier pod of this run left unfinished (running, failed or killed), if any."""
        run_uri = self.tags.get(RUN_URI_TAG, "")
        if not run_uri or "'" in run_uri:
            return None
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_URI_TAG}` = '{run_uri}'",
                                   max_results=10)
        return next((run for run in found if run.info.status != "FINISHED"), None)

    def _send_metrics(self) -> None:
        from mlflow.entities import Metric

        while True:
            with self._condition:
                batch, dropped = self._metrics[:MAX_METRICS_PER_BATCH], self._dropped
            if not batch:
                return
            self._client.log_batch(self.run_id, metrics=[Metric(*values) for values in batch])
            with self._condition:
                # The oldest values may have been dropped meanwhile (MAX_BUFFERED): they were this batch's first.
                del self._metrics[:max(0, len(batch) - (self._dropped - dropped))]

    def _send_artifacts(self) -> None:
        while True:
            with self._condition:
                if not self._artifacts:
                    return
                path, where = self._artifacts[0]
            self._client.log_artifact(self.run_id, str(path), where)
            with self._condition:
                self._artifacts.pop(0)

    def _failed(self, error: BaseException) -> None:
        self._pause = min(self._pause * 2, MAX_RETRY_SECONDS) if self._failing else RETRY_SECONDS
        self._failing = True
        if self._first_warning():
            log.warning("MLflow: cannot log to %s (%s); training goes on, and the tracker tries again every "
                        "%.0f-%.0f s (this warning is not repeated)", self.uri, _short(error), RETRY_SECONDS,
                        MAX_RETRY_SECONDS)

    def _first_warning(self) -> bool:
        """Whether a warning about the server is still to be given (then it is now: one per run)."""
        with self._condition:
            first, self._warned = not self._warned, True
        return first

    def _recovered(self) -> None:
        if self._failing:
            log.info("MLflow: %s answers again; the buffered values were sent", self.uri)
        self._failing = False
        self._pause = RETRY_SECONDS


def experiment_id_of(client, name: str) -> str:
    """The id of experiment NAME, created when missing (by whichever run gets there first)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException:  # another run created it meanwhile
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise RuntimeError(f"the MLflow experiment {name!r} is deleted: restore it or name another in "
                           "spec.tracking.mlflow.experiment")
    return experiment.experiment_id
