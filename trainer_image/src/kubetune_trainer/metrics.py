"""Prometheus metrics of the main training process, served on KUBETUNE_METRICS_ADDR:PORT.

The operator reads these gauges for `status.progress`; Prometheus scrapes them for dashboards.
Labels are the job's namespace and name only: nothing secret, nothing unbounded.
"""
from __future__ import annotations

import os

PREFIX = "kubetune_trainer"


class TrainerMetrics:
    def __init__(self, namespace: str, job: str, port: int | None, addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        labels = ["namespace", "job"]

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", text, labels, registry=self.registry).labels(namespace, job)

        self.step = gauge("step", "Optimizer steps done.")
        self.planned_steps = gauge("planned_steps", "Optimizer steps the run will take.")
        self.loss = gauge("loss", "Training loss of the latest step (mean over processes).")
        self.learning_rate = gauge("learning_rate", "Learning rate of the latest step.")
        self.samples_per_second = gauge("samples_per_second", "Training samples per second, all processes.")
        self.eta_seconds = gauge("eta_seconds", "Estimated seconds until the last step.")
        self.last_checkpoint_step = gauge("last_checkpoint_step", "Step of the newest complete checkpoint.")
        self.server = None
        if port is not None:
            self.server, _thread = start_http_server(port, addr=addr, registry=self.registry)

    @classmethod
    def from_env(cls, fallback_job: str) -> "TrainerMetrics":
        port = os.environ.get("KUBETUNE_METRICS_PORT")
        return cls(
            namespace=os.environ.get("KUBETUNE_NAMESPACE", ""),
            job=os.environ.get("KUBETUNE_JOB_NAME", fallback_job),
            port=int(port) if port else None,
            addr=os.environ.get("KUBETUNE_METRICS_ADDR", "0.0.0.0"),
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
