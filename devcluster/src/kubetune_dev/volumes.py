"""A pod's volumes, materialised as directories under the pod's state directory.

The sandbox later bind-mounts each directory at the container's mountPath. Supported: emptyDir,
hostPath, configMap, secret, downwardAPI and projected (serviceAccountToken, configMap, secret,
downwardAPI) — what kube-api-access-*, operators and trainers use — and persistentVolumeClaim, whose
bound PersistentVolume is a hostPath or local volume (this machine's disks: the dev cluster's storage).
Anything else fails the pod loudly rather than running it with a missing volume.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from kubernetes.client import CoreV1Api
from kubernetes.client.rest import ApiException

from kubetune_dev.fields import field_value, resource_value


class VolumeNotReady(Exception):
    """A referenced object is missing; the kubelet retries, as kubelet does (ContainerCreating)."""


class UnsupportedVolume(Exception):
    """A volume type the process kubelet does not implement."""


def _get(read, name: str, namespace: str, optional: bool) -> dict | None:
    try:
        return json.loads(read(name, namespace, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            if optional:
                return None
            raise VolumeNotReady(f"{name} not found in {namespace}") from None
        raise


def _key_files(data: dict[str, bytes], items: list[dict] | None, default_mode: int) -> dict[str, tuple[bytes, int]]:
    """path -> (content, mode) following `items` when given, else one file per key."""
    if not items:
        return {k: (v, default_mode) for k, v in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            raise VolumeNotReady(f"key {item['key']!r} missing")
        files[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    return files


def _config_map_files(api: CoreV1Api, src: dict, namespace: str, default_mode: int) -> dict:
    cm = _get(api.read_namespaced_config_map, src["name"], namespace, src.get("optional", False))
    if cm is None:
        return {}
    data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return _key_files(data, src.get("items"), src.get("defaultMode", default_mode))


def _secret_files(api: CoreV1Api, src: dict, namespace: str, default_mode: int) -> dict:
    name = src.get("secretName") or src["name"]
    secret = _get(api.read_namespaced_secret, name, namespace, src.get("optional", False))
    if secret is None:
        return {}
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    return _key_files(data, src.get("items"), src.get("defaultMode", default_mode))


def _downward_files(pod: dict, src: dict, default_mode: int) -> dict:
    files = {}
    for item in src.get("items", []):
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"])
        else:
            value = resource_value(pod, item["resourceFieldRef"])
        files[item["path"]] = (value.encode(), item.get("mode", default_mode))
    return files


def _token_file(api: CoreV1Api, pod: dict, src: dict, default_mode: int) -> dict:
    """A bound service-account token from the TokenRequest API, as a real kubelet fetches it."""
    meta = pod["metadata"]
    spec = {"expirationSeconds": src.get("expirationSeconds", 3607),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}
    if src.get("audience"):
        spec["audiences"] = [src["audience"]]
    sa = pod["spec"].get("serviceAccountName", "default")
    response = api.create_namespaced_service_account_token(
        sa, meta["namespace"], {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        _preload_content=False)
    token = json.loads(response.data)["status"]["token"]
    return {src["path"]: (token.encode(), default_mode)}


def _projected_files(api: CoreV1Api, pod: dict, projected: dict) -> dict:
    mode = projected.get("defaultMode", 0o644)
    namespace = pod["metadata"]["namespace"]
    files = {}
    for source in projected.get("sources", []):
        if "serviceAccountToken" in source:
            files.update(_token_file(api, pod, source["serviceAccountToken"], mode))
        elif "configMap" in source:
            files.update(_config_map_files(api, source["configMap"], namespace, mode))
        elif "secret" in source:
            files.update(_secret_files(api, source["secret"], namespace, mode))
        elif "downwardAPI" in source:
            files.update(_downward_files(pod, source["downwardAPI"], mode))
        else:
            raise UnsupportedVolume(f"projected source {sorted(source)} is not supported")
    return files


def unschedulable_claims(api: CoreV1Api, pod: dict) -> str | None:
    """Why the scheduler would leave POD pending for its claims, in kube-scheduler's words; None when
    every claim exists and is bound (the dev cluster has no scheduler: its kubelet binds pods itself)."""
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes", []):
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is None:
            continue
        try:
            read = api.read_namespaced_persistent_volume_claim(claim, namespace, _preload_content=False)
            found = json.loads(read.data)
        except ApiException as e:
            if e.status == 404:
                return f'0/1 nodes are available: persistentvolumeclaim "{claim}" not found.'
            raise
        if (found.get("status") or {}).get("phase") != "Bound":
            return "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    return None


def _claimed_path(api: CoreV1Api, claim: str, namespace: str) -> Path:
    """The host directory of the PersistentVolume bound to CLAIM (hostPath or local)."""
    found = json.loads(api.read_namespaced_persistent_volume_claim(claim, namespace, _preload_content=False).data)
    volume_name = (found.get("spec") or {}).get("volumeName")
    if (found.get("status") or {}).get("phase") != "Bound" or not volume_name:
        raise VolumeNotReady(f"persistentvolumeclaim {claim} is not bound")
    volume = json.loads(api.read_persistent_volume(volume_name, _preload_content=False).data)["spec"]
    source = volume.get("hostPath") or volume.get("local")
    if source is None:
        kinds = sorted(set(volume) & {"nfs", "csi", "iscsi", "cephfs", "glusterfs", "fc", "rbd"}) or sorted(volume)
        raise UnsupportedVolume(f"persistentvolume {volume_name!r} of type {kinds} is not supported by the process "
                                "kubelet (hostPath or local only)")
    return Path(source["path"])


def _write(directory: Path, files: dict[str, tuple[bytes, int]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rel, (content, mode) in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)


def materialise(api: CoreV1Api, pod: dict, volumes_dir: Path) -> dict[str, Path]:
    """Create every volume of POD under VOLUMES_DIR; returns volume name -> host directory."""
    namespace = pod["metadata"]["namespace"]
    paths = {}
    for volume in pod["spec"].get("volumes", []):
        name = volume["name"]
        target = volumes_dir / name
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            target = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                target.mkdir(parents=True, exist_ok=True)
        elif "configMap" in volume:
            _write(target, _config_map_files(api, volume["configMap"], namespace, 0o644))
        elif "secret" in volume:
            _write(target, _secret_files(api, volume["secret"], namespace, 0o644))
        elif "downwardAPI" in volume:
            _write(target, _downward_files(pod, volume["downwardAPI"], volume["downwardAPI"].get("defaultMode", 0o644)))
        elif "projected" in volume:
            _write(target, _projected_files(api, pod, volume["projected"]))
        elif "persistentVolumeClaim" in volume:
            target = _claimed_path(api, volume["persistentVolumeClaim"]["claimName"], namespace)
        else:
            kinds = sorted(set(volume) - {"name"})
            raise UnsupportedVolume(f"volume {name!r} of type {kinds} is not supported by the process kubelet")
        paths[name] = target
    return paths
