"""Rank 0 pushes its progress to the operator's inbox (kubetune_operator.progress_inbox).

Once per interval, a daemon thread POSTs the gauges the operator would otherwise read from
/metrics (contract.final_report's JSON) to TrainerEnv.progress_url; the operator then needs no GET
per running job per interval. Never in the way of training: the thread only reads the Prometheus
registry (thread-safe), a failed push is logged once (the operator falls back to its poll) and the
next interval tries again.

Each push leaves from the pod's own address (TrainerEnv.metrics_addr, the downward API's podIP):
the inbox accepts a job's pushes only from its rank-0 pod's address. In a cluster that is the
source address anyway; where pods share one network (the local control plane's 127.x.y.z pods) the
kernel would otherwise pick 127.0.0.1.
"""
from __future__ import annotations

import http.client
import logging
import os
import threading
from typing import Callable
from urllib.parse import urlsplit

from kubetune_api.contract import TrainerEnv, final_report, progress_path

log = logging.getLogger("kubetune.trainer")
TIMEOUT_SECONDS = 3.0


class ProgressPusher:
    def __init__(self, url: str, interval: float, readings: Callable[[], dict[str, float]],
                 source_address: str | None = None) -> None:
        self.url, self.interval, self._readings = url, interval, readings
        self._source = (source_address, 0) if source_address and source_address != "0.0.0.0" else None
        self._stopped = threading.Event()
        self._failing = False
        self._pushed = False
        self._thread = threading.Thread(target=self._run, name="progress-push", daemon=True)

    @classmethod
    def from_env(cls, namespace: str, job: str, readings: Callable[[], dict[str, float]]) -> "ProgressPusher | None":
        """A pusher where the operator gave an inbox (and this job's name), else None."""
        env = TrainerEnv.from_env(os.environ)
        if not (env.progress_url and env.progress_interval_seconds and namespace and job):
            return None
        url = env.progress_url.rstrip("/") + progress_path(namespace, job)
        return cls(url, env.progress_interval_seconds, readings, source_address=env.metrics_addr)

    def start(self) -> "ProgressPusher":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (a push under way finishes behind the caller)."""
        self._stopped.set()

    def push_final(self) -> bool:
        """End the thread and push the final gauges now; whether the operator took them."""
        self.stop()
        return self.push()

    def push(self) -> bool:
        url = urlsplit(self.url)
        try:
            connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=TIMEOUT_SECONDS,
                                                    source_address=self._source)
            try:
                connection.request("POST", url.path, body=final_report(self._readings()).encode(),
                                   headers={"Content-Type": "application/json"})
                status = connection.getresponse().status
            finally:
                connection.close()
            if status >= 300:
                raise OSError(f"HTTP {status}")
        except (OSError, http.client.HTTPException) as err:  # refused, unreachable, not accepted: the operator polls
            if not self._failing:
                log.warning("progress push to %s failed (the operator reads /metrics instead): %s", self.url, err)
            self._failing = True
            return False
        if self._failing or not self._pushed:
            log.info("progress pushed to %s", self.url)
        self._failing, self._pushed = False, True
        return True

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.push()
