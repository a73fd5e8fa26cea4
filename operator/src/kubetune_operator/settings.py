"""Operator-wide settings, from the environment the Helm chart renders."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubetune_api.contract import BACKENDS as BACKEND_NAMES, PYTORCHJOB, TrainerEnv
from kubetune_operator import image_policy
from kubetune_operator.network_policy import NetworkPolicySettings
from kubetune_operator.preemption_cost import BoostSettings


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
    # How often the operator reconciles a running TrainingSweep: starts trials, reads their values.
    sweep_interval_seconds: float = 2.0
    # Port of the trainer's metrics and progress endpoint (rank 0).
    trainer_metrics_port: int = 9400
    # The progress inbox (progress_inbox.py): rank 0 pushes its progress to progress_url (the operator
    # Service's address, given to the trainers), served on progress_inbox_address:progress_inbox_port;
    # without an address no inbox runs and progress is read from each trainer's /metrics (the poll).
    progress_url: str | None = None
    progress_inbox_address: str | None = None
    progress_inbox_port: int = 9401
    # The admission webhook: served on this address (the pod's IP); None = no webhook.
    webhook_address: str | None = None
    webhook_port: int = 9443
    # Where its certificate comes from (webhook.py): "operator" issues, publishes and rotates its
    # own; "files" serves tls.crt/tls.key in webhook_cert_dir (cert-manager's Secret), reloaded on change.
    webhook_certificates: str = "operator"
    webhook_cert_dir: str = "/tmp/kubetune-webhook"
    # "operator" certificates: the chart's ValidatingWebhookConfiguration whose caBundle the operator
    # sets, the webhook Service's DNS names, and how long each certificate lives.
    webhook_configuration: str = "kubetune-trainingjobs"
    webhook_dns_names: tuple[str, ...] = ()
    webhook_certificate_lifetime_seconds: float = 30 * 24 * 3600.0
    # CPU and memory requested per training process for jobs that set no spec.resources.cpu/memory
    # (requests only, no limit), so no trainer pod is BestEffort; "" requests none.
    default_cpu_per_process: str = ""
    default_memory_per_process: str = ""
    # The size limit of a trainer pod's cache volume when its job sets no spec.resources.cacheSize.
    cache_size_limit: str = "200Gi"
    # Memory of one GPU for jobs without spec.resources.gpuMemory (the fit check), a quantity.
    default_gpu_memory: str = "80Gi"
    # The backend of jobs without spec.backend, and every backend jobs may choose (the chart grants
    # RBAC for these only): pytorchjob (Training Operator v1.9), trainjob (Trainer v2.3 + JobSet).
    backend: str = PYTORCHJOB
    backends: tuple[str, ...] = (PYTORCHJOB,)
    # Each backend's own settings, by backend name, parsed by the backend (Backend.settings_from_env, e.g.
    # backends/trainjob.py's TrainJobSettings: backends.operator_settings fills this in); a backend
    # missing here uses its defaults.
    backend_settings: Mapping[str, Any] = field(default_factory=dict)
    # Read Kueue's Workloads (the chart grants it with kueue.enabled) to say in the Queued condition
    # why a queued job waits or that it was preempted.
    kueue_workloads: bool = False
    # Keep Kueue's priority boost on running jobs' Workloads in proportion to their unsaved work (the
    # chart's kueue.preemptionCost; preemption_cost.py states the bound). Needs kueue_workloads.
    preemption_cost: BoostSettings = field(default_factory=BoostSettings)
    # Hub models (kubetune_trainer.storage.hub): the S3 prefix they are mirrored to once per cluster
    # (Helm value models.mirrorUri; a job's spec.model.mirrorUri overrides it), and the hub's
    # address for clusters that reach it through a proxy or an internal hub (models.hubEndpoint).
    models_mirror_uri: str | None = None
    hub_endpoint: str | None = None
    # A NetworkPolicy beside each job's child, fencing its trainer pods in (network_policy.py); None = none.
    network_policy: NetworkPolicySettings | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        path_style = env.get(TrainerEnv.NAMES["s3_path_style"], "").lower()  # the chart passes it under the trainer's name
        return cls(
            trainer_image=env.get("KUBETUNE_TRAINER_IMAGE", cls.trainer_image),
            allowed_image_prefixes=image_policy.parse_prefixes(env.get("KUBETUNE_ALLOWED_IMAGE_PREFIXES", "")),
            s3_endpoint_url=env.get("KUBETUNE_S3_ENDPOINT_URL") or None,
            s3_region=env.get("KUBETUNE_S3_REGION") or None,
            s3_path_style={"true": True, "false": False}.get(path_style),
            progress_interval_seconds=float(env.get(TrainerEnv.NAMES["progress_interval_seconds"],
                                                    cls.progress_interval_seconds)),
            sweep_interval_seconds=float(env.get("KUBETUNE_SWEEP_INTERVAL_SECONDS", cls.sweep_interval_seconds)),
            trainer_metrics_port=int(env.get("KUBETUNE_TRAINER_METRICS_PORT", cls.trainer_metrics_port)),
            progress_url=env.get(TrainerEnv.NAMES["progress_url"]) or None,
            progress_inbox_address=env.get("KUBETUNE_PROGRESS_INBOX_ADDRESS") or None,
            progress_inbox_port=int(env.get("KUBETUNE_PROGRESS_INBOX_PORT") or cls.progress_inbox_port),
            webhook_address=env.get("KUBETUNE_WEBHOOK_ADDRESS") or None,
            webhook_port=int(env.get("KUBETUNE_WEBHOOK_PORT", cls.webhook_port)),
            webhook_certificates=_one_of(env.get("KUBETUNE_WEBHOOK_CERTIFICATES") or cls.webhook_certificates,
                                         ("operator", "files"), "KUBETUNE_WEBHOOK_CERTIFICATES (Helm value webhook.certificates)"),
            webhook_cert_dir=env.get("KUBETUNE_WEBHOOK_CERT_DIR", cls.webhook_cert_dir),
            webhook_configuration=env.get("KUBETUNE_WEBHOOK_CONFIGURATION") or cls.webhook_configuration,
            webhook_dns_names=tuple(n for n in env.get("KUBETUNE_WEBHOOK_DNS_NAMES", "").split(",") if n),
            webhook_certificate_lifetime_seconds=float(env.get("KUBETUNE_WEBHOOK_CERTIFICATE_LIFETIME_SECONDS")
                                                       or cls.webhook_certificate_lifetime_seconds),
            default_cpu_per_process=_quantity(env.get("KUBETUNE_DEFAULT_CPU_PER_PROCESS", ""),
                                              "KUBETUNE_DEFAULT_CPU_PER_PROCESS (Helm value trainer.defaultRequests.cpuPerProcess)"),
            default_memory_per_process=_quantity(env.get("KUBETUNE_DEFAULT_MEMORY_PER_PROCESS", ""),
                                                 "KUBETUNE_DEFAULT_MEMORY_PER_PROCESS (Helm value trainer.defaultRequests.memoryPerProcess)"),
            cache_size_limit=_quantity(env.get("KUBETUNE_CACHE_SIZE_LIMIT") or cls.cache_size_limit,
                                       "KUBETUNE_CACHE_SIZE_LIMIT (Helm value trainer.cacheSizeLimit)"),
            default_gpu_memory=_gpu_memory(env.get("KUBETUNE_DEFAULT_GPU_MEMORY") or cls.default_gpu_memory),
            **_backends(env.get("KUBETUNE_BACKEND") or cls.backend, env.get("KUBETUNE_BACKENDS", "")),
            kueue_workloads=env.get("KUBETUNE_KUEUE_WORKLOADS", "").lower() == "true",
            preemption_cost=BoostSettings.from_env(env),
            models_mirror_uri=env.get("KUBETUNE_MODELS_MIRROR_URI") or None,
            hub_endpoint=env.get("KUBETUNE_HUB_ENDPOINT") or None,
            network_policy=NetworkPolicySettings.from_json(env.get("KUBETUNE_NETWORK_POLICY", "")),
        )

    def backend_enabled(self, name: str) -> bool:
        return name in self.backends

    @property
    def webhook_check_seconds(self) -> float:
        """How often the webhook's certificate is looked at: often enough to rotate a short-lived
        one in time, at most once a minute."""
        return max(1.0, min(60.0, self.webhook_certificate_lifetime_seconds / 20))


def _gpu_memory(value: str) -> str:
    """The default GPU memory, checked at start-up so a typo stops the operator, naming the setting."""
    from kubetune_api.quantity import parse_quantity

    parse_quantity(value, "KUBETUNE_DEFAULT_GPU_MEMORY (Helm value trainer.gpuMemory)")
    return value


def _quantity(value: str, setting: str) -> str:
    """A cpu or memory quantity (or "" for none), checked at start-up so a typo stops the operator."""
    from kubetune_api.quantity import scale_quantity

    if value:
        scale_quantity(value, 1, setting)
    return value


def _one_of(value: str, allowed: tuple[str, ...], setting: str) -> str:
    if value not in allowed:
        raise ValueError(f"{setting} is {value!r}; use one of {', '.join(allowed)}")
    return value


KNOWN_BACKENDS = BACKEND_NAMES


def _backends(default: str, enabled: str) -> dict:
    """The default backend and the enabled ones (the default always among them), checked at start-up."""
    names = [name.strip() for name in enabled.split(",") if name.strip()]
    for name in [default, *names]:
        if name not in KNOWN_BACKENDS:
            raise ValueError(f"KUBETUNE_BACKEND(S) (Helm value backend): unknown backend {name!r}; "
                             f"use {' or '.join(KNOWN_BACKENDS)}")
    return {"backend": default, "backends": tuple(dict.fromkeys([default, *names]))}
