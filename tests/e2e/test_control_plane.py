"""The local control plane behaves like a cluster: real API server, RBAC, admission, garbage
collection, the Kubeflow training operator, pods run by the process kubelet, S3 and Prometheus."""
from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import boto3
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kubetune_api.ports import free_listen_port
from kubetune_dev.versions import versions
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e


def pod_phase(core, name, namespace):
    try:
        return core.read_namespaced_pod(name, namespace).status.phase
    except ApiException as e:
        if e.status == 404:
            return "Gone"
        raise


# ---- the API server -----------------------------------------------------------------------------

def test_api_server_is_ready_and_reports_its_real_version(control_plane):
    status, body = control_plane.api_get("/readyz")
    assert (status, body) == (200, b"ok")
    status, body = control_plane.api_get("/version")
    assert json.loads(body)["gitVersion"] == versions()["KUBERNETES_VERSION"]


def test_rbac_limits_a_service_account_to_its_role(control_plane, core, namespace):
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    client.RbacAuthorizationV1Api(core.api_client).create_namespaced_role_binding(namespace, {
        "metadata": {"name": "reader-view"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})
    token = core.create_namespaced_service_account_token("reader", namespace, {"spec": {}}).status.token
    as_reader_config = client.Configuration(host=control_plane.server,
                                            api_key={"authorization": f"Bearer {token}"})
    as_reader_config.ssl_ca_cert = str(control_plane.pki / "ca.crt")
    as_reader = client.CoreV1Api(client.ApiClient(as_reader_config))

    def allowed(call) -> bool:
        try:
            eventually(lambda: _not_unauthorized(call), timeout=10, message="RBAC cache")
            call()
            return True
        except ApiException as e:
            assert e.status == 403, e
            return False

    assert allowed(lambda: as_reader.list_namespaced_pod(namespace))
    assert not allowed(lambda: as_reader.create_namespaced_config_map(namespace, {"metadata": {"name": "x"}}))
    assert not allowed(lambda: as_reader.list_namespaced_secret(namespace))
    assert not allowed(lambda: as_reader.list_namespaced_pod("kube-system"))


def _not_unauthorized(call) -> bool:
    """A new token can take a moment to be accepted; 401 means 'not yet', anything else is an answer."""
    try:
        call()
    except ApiException as e:
        return e.status != 401
    return True


def test_pod_security_admission_refuses_a_privileged_pod_in_a_restricted_namespace(core, namespace):
    core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    privileged = {"metadata": {"name": "root"}, "spec": {"containers": [
        {"name": "c", "image": "python:3.11", "securityContext": {"privileged": True}}]}}
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(namespace, privileged)
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest": privileged' in message
    # The same namespace admits a pod that meets the standard (dry run: nothing runs).
    compliant = {"metadata": {"name": "ok"}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": "python:3.11", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}
    core.create_namespaced_pod(namespace, compliant, dry_run="All")


def test_garbage_collector_deletes_the_children_of_a_deleted_parent(core, namespace):
    parent = core.create_namespaced_config_map(namespace, {"metadata": {"name": "parent"}})
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "parent", "uid": parent.metadata.uid}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [owner]}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "bystander"}})

    core.delete_namespaced_config_map("parent", namespace, propagation_policy="Background")

    def child_gone():
        names = {cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items}
        return "child" not in names and names
    remaining = eventually(child_gone, timeout=60, message="garbage collection of the child")
    assert "bystander" in remaining


# ---- the process kubelet ------------------------------------------------------------------------

def test_kubelet_runs_a_pod_with_its_env_volumes_and_exit_code(control_plane, core, namespace):
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"},
                                                  "data": {"greeting": "hello", "file.txt": "from a configmap"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "token"}, "stringData": {"value": "s3cr3t"}})
    script = ("import os, pathlib, socket;"
              "print('greeting', os.environ['GREETING']);"
              "print('secret', os.environ['TOKEN']);"
              "print('pod', os.environ['POD_NAME'], os.environ['POD_IP']);"
              "print('file', pathlib.Path('/etc/settings/file.txt').read_text());"
              "print('labels', pathlib.Path('/etc/podinfo/labels').read_text());"
              "print('hostname', socket.gethostname(), socket.gethostbyname(socket.gethostname()));"
              "pathlib.Path('/tmp/marker').touch();"
              "print('private tmp', os.listdir('/tmp'));"
              "raise SystemExit(3)")
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "probe", "labels": {"app": "probe"}},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "main", "image": "python:3.11-slim", "command": ["python", "-c", script],
            "env": [{"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            # An emptyDir over /tmp, listed first: it must not hide the other volumes' sources.
            "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"},
                             {"name": "settings", "mountPath": "/etc/settings"},
                             {"name": "podinfo", "mountPath": "/etc/podinfo"}]}],
            "volumes": [{"name": "scratch", "emptyDir": {}},
                        {"name": "settings", "configMap": {"name": "settings"}},
                        {"name": "podinfo", "downwardAPI": {"items": [
                            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]}})

    eventually(lambda: pod_phase(core, "probe", namespace) == "Failed", timeout=60, message="pod Failed")
    pod = core.read_namespaced_pod("probe", namespace)
    assert pod.status.container_statuses[0].state.terminated.exit_code == 3
    ip = pod.status.pod_ip
    assert ip.startswith("127.") and ip != "127.0.0.1"
    log = control_plane.pod_log("probe", namespace, None).read_text()
    assert "greeting hello" in log
    assert "secret s3cr3t" in log
    assert f"pod probe {ip}" in log
    assert "file from a configmap" in log
    assert 'app="probe"' in log
    assert f"hostname probe {ip}" in log
    assert "private tmp ['marker']" in log


def test_deleting_a_pod_stops_its_process_with_sigterm(control_plane, core, namespace):
    script = ("import signal, sys, time;"
              "signal.signal(signal.SIGTERM, lambda *_: (print('got SIGTERM', flush=True), sys.exit(143)));"
              "print('running', flush=True); time.sleep(600)")
    core.create_namespaced_pod(namespace, {"metadata": {"name": "sleeper"}, "spec": {
        "terminationGracePeriodSeconds": 20, "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "python:3.11", "command": ["python", "-c", script]}]}})
    eventually(lambda: pod_phase(core, "sleeper", namespace) == "Running", message="pod Running")
    eventually(lambda: "running" in control_plane.pod_log("sleeper", namespace, None).read_text(), message="output")

    # Every state the pod passes through until it is gone, as a controller watching it sees them.
    seen: list[tuple[str, str | None, int | None]] = []
    watching = threading.Thread(target=_record_until_deleted, args=(core, namespace, "sleeper", seen), daemon=True)
    watching.start()
    time.sleep(0.5)  # the watch is open before the deletion
    started = time.monotonic()
    core.delete_namespaced_pod("sleeper", namespace)
    eventually(lambda: pod_phase(core, "sleeper", namespace) == "Gone", timeout=30, message="pod removed")
    assert time.monotonic() - started < 15, "the process should exit on SIGTERM, not wait for SIGKILL"
    assert "got SIGTERM" in control_plane.pod_log("sleeper", namespace, None).read_text()
    # Before it went, the kubelet reported how the container ended (the training operator decides
    # from that exit code whether a replica is restarted), as a real kubelet does.
    watching.join(timeout=10)
    assert ("MODIFIED", "Failed", 143) in seen, seen
    assert seen[-1][0] == "DELETED", seen


def test_kubectl_logs_reads_a_pods_last_start_the_one_before_and_follows_it_through_the_kubelets_api(
        control_plane, core, namespace):
    """`kubectl logs` goes API server -> the kubelet's API (kubetune_dev.kubelet_api) as on any node: the
    container's last start, `--previous`, `--tail`, `-f` until the container ends; what the dev cluster's
    kubelet cannot answer (per-line times) is refused saying so."""
    script = ("import pathlib, sys, time;"
              "marker = pathlib.Path('/scratch/started');"
              "first = not marker.exists(); marker.touch();"
              "print('first start' if first else 'second start', flush=True);"
              "first and sys.exit(1);"
              "[print(f'line {i}', flush=True) or time.sleep(0.5) for i in range(6)]")
    core.create_namespaced_pod(namespace, {"metadata": {"name": "talker"}, "spec": {
        "restartPolicy": "OnFailure",
        "containers": [{"name": "main", "image": "python:3.11", "command": ["python", "-c", script],
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
        "volumes": [{"name": "scratch", "emptyDir": {}}]}})

    def restarted_and_running() -> bool:
        statuses = core.read_namespaced_pod("talker", namespace).status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count == 1 and statuses[0].state.running is not None

    eventually(restarted_and_running, timeout=60, message="the container restarted once")
    followed = subprocess.run([*control_plane.kubectl_argv(), "-n", namespace, "logs", "-f", "talker"],
                              capture_output=True, text=True, timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout == "second start\n" + "".join(f"line {i}\n" for i in range(6)), \
        "-f streams the running start to its end, and ends with it"
    assert control_plane.kubectl("logs", "talker", "-n", namespace, "--previous").stdout == "first start\n"
    assert control_plane.kubectl("logs", "talker", "-n", namespace, "--tail", "2").stdout == "line 4\nline 5\n"
    refused = control_plane.kubectl("logs", "talker", "-n", namespace, "--timestamps", check=False)
    assert refused.returncode != 0 and "keeps no time per log line" in refused.stderr, refused.stderr


def _record_until_deleted(core, namespace: str, name: str, seen: list) -> None:
    for event in watch.Watch().stream(core.list_namespaced_pod, namespace, field_selector=f"metadata.name={name}",
                                      timeout_seconds=60):
        pod = event["object"]
        terminated = next((s.state.terminated for s in pod.status.container_statuses or []
                           if s.state and s.state.terminated), None)
        seen.append((event["type"], pod.status.phase, terminated.exit_code if terminated else None))
        if event["type"] == "DELETED":
            return


# ---- the training operator ----------------------------------------------------------------------

ALL_REDUCE = """
import os
import torch
import torch.distributed as dist

for key in ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_NNODES", "PET_NODE_RANK"]:
    print(f"{key}={os.environ[key]}", flush=True)
dist.init_process_group("gloo")  # env:// rendezvous from what the training operator injected
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"all_reduce={total.item()}", flush=True)
assert total.item() == sum(range(1, dist.get_world_size() + 1))
dist.destroy_process_group()
"""


def _replica(replicas: int) -> dict:
    return {"replicas": replicas, "restartPolicy": "Never", "template": {"spec": {"containers": [{
        "name": "pytorch", "image": "python:3.11", "command": ["python", "-c", ALL_REDUCE],
        "ports": [{"name": "pytorchjob-port", "containerPort": 23456}]}]}}}


def test_pytorchjob_with_master_and_worker_succeeds_through_the_training_operator(control_plane, api_client,
                                                                                  core, namespace):
    jobs = client.CustomObjectsApi(api_client)
    jobs.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "allreduce"},
        "spec": {"nprocPerNode": "1",
                 "pytorchReplicaSpecs": {"Master": _replica(1), "Worker": _replica(1)}}})

    def finished():
        job = jobs.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "allreduce")
        conditions = {c["type"]: c["status"] for c in job.get("status", {}).get("conditions", [])}
        return next((kind for kind in ("Succeeded", "Failed") if conditions.get(kind) == "True"), None)

    outcome = eventually(finished, timeout=240, interval=1, message="PyTorchJob finished")
    logs = {pod: control_plane.pod_log(pod, namespace, "pytorch").read_text()
            for pod in ("allreduce-master-0", "allreduce-worker-0")}
    assert outcome == "Succeeded", logs
    for rank, pod in enumerate(("allreduce-master-0", "allreduce-worker-0")):
        log = logs[pod]
        assert "MASTER_ADDR=allreduce-master-0" in log
        assert "WORLD_SIZE=2" in log and f"RANK={rank}" in log
        assert "PET_NNODES=2" in log and f"PET_NODE_RANK={rank}" in log
        assert "all_reduce=3.0" in log
    # The worker waited for the master's name through the operator's init container.
    assert control_plane.pod_log("allreduce-worker-0", namespace, "init-pytorch").exists()


# ---- S3 and Prometheus --------------------------------------------------------------------------

def test_boto3_round_trips_an_object_through_the_s3_server(control_plane):
    env = control_plane.env()
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket="e2e-roundtrip")
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    s3.put_object(Bucket="e2e-roundtrip", Key="dir/blob.bin", Body=payload)
    assert s3.get_object(Bucket="e2e-roundtrip", Key="dir/blob.bin")["Body"].read() == payload
    listed = s3.list_objects_v2(Bucket="e2e-roundtrip", Prefix="dir/")
    assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [("dir/blob.bin", len(payload))]


def test_prometheus_scrapes_a_target(control_plane):
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    Gauge("kubetune_e2e_probe", "A value the test expects Prometheus to scrape.", registry=registry).set(42)
    port = free_listen_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        (control_plane.prometheus_targets / "e2e.json").write_text(
            json.dumps([{"targets": [f"127.0.0.1:{port}"], "labels": {"suite": "e2e"}}]))
        url = control_plane.env()["PROMETHEUS_URL"] + "/api/v1/query?" + urllib.parse.urlencode(
            {"query": 'kubetune_e2e_probe{suite="e2e"}'})

        def scraped():
            with urllib.request.urlopen(url, timeout=5) as r:
                result = json.load(r)["data"]["result"]
            return result and result[0]["value"][1]
        assert eventually(scraped, timeout=60, interval=1, message="a scrape of the probe") == "42"
    finally:
        (control_plane.prometheus_targets / "e2e.json").unlink(missing_ok=True)
        server.shutdown()
