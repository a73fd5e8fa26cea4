"""A job's volumes against the Pod Security Standard its namespace enforces.

The API server's PodSecurity admission refuses every pod that has a volume its namespace's level
(the namespace label pod-security.kubernetes.io/enforce) forbids: a hostPath under `baseline` and
`restricted`, an NFS volume under `restricted`, whose pods may mount only claims, CSI volumes,
ConfigMaps and what the kubelet makes. The pod the operator renders passes `restricted`
(pod_template.py); a job's spec.volumes may not. Refused there, its pods are never created: the Job
and training controllers only record events, and the job would wait Pending without a word. So the
operator reads the level and refuses such a job itself, naming the volume: at admission, and again
before it creates anything (the webhook fails open). A job refused at reconcile waits, and starts once
the spec or the namespace's level allows it.

Only the namespace's label is read: a cluster-wide default level (the API server's admission
configuration) is not visible to the operator, and a namespace without the label is taken to allow all.
"""
from __future__ import annotations

from kubetune_api.volumes import VolumeSpec

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
CONDITION = "VolumesAllowed"
REASON = "VolumeRefusedByPodSecurity"
# The volume sources of spec.volumes each level refuses (by their field names in the spec).
REFUSED = {"baseline": ("hostPath",), "restricted": ("hostPath", "nfs")}
CHECKED = {source for refused in REFUSED.values() for source in refused}


def names_checked_source(spec: dict) -> bool:
    """Whether SPEC (as stored) has a volume some level refuses: only then is the namespace read."""
    return any(source in volume for volume in spec.get("volumes") or [] for source in CHECKED)


def refusal(volumes: list[VolumeSpec], namespace: str, level: str | None) -> str | None:
    """Why the namespace's LEVEL refuses one of VOLUMES, naming it and the fix; None where none is refused."""
    refused = REFUSED.get(level or "", ())
    for volume in volumes:
        source, _ = volume.source()
        if source in refused:
            return (f"spec.volumes[{volume.name}].{source}: namespace {namespace!r} enforces the {level!r} Pod "
                    f"Security Standard ({ENFORCE_LABEL}), whose pods may not mount {source} volumes; keep the "
                    "data on a PersistentVolumeClaim (spec.volumes[].persistentVolumeClaim), or ask the cluster's "
                    f"admin to allow {source} volumes in {namespace!r}")
    return None
