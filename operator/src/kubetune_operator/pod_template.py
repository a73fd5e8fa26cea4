"""The trainer pod: container, volumes, environment and security settings (pure functions).

The pod passes the restricted Pod Security Standard: non-root, no privilege escalation, all
capabilities dropped, RuntimeDefault seccomp; its own volumes are configMap and emptyDir, besides
the job's (spec.volumes: claims, NFS, CSI and ConfigMaps pass it; a hostPath is the cluster's to allow).

Every backend renders its pods from these functions; what differs between Kubeflow controllers
(the container's name, the rendezvous port they look up) comes in as a ContainerShape, so no
PyTorchJob or TrainJob detail lives here.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubetune_api import contract
from kubetune_api.contract import TrainerEnv
from kubetune_api.hub import hub_inputs
from kubetune_api.quantity import scale_quantity
from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.settings import Settings

from kubetune_operator.queueing import QUEUE_LABEL  # noqa: E402  (one name for Kueue's label)
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass, read by Kueue from the job
CACHE_DIR = contract.CACHE_DIR
NON_ROOT_UID = 10001  # the trainer image's user and group (above 10000: no host account shares it)
METRICS_PORT_NAME = "metrics"  # the PodMonitor scrapes the port of this name
# Room for the trainer's last checkpoint after SIGTERM (preemption, suspend).
TERMINATION_GRACE_SECONDS = 120
# Scratch files only: downloads, caches and checkpoints go to the cache volume.
TMP_SIZE_LIMIT = "16Gi"


@dataclass(frozen=True)
class ContainerShape:
    """What a backend's controller expects of the trainer container.

    name: the container the controller injects its rendezvous environment into;
    rendezvous_port: (port name, number) the controller reads the rendezvous port from, or None
    where the controller adds its own port.
    """

    name: str
    rendezvous_port: tuple[str, int] | None = None


def pod_labels(job: TrainingJob) -> dict[str, str]:
    labels = naming.labels(job.metadata.name)
    if job.spec.scheduling.queue_name:
        labels[QUEUE_LABEL] = job.spec.scheduling.queue_name
    if job.spec.scheduling.workload_priority_class:
        labels[PRIORITY_LABEL] = job.spec.scheduling.workload_priority_class
    return labels


def final_read_seconds(progress_interval: float) -> float:
    """How long a finished trainer waits for the operator's next read of its metrics: the next
    poll comes within one interval; a second interval and a few seconds cover a slow read or a
    busy operator."""
    return 2 * progress_interval + 5


def push_env(settings: Settings) -> dict:
    """Where rank 0 pushes its progress and how often, where the operator runs its inbox (else none)."""
    if not (settings.progress_url and settings.progress_inbox_address):
        return {}
    return {"progress_url": settings.progress_url, "progress_interval_seconds": settings.progress_interval_seconds}


def static_env(settings: Settings) -> list[dict]:
    """The part of the trainer's environment that is the same for every job of this operator."""
    return [
        # Listed first: the KUBETUNE_ variables refer to them, and $(VAR) sees only variables above it.
        {"name": contract.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": contract.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *({"name": name, "valueFrom": {"resourceFieldRef": {"resource": resource, "divisor": "1m"}}}
          for name, resource in ((contract.CPU_REQUEST_MILLICORES, "requests.cpu"),
                                 (contract.CPU_LIMIT_MILLICORES, "limits.cpu"))),
        *TrainerEnv(metrics_port=settings.trainer_metrics_port, metrics_addr=f"$({contract.POD_IP})",
                    cache_dir=f"{CACHE_DIR}/inputs", staging_dir=f"{CACHE_DIR}/staging",
                    pod_name=f"$({contract.POD_NAME})",
                    final_read_seconds=final_read_seconds(settings.progress_interval_seconds),
                    **push_env(settings)).to_env(),
        {"name": "HOME", "value": f"{CACHE_DIR}/home"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": name, "value": value} for name, value in ((contract.MODELS_MIRROR_ENV, settings.models_mirror_uri),
                                                             ("HF_ENDPOINT", settings.hub_endpoint)) if value),
    ]


def job_env(job: TrainingJob, job_uid: str, settings: Settings) -> list[dict]:
    """The part that names this job and its storage; credentials only as secretKeyRef, never as values."""
    s3 = job.spec.s3
    endpoint = s3.endpoint_url or settings.s3_endpoint_url
    region = s3.region or settings.s3_region
    path_style = s3.path_style if s3.path_style is not None else settings.s3_path_style
    # A restarted pod of the same TrainingJob continues its run's version; a re-created job
    # (new UID) gets a new one (kubetune_trainer.checkpoint.runs).
    env = TrainerEnv(job_name=job.metadata.name, namespace=job.metadata.namespace or "default", run_id=job_uid,
                     s3_path_style=path_style).to_env()
    if endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": endpoint})
    if region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": region})
    if s3.credentials_secret:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret, "key": key}}})
    if job.spec.model.hub_token_secret:
        # Read only by the entry point's models stage, which takes it out of the trainers' environment.
        env.append({"name": contract.HUB_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": job.spec.model.hub_token_secret, "key": contract.HUB_TOKEN_KEY}}})
    return env


def trainer_env(job: TrainingJob, job_uid: str, settings: Settings) -> list[dict]:
    """The trainer's whole environment (the contract's TrainerEnv, S3 settings, credentials by reference)."""
    return static_env(settings) + job_env(job, job_uid, settings)


def resources(job: TrainingJob, settings: Settings) -> dict:
    """The trainer container's requests and limits.

    What the job sets is requested and limited exactly (GPUs, and cpu/memory when given). CPU and
    memory it leaves out are requested per training process from the operator's defaults, with no
    limit (a coarse default must not OOM-kill a run), so no trainer pod is BestEffort. A declared
    spec.resources.cacheSize is requested as ephemeral storage (the cache volume's size limit).
    """
    spec = job.spec.resources
    exact: dict[str, str] = {}
    if spec.cpu:
        exact["cpu"] = spec.cpu
    if spec.memory:
        exact["memory"] = spec.memory
    if spec.gpus_per_node:
        exact[spec.gpu_resource_name] = str(spec.gpus_per_node)
    requests = dict(exact)
    processes = job.spec.processes_per_node
    for name, per_process, setting in (("cpu", settings.default_cpu_per_process, "the default cpu per process"),
                                       ("memory", settings.default_memory_per_process, "the default memory per process")):
        if name not in exact and per_process:
            requests[name] = scale_quantity(per_process, processes, setting)
    if spec.cache_size:
        requests["ephemeral-storage"] = spec.cache_size
    amounts = {}
    if requests:
        amounts["requests"] = requests
    if exact:
        amounts["limits"] = exact
    return amounts


def container_security_context() -> dict:
    # A read-only image: the trainer writes only to its volumes (HOME and HF_HOME point into the
    # cache volume, scratch files go to /tmp, shared memory to /dev/shm).
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_identity() -> dict:
    """The trainer never calls the Kubernetes API, so its pods get no service-account token (a
    serviceAccountName still works for cloud identity: IRSA and GKE Workload Identity use their
    own token volume or the metadata server). A job that asks for the token gets it as
    api_access_volume(), the same files automounting would give."""
    return {"automountServiceAccountToken": False}


# Where Kubernetes puts a pod's API credentials, the path client libraries read.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_ACCESS_VOLUME = "kube-api-access"


def api_access_volume() -> dict:
    """What automountServiceAccountToken would mount, for jobs with spec.scheduling.serviceAccountToken:
    a bound, expiring token of the pod's ServiceAccount, the cluster's CA and the namespace. Written
    out because a TrainJob's pod patch cannot set automountServiceAccountToken; volumes it can."""
    return {"name": API_ACCESS_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ]}}


def api_access_mount() -> dict:
    return {"name": API_ACCESS_VOLUME, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}


def cache_stage(container: dict) -> dict:
    """An init container that fills the embedding cache before training starts (rank 0's pod only).

    One process encodes every sample once; the training processes then read the cache.
    """
    return {
        **{key: container[key] for key in ("image", "resources", "securityContext", "volumeMounts")},
        # Hub models are placed by the main container's models stage, the only holder of the hub token.
        "env": [entry for entry in container["env"] if entry["name"] != contract.HUB_TOKEN_ENV],
        "name": "cache",
        "command": list(contract.CACHE_STAGE_COMMAND),
        "args": list(contract.CACHE_STAGE_ARGS),
    }


def models_stage(container: dict) -> dict:
    """An init container that places the job's hub models (the entry point's models stage, run
    before the cache stage needs them): with the main container's environment, the token included."""
    return {
        **{key: container[key] for key in ("image", "env", "resources", "securityContext", "volumeMounts")},
        "name": "models",
        "command": list(contract.MODELS_STAGE_COMMAND),
        "args": list(contract.MODELS_STAGE_ARGS),
    }


def scrape_annotations(settings: Settings) -> dict[str, str]:
    """Where annotation-based Prometheus discovery finds the trainer's metrics."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.trainer_metrics_port),
            "prometheus.io/path": "/metrics"}


def pod_security_context() -> dict:
    return {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID, "fsGroup": NON_ROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def volume_mounts() -> list[dict]:
    return [
        {"name": "config", "mountPath": contract.CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def volumes(config_map: str, shm_size: str, cache_size: str) -> list[dict]:
    """The trainer config (CONFIG_MAP), shared memory for the data loaders, the cache and scratch
    space, each size-limited: a pod that writes past a limit is evicted (and restarted from its
    last checkpoint) instead of filling the node's disk."""
    return [
        {"name": "config", "configMap": {"name": config_map}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        {"name": "cache", "emptyDir": {"sizeLimit": cache_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
    ]


def job_volumes(job: TrainingJob) -> list[dict]:
    """The job's own volumes (spec.volumes: claims, NFS, hostPath, CSI, ConfigMaps)."""
    return [volume.as_volume() for volume in job.spec.volumes]


def job_mounts(job: TrainingJob) -> list[dict]:
    """Where the trainer container sees the job's own volumes."""
    return [volume.as_mount() for volume in job.spec.volumes]


def trainer_container(shape: ContainerShape, image: str, env: list[dict], settings: Settings,
                      resource_amounts: dict | None = None) -> dict:
    """The container that runs the node launcher (the contract's TRAINER_COMMAND)."""
    ports = [{"name": METRICS_PORT_NAME, "containerPort": settings.trainer_metrics_port, "protocol": "TCP"}]
    if shape.rendezvous_port:
        name, number = shape.rendezvous_port
        ports.insert(0, {"name": name, "containerPort": number, "protocol": "TCP"})
    return {
        "name": shape.name,
        "image": image,
        "command": list(contract.TRAINER_COMMAND),
        "args": list(contract.TRAINER_ARGS),
        "env": env,
        "ports": ports,
        "resources": resource_amounts or {},
        "securityContext": container_security_context(),
        "volumeMounts": volume_mounts(),
    }


def scheduling_fields(job: TrainingJob) -> dict:
    """The pod's placement and identity fields the job sets (none when it sets none)."""
    scheduling = job.spec.scheduling
    optional = {
        "nodeSelector": scheduling.node_selector or None,
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations] or None,
        "affinity": scheduling.affinity,
        "priorityClassName": scheduling.priority_class_name,
        "serviceAccountName": scheduling.service_account_name,
        "imagePullSecrets": [{"name": n} for n in scheduling.image_pull_secrets] or None,
    }
    return {key: value for key, value in optional.items() if value is not None}


def pod_template(job: TrainingJob, job_uid: str, settings: Settings, shape: ContainerShape,
                 with_cache_stage: bool = False, serves_metrics: bool = True) -> dict:
    """The trainer pod; with_cache_stage adds the cache-filling init container (for rank 0's pod).

    Only the rank-0 process serves metrics, so only its pod (serves_metrics) is annotated for
    scraping: annotated workers would be targets that are always down.
    """
    spec = job.spec
    container = trainer_container(shape, spec.image or settings.trainer_image, trainer_env(job, job_uid, settings),
                                  settings, resources(job, settings))
    pod_volumes = volumes(naming.config_map_name(job.metadata.name), spec.resources.shm_size,
                          spec.resources.cache_size or settings.cache_size_limit)
    if spec.scheduling.service_account_token:
        pod_volumes.append(api_access_volume())
        container["volumeMounts"].append(api_access_mount())
    pod_volumes += job_volumes(job)
    container["volumeMounts"] += job_mounts(job)
    pod_spec = {
        "securityContext": pod_security_context(),
        **pod_identity(),
        "containers": [container],
        "volumes": pod_volumes,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
    }
    pod_spec.update(scheduling_fields(job))
    if with_cache_stage:
        # The cache stage loads the models, so the job's hub models are placed before it starts.
        pod_spec["initContainers"] = [*([models_stage(container)] if hub_inputs(spec) else []), cache_stage(container)]
    return {
        "metadata": {
            "labels": pod_labels(job),
            **({"annotations": scrape_annotations(settings)} if serves_metrics else {}),
        },
        "spec": pod_spec,
    }
