"""The local control plane, brought up once for every e2e test and taken down at the end.

A control plane that cannot start fails the tests that need it, in CI and out of it, with the
reason and what fixes it (usually: `make cluster-bins`, which `make test` runs first). Nothing is
skipped: a green run means every test ran.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import time
from pathlib import Path

import boto3
import pytest
import yaml
from kubernetes import client, config

from kubetune_dev.cluster import Cluster
from kubetune_dev.images import REAL_IMAGE_REGISTRY
from kubetune_trainer.data.tiny_data import write_tiny_data
from kubetune_trainer.models.tiny_models import write_tiny_model
from tests.conftest import REPO
from tests.e2e.jobs import BUCKET, OPERATOR_NAMESPACE, os_env


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory, built_images):
    # Its trainer pods run as real containers of our images (helm_values): they must be current (built_images).
    # One control plane per machine at a time: pod addresses (127.1.x.y) are not per cluster, so
    # a second test session waits here for the first to finish.
    lock_path = Path(os.environ.get("KUBETUNE_CACHE", Path.home() / ".cache" / "kubetune")) / "control-plane.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _control_plane(tmp_path_factory)


def _control_plane(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("devcluster"), log=lambda line: print(f"[dev up] {line}"))
    try:
        cluster.up()
    except Exception as e:
        cluster.down()
        pytest.fail(f"the local control plane did not start: {e}\n"
                    f"(binaries: `make cluster-bins`; component logs: {cluster.logs})")
    yield cluster
    cluster.down()
    assert not cluster.pids(), "`down` left control-plane or pod processes running"


@pytest.fixture(scope="session")
def api_client(control_plane) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(control_plane.kubeconfig()))


@pytest.fixture(scope="session")
def core(api_client) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture
def namespace(core, request) -> str:
    """A fresh namespace per test, named after it (and its parameters: one per backend)."""
    name = namespace_name(request.node.name)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    delete_namespace_and_wait(core, name)


def delete_namespace_and_wait(core, name: str, timeout: float = 180) -> None:
    """Delete a test namespace and wait until it is gone, while the operator that holds its jobs'
    finalizers still runs: a job left behind would be counted by the next module's operator."""
    core.delete_namespace(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(name)
        except client.exceptions.ApiException as err:
            if err.status == 404:
                return
            raise
        time.sleep(1)
    raise AssertionError(f"namespace {name} still there {timeout:.0f} s after its deletion (a finalizer not released?)")


def namespace_name(test: str) -> str:
    """`e2e-` and the test's name as a DNS label: parameters kept (test_x[trainjob] -> e2e-test-x-trainjob),
    a long name cut and given a hash of the whole, so that each test and parameter gets its own."""
    slug = re.sub(r"[^a-z0-9]+", "-", test.lower()).strip("-")
    if len(slug) > 54:
        slug = slug[:45].rstrip("-") + "-" + hashlib.sha256(test.encode()).hexdigest()[:8]
    return f"e2e-{slug}"


# ---- the operator and its inputs (tests/e2e/jobs.py has the helpers) ---------------------------

@pytest.fixture(scope="module")
def s3(control_plane):
    env = control_plane.env()
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:  # a second module reuses it
        s3.create_bucket(Bucket=BUCKET)
    return s3


@pytest.fixture(scope="module")
def inputs_in_s3(s3, tmp_path_factory):
    """The tiny SD1.5 and a captions data set, uploaded the way a user would stage them."""
    root = tmp_path_factory.mktemp("inputs")
    for local, prefix in ((write_tiny_model("sd15", root / "model"), "models/sd15"),
                          (write_tiny_data("captions", root / "data", count=8, size=32), "data/shapes")):
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local)}")
    return {"model": f"s3://{BUCKET}/models/sd15", "data": f"s3://{BUCKET}/data/shapes"}


@pytest.fixture(scope="module", params=["pytorchjob", "trainjob"])
def backend(request) -> str:
    """The backend the module's operator runs jobs with: every test that installs the operator runs
    once with PyTorchJobs (Training Operator v1.9) and once with TrainJobs (Trainer v2.3 + JobSet)."""
    return request.param


@pytest.fixture(scope="module")
def operator_release(control_plane, backend):
    """`helm install` the chart with BACKEND; the operator runs as a pod. One release per test module
    and backend."""
    install_chart(control_plane, backend)
    yield "kubetune"
    uninstall_chart(control_plane)


def install_chart(control_plane, backend: str, *extra_values: str, webhook_namespace: str = "default") -> None:
    """`helm install` the e2e release (helm_values for BACKEND, then EXTRA_VALUES) and wait for it, and
    for its webhook to answer for WEBHOOK_NAMESPACE (one the operator serves)."""
    env = control_plane.env()
    installed = subprocess.run(
        ["helm", "install", "kubetune", str(REPO / "charts" / "kubetune"), "-n", OPERATOR_NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "180s", *helm_values(env, backend), *extra_values],
        env={**os_env(), **env}, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    if "webhook.enabled=false" not in extra_values:
        wait_for_the_webhook(control_plane, webhook_namespace)


def wait_for_the_webhook(control_plane, namespace: str) -> None:
    """Until the API server gets the webhook's verdict on a job in NAMESPACE.

    `helm install --wait` waits for the operator pod to be Ready, which the process kubelet says as
    soon as the container runs (it runs no probes), before the operator serves: a test applying a
    job at once would be admitted on the schema alone (failurePolicy Ignore). The probe is a dry run
    the webhook only warns about (a GPU of 1Gi cannot hold the job), so it counts no refusal in the
    operator's metrics.
    """
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["spec"]["resources"]["gpuMemory"] = "1Gi"
    document = yaml.safe_dump(manifest)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        result = control_plane.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=document,
                                       check=False)
        if result.returncode == 0 and "FitsGpu:" in result.stderr:
            return
        time.sleep(1)
    pytest.fail(f"the admission webhook did not answer within 120 s of helm install: {result.stderr}")


def uninstall_chart(control_plane) -> None:
    subprocess.run(["helm", "uninstall", "kubetune", "-n", OPERATOR_NAMESPACE, "--wait"],
                   env={**os_env(), **control_plane.env()}, capture_output=True)


# Every trainer pod the e2e jobs start (generation and evaluation too) is a real container of our trainer image
# under the securityContext the operator renders: the dev cluster runs images of this registry in podman.
TRAINER_IMAGE = f"{REAL_IMAGE_REGISTRY}/kubetune/trainer:dev"
# The operator's pod is a real container of our operator image too.
OPERATOR_IMAGE_REPOSITORY = f"{REAL_IMAGE_REGISTRY}/kubetune/operator"


def helm_values(env: dict, backend: str) -> list[str]:
    """The chart values of the e2e release: local images (the trainer's run as containers) and S3, fast progress polls, BACKEND,
    Kueue's Workloads readable (this control plane runs Kueue), the webhook's Service on 8443,
    and one CPU requested per trainer process: the tests' machine has two cores and runs a second
    test worker beside the cluster, so each trainer process takes one CPU thread (cpu_threads)."""
    return ["--set", f"operator.image.repository={OPERATOR_IMAGE_REPOSITORY}", "--set", "operator.image.tag=dev",
            "--set", f"trainer.image={TRAINER_IMAGE}",
            "--set", f"s3.endpointUrl={env['AWS_ENDPOINT_URL']}", "--set-string", "s3.pathStyle=true",
            "--set", f"s3.region={env['AWS_DEFAULT_REGION']}",
            "--set", "operator.progressIntervalSeconds=1", "--set", f"backend={backend}",
            "--set", "kueue.enabled=true", "--set-string", "trainer.defaultRequests.cpuPerProcess=1",
            # The kubelet's service proxy listens on the Service's port as whoever runs the tests:
            # an unprivileged port, so it needs no root.
            "--set", "webhook.servicePort=8443"]


@pytest.fixture
def job_namespace(control_plane, core, namespace):
    """The test namespace plus the S3 credentials Secret the jobs reference."""
    env = control_plane.env()
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-credentials"}, "stringData": {
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"]}})
    return namespace
