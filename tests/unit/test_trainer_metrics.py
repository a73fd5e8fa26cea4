"""The trainer's Prometheus metrics: what a step, a checkpoint and an upload report."""
from __future__ import annotations

import torch

from kubetune_api.contract import RECENT_LOSS_STEPS

from kubetune_trainer.telemetry.phase_clock import PhaseClock
from kubetune_trainer.telemetry.reporting import Reporter


def value(reporter: Reporter, name: str, **labels) -> float:
    labels = {"trainingjob_namespace": "team-a", "trainingjob": "demo", **labels}
    return reporter.metrics.registry.get_sample_value(name, labels)


def reporter() -> Reporter:
    return Reporter(True, total_steps=10, start_step=0, log_dir=None, log_every=1, samples_per_step=4,
                    namespace="team-a", job_name="demo")


def test_a_step_sets_progress_gauges_and_observes_its_duration():
    r = reporter()
    assert value(r, "kubetune_trainer_loss") is None, "no loss before a step (a resumed run at step N has none)"
    r.step(1, loss=0.5, lr=1e-4, epoch=0)
    r.step(2, loss=0.25, lr=2e-4, epoch=1)
    assert value(r, "kubetune_trainer_step") == 2
    assert value(r, "kubetune_trainer_epoch") == 1
    assert value(r, "kubetune_trainer_loss") == 0.25
    assert value(r, "kubetune_trainer_learning_rate") == 2e-4
    assert value(r, "kubetune_trainer_step_duration_seconds_count") == 2
    assert value(r, "kubetune_trainer_eta_seconds") >= 0
    r.close()


def test_the_recent_loss_is_the_mean_of_the_latest_steps_whichever_a_reader_catches():
    r = reporter()
    assert value(r, "kubetune_trainer_recent_loss") is None
    losses = [4.0, 2.0, 0.5, 0.5, 1.0, 1.0, 2.0]
    for step, loss in enumerate(losses, start=1):
        r.step(step, loss=loss, lr=1e-4, epoch=0)
        window = losses[max(0, step - RECENT_LOSS_STEPS):step]
        assert value(r, "kubetune_trainer_recent_loss") == sum(window) / len(window)
    assert RECENT_LOSS_STEPS < len(losses), "the window must have dropped the first losses"
    r.close()


def test_the_phase_clock_charges_each_phase_and_forgets_time_charged_elsewhere():
    r = reporter()
    clock = PhaseClock(r, torch.device("cpu"))
    clock.mark("data_wait")
    sum(range(200_000))
    clock.mark("forward_backward")
    clock.restart()
    clock.mark("optimizer")
    assert value(r, "kubetune_trainer_step_phase_seconds_total", phase="forward_backward") > \
        value(r, "kubetune_trainer_step_phase_seconds_total", phase="optimizer")
    with r.timed("checkpoint"):
        sum(range(200_000))
    assert value(r, "kubetune_trainer_step_phase_seconds_total", phase="checkpoint") > 0
    r.close()


def test_a_checkpoint_counts_as_the_latest_only_once_published():
    r = reporter()
    r.checkpoint_saved(10, seconds=0.5)
    assert value(r, "kubetune_trainer_last_checkpoint_step") == 0, "staged, not yet written and uploaded"
    assert value(r, "kubetune_trainer_checkpoint_save_duration_seconds_sum") == 0.5
    r.checkpoint_published(10, upload_seconds=2.0, size_bytes=1000)
    assert value(r, "kubetune_trainer_last_checkpoint_step") == 10
    assert value(r, "kubetune_trainer_checkpoint_size_bytes") == 1000
    assert value(r, "kubetune_trainer_checkpoint_upload_duration_seconds_sum") == 2.0
    assert value(r, "kubetune_trainer_checkpoint_uploaded_bytes_total") == 1000
    r.close()


def test_unsaved_work_starts_with_training_and_moves_to_a_checkpoint_state_once_it_is_complete():
    r = reporter()
    started = value(r, "kubetune_trainer_unsaved_since_seconds")
    assert started > 0 and value(r, "kubetune_trainer_last_checkpoint_time_seconds") == 0
    r.checkpoint_saved(10, seconds=0.5)
    assert value(r, "kubetune_trainer_unsaved_since_seconds") == started, "staged is not saved yet"
    r.checkpoint_published(10, upload_seconds=None, size_bytes=1)
    written, since = value(r, "kubetune_trainer_last_checkpoint_time_seconds"), value(r, "kubetune_trainer_unsaved_since_seconds")
    assert since != started and since <= written - 0.5, "unsaved since the checkpoint's state was taken, before its write"
    r.close()


def test_a_restarted_run_counts_its_own_starting_checkpoint_as_its_newest():
    r = Reporter(True, total_steps=10, start_step=6, log_dir=None, log_every=1, samples_per_step=4,
                 namespace="team-a", job_name="demo")
    assert value(r, "kubetune_trainer_last_checkpoint_step") == 0, "another run's checkpoint is not this run's"
    r.resumed_own_checkpoint(6)
    assert value(r, "kubetune_trainer_last_checkpoint_step") == 6
    assert value(r, "kubetune_trainer_last_checkpoint_time_seconds") == 0, "written by an earlier attempt"
    r.close()


def test_gpu_memory_is_per_rank_and_pods_are_listed_for_joins():
    r = reporter()
    r.gpu_memory([(1, 2), (3, 4)])
    r.pods(["job-master-0", "job-worker-0"])
    assert value(r, "kubetune_trainer_gpu_memory_reserved_bytes", rank="1") == 4
    assert value(r, "kubetune_trainer_pod_info", trainer_pod="job-worker-0", node_rank="1") == 1
    r.close()


def test_a_validation_sets_its_step_and_one_gauge_per_metric_none_before():
    r = reporter()
    assert value(r, "kubetune_trainer_validation_step") is None, "no result before the first validation"
    assert value(r, "kubetune_trainer_validation_loss") is None
    r.validation(4, {})  # no held-out data: nothing was measured
    assert value(r, "kubetune_trainer_validation_step") is None
    r.validation(5, {"loss": 0.25, "accuracy": 0.5, "f1": 0.4, "made_up": 1.0})
    r.validation(10, {"loss": 0.125, "accuracy": 0.75, "f1": 0.6})
    assert value(r, "kubetune_trainer_validation_step") == 10
    assert (value(r, "kubetune_trainer_validation_loss"), value(r, "kubetune_trainer_validation_accuracy"),
            value(r, "kubetune_trainer_validation_f1")) == (0.125, 0.75, 0.6)
    assert value(r, "kubetune_trainer_validation_clip_score") is None, "not reported: not served"
    names = {metric.name for metric in r.metrics.registry.collect()}
    assert "kubetune_trainer_validation_made_up" not in names, "a bounded set of names"
    r.close()


def test_other_processes_report_nothing():
    quiet = Reporter(False, 10, 0, None, 1, 4)
    quiet.step(1, 0.5, 1e-4, 0)
    quiet.checkpoint_published(1, 1.0, 10)
    quiet.validation(1, {"loss": 0.5})
    assert quiet.metrics is None
