"""A real S3 server (versitygw, built by devcluster/build.sh) on loopback, for storage tests.

A server that cannot start fails the tests (in CI and out of it), naming what fixes it.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import time
import urllib.request

import pytest

from kubetune_api.ports import free_listen_port
from kubetune_trainer.storage import s3


def unavailable(reason: str):
    pytest.fail(reason)


class S3Server:
    """versitygw on a fixed loopback port and directory, so it can be stopped and started again."""

    def __init__(self, root, access: str, secret: str):
        from kubetune_dev import versions

        try:
            self.binary = versions.binary("versitygw")
        except versions.MissingBinary as err:
            unavailable(f"no S3 server: {err}")
        self.root, self.access, self.secret = root, access, secret
        self.port = free_listen_port()
        self.process = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> None:
        """Start on self.port. The first time, if another server took the port meanwhile (a
        concurrent test session), move to a free one; a restart must keep its address."""
        first = self.process is None
        for _ in range(5 if first else 1):
            if self._launch():
                return
            self.port = free_listen_port() if first else self.port
        unavailable("the S3 server did not start (its port was taken?)")

    def _launch(self) -> bool:
        """True once this server answers; False if it exited (a port already taken)."""
        self.process = subprocess.Popen(
            [str(self.binary), "--access", self.access, "--secret", self.secret, "--region", "us-east-1",
             "--port", f"127.0.0.1:{self.port}", "posix", str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while self.process.poll() is None:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
            except urllib.error.HTTPError:
                pass  # it answers (403 without credentials)
            except OSError:
                if time.monotonic() > deadline:
                    self.process.kill()
                    unavailable("the S3 server did not answer within 30 s")
                time.sleep(0.1)
                continue
            time.sleep(0.3)  # whoever answered, this process must still be alive to be the one
            return self.process.poll() is None
        return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def use_server(server: S3Server):
    """Point this process (and the trainers it starts) at the server; put everything back after."""
    saved = {key: os.environ.get(key) for key in server.settings}
    os.environ.update(server.settings)
    s3.forget_clients()
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    s3.forget_clients()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A server for the whole session, with fresh credentials."""
    server = S3Server(tmp_path_factory.mktemp("s3"), "kt" + secrets.token_hex(6), secrets.token_hex(16))
    server.start()
    yield from use_server(server)
    server.stop()


@pytest.fixture
def own_s3_server(tmp_path_factory):
    """A server of the test's own, which it may stop and start again (the session's keeps running)."""
    server = S3Server(tmp_path_factory.mktemp("own-s3"), "kt" + secrets.token_hex(6), secrets.token_hex(16))
    server.start()
    yield from use_server(server)
    if server.process.poll() is None:
        server.stop()


@pytest.fixture
def bucket(s3_server, request) -> str:
    return new_bucket(request)


def new_bucket(request) -> str:
    name = "t-" + request.node.name.replace("_", "-").lower()[:40].strip("-") + "-" + secrets.token_hex(3)
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def mlflow_server(s3_server, tmp_path_factory):
    """A local MLflow tracking server (kubetune_dev.mlflow_server) for the session: runs in SQLite,
    artifacts served through it into s3://<bucket>/mlflow on the session's S3 server (whose
    credentials only the MLflow server gets)."""
    from kubetune_dev.mlflow_server import MlflowServer, MlflowServerError

    bucket = "mlflow-" + secrets.token_hex(4)
    s3.client().create_bucket(Bucket=bucket)
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), f"s3://{bucket}/mlflow", s3_server.endpoint,
                          s3_server.access, s3_server.secret)
    try:
        server.start()
    except MlflowServerError as err:
        unavailable(str(err))
    server.bucket = bucket
    yield server
    server.stop()
