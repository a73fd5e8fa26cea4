"""The seam between the operator and a training system's job object.

A backend knows one Kubeflow job kind: how to build it from a TrainingJob, how to read its state,
suspend, resume and resize it, which pod runs rank 0, and what it needs installed. The handlers
talk to this interface only; nothing outside a backend module names a PyTorchJob or TrainJob
label, container or environment variable.
"""
from __future__ import annotations

from collections.abc import Mapping
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




@dataclass(frozen=True)
class Prerequisite:
    """Something a backend needs in the cluster before its child job can run.

    name None: the API itself (its CRD) must be served; otherwise the cluster-scoped object of
    that name must exist. `reason` and `missing` become the BackendReady condition and the
    Warning event while it is missing: what is missing and how to install it.
    """

    group: str
    version: str
    plural: str
    name: str | None
    reason: str
    missing: str


class Backend(Protocol):
    name: str  # as written in spec.backend and in the Helm value `backend`
    group: str
    version: str
    plural: str
    kind: str
    container: str  # the trainer container's name in the child's pods (its logs: kubectl logs -c)

    def build(self, job: TrainingJob, job_uid: str, settings: Settings) -> dict:
        """The child job object (without ownerReferences: the handler adopts it)."""

    def read_state(self, child: dict) -> ChildState:
        """Translate the child's status into a phase with reason and message."""

    def suspend_patch(self, suspend: bool) -> dict:
        """A merge patch that suspends or resumes the child."""

    def is_suspended(self, child: dict) -> bool:
        """Whether the child is told to run no pods now."""

    def resize_patch(self, child: dict, job: TrainingJob, job_uid: str, settings: Settings) -> list[dict] | None:
        """A JSON patch giving the child JOB's size; the API server must refuse it (changing
        nothing) unless the child is suspended then, so pods of two sizes never run together.
        None: the child cannot change its size in place; it is replaced (deleted while
        suspended, then built again at the new size)."""

    def owned_fields(self, child: dict) -> dict[str, object]:
        """{field path: value} of the child that only kubetune writes (no controller, no Kueue): what a
        hand edit of the child is detected by, comparing the child with the one the spec builds."""

    def rank0_pod_selector(self, job_name: str) -> str:
        """A label selector for the pod that runs rank 0 (the one serving the trainer's metrics)."""

    def prerequisites(self, settings: Settings) -> list[Prerequisite]:
        """What must be installed for this backend's child jobs to be created and run."""

    def unsupported(self, job: TrainingJob, settings: Settings) -> list[str]:
        """Why this backend cannot run JOB as written (a field it cannot honour), one message per
        field; empty when it can. Refused, never silently dropped."""

    def settings_from_env(self, env: Mapping[str, str]) -> object | None:
        """The backend's own settings (its Helm values, passed to the operator as environment
        variables), read once at start-up into Settings.backend_settings; None where it has none."""

    def progress_patch(self, progress: dict, now: str, settings: Settings) -> dict | None:
        """A status patch reporting PROGRESS (status.progress) on the child, where its API has a
        place for it (and its settings ask for it); None where it has none."""


SUSPENDED_BEFORE_START = ChildState("Suspended", "Suspended",
                                    "suspended: no pods run until it is resumed (spec.suspend, or its Kueue queue)")


def observed_state(backend: "Backend", child: dict) -> ChildState:
    """The child's state as the TrainingJob shows it: what its controller reports, except that a child
    told to run no pods (spec.suspend, or held by Kueue) is Suspended from the start, not Pending
    until its controller's work queue gets to it."""
    state = backend.read_state(child)
    return SUSPENDED_BEFORE_START if state.phase == "Pending" and backend.is_suspended(child) else state
