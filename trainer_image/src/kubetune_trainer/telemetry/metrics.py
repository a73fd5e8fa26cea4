"""Prometheus metrics of the main training process, served on TrainerEnv.metrics_addr:metrics_port.

The operator reads these for `status.progress`; Prometheus scrapes them for the dashboard
(charts/kubetune/dashboards). Every series carries the TrainingJob's namespace and name as
`trainingjob_namespace` / `trainingjob`: Prometheus attaches its own `job` and `namespace` target
labels, and a metric label of the same name would be renamed to exported_*. Nothing secret and
nothing unbounded goes into a label (rank and pod are bounded by the job's size).
"""
from __future__ import annotations

import os
from collections import deque

from kubetune_api.contract import RECENT_LOSS_STEPS, TRAINER_METRIC_PREFIX, VALIDATION_METRICS, TrainerEnv, TrainerGauge

PREFIX = TRAINER_METRIC_PREFIX
PHASES = ("data_wait", "forward_backward", "optimizer", "checkpoint", "validation")
# Step times from a tiny CPU model (tens of ms) to a large model on many GPUs (a minute).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class TrainerMetrics:
    def __init__(self, namespace: str, job: str, port: int | None, addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from kubetune_trainer.telemetry.metrics_server import MetricsServer

        self.registry = CollectorRegistry()
        job_labels = ["trainingjob_namespace", "trainingjob"]
        values = (namespace, job)

        def gauge(name: str, text: str, extra: tuple[str, ...] = ()):
            metric = Gauge(f"{PREFIX}_{name}", text, job_labels + list(extra), registry=self.registry)
            return metric if extra else metric.labels(*values)

        def unset_gauge(name: str, text: str):
            """A gauge that serves no sample until labels(*values) sets it."""
            return Gauge(f"{PREFIX}_{name}", text, job_labels, registry=self.registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...]):
            return Histogram(f"{PREFIX}_{name}", text, job_labels, buckets=buckets,
                             registry=self.registry).labels(*values)

        self.step = gauge(TrainerGauge.STEP, "Optimizer steps done.")
        self.planned_steps = gauge(TrainerGauge.PLANNED_STEPS, "Optimizer steps the run will take.")
        self.epoch = gauge("epoch", "Passes over the training data started (0-based).")
        # Absent until this process's first step: a resumed run starts at step N with no loss yet,
        # and a 0 there would read as a loss (status.progress.loss, a sweep's objective).
        self._loss = Gauge(TrainerGauge.full_name(TrainerGauge.LOSS), "Training loss of the latest step (mean over processes).", job_labels,
                           registry=self.registry)
        self._recent_loss = Gauge(TrainerGauge.full_name(TrainerGauge.RECENT_LOSS),
                                  f"Mean training loss of the latest {RECENT_LOSS_STEPS} steps of this process "
                                  "(a sweep's training-loss objective).", job_labels, registry=self.registry)
        self._recent_losses: deque[float] = deque(maxlen=RECENT_LOSS_STEPS)
        self.learning_rate = gauge("learning_rate", "Learning rate of the latest step.")
        self.samples_per_second = gauge("samples_per_second", "Training samples per second, all processes.")
        self.eta_seconds = gauge(TrainerGauge.ETA_SECONDS, "Estimated seconds until the last step.")
        self.run_version = gauge(TrainerGauge.RUN_VERSION, "N of this run's directory <checkpoints.uri>/<namespace>/<job>/v<N>.")
        self.step_duration = histogram("step_duration_seconds", "Wall time of one optimizer step.", STEP_BUCKETS)
        phase_seconds = Counter(f"{PREFIX}_step_phase_seconds", "Time spent per phase of the training steps "
                                "(rate() / steps = the step-time breakdown).", job_labels + ["phase"],
                                registry=self.registry)
        self.phase_seconds = {phase: phase_seconds.labels(*values, phase) for phase in PHASES}
        self._gpu_allocated = gauge("gpu_memory_allocated_bytes", "GPU memory held by tensors, per rank "
                                    "(0 on the CPU).", ("rank",))
        self._gpu_reserved = gauge("gpu_memory_reserved_bytes", "GPU memory reserved by the caching allocator, "
                                   "per rank (0 on the CPU).", ("rank",))
        self._pod_info = gauge("pod_info", "1 for each pod of the run (join trainer_pod to DCGM's pod label).",
                               ("trainer_pod", "node_rank"))
        self.last_checkpoint_step = gauge(TrainerGauge.LAST_CHECKPOINT_STEP, "Step of the newest complete checkpoint "
                                          "(uploaded, when checkpoints go to S3).")
        self.last_checkpoint_time = gauge(TrainerGauge.LAST_CHECKPOINT_TIME, "When the newest complete checkpoint "
                                          "was written (Unix seconds; 0: the one this run resumed from).")
        self.unsaved_since = gauge(TrainerGauge.UNSAVED_SINCE, "Since when this run's work is unsaved (Unix "
                                   "seconds): the newest complete checkpoint's state, or the start of training.")
        self.checkpoint_size = gauge("checkpoint_size_bytes", "Size of the newest complete checkpoint.")
        self.samples_skipped = gauge("samples_skipped", "Bad samples left out of the run (spec.data.skipBad).")
        self.checkpoint_save = histogram("checkpoint_save_duration_seconds", "Time training waits while a "
                                         "checkpoint is staged (copied to CPU memory; written and uploaded behind).",
                                         CHECKPOINT_BUCKETS)
        self.checkpoint_upload = histogram("checkpoint_upload_duration_seconds", "Time one checkpoint takes to "
                                           "upload in the background, retries included.", CHECKPOINT_BUCKETS)
        self.checkpoint_uploaded_bytes = Counter(f"{PREFIX}_checkpoint_uploaded_bytes", "Checkpoint bytes uploaded.",
                                                 job_labels, registry=self.registry).labels(*values)
        self.uploads_pending = gauge("checkpoint_uploads_pending", "Uploads queued or in flight.")
        # Absent until the first validation: a gauge with its labels set reads 0 at once, which the
        # operator would copy into status.validation as a result.
        self._validation_step = unset_gauge(TrainerGauge.VALIDATION_STEP, "Step of the latest validation.")
        self._validation = {name: unset_gauge(TrainerGauge.validation(name), f"Validation {name} at the latest "
                                              "validation (kubetune_trainer_validation_step).")
                            for name in VALIDATION_METRICS}
        self._values = values
        self.server = MetricsServer(self.registry, port, addr) if port is not None else None

    def gpu_memory(self, per_rank: list[tuple[int, int]]) -> None:
        """(allocated, reserved) bytes for each rank, in rank order."""
        for rank, (allocated, reserved) in enumerate(per_rank):
            self._gpu_allocated.labels(*self._values, str(rank)).set(allocated)
            self._gpu_reserved.labels(*self._values, str(rank)).set(reserved)

    def loss(self, value: float) -> None:
        """The latest step's loss, and the mean of the latest RECENT_LOSS_STEPS (a resumed run's first
        steps average what this process trained: the earlier attempt's losses went with it)."""
        self._loss.labels(*self._values).set(value)
        self._recent_losses.append(value)
        self._recent_loss.labels(*self._values).set(sum(self._recent_losses) / len(self._recent_losses))

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """The latest validation's results; a metric outside VALIDATION_METRICS gets no gauge."""
        for name, value in metrics.items():
            if name in self._validation:
                self._validation[name].labels(*self._values).set(value)
        self._validation_step.labels(*self._values).set(step)

    def pods(self, pods: list[str]) -> None:
        """The pod of each node, in node-rank order."""
        for node_rank, pod in enumerate(pods):
            self._pod_info.labels(*self._values, pod, str(node_rank)).set(1)

    def readings(self) -> dict[str, float]:
        """Every sample as the operator's read of /metrics keys it: the name without the prefix
        (labels dropped: one job's series)."""
        return {sample.name.removeprefix(f"{PREFIX}_"): sample.value
                for family in self.registry.collect() if family.name.startswith(f"{PREFIX}_")
                for sample in family.samples}

    @classmethod
    def from_env(cls, namespace: str, job: str) -> "TrainerMetrics":
        """Served only when TrainerEnv.metrics_port is set (the operator sets it for the master pod)."""
        env = TrainerEnv.from_env(os.environ)
        return cls(namespace=namespace, job=job, port=env.metrics_port, addr=env.metrics_addr or "0.0.0.0")
