"""TrainingJob status as a small state machine: pure functions from observations to a patch.

Level-based: each call compares what the child says now with what the status records and
returns only the difference, plus the Events that explain a transition.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kubetune_api import layout
from kubetune_api.contract import VALIDATION_METRICS, TrainerGauge
from kubetune_operator.backends.base import ChildState
from kubetune_operator.timestamps import rfc3339, unix_seconds

PHASES = ("Pending", "Running", "Succeeded", "Failed", "Suspended")
FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def set_condition(conditions: list[dict], type_: str, status: str, reason: str, message: str,
                  now: str) -> list[dict]:
    """Conditions with one updated; lastTransitionTime changes only when the status flips."""
    result, found = [], False
    for condition in conditions:
        if condition.get("type") == type_:
            found = True
            flipped = condition.get("status") != status
            condition = {**condition, "status": status, "reason": reason, "message": message,
                         "lastTransitionTime": now if flipped else condition.get("lastTransitionTime", now)}
        result.append(condition)
    if not found:
        result.append({"type": type_, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": now})
    return result


def status_for_child(current: dict, child: ChildState, now: str) -> tuple[dict, list[Event]]:
    """The status patch and events for what the child job reports."""
    phase = child.phase
    if current.get("phase") in FINISHED:
        return {}, []  # finished is final: late child updates change nothing
    conditions = list(current.get("conditions") or [])
    for other in PHASES:
        if other != "Pending":
            is_current = other == phase
            conditions = set_condition(conditions, other, "True" if is_current else "False",
                                       child.reason if is_current else "", child.message if is_current else "", now)
    patch: dict = {}
    if conditions != (current.get("conditions") or []):
        patch["conditions"] = conditions
    events: list[Event] = []
    if current.get("phase") != phase:
        patch["phase"] = phase
        events.append(Event("Warning" if phase == "Failed" else "Normal", phase,
                            child.message or f"the training job is {phase.lower()}"))
    if phase == "Running" and not current.get("startTime"):
        patch["startTime"] = child.start_time or now
    if phase in FINISHED and not current.get("completionTime"):
        patch["completionTime"] = child.completion_time or now
    return patch, events


def progress_from_metrics(samples: dict[str, float]) -> dict | None:
    """status.progress from the trainer's gauges (names without the kubetune_trainer_ prefix)."""
    if TrainerGauge.STEP not in samples or TrainerGauge.PLANNED_STEPS not in samples:
        return None
    step, total = int(samples[TrainerGauge.STEP]), int(samples[TrainerGauge.PLANNED_STEPS])
    progress = {"step": step, "totalSteps": total, "percent": round(100.0 * step / total, 1) if total else 0.0}
    # A NaN or infinite loss has no JSON form: the API server would refuse the whole status patch.
    if TrainerGauge.LOSS in samples and math.isfinite(samples[TrainerGauge.LOSS]):
        progress["loss"] = round(samples[TrainerGauge.LOSS], 6)
    if TrainerGauge.RECENT_LOSS in samples and math.isfinite(samples[TrainerGauge.RECENT_LOSS]):
        progress["recentLoss"] = round(samples[TrainerGauge.RECENT_LOSS], 6)
    if TrainerGauge.ETA_SECONDS in samples:
        progress["etaSeconds"] = round(samples[TrainerGauge.ETA_SECONDS], 1)
    return progress


def output_uri_from_metrics(samples: dict[str, float], checkpoints_uri: str, namespace: str, job: str) -> str | None:
    """The run directory the trainer chose (it reports its version number as a gauge)."""
    if TrainerGauge.RUN_VERSION not in samples:
        return None
    return layout.run_root(checkpoints_uri, namespace, job, int(samples[TrainerGauge.RUN_VERSION]))


def latest_checkpoint_from_metrics(samples: dict[str, float], output_uri: str | None) -> str | None:
    step = int(samples.get(TrainerGauge.LAST_CHECKPOINT_STEP, 0))
    return layout.join(output_uri, layout.checkpoint_name(step)) if step > 0 and output_uri else None


def saved_work_from_metrics(samples: dict[str, float], now: str, shown: dict | None) -> dict:
    """status.lastCheckpoint (step, time) and status.unsavedWork (steps, seconds) at NOW from the trainer's
    gauges; SHOWN: status.lastCheckpoint as it is. A resumed run reports its starting checkpoint without
    a time (an earlier attempt wrote it): the time shown for that step stays."""
    fields: dict = {}
    saved = int(samples.get(TrainerGauge.LAST_CHECKPOINT_STEP, 0))
    written = samples.get(TrainerGauge.LAST_CHECKPOINT_TIME, 0)
    if saved > 0:
        if written > 0:
            fields["lastCheckpoint"] = {"step": saved, "time": rfc3339(written)}
        elif (shown or {}).get("step") != saved:
            fields["lastCheckpoint"] = {"step": saved, "time": None}
    since = samples.get(TrainerGauge.UNSAVED_SINCE, 0)
    if TrainerGauge.STEP in samples and since > 0:
        fields["unsavedWork"] = {"steps": max(0, int(samples[TrainerGauge.STEP]) - saved),
                                 "seconds": max(0, int(unix_seconds(now) - since))}
    return fields


def validation_from_metrics(samples: dict[str, float]) -> dict | None:
    """status.validation: the latest validation's step and metrics (a sweep's trial objective).

    The trainer serves these gauges only once it has validated. A NaN or infinite value is left
    out: JSON cannot carry it, and the API server would refuse the whole status patch.
    """
    if TrainerGauge.VALIDATION_STEP not in samples:
        return None
    metrics = {}
    for name in VALIDATION_METRICS:
        value = samples.get(TrainerGauge.validation(name))
        if value is not None and math.isfinite(value):
            metrics[name] = float(f"{value:.6g}")
    return {"step": int(samples[TrainerGauge.VALIDATION_STEP]), "metrics": metrics}


def status_from_metrics(samples: dict[str, float], checkpoints_uri: str, namespace: str, job: str) -> dict:
    """The status fields a poll of the rank-0 trainer's gauges sets: progress, outputUri, latestCheckpoint,
    validation."""
    fields = {"progress": progress_from_metrics(samples),
              "outputUri": output_uri_from_metrics(samples, checkpoints_uri, namespace, job),
              "validation": validation_from_metrics(samples)}
    fields["latestCheckpoint"] = latest_checkpoint_from_metrics(samples, fields["outputUri"])
    return {key: value for key, value in fields.items() if value}


def final_progress(spec: dict, status: dict, phase: str) -> dict | None:
    """status.progress once the job finished in PHASE: what is true at the end, not what the last poll saw.

    The trainer is polled every few seconds while it runs, so a short job (or a fast last stretch)
    ends between polls: the last reading is stale. Succeeded: the trainer ran to its planned step
    count (it always does, unless early stopping may have ended it sooner, where the last reading
    is the best known), so the progress shows that step, 100% and no ETA. Failed: the last step
    reached as last seen, and no ETA (nothing is coming). The returned dict replaces status.progress
    as a merge patch: etaSeconds None removes it. None: nothing to say (never seen, not finished).
    """
    seen = dict(status.get("progress") or {})
    if phase == "Succeeded":
        total = seen.get("totalSteps") or (spec.get("training") or {}).get("maxSteps")
        if not total:
            return None
        early_stop = bool((spec.get("validation") or {}).get("earlyStoppingPatience"))
        if early_stop and "step" not in seen:
            return None  # it may have stopped anywhere, and no reading says where
        step = seen["step"] if early_stop else total
        return {**seen, "step": step, "totalSteps": total, "percent": 100.0, "etaSeconds": None}
    if phase == "Failed" and seen:
        return {**seen, "etaSeconds": None}
    return None


def final_checkpoint(spec: dict, status: dict) -> str | None:
    """status.latestCheckpoint once a job succeeded, when it is certain without asking storage.

    The trainer always checkpoints its last step; only early stopping can end a run sooner, and
    then the newest checkpoint the trainer reported while running stands.
    """
    if (spec.get("validation") or {}).get("earlyStoppingPatience") or not status.get("outputUri"):
        return None
    total = (status.get("progress") or {}).get("totalSteps") or (spec.get("training") or {}).get("maxSteps")
    return layout.join(status["outputUri"], layout.checkpoint_name(total)) if total else None


def finished_patch(spec: dict, status: dict, phase: str) -> dict:
    """What else a transition to Succeeded or Failed sets: the final progress and checkpoint, and (Succeeded)
    the report the trainer writes into the run's directory as it ends."""
    patch: dict = {}
    progress = final_progress(spec, status, phase)
    if progress:
        patch["progress"] = progress
    if phase == "Succeeded":
        final = final_checkpoint(spec, status)
        if final:
            patch["latestCheckpoint"] = final
        if status.get("outputUri"):
            patch["reportUri"] = layout.join(status["outputUri"], layout.REPORT_FILE)
    return patch
