"""Operator-wide settings, from the environment the Helm chart renders."""
from __future__ import annotations

import os
from dataclasses import dataclass

from kubetune_operator import image_policy


@dataclass(frozen=True)
class Settings:
    trainer_image: str = "ghcr.io/kubetune/trainer:0.1.0"
    # Images a job's spec.image may name (image_policy); empty = any.
    allowed_image_prefixes: tuple[str, ...] = ()
    # Defaults for spec.s3 fields a job leaves out.
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_path_style: bool | None = None
    # How often the operator reads progress from running trainers.
    progress_interval_seconds: float = 10.0
    # Port of the trainer's metrics and progress endpoint (rank 0).
    trainer_metrics_port: int = 9400
    # The admission webhook: served on this address (the pod's IP); None = no webhook.
    webhook_address: str | None = None
    webhook_port: int = 9443
    webhook_cert_dir: str = "/tmp/kubetune-webhook"
    # Memory of one GPU for jobs without spec.resources.gpuMemory (the fit check), a quantity.
    default_gpu_memory: str = "80Gi"
    # The backend of jobs without spec.backend, and every backend jobs may choose (the chart grants
    # RBAC for these only): pytorchjob (Training Operator v1.9), trainjob (Trainer v2.3 + JobSet).
    backend: str = "pytorchjob"
    backends: tuple[str, ...] = ("pytorchjob",)
    # The ClusterTrainingRuntime TrainJobs reference (the chart ships it), and how often it restarts
    # a job after a retryable failure (its JobSet failurePolicy.maxRestarts).
    trainjob_runtime: str = "kubetune-trainer"
    trainjob_max_restarts: int = 3
    # Also write progress into a TrainJob's status.trainerStatus (Kubeflow Trainer's progress API).
    trainjob_report_progress: bool = True
    # Read Kueue's Workloads (the chart grants it with kueue.enabled) to say in the Queued condition
    # why a queued job waits or that it was preempted.
    kueue_workloads: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        path_style = env.get("KUBETUNE_S3_PATH_STYLE", "").lower()
        return cls(
            trainer_image=env.get("KUBETUNE_TRAINER_IMAGE", cls.trainer_image),
            allowed_image_prefixes=image_policy.parse_prefixes(env.get("KUBETUNE_ALLOWED_IMAGE_PREFIXES", "")),
            s3_endpoint_url=env.get("KUBETUNE_S3_ENDPOINT_URL") or None,
            s3_region=env.get("KUBETUNE_S3_REGION") or None,
            s3_path_style={"true": True, "false": False}.get(path_style),
            progress_interval_seconds=float(env.get("KUBETUNE_PROGRESS_INTERVAL_SECONDS", cls.progress_interval_seconds)),
            trainer_metrics_port=int(env.get("KUBETUNE_TRAINER_METRICS_PORT", cls.trainer_metrics_port)),
            webhook_address=env.get("KUBETUNE_WEBHOOK_ADDRESS") or None,
            webhook_port=int(env.get("KUBETUNE_WEBHOOK_PORT", cls.webhook_port)),
            webhook_cert_dir=env.get("KUBETUNE_WEBHOOK_CERT_DIR", cls.webhook_cert_dir),
            default_gpu_memory=_gpu_memory(env.get("KUBETUNE_DEFAULT_GPU_MEMORY") or cls.default_gpu_memory),
            **_backends(env.get("KUBETUNE_BACKEND") or cls.backend, env.get("KUBETUNE_BACKENDS", "")),
            trainjob_runtime=env.get("KUBETUNE_TRAINJOB_RUNTIME") or cls.trainjob_runtime,
            trainjob_max_restarts=int(env.get("KUBETUNE_TRAINJOB_MAX_RESTARTS") or cls.trainjob_max_restarts),
            trainjob_report_progress=env.get("KUBETUNE_TRAINJOB_REPORT_PROGRESS", "true").lower() != "false",
            kueue_workloads=env.get("KUBETUNE_KUEUE_WORKLOADS", "").lower() == "true",
        )

    def backend_enabled(self, name: str) -> bool:
        return name in self.backends


def _gpu_memory(value: str) -> str:
    """The default GPU memory, checked at start-up so a typo stops the operator, naming the setting."""
    from kubetune_api.quantity import parse_quantity

    parse_quantity(value, "KUBETUNE_DEFAULT_GPU_MEMORY (Helm value trainer.gpuMemory)")
    return value


KNOWN_BACKENDS = ("pytorchjob", "trainjob")


def _backends(default: str, enabled: str) -> dict:
    """The default backend and the enabled ones (the default always among them), checked at start-up."""
    names = [name.strip() for name in enabled.split(",") if name.strip()]
    for name in [default, *names]:
        if name not in KNOWN_BACKENDS:
            raise ValueError(f"KUBETUNE_BACKEND(S) (Helm value backend): unknown backend {name!r}; "
                             f"use {' or '.join(KNOWN_BACKENDS)}")
    return {"backend": default, "backends": tuple(dict.fromkeys([default, *names]))}
