"""A local MLflow tracking server (`mlflow server`) for spec.tracking.mlflow, on loopback.

Runs and metrics go to a SQLite database in the server's directory; artifacts (a run's final
weights) go to S3 through the server: with --serve-artifacts an experiment's artifact location
is mlflow-artifacts:/, so a trainer uploads its artifacts to the server over HTTP and only the
server holds S3 credentials (given to its process alone, never to the trainers).

    server = MlflowServer(tmp_dir, "s3://bucket/mlflow", s3_endpoint, access_key, secret_key)
    server.start()      # returns once /health answers
    ... MlflowClient(server.uri) ...
    server.stop()
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kubetune_api.ports import free_listen_port

START_SECONDS = 180  # a fresh SQLite store runs its schema migrations first (a minute on a busy 2-core machine)


class MlflowServerError(RuntimeError):
    """The server did not start; the message ends with the tail of its log."""


class MlflowServer:
    """`mlflow server` on 127.0.0.1:<free port> in a process group of its own (its workers are
    children of the command), stopped by signalling that group only."""

    def __init__(self, root: Path, artifacts_destination: str, s3_endpoint: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, region: str = "us-east-1"):
        self.root = Path(root)
        self.artifacts_destination = artifacts_destination
        self.s3_endpoint, self.access_key, self.secret_key, self.region = s3_endpoint, access_key, secret_key, region
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "mlflow-server.log"

    def server_env(self) -> dict[str, str]:
        """The server's environment: S3 settings for its artifact store, for this process alone."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("AWS_", "MLFLOW_"))}  # nothing of the caller's S3 or MLflow set-up
        if self.s3_endpoint:
            env["MLFLOW_S3_ENDPOINT_URL"] = self.s3_endpoint
            env["MLFLOW_BOTO_CLIENT_ADDRESSING_STYLE"] = "path"  # an IP endpoint has no virtual hosts
        if self.access_key:
            env["AWS_ACCESS_KEY_ID"] = self.access_key
            env["AWS_SECRET_ACCESS_KEY"] = self.secret_key or ""
        env["AWS_DEFAULT_REGION"] = self.region
        # MLflow 3's server-side jobs (a huey consumer per job type: seven Python processes importing
        # MLflow, ~25 s of start-up each on the test machine) serve features nothing of ours calls.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        return env

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                "--serve-artifacts", "--artifacts-destination", self.artifacts_destination,
                "--workers", "1"]

    def start(self, timeout: float = START_SECONDS) -> None:
        """Start on a free port and return once /health answers; MlflowServerError otherwise."""
        self.root.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # another process may take the free port before the server binds it
            self.port = free_listen_port()
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                                env=self.server_env(), cwd=self.root, start_new_session=True)
            if self._wait_healthy(timeout):
                return
            self.stop()
            if "already in use" not in self.log_tail():
                break
        raise MlflowServerError(f"the MLflow server did not answer {self.uri}/health within {timeout:.0f} s; "
                                f"its log ({self.log_path}) ends:\n{self.log_tail()}")

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM to the server's own process group (the command and its workers), SIGKILL if it lingers."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)  # the group start_new_session made: only what we started
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=timeout)
                _wait_group_gone(process.pid, timeout)
                break
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "MlflowServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Until no process of the group is left (the workers exit after their parent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise subprocess.TimeoutExpired(f"process group {pgid}", timeout)
