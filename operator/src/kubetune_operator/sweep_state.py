"""A TrainingSweep's reconcile as a pure function: from the sweep, the trials its status records
and what its child TrainingJobs say now, to what to do (trials to create, trials to stop) and the
status to write.

Level-based and restart-safe: a recorded trial whose TrainingJob is missing is created again with
its recorded parameters; a TrainingJob whose record was lost (the operator stopped between creating
it and writing status: trials are created first) is adopted back from its labels and annotations
(parameters, for a PBT copy the trial it continues, and whether the median rule stopped it). The
search itself (kubetune_api.search) is a function of the records.

Events follow what happened, not what the status says: a trial's TrialCreated is sent by the act
only when its TrainingJob was created then (sweeps.run_sweep), and a trial's end (TrialFinished,
TrialStopped) only while its TrainingJob does not yet carry the annotation saying it was announced
(Plan.reported, written before the event). A status that lags (lost with a restart, or not yet seen
by kopf's watch) then repeats no event.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kubetune_api import layout
from kubetune_api.search import (MEDIAN_RULE_STOPPED, Trial, best_trial, format_parameters, next_trial,
                                 should_stop)
from kubetune_api.sweep import TRAINING_LOSS, VALIDATION_METRICS, TrainingSweepSpec

# Readings kept in status per trial, so that a sweep of 1000 trials stays far below the API
# server's object size limit (1.5 MiB): a running trial's newest, a finished trial's thinned evenly
# (its last always kept). Enough for the median rule, which compares values at the same step.
RUNNING_READINGS = 50
FINISHED_READINGS = 20


@dataclass(frozen=True)
class TrialJob:
    """What the sweep reads off one trial's TrainingJob."""

    number: int
    parameters: dict[str, Any]
    phase: str | None = None               # the TrainingJob's status.phase
    message: str = ""                      # why it failed, from its conditions
    step: int | None = None                # status.progress
    recent_loss: float | None = None       # the mean of its latest steps' losses (TrainerGauge.RECENT_LOSS)
    validation_step: int | None = None     # status.validation
    validation: dict[str, float] = field(default_factory=dict)
    output_uri: str | None = None
    exploited_from: int | None = None      # PBT: the trial whose checkpoint it continues (from its annotation)
    reported: str | None = None            # the end (state) whose event was sent, from its annotation


@dataclass
class Plan:
    create: list[Trial] = field(default_factory=list)    # trials whose TrainingJob to create
    stop: list[int] = field(default_factory=list)        # trials whose TrainingJob to suspend
    status: dict[str, Any] = field(default_factory=dict)  # the sweep's whole new status
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    # Trial -> the end its events announce: written on its TrainingJob before the events are sent.
    reported: dict[int, str] = field(default_factory=dict)


def trial_job_name(sweep: str, number: int) -> str:
    return f"{sweep}-{number}"


def created_event(trial: Trial) -> tuple[str, str, str]:
    """The event the act sends once it created TRIAL's TrainingJob (not when it found it there)."""
    copied = f" (copies trial {trial.exploited_from})" if trial.exploited_from is not None else ""
    return "Normal", "TrialCreated", f"trial {trial.number}{copied}: {format_parameters(trial.parameters)}"


def reading(job: TrialJob, metric: str) -> tuple[int, float] | None:
    """(step, value) of the objective as the trial's TrainingJob reports it now."""
    if metric == TRAINING_LOSS:
        return (job.step, job.recent_loss) if job.step and job.recent_loss is not None else None
    value = job.validation.get(VALIDATION_METRICS[metric])
    return (job.validation_step, value) if job.validation_step and value is not None else None


def final_value(intermediate: dict[int, float]) -> float | None:
    """A finished trial's objective: its last reading (a training loss is already a mean of the latest
    steps, averaged by the trainer: which steps the polls caught does not change the value)."""
    return intermediate[max(intermediate)] if intermediate else None


def records_to_trials(records: list[dict]) -> list[Trial]:
    return [Trial(number=r["number"], parameters=dict(r["parameters"]), state=r.get("state", "running"),
                  value=r.get("value"), intermediate={int(s): v for s, v in (r.get("intermediate") or {}).items()},
                  reason=r.get("reason", ""), output_uri=r.get("outputUri"), exploited_from=r.get("exploitedFrom"))
            for r in records]


def kept_steps(steps: list[int], keep: int) -> list[int]:
    """At most KEEP of the sorted STEPS, evenly spread, the last always among them."""
    if len(steps) <= keep:
        return steps
    stride = len(steps) / keep
    return sorted({steps[min(len(steps) - 1, round((i + 1) * stride) - 1)] for i in range(keep)})


def trial_record(sweep: str, trial: Trial) -> dict[str, Any]:
    steps = kept_steps(sorted(trial.intermediate), RUNNING_READINGS if trial.state == "running" else FINISHED_READINGS)
    record = {"number": trial.number, "job": trial_job_name(sweep, trial.number), "parameters": trial.parameters,
              "state": trial.state, "intermediate": {str(s): trial.intermediate[s] for s in steps}}
    if trial.value is not None:
        record["value"] = trial.value
    if trial.reason:
        record["reason"] = trial.reason
    if trial.output_uri:
        record["outputUri"] = trial.output_uri
    if trial.exploited_from is not None:
        record["exploitedFrom"] = trial.exploited_from
    return record


def adopted_record(number: int, job: TrialJob, metric: str) -> dict[str, Any]:
    """The record of a trial found only as its TrainingJob: running, unless the job says the median
    rule stopped it (its announcement annotation) — adopted as running, a suspended trial would
    hold its place among parallelTrials for ever and the sweep would never finish."""
    record: dict[str, Any] = {"number": number, "parameters": job.parameters, "state": "running"}
    if job.exploited_from is not None:
        record["exploitedFrom"] = job.exploited_from
    if job.reported == "stopped":
        record.update(state="stopped", reason=MEDIAN_RULE_STOPPED)
        observed = reading(job, metric)  # its last reading: the readings before it went with the status
        if observed:
            record.update(intermediate={str(observed[0]): observed[1]}, value=observed[1])
    return record


def plan(sweep: str, namespace: str, spec: TrainingSweepSpec, status: dict, jobs: dict[int, TrialJob]) -> Plan:
    """What to do now for the sweep NAMESPACE/SWEEP, whose status is STATUS and whose trials'
    TrainingJobs (by trial number) are JOBS: each named decision below in turn, on one list of trials."""
    result = Plan()
    trials = recorded_trials(status, jobs, spec.objective.metric)
    follow_running_trials(sweep, namespace, spec, trials, jobs, result)
    stop_clearly_worse_trials(spec, trials, jobs, result)
    keep_stopped_trials_suspended(trials, jobs, result)
    failed_sweep = too_many_failed(spec, trials)
    if failed_sweep:
        stop_every_running_trial(trials, jobs, result)
    else:
        start_next_trials(spec, trials, result)
    result.status = sweep_status(sweep, spec, trials, failed_sweep)
    result.events += phase_events(status, result.status)
    return result


def recorded_trials(status: dict, jobs: dict[int, TrialJob], metric: str) -> list[Trial]:
    """The trials status records, in order, with any TrainingJob whose record was lost adopted back."""
    records = {r["number"]: r for r in status.get("trials") or []}
    for number, job in jobs.items():
        if number not in records:
            records[number] = adopted_record(number, job, metric)
    return records_to_trials([records[n] for n in sorted(records)])


def follow_running_trials(sweep: str, namespace: str, spec: TrainingSweepSpec, trials: list[Trial],
                          jobs: dict[int, TrialJob], result: Plan) -> None:
    """Each running trial reads its TrainingJob: a new reading, where it writes, whether it ended; one
    recorded but without its TrainingJob is created (again)."""
    metric = spec.objective.metric
    for trial in trials:
        if trial.state != "running":
            continue
        job = jobs.get(trial.number)
        if job is None:
            result.create.append(trial)  # recorded, not created yet (or created by a call that failed)
            continue
        observed = reading(job, metric)
        if observed:
            trial.intermediate[observed[0]] = observed[1]
        # A trial's first run is v0 of its own job: known even before a poll reads status.outputUri.
        trial.output_uri = job.output_uri or trial.output_uri or layout.run_root(
            spec.template.spec["checkpoints"]["uri"], namespace, trial_job_name(sweep, trial.number), 0)
        _follow(trial, job, metric, result, sweep)


def stop_clearly_worse_trials(spec: TrainingSweepSpec, trials: list[Trial], jobs: dict[int, TrialJob],
                              result: Plan) -> None:
    """spec.earlyStopping's median rule: a running trial worse than the others' median is stopped."""
    rule, metric, minimize = spec.early_stopping, spec.objective.metric, spec.objective.minimize
    if rule is None:
        return
    for trial in trials:
        others = [t for t in trials if t is not trial and t.intermediate]
        if trial.state == "running" and trial.number in jobs and should_stop(trial, others, minimize, rule.min_steps):
            trial.state, trial.reason = "stopped", MEDIAN_RULE_STOPPED
            trial.value = _best_so_far(trial, minimize)
            result.stop.append(trial.number)
            _announce(result, trial, jobs[trial.number], ("Normal", "TrialStopped", (
                f"trial {trial.number} stopped: {metric} {trial.value:.5g} at step "
                f"{max(trial.intermediate)} is worse than the other trials' median")))


def keep_stopped_trials_suspended(trials: list[Trial], jobs: dict[int, TrialJob], result: Plan) -> None:
    """Stopped trials stay suspended: asked again until their TrainingJob says so (level-based)."""
    result.stop += [t.number for t in trials if t.state == "stopped" and t.number in jobs
                    and jobs[t.number].phase not in ("Suspended", "Succeeded", "Failed")
                    and t.number not in result.stop]


def too_many_failed(spec: TrainingSweepSpec, trials: list[Trial]) -> bool:
    return sum(t.state == "failed" for t in trials) > spec.max_failed_fraction * spec.max_trials


def stop_every_running_trial(trials: list[Trial], jobs: dict[int, TrialJob], result: Plan) -> None:
    """The sweep failed: its running trials stop, and none is created."""
    for trial in trials:
        if trial.state == "running":
            trial.state, trial.reason = "stopped", "the sweep failed"
            if trial.number in jobs:
                result.stop.append(trial.number)
            result.create = [t for t in result.create if t.number != trial.number]


def start_next_trials(spec: TrainingSweepSpec, trials: list[Trial], result: Plan) -> None:
    """The search's next trials, up to spec.parallelTrials running (their TrialCreated is the act's,
    once created: created_event)."""
    while sum(t.state == "running" for t in trials) < spec.parallel_trials:
        trial = next_trial(spec, trials)
        if trial is None:
            break
        trials.append(trial)
        result.create.append(trial)


def sweep_status(sweep: str, spec: TrainingSweepSpec, trials: list[Trial], failed_sweep: bool) -> dict[str, Any]:
    """The sweep's whole status from its trials."""
    metric = spec.objective.metric
    running = sum(t.state == "running" for t in trials)
    failed = sum(t.state == "failed" for t in trials)
    phase = "Failed" if failed_sweep else "Running" if running else "Succeeded"
    status = {
        "phase": phase,
        "trialsDone": f"{len(trials) - running}/{spec.max_trials}",
        "running": running,
        "failed": failed,
        "trials": [trial_record(sweep, t) for t in trials],
    }
    best = best_trial(trials, spec.objective.minimize)
    if best is not None:
        status["best"] = {"trial": best.number, "job": trial_job_name(sweep, best.number), "value": best.value,
                          "parameters": best.parameters, "outputUri": best.output_uri}
    if failed_sweep:
        status["message"] = (f"{failed} of {spec.max_trials} trials failed, more than spec.maxFailedFraction "
                             f"{spec.max_failed_fraction}: the sweep stopped")
    elif phase == "Succeeded":
        status["message"] = (f"best: trial {best.number} ({metric} {best.value:.6g})" if best
                             else "no trial reported the objective")
    return status


def phase_events(before: dict, after: dict) -> list[tuple[str, str, str]]:
    """SweepSucceeded or SweepFailed, once: when the phase becomes it."""
    phase = after["phase"]
    if phase != before.get("phase") and phase in ("Succeeded", "Failed"):
        return [("Warning" if phase == "Failed" else "Normal", f"Sweep{phase}", after["message"])]
    return []


def _follow(trial: Trial, job: TrialJob, metric: str, result: Plan, sweep: str) -> None:
    """A running trial's state from its TrainingJob's phase."""
    if job.phase == "Succeeded":
        trial.value = final_value(trial.intermediate)
        if trial.value is None or not math.isfinite(trial.value):
            trial.state, trial.reason = "failed", f"it finished without reporting {metric}"
        else:
            trial.state = "succeeded"
    elif job.phase == "Failed":
        trial.state, trial.reason = "failed", job.message or "its TrainingJob failed"
    else:
        return
    kind = "Normal" if trial.state == "succeeded" else "Warning"
    detail = f"{metric} {trial.value:.6g}" if trial.state == "succeeded" else trial.reason
    message = f"trial {trial.number} ({trial_job_name(sweep, trial.number)}) {trial.state}: {detail}"
    _announce(result, trial, job, (kind, "TrialFinished", message))


def _announce(result: Plan, trial: Trial, job: TrialJob, event: tuple[str, str, str]) -> None:
    """EVENT for TRIAL's new state, unless its TrainingJob says it was announced already."""
    if job.reported != trial.state:
        result.reported[trial.number] = trial.state
        result.events.append(event)


def _best_so_far(trial: Trial, minimize: bool) -> float:
    values = trial.intermediate.values()
    return min(values) if minimize else max(values)

