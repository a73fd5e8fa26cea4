"""The local control plane, brought up once for every e2e test and taken down at the end.

Under CI (CI=true) a control plane that cannot start fails the tests that need it; elsewhere
they are skipped with the reason (usually: run `bash devcluster/build.sh` first).
"""
from __future__ import annotations

import os

import pytest
from kubernetes import client, config

from kubetune_dev.cluster import Cluster


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
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
