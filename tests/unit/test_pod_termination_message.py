"""The process kubelet keeps what a container leaves at its terminationMessagePath, as Kubernetes does:
the trainer's final report reaches the operator through it after the pod is gone."""
from __future__ import annotations

import json
import subprocess
import sys

from kubetune_dev.podrunner import TERMINATION_MESSAGE_LIMIT, Container, PodRunner


def runner(tmp_path, **container) -> PodRunner:
    pod = {"metadata": {"name": "train-node-0-0", "namespace": "team"},
           "spec": {"containers": [{"name": "node", "image": "kubetune/trainer", **container}]}}
    return PodRunner(api=None, pod=pod, pod_dir=tmp_path, pod_ip="127.1.0.9", base_env={})


def test_a_container_that_names_no_path_gets_kubernetes_default(tmp_path):
    pod = runner(tmp_path)
    mount = pod._termination_mount(pod.main[0].spec)
    assert mount["target"] == "/dev/termination-log" and not mount["readOnly"]


def test_what_the_container_writes_there_is_its_terminated_message(tmp_path):
    # A path of the test's own: the sandbox makes a missing mount point on the host's side.
    path = str(tmp_path / "container" / "ended")
    pod = runner(tmp_path / "pod", terminationMessagePath=path)
    container: Container = pod.main[0]
    mount = pod._termination_mount(container.spec)
    assert mount["target"] == path
    spec = tmp_path / "sandbox.json"  # the container's first program, as the kubelet starts it
    spec.write_text(json.dumps({"mounts": [mount], "workingDir": "/", "env": {"PATH": "/usr/bin:/bin"},
                                "argv": ["sh", "-c", f"printf '%s' final-report > {path}"]}))
    subprocess.run([sys.executable, "-m", "kubetune_dev.sandbox", str(spec)], check=True, timeout=60)
    pod._record_exit(container, 0)
    assert container.state["terminated"]["message"] == "final-report"
    pod._termination_mount(container.spec)  # started again: the last run's message is not the next one's
    pod._record_exit(container, 0)
    assert "message" not in container.state["terminated"]


def test_a_message_is_cut_at_kubernetes_limit(tmp_path):
    pod = runner(tmp_path)
    container = pod.main[0]
    pod._termination_mount(container.spec)
    pod._termination_file(container.spec).write_text("x" * (TERMINATION_MESSAGE_LIMIT + 100))
    pod._record_exit(container, 1)
    assert len(container.state["terminated"]["message"]) == TERMINATION_MESSAGE_LIMIT
