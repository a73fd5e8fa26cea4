"""Names and labels of the objects a TrainingJob owns.

The training operator names pods and Services `<child>-master-0` / `<child>-worker-<i>`, and a
Service name is a DNS-1035 label of at most 63 characters, so child names are kept short: long
job names are cut and given a hash of the full name, which keeps them unique and stable.
"""
from __future__ import annotations

import hashlib

from kubetune_api.contract import API_GROUP

JOB_LABEL = f"{API_GROUP}/trainingjob"
MAX_CHILD_NAME = 40  # leaves room for "-worker-1023" (PyTorchJob) or "-node-0-1023" (TrainJob) within 63


def child_name(job_name: str) -> str:
    if len(job_name) <= MAX_CHILD_NAME:
        return job_name
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    return f"{job_name[:MAX_CHILD_NAME - 9].rstrip('-.')}-{digest}"


def config_map_name(job_name: str) -> str:
    return f"{child_name(job_name)}-config"


def labels(job_name: str) -> dict[str, str]:
    """Labels on every child; label values are at most 63 characters too."""
    return {JOB_LABEL: child_name(job_name), "app.kubernetes.io/managed-by": "kubetune"}


def master_port(job_uid: str) -> int:
    """A per-job rendezvous port.

    Any port works on a real cluster (each pod has its own network namespace); a stable
    per-job choice also lets jobs share a host's port space, as on the local process kubelet.
    """
    return 20000 + int(hashlib.sha256(job_uid.encode()).hexdigest(), 16) % 20000
