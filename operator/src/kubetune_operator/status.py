"""TrainingJob status as a small state machine: pure functions from observations to a patch.

Level-based: each call compares what the child says now with what the status records and
returns only the difference, plus the Events that explain a transition.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubetune_api import layout
from kubetune_operator.backends.base import ChildState

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
    if "step" not in samples or "planned_steps" not in samples:
        return None
    step, total = int(samples["step"]), int(samples["planned_steps"])
    progress = {"step": step, "totalSteps": total, "percent": round(100.0 * step / total, 1) if total else 0.0}
    if "loss" in samples:
        progress["loss"] = round(samples["loss"], 6)
    if "eta_seconds" in samples:
        progress["etaSeconds"] = round(samples["eta_seconds"], 1)
    return progress


def output_uri_from_metrics(samples: dict[str, float], checkpoints_uri: str, namespace: str, job: str) -> str | None:
    """The run directory the trainer chose (it reports its version number as a gauge)."""
    if "run_version" not in samples:
        return None
    return layout.run_root(checkpoints_uri, namespace, job, int(samples["run_version"]))


def latest_checkpoint_from_metrics(samples: dict[str, float], output_uri: str | None) -> str | None:
    step = int(samples.get("last_checkpoint_step", 0))
    return layout.join(output_uri, layout.checkpoint_name(step)) if step > 0 and output_uri else None


def final_checkpoint(spec: dict, status: dict) -> str | None:
    """status.latestCheckpoint once a job succeeded, when it is certain without asking storage.

    The trainer always checkpoints its last step; only early stopping can end a run sooner, and
    then the newest checkpoint the trainer reported while running stands.
    """
    if (spec.get("validation") or {}).get("earlyStoppingPatience") or not status.get("outputUri"):
        return None
    total = (status.get("progress") or {}).get("totalSteps") or (spec.get("training") or {}).get("maxSteps")
    return layout.join(status["outputUri"], layout.checkpoint_name(total)) if total else None
