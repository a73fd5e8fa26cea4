"""Child-job backends, registered by name: how a TrainingJob becomes the workload of a training system.

pytorchjob: Kubeflow Training Operator v1.9 (PyTorchJob). trainjob: Kubeflow Trainer v2.3 (TrainJob
on JobSet). A job names its backend in spec.backend; otherwise the operator's default (the Helm
value `backend`) applies, and the one chosen is recorded in status.backend for the job's lifetime.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from kubetune_operator.backends.base import Backend, ChildState, Prerequisite
from kubetune_operator.backends.pytorchjob import PyTorchJobBackend
from kubetune_operator.backends.trainjob import TrainJobBackend
from kubetune_operator.settings import Settings

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (PyTorchJobBackend(), TrainJobBackend())}


def operator_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The operator's settings from ENV (the process's environment by default), each backend's own
    read by that backend (Backend.settings_from_env)."""
    env = os.environ if env is None else env
    own = {name: backend.settings_from_env(env) for name, backend in BACKENDS.items()}
    return dataclasses.replace(Settings.from_env(env),
                               backend_settings={name: found for name, found in own.items() if found is not None})


def backend_name(spec: dict, status: dict, default: str) -> str:
    """The backend of a job: the one it started with (status.backend), else spec.backend, else DEFAULT.

    status first: a job keeps its backend when the operator's default changes (a helm upgrade). A job
    started before status.backend existed (a phase, no backend) runs a PyTorchJob, the only backend then.
    """
    status = status or {}
    if status.get("phase") and not status.get("backend"):
        return "pytorchjob"
    return status.get("backend") or (spec or {}).get("backend") or default


__all__ = ["BACKENDS", "Backend", "ChildState", "Prerequisite", "PyTorchJobBackend", "TrainJobBackend",
           "backend_name", "operator_settings"]
