"""A credentials Secret the job's pods cannot use, learned from what the pods report: pure functions.

The operator reads no Secret, not even its metadata (the chart grants no `secrets` rule: a
compromised operator must not be able to read every Secret in the cluster). The kubelet already
says when a Secret a container references is missing: the container waits with reason
CreateContainerConfigError and a message naming the Secret. That message is mapped back to the
spec field that named the Secret, so the job's status says which field to fix and how.
"""
from __future__ import annotations

import re

CONDITION = "CredentialsReady"
REASON = "SecretNotFound"
WAITING_REASON = "CreateContainerConfigError"
# The kubelet's words: `secret "NAME" not found` (a real kubelet), `secret NS/NAME not found` (others).
_MISSING_SECRET = re.compile(r'secret "?(?:[a-z0-9.-]+/)?([a-z0-9][a-z0-9.-]*)"? not found', re.IGNORECASE)
# The fields of a TrainingJob spec whose value names a Secret its pods reference, and what it must hold.
SECRET_FIELDS = {
    ("s3", "credentialsSecret"): "keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
}


def secret_fields(spec: dict) -> dict[str, tuple[str, str]]:
    """{Secret name: (spec field path, what it must hold)} for the Secrets SPEC names."""
    named = {}
    for (section, key), holds in SECRET_FIELDS.items():
        name = (spec.get(section) or {}).get(key)
        if name:
            named[name] = (f"spec.{section}.{key}", holds)
    return named


def missing_secret_message(pods: list[dict], spec: dict, namespace: str) -> str | None:
    """Why the job's pods cannot start for a Secret (from their containers' waiting states), or None."""
    named = secret_fields(spec)
    for pod in pods:
        statuses = ((pod.get("status") or {}).get("containerStatuses") or []) + \
            ((pod.get("status") or {}).get("initContainerStatuses") or [])
        for container in statuses:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") != WAITING_REASON:
                continue
            found = _MISSING_SECRET.search(waiting.get("message") or "")
            if not found:
                continue
            secret = found.group(1)
            field, holds = named.get(secret, ("a Secret the pod references", "the keys the pod reads"))
            return (f"{field}: Secret {secret!r} does not exist in namespace {namespace!r}; create it with {holds} "
                    "(the trainer pods wait for it and start once it exists)")
    return None
