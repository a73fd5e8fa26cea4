"""The control plane runs what both backends and queueing need: JobSet, Kubeflow Trainer v2 and
Kueue, each with its webhooks answering on loopback, and Prometheus built from its Go module."""
from __future__ import annotations

import json
import urllib.request

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetune_dev.versions import versions
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

PRINT_ENV = "import os; print('\\n'.join(f'{k}={v}' for k, v in sorted(os.environ.items()) if k.startswith('PET_')))"


def true_conditions(obj: dict) -> set[str]:
    return {c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c["status"] == "True"}


# ---- JobSet -------------------------------------------------------------------------------------

def test_a_jobset_runs_its_pod_to_completion(control_plane, api_client, namespace):
    jobsets = client.CustomObjectsApi(api_client)
    jobsets.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "hello"},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
            "parallelism": 1, "completions": 1, "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [{
                "name": "main", "image": "python:3.11", "command": ["python", "-c", "print('hello from a jobset')"]}]}}}}}]}})
    created = jobsets.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", "hello")
    # JobSet's defaulting webhook (called by URL on 127.0.0.1) filled in what the spec left out.
    assert created["spec"]["successPolicy"]["operator"] == "All"
    assert created["spec"]["network"]["enableDNSHostnames"] is True

    def completed():
        job = jobsets.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", "hello")
        return true_conditions(job) & {"Completed", "Failed"}
    assert eventually(completed, timeout=120, interval=1, message="JobSet finished") == {"Completed"}
    pods = client.CoreV1Api(api_client).list_namespaced_pod(namespace).items
    assert [p.metadata.labels["jobset.sigs.k8s.io/jobset-name"] for p in pods] == ["hello"]
    assert "hello from a jobset" in control_plane.pod_log(pods[0].metadata.name, namespace, "main").read_text()


def test_jobset_validation_refuses_an_invalid_jobset(api_client, namespace):
    jobsets = client.CustomObjectsApi(api_client)
    bad = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "bad"},
           "spec": {"replicatedJobs": [{"name": "w", "replicas": 1, "template": {"spec": {"template": {"spec": {
               "restartPolicy": "Never", "containers": [{"name": "c", "image": "python:3.11"}]}}}}}],
               # A success policy naming a replicated job that does not exist.
               "successPolicy": {"operator": "All", "targetReplicatedJobs": ["nope"]}}}
    with pytest.raises(ApiException) as refused:
        jobsets.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", bad)
    message = json.loads(refused.value.body)["message"]
    # Refused by JobSet's validating webhook, which the API server called on 127.0.0.1.
    assert refused.value.status == 403 and 'admission webhook "vjobset.kb.io" denied the request' in message
    assert "invalid replicatedJob name 'nope'" in message


# ---- Kubeflow Trainer v2 -----------------------------------------------------------------------

@pytest.fixture
def torch_runtime(api_client):
    """A minimal ClusterTrainingRuntime (torch ML policy, one replicated job `node`)."""
    runtimes = client.CustomObjectsApi(api_client)
    name = "e2e-torch"
    runtimes.create_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [{
            "name": "node", "template": {
                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                "spec": {"template": {"spec": {"containers": [{"name": "node", "image": "pytorch/pytorch:2.8.0"}]}}}}}]}}}})
    yield name
    runtimes.delete_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", name)


def test_a_trainjob_becomes_a_jobset_whose_pod_gets_the_torch_environment(control_plane, api_client, namespace,
                                                                         torch_runtime):
    custom = client.CustomObjectsApi(api_client)
    custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "hello"},
        "spec": {"runtimeRef": {"name": torch_runtime},
                 "trainer": {"numNodes": 1, "command": ["python", "-c", PRINT_ENV]}}})

    def finished():
        job = custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", "hello")
        return true_conditions(job) & {"Complete", "Failed"}
    assert eventually(finished, timeout=120, interval=1, message="TrainJob finished") == {"Complete"}
    # Trainer ran it as a JobSet it owns; the torch policy set the PET_* rendezvous variables.
    jobset = custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", "hello")
    assert jobset["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    pod = client.CoreV1Api(api_client).list_namespaced_pod(namespace).items[0]
    log = control_plane.pod_log(pod.metadata.name, namespace, "node").read_text()
    assert "PET_NNODES=1" in log and "PET_NODE_RANK=0" in log and "PET_MASTER_ADDR=" in log


def test_trainer_validation_refuses_a_trainjob_without_its_runtime(api_client, namespace):
    with pytest.raises(ApiException) as refused:
        client.CustomObjectsApi(api_client).create_namespaced_custom_object(
            "trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", {
                "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "orphan"},
                "spec": {"runtimeRef": {"name": "no-such-runtime"}}})
    message = json.loads(refused.value.body)["message"]
    # Trainer's own webhook and Kueue's TrainJob webhook (Kueue >= v0.19 resolves the runtime too)
    # both refuse it; the API server calls them in no fixed order, so either may answer first.
    refusing_webhooks = ('"validator.trainjob.trainer.kubeflow.org"', '"vtrainjob.kb.io"')
    assert any(f"admission webhook {name} denied the request" in message for name in refusing_webhooks), message
    assert "no-such-runtime" in message


# ---- Kueue -------------------------------------------------------------------------------------

@pytest.fixture
def one_cpu_queue(api_client, namespace):
    """A ClusterQueue with a quota of one CPU and a LocalQueue `jobs` in the test's namespace."""
    custom = client.CustomObjectsApi(api_client)
    group, version = "kueue.x-k8s.io", "v1beta2"
    cluster_queue = f"{namespace}-cq"
    custom.create_cluster_custom_object(group, version, "resourceflavors", {
        "apiVersion": f"{group}/{version}", "kind": "ResourceFlavor", "metadata": {"name": cluster_queue}})
    custom.create_cluster_custom_object(group, version, "clusterqueues", {
        "apiVersion": f"{group}/{version}", "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
            {"name": cluster_queue, "resources": [{"name": "cpu", "nominalQuota": "1"}]}]}]}})
    custom.create_namespaced_custom_object(group, version, namespace, "localqueues", {
        "apiVersion": f"{group}/{version}", "kind": "LocalQueue", "metadata": {"name": "jobs"},
        "spec": {"clusterQueue": cluster_queue}})
    yield cluster_queue
    custom.delete_cluster_custom_object(group, version, "clusterqueues", cluster_queue)
    custom.delete_cluster_custom_object(group, version, "resourceflavors", cluster_queue)


def _queued_pytorchjob(name: str, seconds: int) -> dict:
    master = {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {"containers": [{
        "name": "pytorch", "image": "python:3.11", "resources": {"requests": {"cpu": "1"}},
        "command": ["python", "-c", f"import time; time.sleep({seconds}); print('{name} done')"]}]}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "jobs"}},
            "spec": {"pytorchReplicaSpecs": {"Master": master}}}


def test_kueue_admits_queued_pytorchjobs_one_at_a_time_within_the_quota(control_plane, api_client, namespace,
                                                                        one_cpu_queue):
    custom = client.CustomObjectsApi(api_client)
    get = lambda name: custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)  # noqa: E731
    for name in ("first", "second"):
        custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs",
                                               _queued_pytorchjob(name, seconds=4))
        # Kueue's mutating webhook suspends a queued job at creation, before any pod exists.
        assert get(name)["spec"]["runPolicy"]["suspend"] is True

    def workloads() -> dict[str, set[str]]:
        items = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", namespace, "workloads")["items"]
        return {w["metadata"]["ownerReferences"][0]["name"]: true_conditions(w) for w in items}
    # One CPU of quota: the first is admitted and runs, the second waits in the queue.
    eventually(lambda: "Admitted" in workloads().get("first", set()), timeout=60, message="first admitted")
    # Kueue unsuspends an admitted job in a later pass of its job reconciler than the one that admitted it.
    eventually(lambda: get("first")["spec"]["runPolicy"]["suspend"] is False, timeout=30, message="first unsuspended")
    assert "QuotaReserved" not in workloads()["second"] and get("second")["spec"]["runPolicy"]["suspend"] is True

    def succeeded(name):
        return "Succeeded" in true_conditions(get(name))
    eventually(lambda: succeeded("first"), timeout=120, interval=1, message="first Succeeded")
    # The quota it frees admits the second, which then runs to the end too.
    eventually(lambda: succeeded("second"), timeout=120, interval=1, message="second admitted and Succeeded")
    assert "second done" in control_plane.pod_log("second-master-0", namespace, "pytorch").read_text()


def test_kueue_converts_its_objects_between_api_versions(api_client, one_cpu_queue):
    """v1beta1 is the stored version, v1beta2 what Kueue reads: the conversion webhook on loopback."""
    custom = client.CustomObjectsApi(api_client)
    for version in ("v1beta1", "v1beta2"):
        queue = custom.get_cluster_custom_object("kueue.x-k8s.io", version, "clusterqueues", one_cpu_queue)
        assert queue["apiVersion"] == f"kueue.x-k8s.io/{version}"
        assert queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] == "1"


# ---- Prometheus --------------------------------------------------------------------------------

def test_prometheus_is_the_release_pinned_in_versions_env(control_plane):
    with urllib.request.urlopen(control_plane.env()["PROMETHEUS_URL"] + "/api/v1/status/buildinfo", timeout=5) as r:
        build = json.load(r)["data"]
    minor = versions()["PROMETHEUS_VERSION"].split(".")[1]   # v0.316.0 -> 316 -> 3.16.x
    assert build["version"].startswith(f"3.{int(minor[1:])}.")
