"""One answer to how a process of the trainer image ends on an exception: the trainer and the models
stage print the same line and exit with the same code a restart policy reads (2 final, 3 diverged,
143 retry, the CLI's table for the environment), and an error nothing knows keeps its traceback."""
from __future__ import annotations

import errno
import os
import signal

import pytest
import yaml

from kubetune_trainer.models import hub_stage
from kubetune_trainer.errors import ConfigError, InputsInFlux, TrainingDiverged
from kubetune_trainer.process.exit_answer import exit_answer
from kubetune_trainer.process.preemption import Preempted, StopRequest


@pytest.mark.parametrize("error, code, message", [
    (ConfigError("spec.data.uri: no images"), 2, "spec.data.uri: no images"),
    (FileNotFoundError("spec.model.pretrained: /m has no model_index.json"), 2,
     "spec.model.pretrained: /m has no model_index.json"),
    (TrainingDiverged(7, float("nan")), 3, "training diverged: step 7 gave a loss of nan"),
    (InputsInFlux("spec.model.pretrained: re-uploaded"), 143, "spec.model.pretrained: re-uploaded"),
    (Preempted(4), 143, "stopped by SIGTERM after step 4; the last checkpoint holds it"),
    (RuntimeError("[gloo] Connection reset by peer"), 143,
     "another process of the job is gone ([gloo] Connection reset by peer); stopping so that the job can restart"),
    (RuntimeError("Broken pipe (os error 28)"), 1, "no room left"),  # a full disk is not a lost peer
    (PermissionError(errno.EACCES, "Permission denied", "/ckpt"), 1, "/ckpt: Permission denied: check its permissions"),
])
def test_each_error_gets_its_exit_code_and_one_line(error, code, message):
    found = exit_answer(error)
    assert found.code == code and message in found.message and "\n" not in found.message


def test_an_error_nothing_knows_is_left_to_its_traceback():
    assert exit_answer(ValueError("a bug")) is None
    assert exit_answer(ValueError("a bug"), StopRequest()) is None, "no stop was requested"


@pytest.fixture
def stopped():
    """A stop request that came (SIGTERM) while the training loop defers it."""
    stop = StopRequest().install()
    stop.defer()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested()
        yield stop
    finally:
        stop.uninstall()


def test_after_a_stop_request_any_failure_is_the_stop(stopped):
    try:
        try:
            raise Preempted(None, "SIGTERM")
        except Preempted:
            raise RuntimeError("Failed to import diffusers.pipelines")  # a library's wrapper of our Preempted
    except RuntimeError as wrapped:
        found = exit_answer(wrapped, stopped)
    assert (found.code, found.message) == (143, "stopped by SIGTERM before training started; nothing to save yet")

    found = exit_answer(ValueError("half torn down"), stopped)
    assert (found.code, found.message) == (143, "stopped by SIGTERM (ValueError on the way out)")
    assert exit_answer(ConfigError("spec.data.uri: no images"), stopped).code == 2, "the job's own fault still is"


@pytest.fixture
def models_stage(example_manifest, tmp_path, monkeypatch, capsys):
    """models_stage(error): what `python -m kubetune_trainer.models.hub_stage` exits with, and prints, when placing fails so."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(example_manifest))

    def run(error: BaseException) -> tuple[int, str]:
        def fail(*_, **__):
            raise error
        monkeypatch.setattr(hub_stage, "place_hub_models", fail)
        code = hub_stage.main(["--config", str(config)])
        return code, capsys.readouterr().err
    return run


@pytest.mark.parametrize("error, code, message", [
    (ConfigError("spec.model.pretrained: org/m is gated"), 2, "spec.model.pretrained: org/m is gated"),
    (InputsInFlux("spec.model.pretrained: cannot reach the hub"), 143, "spec.model.pretrained: cannot reach the hub"),
    (PermissionError(errno.EACCES, "Permission denied", "/cache/hub"), 1,
     "/cache/hub: Permission denied: check its permissions"),
])
def test_the_models_stage_answers_as_the_trainer_does(models_stage, error, code, message):
    assert models_stage(error) == (code, f"kubetune models: {message}\n")
    found = exit_answer(error)
    assert (found.code, found.message) == (code, message), "the trainer's answer to the same error"


def test_the_models_stage_keeps_the_traceback_of_a_bug(models_stage):
    with pytest.raises(ValueError, match="a bug"):
        models_stage(ValueError("a bug"))
