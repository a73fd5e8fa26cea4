"""On a cluster, a local path in the spec must lie in a volume the job mounts (spec.volumes).

A pod sees only its image and its volumes: `data.uri: /data/pets` exists in no pod unless a volume is
mounted at /data (or above it). On a workstation (`kubetune train -f`) the same path is read from the
machine's own disks, so these rules are the API server's (CEL in the CRD, kubetune_api.crd) and the
admission webhook's, not the typed model's: `kubetune train` and `kubetune validate` keep taking
local paths.

The path fields are found, not listed: every field of the spec typed as a StorageUri (a local path,
s3:// or, for models, a hub id). A local path here is an absolute one; a relative path means nothing
in a pod, so it is refused too.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

from pydantic import BaseModel

from kubetune_api.rules import Rule
from kubetune_api.spec import TrainingJobSpec
from kubetune_api.spec_uris import check_storage_uri

# Written by the job (checkpoints, the embedding cache): not on a read-only mount.
WRITTEN = ("checkpoints.uri", "data.cache.uri")


@dataclass(frozen=True)
class PathField:
    """One StorageUri field of the spec: its attribute path and its name on the wire."""

    attributes: tuple[str, ...]
    wire: tuple[str, ...]

    @property
    def name(self) -> str:
        return "spec." + ".".join(self.wire)

    def value(self, spec: TrainingJobSpec) -> str | None:
        node = spec
        for attribute in self.attributes:
            node = getattr(node, attribute, None)
            if node is None:
                return None
        return node

    def cel_guard(self) -> str:
        """CEL: every object on the way and the field itself are set."""
        return " && ".join(f"has(self.{'.'.join(self.wire[:i + 1])})" for i in range(len(self.wire)))

    def cel(self) -> str:
        return "self." + ".".join(self.wire)


def _model_of(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_storage_uri(annotation, metadata) -> bool:
    """Typed StorageUri (or Optional[StorageUri]): validated by check_storage_uri."""
    found = [*metadata, *(m for arg in typing.get_args(annotation) for m in getattr(arg, "__metadata__", ()))]
    return any(getattr(m, "func", None) is check_storage_uri for m in found)


def path_fields(model: type[BaseModel] = TrainingJobSpec, attributes=(), wire=()) -> list[PathField]:
    """Every StorageUri field under MODEL, depth first in field order."""
    found = []
    for name, info in model.model_fields.items():
        here_attributes, here_wire = (*attributes, name), (*wire, info.alias or name)
        if _is_storage_uri(info.annotation, info.metadata):
            found.append(PathField(here_attributes, here_wire))
        elif (inner := _model_of(info.annotation)) is not None:
            found += path_fields(inner, here_attributes, here_wire)
    return found


PATH_FIELDS = path_fields()


def _local(value: str | None) -> bool:
    """A local path: no scheme, not a hub id (owner/name: no leading / or .)."""
    return value is not None and "://" not in value and value.startswith(("/", "."))


def _mounted(spec: TrainingJobSpec, path: str, writable: bool = False) -> bool:
    if not path.startswith("/") or any(part in (".", "..") for part in path.split("/")):
        return False
    covering = [v for v in spec.volumes if v.covers(path)]
    return bool(covering) and not (writable and any(v.read_only for v in covering))


def _path_rule(field: PathField) -> Rule:
    writable = ".".join(field.wire) in WRITTEN
    path = field.cel()
    covered = f"({path} == v.mountPath || {path}.startsWith(v.mountPath + '/'))"
    mounted = (f"{path}.startsWith('/') && !{path}.matches('(^|/)[.]{{1,2}}(/|$)') && has(self.volumes) && "
               f"self.volumes.exists(v, {covered})")
    if writable:
        mounted += f" && !self.volumes.exists(v, {covered} && has(v.readOnly) && v.readOnly)"
    local = f"!{path}.contains('://') && ({path}.startsWith('/') || {path}.startsWith('.'))"
    how = ("lie under a writable volume of spec.volumes (readOnly: false)" if writable
           else "lie under a volume of spec.volumes")
    return Rule(
        f"!({field.cel_guard()}) || !({local}) || ({mounted})",
        lambda spec: not _local(value := field.value(spec)) or _mounted(spec, value, writable),
        f"{field.name}: on a cluster a local path must be absolute, without '..', and {how}; mount the volume "
        "that holds it (e.g. volumes: [{name: data, mountPath: /data, persistentVolumeClaim: {claimName: ...}}]) "
        "or use an s3:// URI",
    )


CLUSTER_RULES = [_path_rule(field) for field in PATH_FIELDS]


def refusals(spec: TrainingJobSpec) -> list[str]:
    """What a cluster refuses in SPEC (the admission webhook's side of CLUSTER_RULES)."""
    return [rule.message for rule in CLUSTER_RULES if not rule.holds(spec)]
