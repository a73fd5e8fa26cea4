"""The trainer pod: container, volumes, environment and security settings (pure functions).

The pod passes the restricted Pod Security Standard: non-root, no privilege escalation, all
capabilities dropped, RuntimeDefault seccomp, only configMap and emptyDir volumes.
"""
from __future__ import annotations

from kubetune_api.spec import TrainingJob
from kubetune_operator import naming
from kubetune_operator.settings import Settings

CONTAINER_NAME = "pytorch"  # the training operator finds the rendezvous port on this container
PORT_NAME = "pytorchjob-port"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
CACHE_DIR = "/var/cache/kubetune"
NON_ROOT_UID = 1000


def pod_labels(job: TrainingJob) -> dict[str, str]:
    labels = naming.labels(job.metadata.name)
    if job.spec.scheduling.queue_name:
        labels[QUEUE_LABEL] = job.spec.scheduling.queue_name
    return labels


def trainer_env(job: TrainingJob, job_uid: str, settings: Settings) -> list[dict]:
    """Environment of the trainer; credentials only as secretKeyRef, never as values."""
    s3 = job.spec.s3
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "KUBETUNE_METRICS_ADDR", "value": "$(POD_IP)"},
        {"name": "KUBETUNE_METRICS_PORT", "value": str(settings.trainer_metrics_port)},
        {"name": "KUBETUNE_JOB_NAME", "value": job.metadata.name},
        {"name": "KUBETUNE_NAMESPACE", "value": job.metadata.namespace or "default"},
        # A restarted pod of the same TrainingJob continues its run's version; a re-created job
        # (new UID) gets a new one (kubetune_trainer.storage.runs).
        {"name": "KUBETUNE_RUN_ID", "value": job_uid},
        {"name": "KUBETUNE_CACHE_DIR", "value": f"{CACHE_DIR}/inputs"},
        {"name": "KUBETUNE_STAGING_DIR", "value": f"{CACHE_DIR}/staging"},
        {"name": "HOME", "value": f"{CACHE_DIR}/home"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    endpoint = s3.endpoint_url or settings.s3_endpoint_url
    region = s3.region or settings.s3_region
    path_style = s3.path_style if s3.path_style is not None else settings.s3_path_style
    if endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": endpoint})
    if region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": region})
    if path_style is not None:
        env.append({"name": "KUBETUNE_S3_PATH_STYLE", "value": str(path_style).lower()})
    if s3.credentials_secret:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret, "key": key}}})
    return env


def resources(job: TrainingJob) -> dict:
    spec = job.spec.resources
    amounts: dict[str, str] = {}
    if spec.cpu:
        amounts["cpu"] = spec.cpu
    if spec.memory:
        amounts["memory"] = spec.memory
    if spec.gpus_per_node:
        amounts[spec.gpu_resource_name] = str(spec.gpus_per_node)
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def container_security_context() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def cache_stage(container: dict) -> dict:
    """An init container that fills the embedding cache before training starts (Master only).

    One process encodes every sample once; the training processes then read the cache.
    """
    return {
        **{key: container[key] for key in ("image", "env", "resources", "securityContext", "volumeMounts")},
        "name": "cache",
        "command": ["python", "-m", "kubetune_trainer"],
        "args": ["--config", f"{naming.CONFIG_MOUNT}/{naming.CONFIG_KEY}", "--cache-only"],
    }


def scrape_annotations(settings: Settings) -> dict[str, str]:
    """Where annotation-based Prometheus discovery finds the trainer's metrics."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.trainer_metrics_port),
            "prometheus.io/path": "/metrics"}


def pod_template(job: TrainingJob, job_uid: str, settings: Settings, with_cache_stage: bool = False,
                 serves_metrics: bool = True) -> dict:
    """The trainer pod; with_cache_stage adds the cache-filling init container (for the Master).

    Only the rank-0 process serves metrics, so only its pod (serves_metrics) is annotated for
    scraping: annotated workers would be targets that are always down.
    """
    spec, scheduling = job.spec, job.spec.scheduling
    container = {
        "name": CONTAINER_NAME,
        "image": spec.image or settings.trainer_image,
        "command": ["python", "-m", "kubetune_trainer.entrypoint"],
        "args": ["--config", f"{naming.CONFIG_MOUNT}/{naming.CONFIG_KEY}"],
        "env": trainer_env(job, job_uid, settings),
        "ports": [
            {"name": PORT_NAME, "containerPort": naming.master_port(job_uid), "protocol": "TCP"},
            {"name": "metrics", "containerPort": settings.trainer_metrics_port, "protocol": "TCP"},
        ],
        "resources": resources(job),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "config", "mountPath": naming.CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec = {
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
            "fsGroup": NON_ROOT_UID, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": naming.config_map_name(job.metadata.name)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
        # Room for the trainer's last checkpoint after SIGTERM (preemption, suspend).
        "terminationGracePeriodSeconds": 120,
    }
    optional = {
        "nodeSelector": scheduling.node_selector or None,
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations] or None,
        "affinity": scheduling.affinity,
        "priorityClassName": scheduling.priority_class_name,
        "serviceAccountName": scheduling.service_account_name,
        "imagePullSecrets": [{"name": n} for n in scheduling.image_pull_secrets] or None,
    }
    pod_spec.update({key: value for key, value in optional.items() if value is not None})
    if with_cache_stage:
        pod_spec["initContainers"] = [cache_stage(container)]
    return {
        "metadata": {
            "labels": pod_labels(job),
            **({"annotations": scrape_annotations(settings)} if serves_metrics else {}),
        },
        "spec": pod_spec,
    }
