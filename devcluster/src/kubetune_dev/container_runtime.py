"""A pod's container as a real container: the `podman run` that runs it as a kubelet would.

The translation from the pod spec Kubernetes holds to the runtime's flags, for the parts our pods use:
- identity: the container's (else the pod's) runAsUser/runAsGroup, fsGroup as a supplementary group;
  runAsNonRoot with user 0 is refused, as the kubelet refuses it (CreateContainerConfigError);
- readOnlyRootFilesystem (nothing writable but the volumes: podman's own tmpfs on /tmp, /run and
  /var/tmp is turned off), capabilities dropped/added, allowPrivilegeEscalation false
  (no_new_privs), seccomp RuntimeDefault (podman's default profile) or Unconfined;
- volumes: an emptyDir is a fresh directory any user may write (as the kubelet makes it, mode 0777) or,
  with `medium: Memory`, a tmpfs of its sizeLimit; configMap, hostPath, persistentVolumeClaim and the
  rest are directories the caller has laid out on this machine (`sources`), bound read-only where the
  mount says so. No service-account token is mounted unless a volume carries it.
- command and args replace the image's ENTRYPOINT and CMD, exactly as in Kubernetes;
- env: resolved by the caller as the kubelet resolves it (podenv.declared_env: fieldRefs, resources,
  ConfigMaps and Secrets), the image's own ENV beneath it;

Machine facts (DESIGN.md): runc, not crun, runs containers on this machine's hybrid cgroup layout, with
the cgroupfs manager; rlimits at or below the host's (image_build.ulimit_flags); the host network, so a
pod's servers bind loopback addresses like every other process of the dev cluster.
"""
from __future__ import annotations

import os
from pathlib import Path

from kubetune_api.quantity import parse_quantity
from kubetune_dev.image_build import ulimit_flags

RUNTIME_FLAGS = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")


class PodRefused(ValueError):
    """The pod cannot run as specified; the message says what a kubelet would report."""


def identity_flags(pod_security: dict, container_security: dict) -> list[str]:
    merged = {**pod_security, **container_security}
    user, group = merged.get("runAsUser"), merged.get("runAsGroup")
    # (With no runAsUser the kubelet checks the image's USER instead; our images set 10001.)
    if merged.get("runAsNonRoot") and user == 0:
        raise PodRefused("container's runAsUser breaks non-root policy (runAsNonRoot and runAsUser 0)")
    flags = []
    if user is not None:
        flags += ["--user", f"{user}:{group if group is not None else user}"]
    if pod_security.get("fsGroup") is not None:
        flags += ["--group-add", str(pod_security["fsGroup"])]
    return flags


def security_flags(container_security: dict, pod_security: dict) -> list[str]:
    flags = []
    if container_security.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]
    capabilities = container_security.get("capabilities") or {}
    flags += [flag for name in capabilities.get("drop", []) for flag in ("--cap-drop", name)]
    flags += [flag for name in capabilities.get("add", []) for flag in ("--cap-add", name)]
    if container_security.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    seccomp = (container_security.get("seccompProfile") or pod_security.get("seccompProfile") or {}).get("type")
    if seccomp == "Unconfined":
        flags += ["--security-opt", "seccomp=unconfined"]
    return flags


def volume_flags(volumes: list[dict], mounts: list[dict], sources: dict[str, Path], pod_dir: Path) -> list[str]:
    """`--mount` flags for the container's volumeMounts. emptyDirs are made under pod_dir."""
    by_name = {volume["name"]: volume for volume in volumes}
    flags = []
    for mount in mounts:
        volume = by_name[mount["name"]]
        read_only = ",readonly=true" if mount.get("readOnly") else ""
        empty_dir = volume.get("emptyDir")
        if empty_dir is not None and empty_dir.get("medium") == "Memory":
            size = empty_dir.get("sizeLimit")
            size_option = f",tmpfs-size={parse_quantity(size, 'emptyDir.sizeLimit')}" if size else ""
            flags += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777{size_option}"]
            continue
        if empty_dir is not None:
            source = pod_dir / "volumes" / volume["name"]
            source.mkdir(parents=True, exist_ok=True)
            os.chmod(source, 0o777)
        elif volume["name"] in sources:
            source = Path(sources[volume["name"]])
        else:
            kind = next(key for key in volume if key != "name")
            raise PodRefused(f"volume {volume['name']!r} ({kind}) has no source on this machine")
        flags += ["--mount", f"type=bind,source={source},destination={mount['mountPath']}{read_only}"]
    return flags


def env_flags(env: dict[str, str]) -> list[str]:
    return [flag for name, value in env.items() for flag in ("--env", f"{name}={value}")]


def run_command() -> list[str]:
    """`podman run` as this machine runs containers: runc, cgroupfs, rlimits it allows, local images only."""
    return ["podman", *RUNTIME_FLAGS, "run", "--rm", "--pull", "never", *ulimit_flags()]


def podman_run(pod_spec: dict, container: dict, env: dict[str, str], name: str, pod_dir: Path,
               sources: dict[str, Path] | None = None) -> list[str]:
    """The `podman run` command line for one container (it runs in the foreground; its exit status is the
    container's). env: what the container declares, resolved (podenv.declared_env); the image's ENV
    applies beneath it."""
    pod_security = pod_spec.get("securityContext") or {}
    container_security = container.get("securityContext") or {}
    command = [*run_command(), "--name", name, "--network", "host", *identity_flags(pod_security, container_security),
               *security_flags(container_security, pod_security),
               *volume_flags(pod_spec.get("volumes", []), container.get("volumeMounts", []), sources or {}, pod_dir),
               *env_flags(env)]
    if container.get("workingDir"):
        command += ["--workdir", container["workingDir"]]
    if container.get("command"):
        command += ["--entrypoint", container["command"][0]]
        arguments = container["command"][1:] + container.get("args", [])
    else:
        arguments = container.get("args", [])
    return [*command, container["image"], *arguments]
