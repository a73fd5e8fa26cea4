"""One pod, run as local processes: volumes, init containers, containers, status, deletion.

A PodRunner is a thread the kubelet starts for each pod bound to its node. Each container runs
as `python -m kubetune_dev.sandbox SPEC` in its own process group (so a signal reaches the whole
tree), with its log appended to `<pod dir>/logs/<container>.log`.
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kubernetes.client import CoreV1Api

from kubetune_dev import container_runtime, images, processes
from kubetune_dev.podenv import EnvNotReady, container_env, declared_env, expand
from kubetune_dev.volumes import UnsupportedVolume, VolumeNotReady, materialise

log = logging.getLogger(__name__)
MAX_BACKOFF = 30.0
# The label on every real container this kubelet starts: its pods directory, so that its shutdown finds
# the containers an earlier kubelet process left.
POD_DIR_LABEL = "kubetune.dev/pods-dir"
# A container's terminationMessagePath when its spec names none, and how much of it is kept (Kubernetes').
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_LIMIT = 4096


def real_container_name(pod_metadata: dict, container: str) -> str:
    """The podman name of the pod's CONTAINER where it runs as a real container (as a CRI names it)."""
    meta = pod_metadata
    return f"k8s_{container}_{meta['name']}_{meta['namespace']}_{meta['uid'][:8]}"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    """A container's process and its status as reported in pod.status."""

    spec: dict
    proc: subprocess.Popen | None = None
    started_at: str | None = None
    restarts: int = 0
    state: dict | None = None
    last_state: dict | None = None
    restart_at: float = 0.0  # monotonic time before which a restart waits (back-off)
    container_name: str | None = None  # a real container's name in podman (None: a local process)
    # The container's log file holds every start's output, a line `--- restart N ---` between two. For
    # each start: (where the previous start's output ended, where this start's begins); `kubectl logs`
    # reads the last start's, `--previous` the one before (kubelet_api.py).
    log_starts: list[tuple[int, int]] = field(default_factory=list)

    def status(self, image: str) -> dict:
        return {"name": self.spec["name"], "image": image, "imageID": "", "restartCount": self.restarts,
                "ready": self.proc is not None, "started": self.proc is not None,
                "state": self.state or {"waiting": {"reason": "ContainerCreating"}},
                "lastState": self.last_state or {}}


class PodRunner(threading.Thread):
    def __init__(self, api: CoreV1Api, pod: dict, pod_dir: Path, pod_ip: str, base_env: dict[str, str]):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.api, self.pod, self.dir, self.ip, self.base_env = api, pod, pod_dir, pod_ip, base_env
        self.meta = pod["metadata"]
        self.policy = pod["spec"].get("restartPolicy", "Always")
        self.hosts_file = pod_dir / "hosts"
        self._stop_grace: float | None = None
        self._stopping = threading.Event()
        self.phase = "Pending"
        self.message = ""
        self.init = [Container(c) for c in pod["spec"].get("initContainers", [])]
        self.main = [Container(c) for c in pod["spec"]["containers"]]
        self.started_at = now()
        self.mounts: dict[str, Path] = {}

    # ---- called from the kubelet's loop -------------------------------------------------------
    def stop(self, grace: float) -> None:
        """Deletion: SIGTERM every container now, SIGKILL what is left after GRACE seconds."""
        if self._stop_grace is None:
            self._stop_grace = grace
            self._stopping.set()

    @property
    def finished(self) -> bool:
        return not self.is_alive()

    # ---- read by the kubelet's API (`kubectl logs`) --------------------------------------------
    def container(self, name: str) -> Container | None:
        return next((c for c in self.init + self.main if c.spec["name"] == name), None)

    def log_file(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.log"

    # ---- the pod's life -----------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self._prepare() and self._run_init_containers():
                self._run_containers()
        except Exception as e:  # a kubelet bug must not leave a pod Pending forever
            log.exception("pod %s/%s failed in the kubelet", self.meta["namespace"], self.meta["name"])
            self.phase, self.message = "Failed", f"process kubelet error: {e}"
        finally:
            stopped = self._kill_all()
            if stopped and self._stopping.is_set():
                # Deleted: say how the containers ended before the kubelet removes the pod, as a real
                # kubelet does (a controller such as the training operator reads the exit code).
                codes = [c.state["terminated"]["exitCode"] for c in self.main if "terminated" in (c.state or {})]
                self.phase = "Succeeded" if codes and not any(codes) else "Failed"
            if stopped or not self._stopping.is_set():
                self._publish()

    def _prepare(self) -> bool:
        """Volumes, retried while a referenced object is missing (as ContainerCreating)."""
        self.hosts_file.touch()
        while not self._stopping.is_set():
            try:
                self.mounts = materialise(self.api, self.pod, self.dir / "volumes")
                return True
            except VolumeNotReady as e:
                self.message = str(e)
                self._publish()
                self._stopping.wait(2)
            except UnsupportedVolume as e:
                self.phase, self.message = "Failed", str(e)
                return False
        return False

    def _run_init_containers(self) -> bool:
        for c in self.init:
            while True:
                if not self._start(c):
                    return False
                self._publish()
                code = self._wait(c)
                if code is None:  # deleted meanwhile
                    return False
                if code == 0:
                    break
                if self.policy == "Never":
                    self.phase, self.message = "Failed", f"init container {c.spec['name']} exited {code}"
                    return False
                self._back_off(c)
                if self._stopping.wait(max(0.0, c.restart_at - time.monotonic())):
                    return False
        return True

    def _run_containers(self) -> None:
        for c in self.main:
            if not self._start(c):
                return
        self.phase = "Running"
        self._publish()
        while not self._stopping.is_set():
            changed = False
            for c in self.main:
                if c.proc is not None and c.proc.poll() is not None:
                    self._record_exit(c, c.proc.returncode)
                    changed = True
                    restart = self.policy == "Always" or (self.policy == "OnFailure" and c.proc.returncode != 0)
                    c.proc = None
                    if restart:
                        self._back_off(c)
                elif c.proc is None and c.restart_at and time.monotonic() >= c.restart_at:
                    c.restart_at = 0.0
                    c.restarts += 1
                    if not self._start(c):
                        return
                    changed = True
            if all(c.proc is None and not c.restart_at for c in self.main):
                codes = [c.state["terminated"]["exitCode"] for c in self.main]
                self.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
                return
            if changed:
                self._publish()
            self._stopping.wait(0.2)

    # ---- containers ---------------------------------------------------------------------------
    def _start(self, c: Container) -> bool:
        """Launch C in the sandbox, or as a real container where its image is one (images.REAL_IMAGE_REGISTRY);
        False (pod Failed or waiting) when it cannot be started."""
        spec = c.spec
        try:
            if images.runs_as_real_container(spec["image"]):
                return self._start_real(c)
            image = images.resolve(spec["image"])
            env = container_env(self.api, self.pod, spec, image, self.base_env)
        except images.UnknownImage as e:
            return self._wait_until_deleted(c, "ErrImagePull", str(e))
        except EnvNotReady as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            self._publish()
            if self._stopping.wait(2):
                return False
            return self._start(c)
        argv = image.argv([expand(a, env) for a in spec.get("command", [])] or None,
                          [expand(a, env) for a in spec.get("args", [])] or None)
        sandbox_spec = {
            "hostname": self._hostname(),
            "hosts": str(self.hosts_file),
            "image": {"root": images.IMAGE_ROOT, "mounts": images.image_mounts()},
            "mounts": [*self._mounts(spec), self._termination_mount(spec)],
            "workingDir": spec.get("workingDir") or "/",
            "argv": argv,
            "env": env,
        }
        spec_file = self.dir / "containers" / f"{spec['name']}.json"
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        spec_file.write_text(json.dumps(sandbox_spec, indent=1))
        self._launch(c, [sys.executable, "-m", "kubetune_dev.sandbox", str(spec_file)])
        return True

    def _start_real(self, c: Container) -> bool:
        """C as a real container of its image (podman, runc): the pod's securityContext enforced, its
        volumes, hosts file and termination log mounted, the host's network (the pod binds its own
        127.x address)."""
        spec = c.spec
        if not container_runtime.image_present(spec["image"]):
            return self._wait_until_deleted(c, "ErrImagePull", (
                f"image {spec['image']!r} is not in this machine's podman store: build it with `make images` "
                "(IMAGE_TAG= for another tag)"))
        # What every container gets from the kubelet (the API's address), not HOME or PATH: the image's.
        base = {key: value for key, value in self.base_env.items() if key not in ("HOME", "PATH")}
        env = declared_env(self.api, self.pod, spec, base)
        declared = {**spec, "command": [expand(a, env) for a in spec.get("command", [])],
                    "args": [expand(a, env) for a in spec.get("args", [])]}
        termination = self._termination_mount(spec)
        Path(termination["source"]).chmod(0o666)  # the container's user writes it (the kubelet's mode too)
        c.container_name = real_container_name(self.meta, spec["name"])
        container_runtime.remove(c.container_name)  # a leftover of a killed earlier start
        try:
            argv = container_runtime.podman_run(
                self.pod["spec"], declared, env, c.container_name, self.dir, self.mounts,
                files=[{"source": str(self.hosts_file), "target": "/etc/hosts", "readOnly": True}, termination],
                hostname=self._hostname(), labels={POD_DIR_LABEL: str(self.dir.parent)})
        except container_runtime.PodRefused as e:
            return self._wait_until_deleted(c, "CreateContainerConfigError", str(e))
        self._launch(c, argv, cwd=container_runtime.runtime_dir(self.dir, c.container_name))
        return True

    def _wait_until_deleted(self, c: Container, reason: str, message: str) -> bool:
        """C cannot start (REASON: MESSAGE): as a real kubelet, the pod stays Pending until deleted."""
        c.state = {"waiting": {"reason": reason, "message": message}}
        self.message = message
        self._publish()
        self._stopping.wait()
        return False

    def _hostname(self) -> str:
        return self.pod["spec"].get("hostname") or self.meta["name"][:63]

    def _launch(self, c: Container, argv: list[str], cwd: Path | None = None) -> None:
        log_file = self.log_file(c.spec["name"])
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as out:
            previous_end = out.tell()
            if c.restarts:
                out.write(f"--- restart {c.restarts} at {now()} ---\n".encode())
                out.flush()
            c.log_starts.append((previous_end, out.tell()))
            c.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=cwd)
        # Recorded so that `kubetune dev down` can stop it even if this kubelet died.
        processes.record(c.proc.pid, self.dir / "pids" / f"{c.spec['name']}.json")
        c.started_at = now()
        c.state = {"running": {"startedAt": c.started_at}}

    def _mounts(self, spec: dict) -> list[dict]:
        mounts = []
        for m in spec.get("volumeMounts", []):
            source = self.mounts[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
            mounts.append({"source": str(source), "target": m["mountPath"], "readOnly": m.get("readOnly", False)})
        return mounts

    def _termination_file(self, spec: dict) -> Path:
        return self.dir / "termination" / spec["name"]

    def _termination_mount(self, spec: dict) -> dict:
        """The container's terminationMessagePath, as a kubelet makes it: an empty file of this
        container's (emptied at each start), whose text becomes state.terminated.message on exit."""
        host = self._termination_file(spec)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(b"")
        return {"source": str(host), "target": spec.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH,
                "readOnly": False}

    def _termination_message(self, spec: dict) -> str | None:
        try:
            text = self._termination_file(spec).read_bytes()[:TERMINATION_MESSAGE_LIMIT]
        except OSError:
            return None
        return text.decode(errors="replace") or None

    def _wait(self, c: Container) -> int | None:
        while c.proc.poll() is None:
            if self._stopping.wait(0.2):
                return None
        code = c.proc.returncode
        self._record_exit(c, code)
        c.proc = None
        return code

    def _record_exit(self, c: Container, code: int) -> None:
        # A signal death reads as 128+N, as container runtimes report it.
        exit_code = 128 - code if code < 0 else code
        reason = "Completed" if exit_code == 0 else "Error"
        if exit_code == 137 and c.container_name and container_runtime.oom_killed(
                container_runtime.runtime_dir(self.dir, c.container_name)):
            reason = "OOMKilled"
        c.state = {"terminated": {"exitCode": exit_code, "reason": reason,
                                  "startedAt": c.started_at, "finishedAt": now()}}
        message = self._termination_message(c.spec)
        if message:
            c.state["terminated"]["message"] = message
        c.last_state = {"terminated": dict(c.state["terminated"])}

    def _back_off(self, c: Container) -> None:
        delay = min(MAX_BACKOFF, 2.0 ** min(c.restarts, 5))
        c.restart_at = time.monotonic() + delay
        c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay:.0f}s"}}
        self._publish()

    def _kill_all(self) -> bool:
        """SIGTERM every running container's group, SIGKILL after the grace period; record how each
        ended. Returns whether any was still running."""
        running = [c for c in self.init + self.main if c.proc is not None and c.proc.poll() is None]
        for c in running:
            processes.Recorded(c.proc.pid, processes.start_time(c.proc.pid) or -1).signal_group(signal.SIGTERM)
        deadline = time.monotonic() + (self._stop_grace if self._stop_grace is not None else 30)
        for c in running:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                processes.Recorded(c.proc.pid, processes.start_time(c.proc.pid) or -1).signal_group(signal.SIGKILL)
                c.proc.wait()
                if c.container_name:  # the container outlives its killed podman process: SIGKILL it too
                    container_runtime.remove(c.container_name)
            self._record_exit(c, c.proc.returncode)
            c.proc = None
        return bool(running)

    # ---- status -------------------------------------------------------------------------------
    def _publish(self) -> None:
        init_done = all(c.state and "terminated" in c.state and c.state["terminated"]["exitCode"] == 0
                        for c in self.init)
        ready = self.phase == "Running" and all(c.proc is not None for c in self.main)

        def cond(kind: str, ok: bool) -> dict:
            return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": now()}

        status = {
            "phase": self.phase,
            "message": self.message or None,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.started_at,
            "conditions": [cond("PodScheduled", True), cond("Initialized", init_done),
                           cond("ContainersReady", ready), cond("Ready", ready)],
            "initContainerStatuses": [c.status(c.spec["image"]) for c in self.init],
            "containerStatuses": [c.status(c.spec["image"]) for c in self.main],
        }
        try:
            self.api.patch_namespaced_pod_status(self.meta["name"], self.meta["namespace"], {"status": status},
                                                 _content_type="application/merge-patch+json")
        except Exception as e:  # the pod may be gone already; the kubelet's loop notices that
            log.info("status of %s/%s not written: %s", self.meta["namespace"], self.meta["name"], e)
