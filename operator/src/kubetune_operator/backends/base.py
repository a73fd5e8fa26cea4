"""The seam between the operator and a training system's job object.

A backend knows one Kubeflow job kind: how to build it from a TrainingJob, how to read its state,
suspend, resume and resize it, which pod runs rank 0, what it needs installed and its own settings.
The reconcile talks to this interface only; nothing outside a backend module names a PyTorchJob or
TrainJob label, container or environment variable.

How to add a backend (say `mpijob`), in this order:
  1. kubetune_api.contract: add its name to BACKENDS (spec.backend's values, the CRD's enum and the
     operator's check of the Helm value `backend` all read it), then `make crd`.
  2. backends/mpijob.py: a class with every attribute and verb of Backend below (pytorchjob.py is the
     shorter model). Its pods come from pod_template.pod_template with the ContainerShape its
     controller expects (container name, rendezvous port); its Helm values, if any, through
     settings_from_env. Register an instance in backends/__init__.py's BACKENDS.
  3. The chart: values.yaml and values.schema.json (`mpijob.enabled`, the `backend` enum),
     _helpers.tpl (`kubetune.mpijobEnabled` and the enabled list), rbac.yaml (its kind's rules, only
     when enabled), podmonitor.yaml (its rank-0 pod's labels); then `make manifests`.
  4. The dev cluster: its controller and CRDs (devcluster/src/kubetune_dev/versions.py, controllers.py,
     Kueue's frameworks there), trainer_pods.py and lint.py (its pods linted like the others').
  5. Tests: tests/unit/test_backends.py for the verbs, and the backend in tests/e2e/conftest.py's
     `backend` parameters, so every e2e test that installs the operator runs it too.
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
