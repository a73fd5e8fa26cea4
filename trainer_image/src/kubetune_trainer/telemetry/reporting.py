"""What a run tells people while it trains: a progress bar, log lines, TensorBoard events,
Prometheus metrics (kubetune_trainer.telemetry.metrics) and, with spec.tracking.mlflow, an MLflow run
(kubetune_trainer.telemetry.tracking: logged steps, validations and the final weights).

Only the main process reports; every method is a no-op elsewhere. Methods called from the
background upload thread (checkpoint_published, uploads_pending) touch only Prometheus metrics,
which are thread-safe.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

from kubetune_api.contract import TERMINATION_MESSAGE_PATH, TrainerLog, final_report

log = logging.getLogger("kubetune.trainer")


class Reporter:
    def __init__(self, enabled: bool, total_steps: int, start_step: int, log_dir: Path | None,
                 log_every: int, samples_per_step: int, namespace: str = "", job_name: str = "", tracker=None):
        self.enabled = enabled
        self.tracker = tracker if enabled else None  # kubetune_trainer.telemetry.tracking.MlflowTracker
        self.start_step = start_step
        self._started = time.perf_counter()
        self.metrics = None
        self.total_steps = total_steps
        self.log_every = log_every
        self.samples_per_step = samples_per_step
        self._last_time = time.perf_counter()
        self._bar = None
        self._writer = None
        # When each staged checkpoint's state was taken (time.time()), until it is complete: from then
        # on only the steps after it are unsaved.
        self._staged_at: dict[int, float] = {}
        self._pusher = None  # kubetune_trainer.telemetry.progress_push, where the operator runs an inbox
        if not enabled:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir))
        from kubetune_trainer.telemetry.metrics import TrainerMetrics

        self.metrics = TrainerMetrics.from_env(namespace, job_name)
        self.metrics.planned_steps.set(total_steps)
        self.metrics.step.set(start_step)
        self.metrics.unsaved_since.set(time.time())  # work is unsaved from here on
        from kubetune_trainer.telemetry.progress_push import ProgressPusher

        self._pusher = ProgressPusher.from_env(namespace, job_name, self.metrics.readings)
        if self._pusher is not None:
            self._pusher.start()

    def step(self, step: int, loss: float, lr: float, epoch: int, ended: float | None = None) -> None:
        """Step `step` is done; `ended`: when the host finished queuing it (time.time()), where its
        numbers are read later than that (step_readout), so that rates and event times are the step's."""
        if not self.enabled:
            return
        wall = ended if ended is not None else time.time()
        now = time.perf_counter() - (time.time() - wall)
        step_seconds, self._last_time = now - self._last_time, now
        samples_per_second = self.samples_per_step / step_seconds if step_seconds > 0 else 0.0
        seconds_per_step = (now - self._started) / max(1, step - self.start_step)
        eta = seconds_per_step * (self.total_steps - step)
        self.metrics.step.set(step)
        self.metrics.epoch.set(epoch)
        self.metrics.loss(loss)
        self.metrics.learning_rate.set(lr)
        self.metrics.samples_per_second.set(samples_per_second)
        self.metrics.eta_seconds.set(eta)
        self.metrics.step_duration.observe(step_seconds)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if self._writer is not None:
            self._writer.add_scalar("train/loss", loss, step, walltime=wall)
            self._writer.add_scalar("train/lr", lr, step, walltime=wall)
            self._writer.add_scalar("train/samples_per_second", samples_per_second, step, walltime=wall)
        if step % self.log_every == 0 or step == self.total_steps:
            log.info(TrainerLog.STEP, step, self.total_steps, loss, lr,
                     samples_per_second)
            if self.tracker is not None:  # queued: sent in batches by the tracker's thread
                self.tracker.log_metrics(step, {"train/loss": loss, "train/lr": lr})

    def phase(self, name: str, seconds: float) -> None:
        """Time one part of a step took (kubetune_trainer.telemetry.metrics.PHASES)."""
        if self.enabled:
            self.metrics.phase_seconds[name].inc(seconds)

    @contextmanager
    def timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phase(phase, time.perf_counter() - started)

    def run_version(self, version: int) -> None:
        if self.enabled:
            self.metrics.run_version.set(version)

    def pods(self, pods: list[str]) -> None:
        """The pod (host) of each node in node order, for joining GPU exporters' per-pod series."""
        if self.enabled:
            self.metrics.pods(pods)

    def samples_skipped(self, count: int) -> None:
        """Bad samples left out of the run (spec.data.skipBad)."""
        if self.enabled:
            self.metrics.samples_skipped.set(count)
            if count:
                log.warning("%d bad sample(s) skipped (spec.data.skipBad)", count)

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """The metrics of the validation at `step` (none without held-out data), for status.validation."""
        if self.enabled and metrics:
            self.metrics.validation(step, metrics)
            if self.tracker is not None:
                self.tracker.log_metrics(step, {f"validation/{name}": value for name, value in metrics.items()})

    def gpu_memory(self, per_rank: list[tuple[int, int]]) -> None:
        if self.enabled:
            self.metrics.gpu_memory(per_rank)

    def resumed_own_checkpoint(self, step: int) -> None:
        """A restarted attempt continues this run's own newest checkpoint: it is the run's newest complete
        one (written by an earlier attempt, at a time not known here: the time gauge stays 0). Not for a
        start from another run's checkpoint, which is not in this run's directory."""
        if self.enabled:
            self.metrics.last_checkpoint_step.set(step)

    def checkpoint_saved(self, step: int, seconds: float) -> None:
        """Staged for writing (training waited `seconds` for it; writing and uploading go on behind)."""
        self._staged_at[step] = time.time() - seconds
        if self.enabled:
            self.metrics.checkpoint_save.observe(seconds)

    def checkpoint_published(self, step: int, upload_seconds: float | None, size_bytes: int) -> None:
        """Complete where the run's checkpoints live; upload_seconds is None for local storage."""
        if not self.enabled:
            return
        self.metrics.checkpoint_size.set(size_bytes)
        if upload_seconds is not None:
            self.metrics.checkpoint_upload.observe(upload_seconds)
            self.metrics.checkpoint_uploaded_bytes.inc(size_bytes)
        self.metrics.last_checkpoint_step.set(step)
        self.metrics.last_checkpoint_time.set(time.time())
        self.metrics.unsaved_since.set(self._staged_at.pop(step, time.time()))

    def uploads_pending(self, count: int) -> None:
        if self.enabled:
            self.metrics.uploads_pending.set(count)

    def flush(self) -> None:
        """Write buffered TensorBoard events to disk (before the logs are uploaded)."""
        if self._writer is not None:
            self._writer.flush()

    def samples(self, files: list[Path], root: Path) -> None:
        """A validation's sample files (under root/samples/): uploaded to the MLflow run as they come."""
        if self.tracker is not None:
            self.tracker.log_artifacts(files, root / "samples", under="samples")

    def final_weights(self, files: list[Path], root: Path) -> None:
        """The run's final weights (files under root): uploaded to the MLflow run when it ends."""
        if self.tracker is not None:
            self.tracker.log_artifacts(files, root)

    def write_final_report(self, path: Path = Path(TERMINATION_MESSAGE_PATH)) -> bool:
        """Leave the final gauges in the pod's termination message (contract.final_report), which
        Kubernetes keeps in the pod's status after the process exits: the operator reads them there
        when its last poll came before the end. Whether it was written (kubetune_trainer.process.termination
        says where it is)."""
        from kubetune_trainer.process.termination import write_termination_message

        return self.metrics is not None and write_termination_message(final_report(self.metrics.readings()), path)

    def await_final_read(self, seconds: float | None) -> None:
        """Push the final metrics to the operator's progress inbox, where it runs one; else (or when
        that fails) wait up to SECONDS for the operator to read them (kubetune_trainer.telemetry.metrics_server);
        nothing to wait for without a metrics server or a time (a run outside the operator)."""
        if self._pusher is not None and seconds and self._pusher.push_final():
            log.info("the operator has the final metrics (pushed to its progress inbox)")
            return
        server = self.metrics.server if self.metrics is not None else None
        if server is None or not seconds:
            return
        started = time.perf_counter()
        if server.wait_for_operator_read(seconds):
            log.info("the operator read the final metrics (%.1f s)", time.perf_counter() - started)
        else:
            log.warning("the operator did not read the final metrics within %.0f s: the TrainingJob's status "
                        "may show an earlier step, loss or validation than the run's last", seconds)

    def message(self, text: str, *args) -> None:
        if self.enabled:
            log.info(text, *args)

    def close(self, status: str = "FINISHED", wait: bool = True, timeout: float | None = None) -> None:
        """Ends the bar and the event file; the metrics keep serving until the process exits, so
        the last values (final step, checkpoint) can still be scraped. The MLflow run ends with
        STATUS (FINISHED, FAILED, KILLED) once its last values and weights are sent: WAIT waits
        for that (at most TIMEOUT); without it the sending goes on behind the caller."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.tracker is not None:
            self.tracker.close(status, wait=wait, timeout=timeout)
            if wait:
                self.tracker = None
        if wait and self._pusher is not None:  # the last close: no more pushes
            self._pusher.stop()
            self._pusher = None
