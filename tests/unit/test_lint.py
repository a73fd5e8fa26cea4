"""`make lint`: kube-score and checkov pass on everything kubetune deploys, and they really look.

The linters are installed by `make lint-tools` (a prerequisite of `make test`). A missing one fails
these tests with the command that installs it, in CI and on a workstation alike: never a skip.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubetune_dev import lint
from kubetune_dev.trainer_pods import trainer_pods
from tests.conftest import REPO

# A pod no hardening would accept: privileged, root, a moving tag, no limits.
BAD_POD = """\
apiVersion: v1
kind: Pod
metadata: {name: bad, namespace: default}
spec:
  containers:
    - name: bad
      image: busybox:latest
      securityContext: {privileged: true, runAsUser: 0}
"""


def run_lint(*args: str) -> subprocess.CompletedProcess:
    # The same command `make lint` runs.
    return subprocess.run([sys.executable, "-m", "kubetune_dev.lint", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


def test_kubetune_manifests_pass_both_linters_with_every_exception_explained():
    result = run_lint()
    assert result.returncode == 0, (
        f"`make lint` failed (exit {result.returncode}); fix the manifest, or add an entry with its reason to "
        f"lint/exceptions.yaml:\n{result.stdout}\n{result.stderr}")
    # Every target was linted, and the exceptions in use were applied (none stale).
    assert f"{len(lint.CHART_VARIANTS) + 2} targets" in result.stdout and "0 failing, 0 stale" in result.stdout, result.stdout


def test_each_linter_reports_a_privileged_root_container(tmp_path):
    bad = tmp_path / "bad-pod.yaml"
    bad.write_text(BAD_POD)
    result = run_lint("--no-exceptions", str(bad))
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "FAIL kube-score container-security-context-privileged [bad-pod] Pod/bad" in result.stdout, result.stdout
    assert "FAIL checkov CKV_K8S_16 [bad-pod] Pod/bad" in result.stdout, result.stdout  # privileged
    assert "FAIL checkov CKV_K8S_14 [bad-pod] Pod/bad" in result.stdout, result.stdout  # latest tag


def test_a_linter_that_reads_nothing_fails_the_lint(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# no objects\n")
    result = run_lint("--no-exceptions", str(empty))
    assert result.returncode == 2 and "read no object" in result.stderr, result.stdout + result.stderr


def test_an_exception_must_give_its_reason(tmp_path):
    path = tmp_path / "exceptions.yaml"
    path.write_text("- {linter: checkov, check: CKV_K8S_43}\n")
    with pytest.raises(lint.LintError, match="gives no reason"):
        lint.load_exceptions(path)
    path.write_text("- {linter: kube-linter, check: x, why: y}\n")
    with pytest.raises(lint.LintError, match="bad entry"):
        lint.load_exceptions(path)


def test_exceptions_are_narrowed_by_object_target_and_text():
    entry = lint.Exception_("kube-score", "container-resources", "why", objects=["Deployment/kubetune"],
                            matching="CPU limit")
    cpu = lint.Finding("kube-score", "container-resources", "chart-defaults", "Deployment/kubetune",
                       "(operator) CPU limit is not set")
    assert entry.covers(cpu)
    assert not entry.covers(lint.Finding(**{**cpu.__dict__, "detail": "(operator) Memory limit is not set"}))
    assert not entry.covers(lint.Finding(**{**cpu.__dict__, "obj": "Pod/kubetune-test"}))
    assert not entry.covers(lint.Finding(**{**cpu.__dict__, "linter": "checkov"}))


def test_the_linted_trainer_pods_are_the_operators_for_both_backends():
    documents = trainer_pods()
    [policy] = [d for d in documents if d["kind"] == "NetworkPolicy"]
    pods = {pod["metadata"]["name"]: pod for pod in documents if pod["kind"] == "Pod"}
    for pod in pods.values():  # the policy networkPolicy.enabled adds fences in every one of them
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert set(pods) == {"sd15-lora-demo-pytorchjob-master", "sd15-lora-demo-trainjob-node",
                         "sd15-lora-demo-2nodes-pytorchjob-master", "sd15-lora-demo-2nodes-pytorchjob-worker",
                         "sd15-lora-demo-2nodes-trainjob-node"}
    for pod in pods.values():
        assert pod["spec"]["automountServiceAccountToken"] is False
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}  # the example's one GPU
            assert set(container["resources"]["requests"]) == {"cpu", "memory", "nvidia.com/gpu"}  # chart defaults
    # The cache stage: an init container on the PyTorchJob's Master (after the models stage: the
    # example's model is a hub id), the runtime's entry point on TrainJob.
    init = pods["sd15-lora-demo-2nodes-pytorchjob-master"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["models", "cache"]
    assert "--cache-stage" in pods["sd15-lora-demo-2nodes-trainjob-node"]["spec"]["containers"][0]["args"]
    # The TrainJob's config volume is the job's ConfigMap (the runtime patch replaced the placeholder).
    volumes = {v["name"]: v for v in pods["sd15-lora-demo-trainjob-node"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "sd15-lora-demo-config"


def test_the_linters_are_pinned():
    assert lint.versions.versions()["KUBE_SCORE_VERSION"].startswith("v")
    assert Path(REPO / "requirements-lint.txt").read_text().count("checkov==") == 1


def test_the_trainer_pods_of_every_example_are_linted():
    from kubetune_dev.trainer_pods import EXAMPLES, every_examples_trainer_pods

    linted = {d["metadata"]["name"] for d in every_examples_trainer_pods() if d["kind"] == "Pod"}
    for example in sorted(EXAMPLES.glob("*.yaml")):
        job = yaml.safe_load(example.read_text())["metadata"]["name"]
        assert {f"{job}-pytorchjob-master", f"{job}-trainjob-node", f"{job}-2nodes-pytorchjob-worker"} <= linted, example
