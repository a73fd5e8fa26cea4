"""operator.watchNamespaces: the operator runs jobs in the watched namespaces only, and holds rights
(Secrets, pods, child jobs) there only: a Role per watched namespace, no cluster-wide grant.

This release also turns the progress push off (operator.progressPush.enabled=false), so that the
poll the operator falls back to (a GET of the rank-0 pod's /metrics, with the pod LIST its Role in
the watched namespace allows) has an e2e: every other release pushes (the chart's default). Its
one training job costs the check a few more steps than it needs for the namespaces alone."""
from __future__ import annotations

import re
import time

import pytest
import yaml

from tests.e2e.conftest import delete_namespace_and_wait, install_chart, uninstall_chart
from tests.e2e.jobs import OPERATOR_NAMESPACE, example_job, get_job, kubectl, operator_log, phase, rank0_pod_logs
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e
WATCHED, UNWATCHED = "e2e-watched", "e2e-unwatched"
# Enough steps for the 1 s poll to read the running trainer a few times (a few steps a second here).
WATCHED_STEPS = 16


@pytest.fixture(scope="module")
def namespaced_operator(control_plane, core):
    """Both namespaces (the watched one with the S3 Secret), then the chart watching only WATCHED."""
    env = control_plane.env()
    for namespace in (WATCHED, UNWATCHED):
        core.create_namespace({"metadata": {"name": namespace}})
        core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-credentials"}, "stringData": {
            "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"]}})
    install_chart(control_plane, "pytorchjob", "--set", f"operator.watchNamespaces={{{WATCHED}}}",
                  "--set", "operator.progressPush.enabled=false",  # the poll fallback (module docstring)
                  webhook_namespace=WATCHED)  # the webhook covers the watched namespaces only
    yield
    for namespace in (WATCHED, UNWATCHED):  # while the operator runs to release its finalizers
        delete_namespace_and_wait(core, namespace)
    uninstall_chart(control_plane)


def test_the_operator_may_act_in_watched_namespaces_only(control_plane, namespaced_operator):
    account = f"system:serviceaccount:{OPERATOR_NAMESPACE}:kubetune"

    def can(verb, resource, namespace):
        result = kubectl(control_plane, "auth", "can-i", verb, resource, "--as", account, "-n", namespace, check=False)
        return result.stdout.strip() == "yes"

    for verb, resource in [("list", "pods"), ("create", "pytorchjobs.kubeflow.org"),
                           ("watch", "trainingjobs.kubetune.dev"), ("create", "configmaps")]:
        assert can(verb, resource, WATCHED), f"the operator cannot {verb} {resource} in {WATCHED}"
        assert not can(verb, resource, UNWATCHED), f"the operator may {verb} {resource} in {UNWATCHED}"
    for namespace in (WATCHED, UNWATCHED):  # no Secret read anywhere: a missing one is learned from the pods
        assert not can("get", "secrets", namespace), f"the operator may get secrets in {namespace}"
        assert not can(verb, resource, "default"), f"the operator may {verb} {resource} in default"


def test_jobs_run_in_the_watched_namespace_and_are_left_alone_elsewhere(
        control_plane, api_client, core, namespaced_operator, inputs_in_s3):
    for namespace, name in ((WATCHED, "watched-job"), (UNWATCHED, "unwatched-job")):
        manifest = example_job(inputs_in_s3, name, f"runs/{name}", maxSteps=WATCHED_STEPS if namespace == WATCHED else 2)
        kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

    # The steps status.progress showed while the job ran: with the push off, only the poll writes them.
    shown: set[int] = set()

    def finished():
        status = get_job(api_client, WATCHED, "watched-job").get("status") or {}
        if status.get("phase") == "Running":
            shown.add((status.get("progress") or {}).get("step", 0))
        return status.get("phase") in ("Succeeded", "Failed") and status

    final = eventually(finished, timeout=600, interval=0.25,
                       message=lambda: "the watched job finished; operator log:\n" + operator_log(control_plane, core))
    [log] = rank0_pod_logs(control_plane, "pytorchjob", WATCHED, "watched-job")
    assert final["phase"] == "Succeeded", log[-3000:]
    assert shown & set(range(1, WATCHED_STEPS)), f"status.progress never advanced while running: {sorted(shown)}"
    # The trainer was told of no inbox, so it pushed nothing; the operator polled it to the end, and
    # the final reading reached the status (read at the end, and kept in the termination message).
    assert "progress pushed" not in log and "progress inbox" not in log, log[-3000:]
    assert "the operator read the final metrics" in log, log[-3000:]
    last_loss = float(re.findall(rf"step {WATCHED_STEPS}/{WATCHED_STEPS} loss ([\d.]+)", log)[-1])
    assert final["progress"]["step"] == WATCHED_STEPS and final["progress"]["percent"] == 100
    assert final["progress"]["loss"] == pytest.approx(last_loss, abs=1e-5)
    assert not core.list_namespaced_service(OPERATOR_NAMESPACE, field_selector="metadata.name=kubetune-progress").items
    time.sleep(3)  # the operator has long been up; a job it took would have a status by now
    untouched = get_job(api_client, UNWATCHED, "unwatched-job")
    assert not untouched.get("status"), untouched.get("status")
    assert not untouched["metadata"].get("finalizers"), "no finalizer: it deletes without this operator"
    assert not core.list_namespaced_config_map(UNWATCHED, label_selector="kubetune.dev/trainingjob").items
    kubectl(control_plane, "delete", "tj", "unwatched-job", "-n", UNWATCHED, "--wait=true", "--timeout=60s")
