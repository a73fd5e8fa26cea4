"""spec.resources, spec.distributed, spec.s3, spec.tracking, spec.scheduling and spec.runPolicy: the pods, how
the processes share the model, S3 access, MLflow, placement and identity, retries and time limits."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, model_validator

from kubetune_api.rules import Rule, enforce, entries
from kubetune_api.spec_base import SpecModel
from kubetune_api.spec_data import Quantity


DnsName = Annotated[str, Field(
    min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
)]
GPU_MEMORY_BOUNDS = ("1Gi", "4Ti")


def check_gpu_memory(value: str) -> str:
    from kubetune_api.quantity import parse_quantity

    low, high = (parse_quantity(bound, "bound") for bound in GPU_MEMORY_BOUNDS)
    if not low <= parse_quantity(value, "spec.resources.gpuMemory") <= high:
        raise ValueError(f"spec.resources.gpuMemory {value!r} is outside {GPU_MEMORY_BOUNDS[0]}-{GPU_MEMORY_BOUNDS[1]}")
    return value


# A memory size as a Kubernetes quantity: bytes with a decimal or binary suffix (no milli-bytes).
MemoryQuantity = Annotated[str, Field(
    pattern=r"^[0-9]+(\.[0-9]+)?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$", max_length=64,
), AfterValidator(check_gpu_memory)]


class ResourcesSpec(SpecModel):
    """How many machines and accelerators the job uses, and what each pod requests."""

    nodes: int = Field(default=1, ge=1, le=1024, description="Nodes (pods); 1 = single node.")
    gpus_per_node: int = Field(default=1, ge=0, le=16, description="GPUs per node; 0 trains on CPU.")
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu", max_length=253, pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
        description="The extended resource that counts GPUs on your nodes.",
    )
    cpu: Optional[Quantity] = Field(default=None, description="CPU per pod (request = limit), e.g. 8 or 7500m.")
    memory: Optional[Quantity] = Field(default=None, description="Memory per pod (request = limit), e.g. 64Gi.")
    shm_size: Quantity = Field(
        default="1Gi", description="Size of the memory-backed /dev/shm (data loader workers and NCCL use it).",
    )
    cache_size: Optional[Quantity] = Field(
        default=None,
        description="Disk for the cache volume of each pod (models and data mirrored from S3, the embedding "
        "cache, checkpoints before upload): its size limit, and requested as ephemeral storage so the pod "
        "lands on a node with that much. Unset: limited to the operator's default (Helm value "
        "trainer.cacheSizeLimit), nothing requested.",
    )
    gpu_memory: Optional[MemoryQuantity] = Field(
        default=None,
        description="Memory of one GPU, e.g. 80Gi (1Gi-4Ti), for the fit check: `kubectl apply` warns and the "
        "FitsGpu condition turns False when the job's estimate exceeds it. Unset = the operator's default "
        "(Helm value trainer.gpuMemory).",
    )


DISTRIBUTED_RULES = [
    Rule("!has(self.cpuOffload) || !self.cpuOffload || self.strategy == 'fsdp'",
         lambda distributed: not distributed.cpu_offload or distributed.strategy == "fsdp",
         "spec.distributed.cpuOffload shards to CPU memory: it needs strategy fsdp"),
]


class DistributedSpec(SpecModel):
    """How the job's processes share the work: one process per GPU, across every node."""

    model_config = ConfigDict(json_schema_extra=entries(DISTRIBUTED_RULES))

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        default="auto",
        description="ddp: every process holds the whole model and gradients are averaged; fsdp: parameters, "
        "gradients and optimizer state are sharded over all processes (FSDP2), for models that do not fit one "
        "GPU; auto: fsdp when the model does not fit a GPU under ddp (see `kubetune plan`), else ddp "
        "(always ddp on the CPU).",
    )
    processes_per_node: Optional[int] = Field(
        default=None, ge=1, le=64,
        description="Training processes per pod. Unset: one per GPU, or one on the CPU. CPU jobs may run "
        "several (they train together over gloo); a GPU job always runs one per GPU.",
    )
    cpu_offload: bool = Field(
        default=False,
        description="fsdp only: keep the sharded parameters, gradients and optimizer state in CPU memory "
        "between uses (CUDA GPUs; slower, for models that do not fit even sharded).",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "DistributedSpec":
        return enforce(DISTRIBUTED_RULES, self, info)


ENDPOINT_CREDENTIALS_MESSAGE = ("spec.s3.endpointUrl must not carry credentials (user:password@host): they would "
                                "be stored in plain text in the ConfigMap and the pods' environment; put them in "
                                "the Secret named by spec.s3.credentialsSecret")


def check_endpoint_url(value: str) -> str:
    if "@" in value.split("://", 1)[-1].split("/", 1)[0]:
        raise ValueError(ENDPOINT_CREDENTIALS_MESSAGE)
    return value


EndpointUrl = Annotated[str, Field(max_length=2048, pattern=r"^https?://[^\s]+$", json_schema_extra={
    "x-kubernetes-validations": [{"rule": "!self.matches('^https?://[^/]*@')", "message": ENDPOINT_CREDENTIALS_MESSAGE}],
}), AfterValidator(check_endpoint_url)]


class S3Spec(SpecModel):
    """How the trainer reaches S3 for s3:// URIs. Without a Secret the default AWS chain is used (IRSA)."""

    credentials_secret: Optional[DnsName] = Field(
        default=None,
        description="Name of a Secret in the job's namespace with keys AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY; passed to pods only as secretKeyRef.",
    )
    endpoint_url: Optional[EndpointUrl] = Field(
        default=None, description="S3 endpoint for MinIO or other S3-compatible stores; unset = AWS.",
    )
    region: Optional[Annotated[str, Field(max_length=64, pattern=r"^[a-z0-9-]+$")]] = Field(
        default=None, description="S3 region; unset = the operator's default.",
    )
    path_style: Optional[bool] = Field(
        default=None, description="Path-style addressing (MinIO and most self-hosted stores); unset = automatic.",
    )


# An MLflow tracking server: http(s)://host[:port][/path], nothing else (no user:password@, no query,
# no fragment). The same expression for the API server (CEL, RE2) and Python (re.fullmatch).
_MLFLOW_URI = (r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?"
               r"(/[A-Za-z0-9._~!$&()*+,;=:@%/-]*)?$")
MLFLOW_URI_MESSAGE = ("spec.tracking.mlflow.uri must be an MLflow tracking server's http(s)://host[:port][/path], "
                      "e.g. http://mlflow.mlops.svc:5000 (no credentials, query or fragment)")
MLFLOW_URI_CREDENTIALS_MESSAGE = ("spec.tracking.mlflow.uri must not carry credentials (user:password@host): the "
                                  "spec is stored, shown and logged in plain text")


def check_mlflow_uri(value: str) -> str:
    if "@" in value.split("://", 1)[-1].split("/", 1)[0]:
        raise ValueError(MLFLOW_URI_CREDENTIALS_MESSAGE)
    if not re.fullmatch(_MLFLOW_URI, value):
        raise ValueError(MLFLOW_URI_MESSAGE)
    return value


MlflowUri = Annotated[str, Field(min_length=1, max_length=2048, json_schema_extra={
    "x-kubernetes-validations": [{"rule": "self.matches('" + _MLFLOW_URI.replace("\\", "\\\\") + "')",  # CEL escapes
                                  "message": MLFLOW_URI_MESSAGE}],
}), AfterValidator(check_mlflow_uri)]


class MlflowSpec(SpecModel):
    """An MLflow tracking server that records the run: its hyperparameters (flattened spec paths such as
    training.learningRate), per-step metrics (train/loss, train/lr, validation/<metric>) and the final weights
    as artifacts. Only the main process logs; an unreachable server never stops training."""

    uri: MlflowUri = Field(
        description="The tracking server, http(s)://host[:port][/path], e.g. http://mlflow.mlops.svc:5000. Run it "
        "with --serve-artifacts: the final weights are then uploaded through the server, and the trainer needs no "
        "credentials of the artifact store. The trainers' network policy must allow reaching it (Helm value "
        "networkPolicy.trainerEgress).",
    )
    experiment: str = Field(
        default="kubetune", min_length=1, max_length=256, pattern=r"^\S(.*\S)?$",
        description="The MLflow experiment the run is logged in; created when missing.",
    )
    parent_run_id: Optional[str] = Field(
        default=None, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$",
        description="Log this run as a child of that MLflow run (tag mlflow.parentRunId). A TrainingSweep sets it "
        "on each trial to the sweep's own parent run; unset = a top-level run.",
    )


class TrackingSpec(SpecModel):
    """Experiment trackers that record the run, besides TensorBoard and the Prometheus metrics."""

    mlflow: Optional[MlflowSpec] = Field(default=None, description="Log the run to an MLflow tracking server.")


class Toleration(SpecModel):
    """A Kubernetes toleration, passed to the training pods as is."""

    key: Optional[str] = Field(default=None, max_length=316, description="Taint key.")
    operator: Optional[Literal["Exists", "Equal"]] = Field(default=None, description="Exists or Equal.")
    value: Optional[str] = Field(default=None, max_length=63, description="Taint value.")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        default=None, description="Taint effect.",
    )
    toleration_seconds: Optional[int] = Field(default=None, ge=0, description="For NoExecute: seconds to stay.")


WORKLOAD_PRIORITY_NEEDS_QUEUE = ("spec.scheduling.workloadPriorityClass orders jobs in a Kueue queue: set "
                                 "spec.scheduling.queueName too, or use priorityClassName for a pod priority")


SCHEDULING_RULES = [
    Rule("!has(self.workloadPriorityClass) || has(self.queueName)",
         lambda scheduling: not scheduling.workload_priority_class or bool(scheduling.queue_name),
         WORKLOAD_PRIORITY_NEEDS_QUEUE),
]


class SchedulingSpec(SpecModel):
    """Where and under which identity the training pods run; passed through to the pods."""

    model_config = ConfigDict(json_schema_extra=entries(SCHEDULING_RULES))

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Taints the pods tolerate.")
    affinity: Optional[dict[str, Any]] = Field(default=None, description="A Kubernetes Affinity object.")
    priority_class_name: Optional[DnsName] = Field(default=None, description="PriorityClass of the pods.")
    queue_name: Optional[DnsName] = Field(
        default=None, description="Kueue LocalQueue: set as the kueue.x-k8s.io/queue-name label.",
    )
    workload_priority_class: Optional[DnsName] = Field(
        default=None, description="Kueue WorkloadPriorityClass: the job's priority in its queue (who waits, who is "
        "preempted), set as the kueue.x-k8s.io/priority-class label; needs queueName. Works with every backend.",
    )
    service_account_name: Optional[DnsName] = Field(
        default=None, description="ServiceAccount of the training pods (e.g. one bound to an IAM role).",
    )
    service_account_token: bool = Field(
        default=False,
        description="Mount the ServiceAccount's API token in the training pods (off: the trainer never calls the "
        "Kubernetes API; IRSA, EKS Pod Identity and GKE Workload Identity do not need it). For code of your own "
        "that talks to the API server.",
    )
    image_pull_secrets: list[DnsName] = Field(
        default_factory=list, max_length=16, description="Secrets for pulling the trainer image.",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "SchedulingSpec":
        return enforce(SCHEDULING_RULES, self, info)


class RunPolicySpec(SpecModel):
    """Lifetime limits of the run."""

    backoff_limit: int = Field(default=3, ge=0, le=100, description="Pod restarts on retryable failures before Failed.")
    active_deadline_seconds: Optional[int] = Field(
        default=None, ge=1, description="Fail the job when it has run longer than this.",
    )
    ttl_seconds_after_finished: Optional[int] = Field(
        default=None, ge=0, description="Delete the child job this long after it finished (the TrainingJob stays).",
    )
