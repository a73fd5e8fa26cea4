"""The trainer's configuration: the TrainingJob manifest itself, in a ConfigMap.

The trainer parses it with the same typed spec the CRD was generated from. Secrets never go
here: S3 credentials reach the pods only as secretKeyRef environment variables.
"""
from __future__ import annotations

import yaml

from kubetune_api.contract import CONFIG_KEY
from kubetune_api.spec import TrainingJob
from kubetune_operator import naming


def trainer_manifest(job: TrainingJob) -> str:
    """The manifest the trainer reads: apiVersion, kind, name and spec (no status, no server fields)."""
    document = {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "metadata": {"name": job.metadata.name, "namespace": job.metadata.namespace},
        "spec": job.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    return yaml.safe_dump(document, sort_keys=False)


def build_config_map(job: TrainingJob) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": naming.config_map_name(job.metadata.name),
            "namespace": job.metadata.namespace,
            "labels": naming.labels(job.metadata.name),
        },
        "data": {CONFIG_KEY: trainer_manifest(job)},
    }


# libyaml's safe loader where PyYAML was built with it: every reconcile of a started job parses its
# ConfigMap, and the pure-Python parser was the operator's largest CPU cost at thousands of jobs.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def job_from_config_map(data: dict[str, str]) -> TrainingJob:
    """The job as the trainer runs it: the manifest in a ConfigMap's data (build_config_map's inverse)."""
    return TrainingJob.model_validate(yaml.load(data[CONFIG_KEY], Loader=_LOADER))  # a safe loader, C or Python
