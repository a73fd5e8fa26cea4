"""The downward API: a pod's own fields and resources, for env vars and downwardAPI volumes."""
from __future__ import annotations

import math
import os
import re

_SUFFIXES = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str) -> float:
    """A Kubernetes quantity ('500m', '2Gi', '3') as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    if not match or match.group(2) not in _SUFFIXES:
        raise ValueError(f"cannot parse quantity {text!r}")
    return float(match.group(1)) * _SUFFIXES[match.group(2)]


def field_value(pod: dict, path: str) -> str:
    """fieldRef.fieldPath -> value, e.g. metadata.name or metadata.labels['app']."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    subscript = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if subscript:
        return (meta.get(subscript.group(1)) or {}).get(subscript.group(2), "")
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs", [])),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        values = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
    if path not in simple:
        raise ValueError(f"unsupported fieldPath {path!r}")
    return simple[path] or ""


def resource_value(pod: dict, ref: dict, container: dict | None = None) -> str:
    """resourceFieldRef -> value in units of its divisor; unset limits default to the host's."""
    if container is None or ref.get("containerName"):
        name = ref.get("containerName")
        container = next(c for c in pod["spec"]["containers"] if name in (None, c["name"]))
    kind, _, resource = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    if value is None:
        value = str(os.cpu_count()) if resource == "cpu" else str(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    divisor = quantity(ref.get("divisor", "1"))
    return str(math.ceil(quantity(value) / divisor))
