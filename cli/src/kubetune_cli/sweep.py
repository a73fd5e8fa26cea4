"""`kubetune sweep -f SWEEP.yaml`: a TrainingSweep's trials as training runs on this machine.

The same YAML `kubectl apply` takes. Each trial is the template's TrainingJob named
`<sweep>-<number>` with the trial's parameter values, trained by the trainer in a process of its
own (as `kubetune train` does); up to parallelTrials run at once. What a trial reports is read
from its log: the training loss at every logged step, the validation metrics at every
validation. The median rule stops a clearly worse trial with SIGTERM (it checkpoints and exits,
as on preemption); a failed trial is recorded and the sweep goes on, unless more than
maxFailedFraction of its trials failed.

With spec.tracking.mlflow in the template, the sweep is one MLflow parent run (named after the
sweep, holding the search space and, at the end, each trial's objective and the best) and each
trial a child run of it: the trial's spec gets tracking.mlflow.parentRunId. A server that cannot
be reached does not stop the sweep: the trials then log (or try to) as top-level runs.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from kubetune_api.contract import API_GROUP_VERSION, KIND, RECENT_LOSS_STEPS, SWEEP_LABEL, TrainerEnv, TrainerLog
from kubetune_api.mlflow_sweeps import end_sweep_run, start_sweep_run, sweep_run_params
from kubetune_api.spec_resources import MlflowSpec
from kubetune_api.spec import TrainingJobSpec
from kubetune_api.search import (MEDIAN_RULE_STOPPED, Trial, best_trial, format_parameters, next_trial,
                                 should_stop)
from kubetune_api.sweep import TRAINING_LOSS, VALIDATION_METRICS, TrainingSweep, trial_spec, with_value
from kubetune_trainer.process import spawn

POLL_SECONDS = 0.5


@dataclass
class RunningTrial:
    trial: Trial
    process: subprocess.Popen
    log: Path
    stopping: bool = False


def trial_name(sweep: TrainingSweep, number: int) -> str:
    return f"{sweep.metadata.name}-{number}"


def write_trial_manifest(sweep: TrainingSweep, trial: Trial, directory: Path,
                         parent_run_id: str | None = None) -> Path:
    spec = trial_spec(sweep.spec, trial.parameters)
    if parent_run_id:  # the trial is a child of the sweep's MLflow run
        spec = with_value(spec, "tracking.mlflow.parentRunId", parent_run_id)
    manifest = {"apiVersion": API_GROUP_VERSION, "kind": KIND,
                "metadata": {"name": trial_name(sweep, trial.number),
                             "labels": {SWEEP_LABEL: sweep.metadata.name}},
                "spec": spec}
    path = directory / f"{trial_name(sweep, trial.number)}.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path


def reported(log_text: str, metric: str) -> dict[int, float]:
    """Step -> the objective as the trial reported it so far (from its log)."""
    if metric == TRAINING_LOSS:
        losses = TrainerLog.parse_steps(log_text)
        return {step: _mean([loss for _, loss in losses[max(0, i + 1 - RECENT_LOSS_STEPS):i + 1]])
                for i, (step, _) in enumerate(losses)}
    name = VALIDATION_METRICS[metric]
    values = {}
    for line in log_text.splitlines():
        validation = TrainerLog.parse_validation(line)
        if validation and name in validation[1]:
            values[validation[0]] = validation[1][name]
    return values


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class LocalSweep:
    def __init__(self, sweep: TrainingSweep, workdir: Path, parallel: int | None = None, echo=print):
        self.sweep, self.spec = sweep, sweep.spec
        self.workdir = workdir
        self.parallel = parallel or self.spec.parallel_trials
        self.echo = echo
        self.trials: list[Trial] = []
        self.running: list[RunningTrial] = []
        self.weights: dict[int, str] = {}
        self.failed_sweep = ""
        self.mlflow: MlflowSpec | None = TrainingJobSpec.model_validate(self.spec.template.spec).tracking.mlflow
        self.parent_run_id: str | None = None  # the sweep's MLflow run
        # This sweep's own identity, in every trial's run id: a trial restarted within the sweep finds
        # its run again, while a later sweep of the same name (same trial job names) gets new run
        # versions instead of resuming, and overwriting, the earlier sweep's finished runs.
        self.identity = f"{sweep.metadata.name}-{uuid.uuid4().hex[:12]}"

    def run(self) -> bool:
        """Run every trial; True unless too many failed."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_parent_run()
        while True:
            while len(self.running) < self.parallel and not self.failed_sweep:
                trial = next_trial(self.spec, self.trials)
                if trial is None:
                    break
                self._start(trial)
            if not self.running:
                self._end_parent_run()
                return not self.failed_sweep
            time.sleep(POLL_SECONDS)
            self._poll()

    def _start_parent_run(self) -> None:
        """The sweep's MLflow run (spec.tracking.mlflow in the template), its search space as parameters."""
        if self.mlflow is None:
            return
        name = self.sweep.metadata.name
        params = {**sweep_run_params(self.spec), "sweep.parallelTrials": str(self.parallel)}
        try:
            self.parent_run_id = start_sweep_run(self.mlflow.uri, self.mlflow.experiment,
                                                 self.sweep.metadata.namespace or "default", name, params)
        except Exception as err:  # noqa: BLE001 - tracking never stops the sweep
            self.echo(f"MLflow: cannot create the sweep's run at {self.mlflow.uri} ({short_error(err)}); "
                      "the trials log as top-level runs")
            return
        self.echo(f"MLflow: sweep run {self.parent_run_id} in experiment {self.mlflow.experiment!r} at "
                  f"{self.mlflow.uri}")

    def _end_parent_run(self) -> None:
        """Each trial's objective (its step: the trial's number) and the best's, then the run's end."""
        if self.parent_run_id is None:
            return
        values = {t.number: t.value for t in self.trials if t.value is not None}
        best = best_trial(self.trials, self.spec.objective.minimize)
        try:
            end_sweep_run(self.mlflow.uri, self.parent_run_id, not self.failed_sweep, self.spec.objective.metric,
                          values, best and (best.number, trial_name(self.sweep, best.number)))
        except Exception as err:  # noqa: BLE001
            self.echo(f"MLflow: cannot end the sweep's run {self.parent_run_id} ({short_error(err)})")

    def _start(self, trial: Trial) -> None:
        self.trials.append(trial)
        manifest = write_trial_manifest(self.sweep, trial, self.workdir, self.parent_run_id)
        log = self.workdir / f"{trial_name(self.sweep, trial.number)}.log"
        threads = str(max(1, (os.cpu_count() or 1) // self.parallel))  # no oversubscribed cores
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
               TrainerEnv.NAMES["run_id"]: self.trial_run_id(trial.number)}
        with log.open("w") as out:
            process = spawn.start([sys.executable, "-m", "kubetune_trainer", "--config", str(manifest)], env,
                                  stdout=out, stderr=subprocess.STDOUT)
        self.running.append(RunningTrial(trial, process, log))
        copied = f" (copies trial {trial.exploited_from})" if trial.exploited_from is not None else ""
        self.echo(f"trial {trial.number} started{copied}: {format_parameters(trial.parameters)}")

    def trial_run_id(self, number: int) -> str:
        return f"{self.identity}-trial-{number}"

    def _poll(self) -> None:
        metric = self.spec.objective.metric
        for running in list(self.running):
            trial, text = running.trial, running.log.read_text(errors="replace")
            trial.intermediate = reported(text, metric)
            code = running.process.poll()
            if code is None:
                if self._clearly_worse(trial) and not running.stopping:
                    running.stopping = True
                    trial.reason = MEDIAN_RULE_STOPPED
                    running.process.send_signal(signal.SIGTERM)
                continue
            self.running.remove(running)
            self._finish(running, code, text)

    def _clearly_worse(self, trial: Trial) -> bool:
        rule = self.spec.early_stopping
        if rule is None:
            return False
        others = [t for t in self.trials if t is not trial and t.intermediate]
        return should_stop(trial, others, self.spec.objective.minimize, rule.min_steps)

    def _finish(self, running: RunningTrial, code: int, text: str) -> None:
        trial = running.trial
        values = trial.intermediate
        trial.value = values[max(values)] if values else None
        if running.stopping:
            trial.state = "stopped"
        elif code == 0 and trial.value is not None and math.isfinite(trial.value):
            trial.state = "succeeded"
            weights = TrainerLog.parse_final_weights(text)
            if weights:
                trial.output_uri = str(Path(weights[-1]).parent)  # PBT resumes its checkpoints
                self.weights[trial.number] = trial.output_uri
        else:
            trial.state = "failed"
            trial.reason = last_error(text) or f"exit code {code}"
        self.echo(f"trial {trial.number} {trial.state}" + (f": {trial.reason}" if trial.reason else "")
                  + (f" ({self.spec.objective.metric} {trial.value:.5g})" if trial.value is not None else ""))
        failed = sum(t.state == "failed" for t in self.trials)
        if failed > self.spec.max_failed_fraction * self.spec.max_trials and not self.failed_sweep:
            self.failed_sweep = (f"{failed} of {self.spec.max_trials} trials failed, more than spec.maxFailedFraction "
                                 f"{self.spec.max_failed_fraction}: the sweep stops")
            for other in self.running:
                other.stopping = True
                other.trial.reason = "the sweep failed"
                other.process.send_signal(signal.SIGTERM)

    def table(self) -> str:
        metric = self.spec.objective.metric
        lines = [f"{'trial':>5}  {'state':<9}  {metric:>14}  parameters"]
        for trial in self.trials:
            value = f"{trial.value:.6g}" if trial.value is not None else "-"
            lines.append(f"{trial.number:>5}  {trial.state:<9}  {value:>14}  {format_parameters(trial.parameters)}")
        best = best_trial(self.trials, self.spec.objective.minimize)
        if best is not None:
            where = self.weights.get(best.number, "")
            lines.append(f"best: trial {best.number} ({metric} {best.value:.6g}): "
                         f"{format_parameters(best.parameters)}" + (f"; weights in {where}" if where else ""))
        if self.failed_sweep:
            lines.append(f"sweep failed: {self.failed_sweep}")
        return "\n".join(lines)


def short_error(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def last_error(text: str) -> str:
    """The trainer's own one-line reason for failing, when it gave one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("kubetune trainer: "):
            return line.removeprefix("kubetune trainer: ")[:300]
    return lines[-1][:300] if lines else ""
