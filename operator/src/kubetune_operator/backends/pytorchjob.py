"""Kubeflow Training Operator v1: a PyTorchJob with one Master and nodes-1 Workers."""
from __future__ import annotations

from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.backends.base import ChildState, Prerequisite
from kubetune_operator.pod_template import ContainerShape, pod_labels, pod_template
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
# The training operator injects MASTER_ADDR/MASTER_PORT (and PET_*) into the container of this
# name, taking the port from the container port of this name.
CONTAINER_NAME = "pytorch"
PORT_NAME = "pytorchjob-port"
# Labels the training operator puts on the pods it creates.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
INSTALL = ('install the Kubeflow Training Operator v1.9: kubectl apply --server-side -k '
           '"github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.3"')


class PyTorchJobBackend:
    name = "pytorchjob"
    group = "kubeflow.org"
    version = "v1"
    plural = "pytorchjobs"
    kind = "PyTorchJob"
    container = CONTAINER_NAME

    def build(self, job: TrainingJob, job_uid: str, settings: Settings) -> dict:
        spec = job.spec
        # A per-job port: jobs may share a host's port space (the local process kubelet does).
        shape = ContainerShape(CONTAINER_NAME, (PORT_NAME, naming.master_port(job_uid)))

        def replica(count: int, master: bool) -> dict:
            # The embedding cache is filled once, by the Master, before anyone trains.
            # Only the Master runs rank 0, the one process that serves metrics.
            template = pod_template(job, job_uid, settings, shape,
                                    with_cache_stage=master and spec.data.cache.enabled, serves_metrics=master)
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

    def is_suspended(self, child: dict) -> bool:
        return bool(((child.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def resize_patch(self, child: dict, job: TrainingJob, job_uid: str, settings: Settings) -> list[dict]:
        """Replica specs and nprocPerNode rebuilt for JOB's size, as one JSON patch.

        The training operator (v1.9) deletes every pod of a suspended PyTorchJob and, on resume,
        creates pods from the replica specs it then reads, with PET_NNODES, PET_NPROC_PER_NODE and
        WORLD_SIZE computed at pod creation; its webhook lets replicas and nprocPerNode change (only
        runPolicy.managedBy is immutable). So the child is patched in place, keeping its UID and
        status. The replica specs are replaced whole (a merge patch would keep a dropped Worker or a
        GPU limit), and a `test` of runPolicy.suspend makes the patch fail unless the child is still
        suspended when the API server applies it. The containers keep the image they run.
        """
        built = self.build(job, job_uid, settings)["spec"]
        running_images = {container["name"]: container["image"]
                          for replica in (child.get("spec") or {}).get("pytorchReplicaSpecs", {}).values()
                          for container in replica["template"]["spec"].get("containers", [])
                          + replica["template"]["spec"].get("initContainers", [])}
        for replica in built["pytorchReplicaSpecs"].values():
            pod = replica["template"]["spec"]
            for container in pod["containers"] + pod.get("initContainers", []):
                container["image"] = running_images.get(container["name"], container["image"])
        return [{"op": "test", "path": "/spec/runPolicy/suspend", "value": True},
                {"op": "add", "path": "/spec/nprocPerNode", "value": built["nprocPerNode"]},
                {"op": "add", "path": "/spec/pytorchReplicaSpecs", "value": built["pytorchReplicaSpecs"]}]

    def owned_fields(self, child: dict) -> dict[str, object]:
        """Replica counts and trainer images: written by kubetune only (not by the training operator,
        nor by Kueue, which only suspends and adds scheduling constraints)."""
        fields: dict[str, object] = {}
        for replica, spec in sorted(((child.get("spec") or {}).get("pytorchReplicaSpecs") or {}).items()):
            fields[f"spec.pytorchReplicaSpecs.{replica}.replicas"] = spec.get("replicas")
            containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
            fields[f"spec.pytorchReplicaSpecs.{replica}.template.spec.containers[{CONTAINER_NAME}].image"] = next(
                (c.get("image") for c in containers if c.get("name") == CONTAINER_NAME), None)
        return fields

    def rank0_pod_selector(self, job_name: str) -> str:
        # Rank 0 runs in the Master (node rank 0), which the training operator labels replica-type=master.
        return f"{JOB_NAME_LABEL}={naming.child_name(job_name)},{REPLICA_TYPE_LABEL}=master"

    def prerequisites(self, settings: Settings) -> list[Prerequisite]:
        return [Prerequisite(self.group, self.version, self.plural, None, "PyTorchJobAPIMissing",
                             f"the PyTorchJob API ({self.plural}.{self.group}/{self.version}) is not installed: "
                             f"{INSTALL}")]

    def unsupported(self, job: TrainingJob, settings: Settings) -> list[str]:
        return []  # the PyTorchJob carries every field of the spec

    def settings_from_env(self, env) -> None:
        return None  # no Helm values of its own

    def progress_patch(self, progress: dict, now: str, settings: Settings) -> dict | None:
        return None  # a PyTorchJob's status has no place for progress
