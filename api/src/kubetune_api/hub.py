"""Which inputs of a TrainingJob are model-hub ids (torch-free: the operator and the trainer both ask).

A hub id reads org/name; a local path starts with / ./ ../ or ~, an S3 URI with s3://. A bare
relative path such as models/sd is ambiguous, so the trainer, which sees the pod's files, takes it
as local when it exists (kubetune_trainer.storage.hub.is_hub_input).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
DEFAULT_REVISION = "main"
TOKEN_FIELD = "spec.model.hubTokenSecret"


def looks_like_hub_id(uri: str | None) -> bool:
    return bool(uri) and HUB_ID.fullmatch(uri) is not None and not uri.startswith((".", "~"))


@dataclass(frozen=True)
class HubInput:
    """One hub model a job reads: the spec field naming it, the field naming its revision, the id and revision."""

    field: str
    repo_id: str
    revision: str
    revision_field: str | None = None  # None: the input has no revision field (its default branch)


def hub_inputs(spec) -> list[HubInput]:
    """The job's hub models: spec.model.pretrained (at spec.model.revision), spec.model.vae and
    spec.validation.clipModel (at their default branch), each pinned to a commit per run."""
    candidates = [
        HubInput("spec.model.pretrained", spec.model.pretrained, spec.model.revision or DEFAULT_REVISION,
                 "spec.model.revision"),
        HubInput("spec.model.vae", spec.model.vae, DEFAULT_REVISION),
        HubInput("spec.validation.clipModel", spec.validation.clip_model, DEFAULT_REVISION),
    ]
    return [item for item in candidates if looks_like_hub_id(item.repo_id)]
