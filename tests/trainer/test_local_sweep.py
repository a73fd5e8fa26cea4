"""`kubetune sweep -f SWEEP.yaml`: a TrainingSweep's trials trained on this machine, as a user
runs it: trials in parallel, each recorded with its parameters and objective, the best one's
weights retrievable, a clearly worse trial stopped by the median rule, a failing trial recorded
while the sweep goes on (and the sweep failing when too many do)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import warm_python
from tests.trainer.conftest import trainer_env

pytestmark = pytest.mark.slow


def write_sweep(tmp_path: Path, model: Path, data: Path, name: str, parameters: dict, **spec) -> Path:
    template = {"model": {"family": "sd15", "pretrained": str(model)},
                "adapter": {"type": "lora", "rank": 4},
                "data": {"layout": "captions", "uri": str(data), "resolution": 32},
                "training": {"maxSteps": 4, "batchSize": 2, "learningRate": 1e-2, "seed": 3},
                "checkpoints": {"uri": str(tmp_path / "runs"), "everySteps": 100},
                "resources": {"gpusPerNode": 0}}
    document = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": name},
                "spec": {"template": {"spec": template}, "parameters": parameters,
                         "objective": {"metric": "loss"}, **spec}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def kubetune_sweep(path: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-m", "kubetune_cli.main", "sweep", "-f", str(path),
                            "--workdir", str(tmp_path / "sweep"), *extra], env=trainer_env(), timeout=900)


def rows(table: str) -> list[tuple[int, str, str]]:
    """(trial, state, objective) of each row of the printed table."""
    return [(int(n), state, value) for n, state, value in re.findall(r"^\s+(\d+)\s+(\w+)\s+(\S+)\s", table, re.M)]


def test_a_random_sweep_runs_its_trials_two_at_a_time_and_names_the_best(tiny_sd15, captions_data, tmp_path):
    from kubetune_cli.main import cli
    from click.testing import CliRunner

    path = write_sweep(tmp_path, tiny_sd15, captions_data, "lr",
                       {"training.learningRate": {"logUniform": [1e-4, 5e-2]}, "adapter.rank": {"choice": [2, 4]}},
                       algorithm="random", maxTrials=4, parallelTrials=2)
    result = kubetune_sweep(path, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    table = rows(result.stdout)
    assert [(n, state) for n, state, _ in table] == [(n, "succeeded") for n in range(4)], result.stdout
    assert len({value for _, _, value in table}) == 4, "four different trials"
    started = [line for line in result.stderr.splitlines() if " started: " in line]
    finished = [i for i, line in enumerate(result.stderr.splitlines()) if "succeeded" in line]
    assert len(started) == 4 and finished, result.stderr
    assert result.stderr.splitlines().index(started[1]) < finished[0], "the second trial started beside the first"

    best = re.search(r"best: trial (\d+) \(loss ([0-9.e-]+)\).*weights in (\S+)", result.stdout)
    assert best, result.stdout
    assert float(best.group(2)) == min(float(value) for _, _, value in table)
    pulled = CliRunner().invoke(cli, ["checkpoints", "pull", str(Path(best.group(3)).parent), "--step", "final",
                                      "-o", str(tmp_path / "best")])
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "best" / "pytorch_lora_weights.safetensors").is_file()


def test_the_median_rule_stops_a_clearly_worse_trial(tiny_sd15, captions_data, tmp_path):
    """Over a minute: three 20-step trials one after another; the rule judges a trial only once two others have a
    value at its step, and it must be seen stopping the bad one before its end."""
    # A strong offset noise makes the loss far higher at every step: the median rule must stop it.
    # Three trials: the rule judges a trial once two others have a value at its step.
    path = write_sweep(tmp_path, tiny_sd15, captions_data, "offset",
                       {"training.noiseOffset": {"choice": [0.0, 0.0, 0.9]}}, algorithm="grid", maxTrials=3,
                       earlyStopping={"rule": "median", "minSteps": 2})
    manifest = yaml.safe_load(path.read_text())
    manifest["spec"]["template"]["spec"]["training"]["maxSteps"] = 20
    path.write_text(yaml.safe_dump(manifest))
    result = kubetune_sweep(path, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    table = rows(result.stdout)
    assert [state for _, state, _ in table] == ["succeeded", "succeeded", "stopped"], result.stdout
    assert "trial 2 stopped: stopped by the median rule" in result.stderr
    steps = re.findall(r"step (\d+)/20", (tmp_path / "sweep" / "offset-2.log").read_text())
    assert steps and int(steps[-1]) < 20, "stopped before its last step"
    assert re.search(r"best: trial [01]\b", result.stdout), result.stdout


def test_a_failing_trial_is_recorded_and_the_sweep_goes_on_unless_too_many_fail(tiny_sd15, captions_data, tmp_path):
    missing = str(tmp_path / "nowhere" / "default" / "x" / "v0" / "checkpoint-3")
    parameters = {"checkpoints.resumeFrom": {"choice": [missing, "latest"]}}
    tolerant = write_sweep(tmp_path, tiny_sd15, captions_data, "tolerant", parameters, algorithm="grid",
                           maxTrials=2, maxFailedFraction=0.5)
    result = kubetune_sweep(tolerant, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [state for _, state, _ in rows(result.stdout)] == ["failed", "succeeded"], result.stdout
    assert "trial 0 failed: " in result.stderr and "checkpoint-3" in result.stderr

    strict = write_sweep(tmp_path, tiny_sd15, captions_data, "strict", parameters, algorithm="grid",
                         maxTrials=2, maxFailedFraction=0.0)
    result = kubetune_sweep(strict, tmp_path)
    assert result.returncode == 1
    assert "sweep failed: 1 of 2 trials failed, more than spec.maxFailedFraction 0.0" in result.stdout
    assert [state for _, state, _ in rows(result.stdout)] == ["failed"], "no trial started after that"


def test_pbt_copies_the_stronger_trials_checkpoint_into_the_weaker_line(tiny_sd15, captions_data, tmp_path):
    # Two members, two generations of 3 steps: after generation 0 the weaker member (the one with
    # offset noise, whose loss is far higher) continues from the stronger one's checkpoint-3.
    path = write_sweep(tmp_path, tiny_sd15, captions_data, "pbt",
                       {"training.noiseOffset": {"choice": [0.0, 0.9]}}, algorithm="pbt", maxTrials=4,
                       parallelTrials=2, pbt={"stepsPerGeneration": 3, "quantile": 0.5, "resampleProbability": 0})
    manifest = yaml.safe_load(path.read_text())
    manifest["spec"]["seed"] = next(seed for seed in range(100) if _pbt_draws_both_offsets(manifest, seed))
    path.write_text(yaml.safe_dump(manifest))
    result = kubetune_sweep(path, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [state for _, state, _ in rows(result.stdout)] == ["succeeded"] * 4, result.stdout
    copied = re.findall(r"trial (\d) started \(copies trial (\d)\)", result.stderr)
    assert len(copied) == 1, result.stderr
    weak, strong = int(copied[0][0]), int(copied[0][1])
    assert weak in (2, 3) and strong in (0, 1)
    assert f"trial {strong} started: training.noiseOffset=0," in result.stderr, "the low-loss member is the strong one"
    log = (tmp_path / "sweep" / f"pbt-{weak}.log").read_text()
    strong_run = tmp_path / "runs" / "default" / f"pbt-{strong}" / "v0"
    assert f"resumed from {strong_run / 'checkpoint-3'} at step 3" in log, log[-2000:]
    assert re.findall(r"step (\d+)/6", log)[-1] == "6", "generation 1 trains to step 2 x 3"


def _pbt_draws_both_offsets(manifest: dict, seed: int) -> bool:
    """Whether generation 0 of the sweep gets one member with each offset (so one is clearly weaker)."""
    from kubetune_api.search import next_trial
    from kubetune_api.sweep import TrainingSweep

    spec = TrainingSweep.model_validate({**manifest, "spec": {**manifest["spec"], "seed": seed}}).spec
    first = next_trial(spec, [])
    second = next_trial(spec, [first])
    return first.parameters["training.noiseOffset"] != second.parameters["training.noiseOffset"]
