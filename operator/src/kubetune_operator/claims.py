"""A PersistentVolumeClaim the job's pods wait for, learned from what the scheduler says: pure functions.

The operator reads no claim (its chart grants no `persistentvolumeclaims` rule). kube-scheduler
already says why a pod with a claim does not start: PodScheduled=False, reason Unschedulable,
`persistentvolumeclaim "NAME" not found`, or `pod has unbound immediate PersistentVolumeClaims`. That
is mapped back to the volume of spec.volumes that named the claim, so the job's status says which
field to fix and how, and the job waits (its pods start once the claim exists and is bound).
"""
from __future__ import annotations

import re

CONDITION = "VolumesReady"
NOT_FOUND, NOT_BOUND = "ClaimNotFound", "ClaimNotBound"
_MISSING_CLAIM = re.compile(r'persistentvolumeclaim "([a-z0-9][a-z0-9.-]*)" not found', re.IGNORECASE)
_UNBOUND = "unbound immediate PersistentVolumeClaims"


def claim_fields(spec: dict) -> dict[str, str]:
    """{claim name: its field in the spec} for the claims SPEC's volumes name."""
    return {volume["persistentVolumeClaim"]["claimName"]:
            f"spec.volumes[{volume['name']}].persistentVolumeClaim.claimName"
            for volume in spec.get("volumes") or [] if volume.get("persistentVolumeClaim")}


def claim_problem(pods: list[dict], spec: dict, namespace: str) -> tuple[str, str] | None:
    """(reason, message) when the job's pods wait for a claim, as the scheduler reports it; else None."""
    named = claim_fields(spec)
    for pod in pods:
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") != "PodScheduled" or condition.get("status") != "False":
                continue
            said = condition.get("message") or ""
            missing = _MISSING_CLAIM.search(said)
            if missing:
                claim = missing.group(1)
                field = named.get(claim, "spec.volumes")
                return NOT_FOUND, (f"{field}: PersistentVolumeClaim {claim!r} does not exist in namespace "
                                   f"{namespace!r}; create it (the trainer pods wait for it and start once it "
                                   "exists and is bound)")
            if _UNBOUND in said:
                return NOT_BOUND, (f"spec.volumes: a PersistentVolumeClaim of the job is not bound to a volume yet "
                                   f"(claims: {', '.join(sorted(named))}); the trainer pods start once it is "
                                   "(kubectl describe pvc says why it waits)")
    return None
