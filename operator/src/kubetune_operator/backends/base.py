"""The seam between the operator and a training system's job object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kubetune_api.spec import TrainingJob
from kubetune_operator.settings import Settings


@dataclass(frozen=True)
class ChildState:
    """What the child job says, in TrainingJob terms."""

    phase: str  # Pending | Running | Succeeded | Failed | Suspended
    reason: str = ""
    message: str = ""
    start_time: str | None = None
    completion_time: str | None = None


class Backend(Protocol):
    group: str
    version: str
    plural: str
    kind: str

    def build(self, job: TrainingJob, job_uid: str, settings: Settings) -> dict:
        """The child job object (without ownerReferences: the handler adopts it)."""

    def read_state(self, child: dict) -> ChildState:
        """Translate the child's status into a phase with reason and message."""

    def suspend_patch(self, suspend: bool) -> dict:
        """A merge patch that suspends or resumes the child."""

    def is_suspended(self, child: dict) -> bool:
        """Whether the child is told to run no pods now."""

    def resize_patch(self, child: dict, job: TrainingJob, job_uid: str, settings: Settings) -> list[dict]:
        """A JSON patch giving the child JOB's size; the API server must refuse it (changing
        nothing) unless the child is suspended then, so pods of two sizes never run together."""
