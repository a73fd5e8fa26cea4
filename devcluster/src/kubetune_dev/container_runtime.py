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
- resources: limits.memory as the container's memory cgroup limit with no swap beyond it, limits.cpu as
  its CFS quota and requests.cpu as its CPU shares (1024 per CPU), as the kubelet sets them; a container
  over its memory limit is killed by the kernel (exit 137), which the kubelet reports as OOMKilled
  (oom_killed, from what conmon leaves in runtime_dir). Where the machine has no such cgroup controller, no limit is set (RESOURCE_CONTROLLERS);
- command and args replace the image's ENTRYPOINT and CMD, exactly as in Kubernetes;
- env: resolved by the caller as the kubelet resolves it (podenv.declared_env: fieldRefs, resources,
  ConfigMaps and Secrets), the image's own ENV beneath it;

Machine facts (DESIGN.md): runc, not crun, runs containers on this machine's hybrid cgroup layout, with
the cgroupfs manager; rlimits at or below the host's (image_build.ulimit_flags); the host network, so a
pod's servers bind loopback addresses like every other process of the dev cluster.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kubetune_api.quantity import parse_quantity
from kubetune_dev.fields import quantity
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


def _cgroup_controllers() -> set[str]:
    """The cgroup controllers this machine has: v2's list, else v1's hierarchies (this machine's layout)."""
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if unified.exists():
        return set(unified.read_text().split())
    return {entry.name for entry in Path("/sys/fs/cgroup").iterdir() if entry.is_dir()}


RESOURCE_CONTROLLERS = _cgroup_controllers() & {"memory", "cpu"}


def resource_flags(resources: dict) -> list[str]:
    """The container's memory and CPU limits and its CPU request, where the machine can enforce them."""
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    flags = []
    if "memory" in limits and "memory" in RESOURCE_CONTROLLERS:
        size = str(int(quantity(limits["memory"])))
        flags += ["--memory", size, "--memory-swap", size]  # swap equal to the limit: none beyond it
    if "cpu" in RESOURCE_CONTROLLERS:
        if "cpu" in limits:
            flags += ["--cpus", f"{quantity(limits['cpu']):g}"]
        if "cpu" in requests:
            flags += ["--cpu-shares", str(max(2, int(quantity(requests["cpu"]) * 1024)))]
    return flags


def oom_killed(runtime_dir: Path) -> bool:
    """Whether the kernel killed the container for memory. conmon records it as a file `oom` in its working
    directory, which is podman's: run each container's podman in its own RUNTIME_DIR (runtime_dir()). (podman
    4.3 with the cgroupfs manager then looks for that file elsewhere and reports State.OOMKilled false.)"""
    return (runtime_dir / "oom").exists()


def volume_flags(volumes: list[dict], mounts: list[dict], sources: dict[str, Path], pod_dir: Path) -> list[str]:
    """`--mount` flags for the container's volumeMounts: SOURCES holds the directories the kubelet laid
    out (volume name -> path); an emptyDir it did not is made under POD_DIR."""
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
        if volume["name"] in sources:
            source = Path(sources[volume["name"]])
        elif empty_dir is not None:
            source = pod_dir / "volumes" / volume["name"]
            source.mkdir(parents=True, exist_ok=True)
        else:
            kind = next(key for key in volume if key != "name")
            raise PodRefused(f"volume {volume['name']!r} ({kind}) has no source on this machine")
        if empty_dir is not None:
            os.chmod(source, 0o777)  # as the kubelet makes an emptyDir: any user of the pod may write it
        if mount.get("subPath"):
            source = source / mount["subPath"]
        flags += ["--mount", f"type=bind,source={source},destination={mount['mountPath']}{read_only}"]
    return flags


def file_flags(files: list[dict]) -> list[str]:
    """Single files the kubelet provides ({source, target, readOnly}: /etc/hosts, the termination log)."""
    flags = []
    for f in files:
        read_only = ",readonly=true" if f["readOnly"] else ""
        flags += ["--mount", f"type=bind,source={f['source']},destination={f['target']}{read_only}"]
    return flags


def env_flags(env: dict[str, str], env_file: Path) -> list[str]:
    """The environment through a file only root reads (`--env-file`), never on podman's command line,
    where every process could read a Secret's value in /proc."""
    for name, value in env.items():
        if "\n" in value or "\r" in value:
            raise PodRefused(f"env {name}: a value holding a line break cannot be passed to podman's --env-file")
    env_file.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.writelines(f"{name}={value}\n" for name, value in env.items())
    return ["--env-file", str(env_file)]


def image_present(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode == 0


def kill(name: str, signal_name: str = "KILL") -> None:
    """Send the container NAME's main process SIGNAL_NAME, as the kernel or a crash would end it."""
    subprocess.run(["podman", *RUNTIME_FLAGS, "kill", "--signal", signal_name, name], check=True, capture_output=True)


def remove(name: str) -> None:
    """Kill and remove the container NAME if it is still there (its podman process was killed: the
    container outlives it, held by conmon)."""
    subprocess.run(["podman", *RUNTIME_FLAGS, "rm", "--force", "--time", "0", name], capture_output=True)


def labelled(label: str) -> dict[str, list[str]]:
    """{value of LABEL: the ids of the containers, running or not, that carry it}."""
    listed = subprocess.run(["podman", "ps", "--all", "--filter", f"label={label}", "--format",
                             f'{{{{.ID}}}} {{{{index .Labels "{label}"}}}}'], capture_output=True, text=True).stdout
    found: dict[str, list[str]] = {}
    for line in listed.splitlines():
        container, _, value = line.partition(" ")
        found.setdefault(value, []).append(container)
    return found


def run_command() -> list[str]:
    """`podman run` as this machine runs containers: runc, cgroupfs, rlimits it allows, local images only."""
    return ["podman", *RUNTIME_FLAGS, "run", "--rm", "--pull", "never", *ulimit_flags()]


def runtime_dir(pod_dir: Path, name: str) -> Path:
    """The working directory to run the container NAME's podman in: what conmon leaves there says how the
    container ended (oom_killed)."""
    return pod_dir / "runtime" / name


def podman_run(pod_spec: dict, container: dict, env: dict[str, str], name: str, pod_dir: Path,
               sources: dict[str, Path] | None = None, files: list[dict] = (), hostname: str | None = None,
               labels: dict[str, str] | None = None) -> list[str]:
    """The `podman run` command line for one container, to run in runtime_dir(POD_DIR, NAME) (it runs in the
    foreground; its exit status is the container's, 128+N after signal N; a signal sent to it reaches the
    container). env: what the container
    declares, resolved (podenv.declared_env), written to POD_DIR/env/NAME (mode 0600); the image's ENV
    applies beneath it. files: single files
    mounted over the image's (an /etc/hosts among them replaces podman's own)."""
    pod_security = pod_spec.get("securityContext") or {}
    container_security = container.get("securityContext") or {}
    own_hosts = any(f["target"] == "/etc/hosts" for f in files)
    workdir = runtime_dir(pod_dir, name)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "oom").unlink(missing_ok=True)  # an earlier start's
    command = [*run_command(), "--name", name, "--network", "host",
               *(["--no-hosts"] if own_hosts else []),
               *(["--hostname", hostname] if hostname else []),
               *[flag for key, value in (labels or {}).items() for flag in ("--label", f"{key}={value}")],
               *identity_flags(pod_security, container_security), *security_flags(container_security, pod_security),
               *resource_flags(container.get("resources") or {}),
               *volume_flags(pod_spec.get("volumes", []), container.get("volumeMounts", []), sources or {}, pod_dir),
               *file_flags(list(files)), *env_flags(env, pod_dir / "env" / name)]
    if container.get("workingDir"):
        command += ["--workdir", container["workingDir"]]
    if container.get("command"):
        command += ["--entrypoint", container["command"][0]]
        arguments = container["command"][1:] + container.get("args", [])
    else:
        arguments = container.get("args", [])
    return [*command, container["image"], *arguments]
