"""The TrainingJob's status: phase, conditions, progress, checkpoints, validation, generations."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from kubetune_api.contract import RECENT_LOSS_STEPS
from kubetune_api.spec_base import SpecModel


class Condition(SpecModel):
    """A Kubernetes-style condition: one aspect of the job's state, with why and since when."""

    type: str = Field(max_length=316, description="Condition type, e.g. Ready, Succeeded, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", max_length=1024, description="CamelCase reason for the last transition.")
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: Optional[str] = Field(default=None, description="When status last changed (RFC 3339).")


class Progress(SpecModel):
    """Training progress as the trainer reports it."""

    step: int = Field(default=0, ge=0, description="Optimizer steps done.")
    total_steps: int = Field(default=0, ge=0, description="Optimizer steps planned.")
    percent: float = Field(default=0, ge=0, le=100, description="step / totalSteps in percent.")
    eta_seconds: Optional[float] = Field(default=None, ge=0, description="Estimated seconds to finish.")
    loss: Optional[float] = Field(default=None, description="Latest training loss.")
    recent_loss: Optional[float] = Field(default=None, description=f"Mean training loss of the latest "
                                         f"{RECENT_LOSS_STEPS} steps: a sweep's loss objective.")


class CheckpointMark(SpecModel):
    """The newest complete checkpoint as the trainer reports it."""

    step: int = Field(ge=0, description="The step it holds.")
    time: Optional[str] = Field(default=None, description="When it was written (RFC 3339); unset for one written "
                                "before the operator saw the run (a resumed run's starting checkpoint).")


class UnsavedWork(SpecModel):
    """Work a stop without a final checkpoint would lose, while the job runs: what a preemption costs."""

    steps: int = Field(ge=0, description="Optimizer steps done since the newest complete checkpoint.")
    seconds: int = Field(ge=0, description="Seconds of training since that checkpoint's state was taken (or since "
                         "this attempt started training, if later).")


class ValidationResult(SpecModel):
    """The latest validation as the trainer reports it."""

    step: int = Field(ge=0, description="The step it validated at.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="What it measured on the held-out data, by name (loss; accuracy "
        "and f1 for classifiers; clip_score or clip_directional with spec.validation.clipModel): a sweep's "
        "trial objective.",
    )


class Generation(SpecModel):
    """One `kubetune generate --on-cluster` request (the kubetune.dev/generate annotation) as the operator
    answers it: the batch Job that draws it and where the images go."""

    id: str = Field(max_length=64, description="The request's id (in the annotation, the Job's name and the folder).")
    phase: Literal["Running", "Succeeded", "Failed"] = Field(description="Running, Succeeded or Failed.")
    uri: Optional[str] = Field(default=None, description="Where the PNGs and grid.png go: "
                               "<outputUri>/generated/<step>[-compare]-<id>.")
    job: Optional[str] = Field(default=None, description="The batch Job that draws them.")
    message: Optional[str] = Field(default=None, max_length=32768, description="Why it failed.")
    start_time: Optional[str] = Field(default=None, description="When the Job started (RFC 3339).")
    completion_time: Optional[str] = Field(default=None, description="When it finished (RFC 3339).")


class TrainingJobStatus(SpecModel):
    """What the operator observed."""

    phase: Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"] = Field(
        default="Pending", description="Pending, Running, Succeeded, Failed or Suspended."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Detailed state.")
    start_time: Optional[str] = Field(default=None, description="When training started (RFC 3339).")
    completion_time: Optional[str] = Field(default=None, description="When the job finished (RFC 3339).")
    progress: Optional[Progress] = Field(default=None, description="Latest progress from the trainer.")
    output_uri: Optional[str] = Field(
        default=None, description="This run's directory: <checkpoints.uri>/<namespace>/<name>/v<N> "
        "(checkpoints, final weights, logs).",
    )
    latest_checkpoint: Optional[str] = Field(default=None, description="URI of the newest complete checkpoint.")
    last_checkpoint: Optional[CheckpointMark] = Field(
        default=None, description="The newest complete checkpoint's step and time, read from the trainer.")
    unsaved_work: Optional[UnsavedWork] = Field(
        default=None, description="Work done since the newest complete checkpoint, while the job runs (removed "
        "once it stops: a stopping trainer writes a last checkpoint).")
    priority_boost: Optional[int] = Field(
        default=None, description="The kueue.x-k8s.io/priority-boost kubetune keeps on the job's Kueue Workload "
        "for its unsaved work (the chart's kueue.preemptionCost).")
    report_uri: Optional[str] = Field(
        default=None, description="URI of the run's report (report.html in the run's directory: curves, validation "
        "grids, the resolved spec, where the weights are), set when the job succeeds. The trainer writes it last; "
        "where writing it failed (a warning in the trainer's log) `kubetune report` writes one from the run.",
    )
    validation: Optional[ValidationResult] = Field(
        default=None, description="The latest validation's metrics, read from the trainer while it runs "
        "(spec.validation.everySteps with held-out data).",
    )
    observed_generation: Optional[int] = Field(default=None, description="The spec generation last acted on.")
    backend: Optional[str] = Field(default=None, description="The backend running the job (pytorchjob or trainjob).")
    generations: list[Generation] = Field(
        default_factory=list, description="The latest `kubetune generate --on-cluster` requests (at most 10), "
        "each with its phase and the URI of its images.")
