"""spec.volumes: where a cluster keeps data sets, models and checkpoints, mounted in every pod of the job.

A volume is a name, a mountPath, readOnly, and one Kubernetes volume source of those clusters hold
data on: a PersistentVolumeClaim (NFS, Lustre/FSx, Filestore, CephFS behind it), an NFS export, a
hostPath, a CSI volume or a ConfigMap. The operator mounts each in the trainer pods and in the pods
of `kubetune generate` and `kubetune evaluate` on the cluster; `kubetune train -f` on a workstation
ignores them and reads the same paths on its own disks.

The rules here hold wherever a spec is read; the ones that only make sense on a cluster (a local path
must lie under a mount) are kubetune_api.cluster_paths'.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from kubetune_api.contract import TRAINER_OWN_PATHS
from kubetune_api.rules import Rule
from kubetune_api.spec_base import SpecModel

MAX_VOLUMES = 16

# A Kubernetes name: DNS label (volumes, claims) or subdomain (ConfigMaps, CSI drivers).
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
VolumeName = Annotated[str, Field(min_length=1, max_length=63, pattern=_DNS_LABEL)]
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)]
# An absolute path, without a trailing slash (except "/" itself, which the rules refuse as a mountPath).
AbsolutePath = Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^/([^/\x00]+(/[^/\x00]+)*)?$")]


class ClaimSource(SpecModel):
    """A PersistentVolumeClaim of the job's namespace."""

    claim_name: VolumeName = Field(description="The claim's name.")


class NfsSource(SpecModel):
    """An NFS export, mounted directly by the node."""

    server: Annotated[str, Field(min_length=1, max_length=253)] = Field(description="The NFS server: host or IP.")
    path: AbsolutePath = Field(description="The exported path on the server.")


class HostPathSource(SpecModel):
    """A directory of the node (often refused by a cluster's Pod Security policy: prefer a claim)."""

    path: AbsolutePath = Field(description="The directory on the node.")
    type: Literal["", "Directory", "DirectoryOrCreate"] = Field(
        default="Directory", description="Directory (it must exist) or DirectoryOrCreate.")


class CsiSource(SpecModel):
    """An inline CSI volume (e.g. a Secrets Store or an object-store driver)."""

    driver: ObjectName = Field(description="The CSI driver's name.")
    volume_attributes: dict[Annotated[str, Field(max_length=253)], Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=32, description="The driver's attributes.")
    fs_type: Optional[Annotated[str, Field(min_length=1, max_length=32)]] = Field(
        default=None, description="The file system to mount (the driver's default when unset).")


class ConfigMapSource(SpecModel):
    """A ConfigMap of the job's namespace, one file per key (small inputs: prompt lists, label maps)."""

    name: ObjectName = Field(description="The ConfigMap's name.")


SOURCES = ("persistent_volume_claim", "nfs", "host_path", "csi", "config_map")
SOURCE_NAMES = "persistentVolumeClaim, nfs, hostPath, csi or configMap"


class VolumeSpec(SpecModel):
    """One volume mounted in every pod of the job."""

    name: VolumeName = Field(description="The volume's name in the pod (a DNS label, unique in spec.volumes).")
    mount_path: AbsolutePath = Field(description="Where the pods see it: an absolute path, e.g. /data.")
    read_only: bool = Field(default=False, description="Mounted read-only (data sets, base models).")
    persistent_volume_claim: Optional[ClaimSource] = Field(default=None, description="A PersistentVolumeClaim.")
    nfs: Optional[NfsSource] = Field(default=None, description="An NFS export.")
    host_path: Optional[HostPathSource] = Field(default=None, description="A directory of the node.")
    csi: Optional[CsiSource] = Field(default=None, description="An inline CSI volume.")
    config_map: Optional[ConfigMapSource] = Field(default=None, description="A ConfigMap.")

    def source(self) -> tuple[str, SpecModel]:
        """(the source's field name on the wire, the source) of this volume's one source."""
        (name, value), = ((n, getattr(self, n)) for n in SOURCES if getattr(self, n) is not None)
        return type(self).model_fields[name].alias or name, value

    def covers(self, path: str) -> bool:
        """Whether PATH (absolute, local) is this mount or lies under it."""
        return path == self.mount_path or path.startswith(self.mount_path + "/")

    def as_volume(self) -> dict:
        """The pod's volume (Kubernetes' form)."""
        wire, source = self.source()
        rendered = source.model_dump(by_alias=True, exclude_none=True)
        if wire in ("persistentVolumeClaim", "nfs", "csi") and self.read_only:
            rendered["readOnly"] = True
        return {"name": self.name, wire: rendered}

    def as_mount(self) -> dict:
        """The container's volumeMount."""
        return {"name": self.name, "mountPath": self.mount_path, **({"readOnly": True} if self.read_only else {})}


def _one_source(volume: VolumeSpec) -> bool:
    return sum(getattr(volume, name) is not None for name in SOURCES) == 1


def _clear_of_own_paths(volume: VolumeSpec) -> bool:
    return not any(volume.covers(own) or volume.mount_path.startswith(own + "/") for own in TRAINER_OWN_PATHS)


def _no_dot_segments(volume: VolumeSpec) -> bool:
    return not any(part in (".", "..") for part in volume.mount_path.split("/"))


def _names(spec) -> list[str]:
    return [v.name for v in spec.volumes]


def _paths(spec) -> list[str]:
    return [v.mount_path for v in spec.volumes]


def _offenders(spec, test) -> str:
    return ", ".join(repr(v.name) for v in spec.volumes if not test(v))


_OWN = TRAINER_OWN_PATHS
# CEL: a mountPath equal to, under or over (a parent of) one of the trainer's own paths.
_OWN_CEL = " || ".join(f"v.mountPath == '{p}' || v.mountPath.startsWith('{p}/') || '{p}'.startsWith(v.mountPath + '/')"
                       for p in _OWN)
_SOURCES_CEL = " + ".join(f"(has(v.{name}) ? 1 : 0)" for name in
                          ("persistentVolumeClaim", "nfs", "hostPath", "csi", "configMap"))

# Job-level rules (`self` is the spec), so each can name the volume it refuses.
VOLUME_RULES = [
    Rule(f"!has(self.volumes) || self.volumes.all(v, {_SOURCES_CEL} == 1)",
         lambda spec: all(_one_source(v) for v in spec.volumes),
         f"spec.volumes: each volume takes exactly one source ({SOURCE_NAMES})",
         lambda spec: f"volume {_offenders(spec, _one_source)}"),
    Rule("!has(self.volumes) || self.volumes.all(v, !v.mountPath.matches('(^|/)[.]{1,2}(/|$)'))",
         lambda spec: all(_no_dot_segments(v) for v in spec.volumes),
         "spec.volumes: a mountPath has no '.' or '..' segment; write the path it means (e.g. /data)",
         lambda spec: f"volume {_offenders(spec, _no_dot_segments)}"),
    Rule(f"!has(self.volumes) || self.volumes.all(v, v.mountPath != '/' && !({_OWN_CEL}))",
         lambda spec: all(v.mount_path != "/" and _clear_of_own_paths(v) for v in spec.volumes),
         "spec.volumes: a mountPath may not be /, nor on, under or over where the trainer keeps "
         + ", ".join(f"{why} ({path})" for path, why in _OWN.items()) + "; mount the volume elsewhere, e.g. /data",
         lambda spec: f"volume {_offenders(spec, lambda v: v.mount_path != '/' and _clear_of_own_paths(v))}"),
    Rule("!has(self.volumes) || self.volumes.all(a, self.volumes.exists_one(b, b.name == a.name))",
         lambda spec: len(set(_names(spec))) == len(spec.volumes),
         "spec.volumes: each volume's name is used once; rename the second"),
    Rule("!has(self.volumes) || self.volumes.all(a, self.volumes.exists_one(b, b.mountPath == a.mountPath))",
         lambda spec: len(set(_paths(spec))) == len(spec.volumes),
         "spec.volumes: each mountPath is used once; mount the second volume elsewhere"),
]
