"""Where a queued job stands in Kueue, as a TrainingJob condition: pure functions.

A job with spec.scheduling.queueName is held by Kueue: its child job carries the queue label, and
Kueue's own integration (PyTorchJob, TrainJob) suspends it until a ClusterQueue admits its
Workload, and suspends it again to preempt it. The child's state only says "suspended"; the
Workload says why. The operator copies that into the `Queued` condition, whose reason is the
QUEUE column of `kubectl get tj`:

  Waiting    (True)   in the queue, not admitted yet; the message is Kueue's (e.g. not enough quota)
  Inadmissible (True) Kueue cannot admit it as things are (e.g. its LocalQueue does not exist); the
                      message says what to create or fix; it is admitted once that is done
  Preempted  (True)   evicted for other work; it checkpointed and continues once readmitted
  Admitted   (False)  a ClusterQueue admitted it: its pods run
"""
from __future__ import annotations

from dataclasses import dataclass

CONDITION = "Queued"
# How Kueue's documentation queues any job; on a TrainingJob it means spec.scheduling.queueName.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue names the Workload of a job by a hash; it labels it with the job's UID.
WORKLOAD_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")


@dataclass(frozen=True)
class QueueState:
    status: str  # of the Queued condition: True while it waits, False once admitted
    reason: str  # Waiting | Preempted | Admitted
    message: str


def _condition(workload: dict, kind: str, status: str = "True") -> dict | None:
    """The Workload's condition KIND when it has STATUS, else None."""
    return next((c for c in (workload.get("status") or {}).get("conditions") or []
                 if c.get("type") == kind and c.get("status") == status), None)


def is_finished(workload: dict) -> bool:
    return _condition(workload, "Finished") is not None


def is_admitted(workload: dict) -> bool:
    """Whether a ClusterQueue admits the Workload now (its pods may run)."""
    return _condition(workload, "Admitted") is not None and not is_finished(workload)


def queue_state(queue: str, child_suspended: bool, workload: dict | None) -> QueueState | None:
    """Where a job in LocalQueue QUEUE stands, from its child's suspension and Kueue's Workload.

    None: nothing to say (no Workload yet and the child runs, or the Workload finished)."""
    if workload is None:
        if not child_suspended:
            return None
        return QueueState("True", "Waiting", f"waiting in queue '{queue}' for Kueue to admit it")
    if _condition(workload, "Finished"):
        return None
    if _condition(workload, "Admitted"):
        cluster_queue = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        by = f" by ClusterQueue '{cluster_queue}'" if cluster_queue else ""
        return QueueState("False", "Admitted", f"admitted{by} from queue '{queue}'")
    preempted = _condition(workload, "Preempted") or _evicted_by_preemption(workload)
    if preempted:
        why = preempted.get("message") or "preempted"
        return QueueState("True", "Preempted", f"preempted in queue '{queue}': {why}; it took a checkpoint and "
                                               "continues from it once Kueue readmits it")
    pending = _condition(workload, "QuotaReserved", "False")
    why = (pending or {}).get("message") or "not admitted yet"
    if (pending or {}).get("reason") == "Inadmissible":
        return QueueState("True", "Inadmissible", f"waiting in queue '{queue}': {why}{_fix_for(why, queue)}")
    return QueueState("True", "Waiting", f"waiting in queue '{queue}': {why}")


def _fix_for(why: str, queue: str) -> str:
    """How to make an inadmissible job admissible, where Kueue's message says what is missing."""
    if why.startswith("LocalQueue") and "doesn't exist" in why:
        return (f"; create a LocalQueue '{queue}' in this namespace (kueue.x-k8s.io/v1beta2, spec.clusterQueue: "
                "a ClusterQueue with quota) or fix spec.scheduling.queueName; the job starts once it is admitted")
    if why.startswith("ClusterQueue") and "doesn't exist" in why:
        return f"; create that ClusterQueue, or point LocalQueue '{queue}' at one that exists"
    return ""


def _evicted_by_preemption(workload: dict) -> dict | None:
    evicted = _condition(workload, "Evicted")
    return evicted if evicted and evicted.get("reason") == "Preempted" else None


def event_for(state: QueueState) -> tuple[str, str]:
    """The Event (type, reason) that announces a change to STATE."""
    return ("Warning" if state.reason in ("Preempted", "Inadmissible") else "Normal"), {
        "Waiting": "Queued", "Inadmissible": "Inadmissible", "Preempted": "Preempted",
        "Admitted": "Admitted"}[state.reason]
