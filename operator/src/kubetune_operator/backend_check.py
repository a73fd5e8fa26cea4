"""Can this job's backend run it? Pure decisions behind the BackendReady condition.

Three things stop a child job from being created, each with a message that says what is missing
and how to get it:
  * the job's backend is not enabled in this operator (its RBAC was not granted by the chart);
  * the backend cannot honour a field the job sets (refused, never silently dropped);
  * something the backend needs is not installed (an API, a ClusterTrainingRuntime): the handler
    finds that out from the API server and reports the backend's Prerequisite.
The first and the last are waited out (the job starts once the piece is there); the second is a
permanent refusal until the spec changes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubetune_api.spec import TrainingJob
from kubetune_operator import status
from kubetune_operator.backends import Backend, Prerequisite
from kubetune_operator.settings import Settings

CONDITION = "BackendReady"


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str
    permanent: bool = False  # True: no retry helps until the spec changes


def not_enabled(backend: Backend, settings: Settings) -> Problem | None:
    if settings.backend_enabled(backend.name):
        return None
    return Problem("BackendNotEnabled", (
        f"spec.backend {backend.name}: this kubetune operator was installed without the {backend.name} backend "
        f"(enabled: {', '.join(settings.backends)}); enable it with helm upgrade kubetune charts/kubetune "
        f"--reuse-values --set {backend.name}.enabled=true, and the job starts"))


def unsupported(job: TrainingJob, backend: Backend, settings: Settings) -> Problem | None:
    problems = backend.unsupported(job, settings)
    if not problems:
        return None
    return Problem("UnsupportedByBackend", f"the {backend.name} backend cannot run this job: " + "; ".join(problems),
                   permanent=True)


def missing(prerequisite: Prerequisite) -> Problem:
    return Problem(prerequisite.reason, prerequisite.missing)


def forbidden(prerequisite: Prerequisite, backend: Backend) -> Problem:
    """The API server refused the operator a look at a prerequisite: the chart did not grant it."""
    what = prerequisite.plural + (f"/{prerequisite.name}" if prerequisite.name else "")
    return Problem("BackendNotPermitted", (
        f"the operator may not read {what}.{prerequisite.group}: its ClusterRole lacks the {backend.name} backend; "
        f"helm upgrade kubetune charts/kubetune --reuse-values --set {backend.name}.enabled=true"))


def conditions(current_status: dict, problem: Problem | None, backend: Backend, child: str, now: str) -> list[dict]:
    """status.conditions with BackendReady saying what stops the job, or that its child exists."""
    if problem:
        return status.set_condition(list(current_status.get("conditions") or []), CONDITION, "False",
                                    problem.reason, problem.message, now)
    return status.set_condition(list(current_status.get("conditions") or []), CONDITION, "True", "ChildCreated",
                                f"{backend.kind} {child} ({backend.name} backend)", now)
