"""Kubeflow Training Operator v1: a PyTorchJob with one Master and nodes-1 Workers."""
from __future__ import annotations

from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.backends.base import ChildState
from kubetune_operator.pod_template import pod_labels, pod_template
from kubetune_operator.settings import Settings

# PyTorchJob condition type -> TrainingJob phase, most decisive first.
_PHASE_BY_CONDITION = [
    ("Succeeded", "Succeeded"),
    ("Failed", "Failed"),
    ("Suspended", "Suspended"),
    ("Restarting", "Running"),
    ("Running", "Running"),
    ("Created", "Pending"),
]


class PyTorchJobBackend:
    group = "kubeflow.org"
    version = "v1"
    plural = "pytorchjobs"
    kind = "PyTorchJob"

    def build(self, job: TrainingJob, job_uid: str, settings: Settings) -> dict:
        spec = job.spec
        def replica(count: int, master: bool) -> dict:
            # The embedding cache is filled once, by the Master, before anyone trains.
            # Only the Master runs rank 0, the one process that serves metrics.
            template = pod_template(job, job_uid, settings, with_cache_stage=master and spec.data.cache.enabled,
                                    serves_metrics=master)
            return {"replicas": count, "restartPolicy": "ExitCode", "template": template}

        replica_specs = {"Master": replica(1, master=True)}
        if spec.resources.nodes > 1:
            replica_specs["Worker"] = replica(spec.resources.nodes - 1, master=False)
        run_policy = {
            # Pods stay after the end (logs); the TrainingJob's deletion removes them via the job.
            "cleanPodPolicy": "None",
            "backoffLimit": spec.run_policy.backoff_limit,
            "suspend": spec.suspend,
        }
        if spec.run_policy.active_deadline_seconds is not None:
            run_policy["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds
        if spec.run_policy.ttl_seconds_after_finished is not None:
            run_policy["ttlSecondsAfterFinished"] = spec.run_policy.ttl_seconds_after_finished
        return {
            "apiVersion": f"{self.group}/{self.version}",
            "kind": self.kind,
            "metadata": {
                "name": naming.child_name(job.metadata.name),
                "namespace": job.metadata.namespace,
                "labels": pod_labels(job),
            },
            "spec": {
                "runPolicy": run_policy,
                # One process per GPU; on CPU nodes distributed.processesPerNode (default 1).
                "nprocPerNode": str(spec.processes_per_node),
                "pytorchReplicaSpecs": replica_specs,
            },
        }

    def read_state(self, child: dict) -> ChildState:
        status = child.get("status") or {}
        true_conditions = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
        for condition_type, phase in _PHASE_BY_CONDITION:
            if condition_type in true_conditions:
                condition = true_conditions[condition_type]
                return ChildState(
                    phase=phase,
                    reason=condition.get("reason") or condition_type,
                    message=condition.get("message") or "",
                    start_time=status.get("startTime"),
                    completion_time=status.get("completionTime"),
                )
        return ChildState(phase="Pending", reason="Created", message="waiting for the training operator")

    def suspend_patch(self, suspend: bool) -> dict:
        return {"spec": {"runPolicy": {"suspend": suspend}}}
