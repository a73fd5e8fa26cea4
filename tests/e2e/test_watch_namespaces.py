"""operator.watchNamespaces: the operator runs jobs in the watched namespaces only, and holds rights
(Secrets, pods, child jobs) there only: a Role per watched namespace, no cluster-wide grant."""
from __future__ import annotations

import time

import pytest
import yaml

from tests.e2e.conftest import delete_namespace_and_wait, install_chart, uninstall_chart
from tests.e2e.jobs import OPERATOR_NAMESPACE, example_job, get_job, kubectl, operator_log, phase
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e
WATCHED, UNWATCHED = "e2e-watched", "e2e-unwatched"


@pytest.fixture(scope="module")
def namespaced_operator(control_plane, core):
    """Both namespaces (the watched one with the S3 Secret), then the chart watching only WATCHED."""
    env = control_plane.env()
    for namespace in (WATCHED, UNWATCHED):
        core.create_namespace({"metadata": {"name": namespace}})
        core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-credentials"}, "stringData": {
            "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"]}})
    install_chart(control_plane, "pytorchjob", "--set", f"operator.watchNamespaces={{{WATCHED}}}",
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
        manifest = example_job(inputs_in_s3, name, f"runs/{name}", maxSteps=2)
        kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

    eventually(lambda: phase(api_client, WATCHED, "watched-job") in ("Succeeded", "Failed"), timeout=600, interval=2,
               message=lambda: "the watched job finished; operator log:\n" + operator_log(control_plane, core))
    assert phase(api_client, WATCHED, "watched-job") == "Succeeded"
    time.sleep(3)  # the operator has long been up; a job it took would have a status by now
    untouched = get_job(api_client, UNWATCHED, "unwatched-job")
    assert not untouched.get("status"), untouched.get("status")
    assert not untouched["metadata"].get("finalizers"), "no finalizer: it deletes without this operator"
    assert not core.list_namespaced_config_map(UNWATCHED, label_selector="kubetune.dev/trainingjob").items
    kubectl(control_plane, "delete", "tj", "unwatched-job", "-n", UNWATCHED, "--wait=true", "--timeout=60s")
