"""Kubeflow Trainer v2.3: a TrainJob that references kubetune's ClusterTrainingRuntime.

Two halves, both built from pod_template's pure functions so that a TrainJob's pods equal a
PyTorchJob's (same command, security context, volumes and environment):

  * the ClusterTrainingRuntime, shipped by the Helm chart (`runtime()`; the chart template is
    written by `python -m kubetune_operator.runtime_chart --write` and a test keeps it equal);
    it holds what is the same for every job: the torch ML policy, the trainer container and its
    entry point, the cache stage, PSS-restricted pods, shm, and how failures restart the job;
  * the TrainJob per TrainingJob (`TrainJobBackend.build`): runtimeRef plus the trainer overrides
    (numNodes, numProcPerNode, resourcesPerNode, image, env) and a runtime patch for what the
    Trainer API lets a job set on its pods (the config volume, shm size, labels, scheduling).

The Trainer's torch plugin injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the pod's
completion index) and PET_MASTER_ADDR/PET_MASTER_PORT into the container named `node`; the
trainer reads them through kubetune_api.contract.NodeEnv.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubetune_api import contract
from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.backends.base import ChildState, Prerequisite
from kubetune_operator.pod_template import (TERMINATION_GRACE_SECONDS, ContainerShape, api_access_mount,
                                            api_access_volume, job_env, job_mounts, job_volumes, pod_identity,
                                            pod_labels, pod_security_context, resources, scheduling_fields,
                                            scrape_annotations, static_env, trainer_container, volumes)
from kubetune_operator.settings import Settings

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
# The Trainer finds the trainer's pod template by this label and its container by this name.
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"
# JobSet's labels on every pod; the Job controller adds the completion index (= the node rank).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# Who owns our entry in a TrainJob's spec.runtimePatches (Kueue writes its own next to it).
PATCH_MANAGER = f"{contract.API_GROUP}/operator"
# Trainer exit codes that restart the job (after a signal: 143 = SIGTERM after the last
# checkpoint, 137 = SIGKILL or OOM, 129/130 = SIGHUP/SIGINT); any other failure (1-127: refused
# input, a bug) fails it at once, as a PyTorchJob's restartPolicy ExitCode does.
RETRYABLE_EXIT_CODES = [129, 130, 137, contract.EXIT_PREEMPTED]
INSTALL = ("install Kubeflow Trainer v2.3 with JobSet: helm install kubeflow-trainer "
           "oci://ghcr.io/kubeflow/charts/kubeflow-trainer --version 2.3.0 -n kubeflow-system --create-namespace")
# The config volume's ConfigMap is per job; the runtime names none that exists.
CONFIG_MAP_SET_PER_JOB = "set-per-job-by-the-kubetune-operator"
DEFAULT_SHM = "1Gi"


@dataclass(frozen=True)
class TrainJobSettings:
    """The TrainJob backend's own settings (Helm values trainjob.*)."""

    # The ClusterTrainingRuntime TrainJobs reference (the chart ships it), and how often it restarts
    # a job after a retryable failure (its JobSet failurePolicy.maxRestarts).
    runtime: str = "kubetune-trainer"
    max_restarts: int = 3
    # Also write progress into a TrainJob's status.trainerStatus (Kubeflow Trainer's progress API).
    report_progress: bool = True

    @classmethod
    def from_env(cls, env) -> "TrainJobSettings":
        return cls(runtime=env.get("KUBETUNE_TRAINJOB_RUNTIME") or cls.runtime,
                   max_restarts=int(env.get("KUBETUNE_TRAINJOB_MAX_RESTARTS") or cls.max_restarts),
                   report_progress=env.get("KUBETUNE_TRAINJOB_REPORT_PROGRESS", "true").lower() != "false")

    @classmethod
    def of(cls, settings: Settings) -> "TrainJobSettings":
        return settings.backend_settings.get("trainjob") or cls()


@dataclass(frozen=True)
class RuntimeValues:
    """The chart values the ClusterTrainingRuntime depends on."""

    name: str = "kubetune-trainer"
    image: str = Settings.trainer_image
    metrics_port: int = Settings.trainer_metrics_port
    max_restarts: int = TrainJobSettings.max_restarts


def runtime(values: RuntimeValues, labels: dict[str, str] | None = None) -> dict:
    """The ClusterTrainingRuntime for the kubetune trainer (what the chart ships)."""
    settings = Settings(trainer_image=values.image, trainer_metrics_port=values.metrics_port)
    # The environment is the job's (TrainJob spec.trainer.env), and so are the GPUs: a TrainJob sets
    # resources on this container only, which is why the cache stage runs in it (contract.CACHE_STAGE_FIRST)
    # rather than in an init container, which would get no GPU.
    main = {key: value for key, value in trainer_container(ContainerShape(NODE), values.image, [], settings).items()
            if value not in ([], {})}
    pod = {
        "securityContext": pod_security_context(),
        **pod_identity(),
        # A failed pod fails its Job (podFailurePolicy needs Never); the JobSet then restarts every node.
        "restartPolicy": "Never",
        "containers": [main],
        "volumes": volumes(CONFIG_MAP_SET_PER_JOB, DEFAULT_SHM, settings.cache_size_limit),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
    }
    node_job = {
        "name": NODE,
        "template": {
            "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
            "spec": {
                # Indexed: each pod's completion index is its node rank (PET_NODE_RANK).
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{
                    "action": "FailJob",
                    "onExitCodes": {"operator": "NotIn", "values": RETRYABLE_EXIT_CODES},
                }]},
                "template": {"spec": pod},
            },
        },
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": values.name, "labels": {"trainer.kubeflow.org/framework": "torch", **(labels or {})}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {
                # Stable pod hostnames: PET_MASTER_ADDR names rank 0's pod.
                "network": {"enableDNSHostnames": True},
                "failurePolicy": {
                    "maxRestarts": values.max_restarts,
                    # A trainer error is final; a lost or preempted pod restarts the job (all nodes,
                    # each resuming from the newest checkpoint), up to maxRestarts.
                    "rules": [{"name": "failOnTrainerError", "action": "FailJobSet",
                               "onJobFailureReasons": ["PodFailurePolicy"]}],
                },
                "replicatedJobs": [node_job],
            }},
        },
    }


# Phases of a TrainJob condition, most decisive first.
_PHASE_BY_CONDITION = [("Complete", "Succeeded"), ("Failed", "Failed"), ("Suspended", "Suspended")]


class TrainJobBackend:
    name = "trainjob"
    group = GROUP
    version = VERSION
    plural = "trainjobs"
    kind = "TrainJob"
    container = NODE

    def build(self, job: TrainingJob, job_uid: str, settings: Settings) -> dict:
        spec = job.spec
        trainer: dict = {
            "image": spec.image or settings.trainer_image,
            # The runtime's entry point; with the cache on, node 0 fills it first (one pod template for all nodes).
            **({"args": [*contract.TRAINER_ARGS, contract.CACHE_STAGE_FIRST]} if spec.data.cache.enabled else {}),
            "env": static_env(settings) + job_env(job, job_uid, settings),
            "numNodes": spec.resources.nodes,
            # Always explicit: the Trainer's default "auto" would mean one process per CPU core.
            "numProcPerNode": spec.processes_per_node,
        }
        amounts = resources(job, settings)
        if amounts:
            trainer["resourcesPerNode"] = amounts
        train_job = {
            "apiVersion": f"{self.group}/{self.version}",
            "kind": self.kind,
            "metadata": {
                "name": naming.child_name(job.metadata.name),
                "namespace": job.metadata.namespace,
                "labels": pod_labels(job),
            },
            "spec": {
                "runtimeRef": {"name": TrainJobSettings.of(settings).runtime, "apiGroup": GROUP,
                               "kind": "ClusterTrainingRuntime"},
                "suspend": spec.suspend,
                "trainer": trainer,
                "runtimePatches": [self._runtime_patch(job, settings)],
            },
        }
        if spec.run_policy.active_deadline_seconds is not None:
            train_job["spec"]["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds
        return train_job

    def _runtime_patch(self, job: TrainingJob, settings: Settings) -> dict:
        """What the Trainer lets a job set on its pods: the config, shm and cache volumes, labels and
        annotations, placement and identity (a pod priority it cannot set: see unsupported())."""
        spec = job.spec
        config, shm, cache = volumes(naming.config_map_name(job.metadata.name), spec.resources.shm_size,
                                     spec.resources.cache_size or settings.cache_size_limit)[:3]
        pod_spec = {
            "volumes": [config, shm, cache, *job_volumes(job)],  # merged by name into the runtime's volumes
            **{key: value for key, value in scheduling_fields(job).items() if key != "priorityClassName"},
        }
        mounts = job_mounts(job)
        if spec.scheduling.service_account_token:
            pod_spec["volumes"].append(api_access_volume())
            mounts.insert(0, api_access_mount())
        if mounts:
            pod_spec["containers"] = [{"name": NODE, "volumeMounts": mounts}]  # upserted by mountPath
        # All nodes share one pod template, so every node's pod carries the scrape annotations;
        # only rank 0 serves (the PodMonitor selects its pod by completion index 0).
        pod_metadata = {"labels": naming.labels(job.metadata.name), "annotations": scrape_annotations(settings)}
        return {
            "manager": PATCH_MANAGER,
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                "name": NODE,
                "template": {"spec": {"template": {"metadata": pod_metadata, "spec": pod_spec}}},
            }]}}},
        }

    def read_state(self, child: dict) -> ChildState:
        status = child.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
        for condition_type, phase in _PHASE_BY_CONDITION:
            if condition_type in conditions:
                condition = conditions[condition_type]
                return ChildState(phase, condition.get("reason") or condition_type, condition.get("message") or "",
                                  completion_time=condition.get("lastTransitionTime")
                                  if phase in ("Succeeded", "Failed") else None)
        # The TrainJob has no Running condition: its JobSet's node Job has pods running or starting.
        nodes = next((s for s in status.get("jobsStatus") or [] if s.get("name") == NODE), {})
        if (nodes.get("active") or 0) > 0 or (nodes.get("ready") or 0) > 0:
            return ChildState("Running", "Running", "the training pods are running")
        return ChildState("Pending", "Created", "waiting for the Kubeflow Trainer controller to start the pods")

    def suspend_patch(self, suspend: bool) -> dict:
        return {"spec": {"suspend": suspend}}

    def is_suspended(self, child: dict) -> bool:
        return bool((child.get("spec") or {}).get("suspend"))

    def resize_patch(self, child: dict, job: TrainingJob, job_uid: str, settings: Settings) -> None:
        """None: a TrainJob is replaced to change its size.

        The Trainer builds the JobSet from the TrainJob while it is suspended, but JobSet's webhook
        refuses any change of a replicated job's parallelism or containers (only pod labels,
        annotations, nodeSelector, tolerations and scheduling gates may change while suspended).
        So the suspended TrainJob is deleted with its JobSet and created again at the new size; the
        run id (the TrainingJob's UID) stays, so the run continues from its latest checkpoint.
        """
        return None

    def owned_fields(self, child: dict) -> dict[str, object]:
        """The trainer's image and size: written by kubetune only (the Trainer and Kueue leave them)."""
        trainer = (child.get("spec") or {}).get("trainer") or {}
        return {f"spec.trainer.{key}": trainer.get(key) for key in ("image", "numNodes", "numProcPerNode")}

    def rank0_pod_selector(self, job_name: str) -> str:
        # Rank 0 runs in node rank 0: the pod of completion index 0 of the JobSet's node Job.
        return (f"{JOBSET_NAME_LABEL}={naming.child_name(job_name)},{REPLICATED_JOB_LABEL}={NODE},"
                f"{COMPLETION_INDEX_LABEL}=0")

    def settings_from_env(self, env) -> TrainJobSettings:
        return TrainJobSettings.from_env(env)

    def prerequisites(self, settings: Settings) -> list[Prerequisite]:
        runtime_name = TrainJobSettings.of(settings).runtime
        return [
            Prerequisite(self.group, self.version, self.plural, None, "TrainJobAPIMissing",
                         f"the TrainJob API ({self.plural}.{self.group}/{self.version}) is not installed: {INSTALL}"),
            Prerequisite(self.group, self.version, "clustertrainingruntimes", runtime_name,
                         "TrainingRuntimeMissing",
                         f"ClusterTrainingRuntime {runtime_name!r} does not exist: the kubetune chart ships "
                         "it with the TrainJob backend (helm upgrade kubetune charts/kubetune --reuse-values "
                         "--set trainjob.enabled=true); with trainjob.runtime.create=false, apply your own of that name"),
        ]

    def unsupported(self, job: TrainingJob, settings: Settings) -> list[str]:
        spec, problems, max_restarts = job.spec, [], TrainJobSettings.of(settings).max_restarts
        if spec.scheduling.priority_class_name:
            problems.append("spec.scheduling.priorityClassName: a TrainJob (Kubeflow Trainer v2.3) cannot set a pod "
                            "priority per job; use a Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class) "
                            "or spec.backend pytorchjob")
        if spec.run_policy.ttl_seconds_after_finished is not None:
            problems.append("spec.runPolicy.ttlSecondsAfterFinished: a TrainJob (Kubeflow Trainer v2.3) has no "
                            "per-job TTL; remove it or use spec.backend pytorchjob")
        if ("backoff_limit" in spec.run_policy.model_fields_set
                and spec.run_policy.backoff_limit != max_restarts):
            problems.append(f"spec.runPolicy.backoffLimit {spec.run_policy.backoff_limit}: TrainJobs restart as often "
                            f"as their ClusterTrainingRuntime allows ({max_restarts}, Helm value "
                            "trainjob.runtime.maxRestarts); leave it unset or use spec.backend pytorchjob")
        return problems

    def progress_patch(self, progress: dict, now: str, settings: Settings) -> dict | None:
        """status.trainerStatus, Kubeflow Trainer's place for progress (read by its SDK and UIs);
        None where the chart turned it off (trainjob.reportProgress)."""
        if not TrainJobSettings.of(settings).report_progress:
            return None
        trainer_status: dict = {"progressPercentage": int(progress.get("percent", 0)), "lastUpdatedTime": now,
                                "metrics": [{"name": "step", "value": str(progress.get("step", 0))},
                                            {"name": "totalSteps", "value": str(progress.get("totalSteps", 0))}]}
        if progress.get("loss") is not None:
            trainer_status["metrics"].append({"name": "loss", "value": str(progress["loss"])})
        if progress.get("etaSeconds") is not None:
            trainer_status["estimatedRemainingSeconds"] = int(progress["etaSeconds"])
        return {"status": {"trainerStatus": trainer_status}}
