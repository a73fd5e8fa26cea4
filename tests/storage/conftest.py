"""A real S3 server (versitygw, built by devcluster/build.sh) on loopback, for storage tests.

Under CI (CI=true) a server that cannot start fails the tests; elsewhere they are skipped.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
import urllib.request

import pytest

from kubetune_trainer.storage import s3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Start versitygw with fresh credentials; point this process's AWS settings at it."""
    from kubetune_dev import versions

    try:
        binary = versions.binary("versitygw")
    except versions.MissingBinary as err:
        unavailable(f"no S3 server: {err}")
    root = tmp_path_factory.mktemp("s3")
    port = free_port()
    access, secret = "kt" + secrets.token_hex(6), secrets.token_hex(16)
    process = subprocess.Popen(
        [str(binary), "--access", access, "--secret", secret, "--region", "us-east-1",
         "--port", f"127.0.0.1:{port}", "posix", str(root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break  # it answers (403 without credentials): up
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                unavailable("the S3 server did not start")
            time.sleep(0.1)
    settings = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    s3.client.cache_clear()
    yield settings
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    s3.client.cache_clear()
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def bucket(s3_server, request) -> str:
    name = "t-" + request.node.name.replace("_", "-").lower()[:40].strip("-") + "-" + secrets.token_hex(3)
    s3.client().create_bucket(Bucket=name)
    return name
