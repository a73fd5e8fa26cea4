"""The local control plane, brought up once for every e2e test and taken down at the end.

Under CI (CI=true) a control plane that cannot start fails the tests that need it; elsewhere
they are skipped with the reason (usually: run `bash devcluster/build.sh` first).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from kubernetes import client, config

from kubetune_dev.cluster import Cluster


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
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
        reason = f"the local control plane did not start: {e}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
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
    """A fresh namespace per test, named after it."""
    name = "e2e-" + request.node.name.replace("_", "-").lower()[:50].strip("-")
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)
