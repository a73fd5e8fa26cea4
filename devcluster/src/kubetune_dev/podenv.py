"""A container's environment, resolved the way the kubelet does it.

Order: the image's env, Kubernetes service variables, envFrom, then env (later wins);
`$(VAR)` in env values, command and args expands from what is defined before it, `$$` escapes.
"""
from __future__ import annotations

import base64
import json
import re

from kubernetes.client import CoreV1Api
from kubernetes.client.rest import ApiException

from kubetune_dev.fields import field_value, resource_value
from kubetune_dev.images import LocalImage

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class EnvNotReady(Exception):
    """A referenced ConfigMap/Secret (or key) is missing: CreateContainerConfigError."""


def expand(text: str, env: dict[str, str]) -> str:
    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(sub, text)


def _object_data(api: CoreV1Api, kind: str, name: str, namespace: str, optional: bool) -> dict[str, str] | None:
    read = api.read_namespaced_config_map if kind == "configMap" else api.read_namespaced_secret
    try:
        obj = json.loads(read(name, namespace, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404 and optional:
            return None
        if e.status == 404:
            raise EnvNotReady(f"{kind} {namespace}/{name} not found") from None
        raise
    data = obj.get("data") or {}
    if kind == "secret":
        return {k: base64.b64decode(v).decode() for k, v in data.items()}
    return dict(data)


def container_env(api: CoreV1Api, pod: dict, container: dict, image: LocalImage,
                  base: dict[str, str]) -> dict[str, str]:
    """BASE holds what every container gets (PATH, HOSTNAME, KUBERNETES_SERVICE_*)."""
    return declared_env(api, pod, container, {"PATH": ":".join(image.path), **base, **image.env})


def declared_env(api: CoreV1Api | None, pod: dict, container: dict, env: dict[str, str]) -> dict[str, str]:
    """ENV extended by what the container declares (envFrom, then env), resolved. A real container
    runtime applies the image's own ENV itself, so it starts from {} (api may be None when nothing
    refers to a ConfigMap or Secret)."""
    env = dict(env)
    namespace = pod["metadata"]["namespace"]
    for source in container.get("envFrom", []):
        kind = "configMap" if "configMapRef" in source else "secret"
        ref = source[f"{kind}Ref"]
        data = _object_data(api, kind, ref["name"], namespace, ref.get("optional", False)) or {}
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env", []):
        if "valueFrom" not in var:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        if "fieldRef" in src:
            env[var["name"]] = field_value(pod, src["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in src:
            env[var["name"]] = resource_value(pod, src["resourceFieldRef"], container)
        else:
            kind = "configMap" if "configMapKeyRef" in src else "secret"
            ref = src[f"{kind}KeyRef"]
            data = _object_data(api, kind, ref["name"], namespace, ref.get("optional", False))
            if data is None or ref["key"] not in data:
                if ref.get("optional", False):
                    continue
                raise EnvNotReady(f"key {ref['key']!r} not in {kind} {namespace}/{ref['name']}")
            env[var["name"]] = data[ref["key"]]
    return env
