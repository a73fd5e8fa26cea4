"""`kubetune checkpoints ls|pull` on a job directory (the s3:// and cluster paths: tests/storage, tests/e2e)."""
from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from kubetune_cli.main import cli
from tests.trainer.conftest import run_dir, run_trainer, tiny_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_sd15, captions_data):
    """A job with two runs: v0 finished at step 4, v1 killed (as if) after its checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("runs")
    manifest = tiny_manifest(tiny_sd15, captions_data, tmp / "out", maxSteps=4)
    run_trainer(manifest, tmp)
    # A second run of the same manifest writes what the first wrote, under v1: copied, not trained again.
    unfinished = run_dir(tmp / "out", 1)
    shutil.copytree(run_dir(tmp / "out", 0), unfinished)
    (unfinished / "pytorch_lora_weights.safetensors").unlink()
    (unfinished / "run.json").write_text('{"runId": null, "steps": 3, "finished": false}')
    return tmp / "out" / "default" / "tiny"


def kubetune(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_ls_lists_every_run_with_its_complete_checkpoints_and_final_weights(job_dir):
    result = kubetune("checkpoints", "ls", str(job_dir))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("v0  (finished)")
    assert any(line.split()[:2] == ["2", "0"] for line in lines), "checkpoint-2, epoch 0"
    final = next(line for line in lines if line.strip().startswith("final"))
    assert "pytorch_lora_weights.safetensors" in final and "job.yaml" not in final, "final weights, not the records"
    v1 = lines.index(next(line for line in lines if line.startswith("v1")))
    assert "3 steps recorded, not finished" in lines[v1]
    assert not any(line.strip().startswith("final") for line in lines[v1:]), "an unfinished run has no final weights"


def test_pull_fetches_a_verified_checkpoint_or_the_final_weights(job_dir, tmp_path):
    result = kubetune("checkpoints", "pull", str(job_dir), "--version", "0", "--step", "2", "-o", str(tmp_path / "c2"))
    assert result.exit_code == 0, result.output
    assert "pulled checkpoint-2 of" in result.output
    assert load_file(tmp_path / "c2" / "pytorch_lora_weights.safetensors")
    assert (tmp_path / "c2" / "state" / ".metadata").is_file(), "the whole checkpoint, resumable"
    assert (tmp_path / "c2" / "manifest.json").is_file()

    result = kubetune("checkpoints", "pull", str(job_dir), "--version", "0", "--step", "final", "-o", str(tmp_path / "f"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "f" / "pytorch_lora_weights.safetensors").is_file()

    result = kubetune("checkpoints", "pull", str(job_dir), "-o", str(tmp_path / "newest"))
    assert "pulled checkpoint-4 of" in result.output and "/v1" in result.output, "latest of the newest run"


@pytest.mark.parametrize("args, message", [
    (["--step", "3"], "has no complete checkpoint-3; it has checkpoints at steps 2, 4, no final weights"),
    (["--step", "final"], "has no final weights (the run has not finished); it has checkpoints at steps 2, 4: "
                          "use --step N or latest"),
    (["--step", "newest"], "--step 'newest': use a step number, latest or final"),
    (["--version", "7"], "--version 7: no such run; there are v0, v1"),
])
def test_pull_refuses_what_is_not_there_naming_the_option(job_dir, tmp_path, args, message):
    result = kubetune("checkpoints", "pull", str(job_dir), *args, "-o", str(tmp_path / "x"))
    assert result.exit_code == 2
    assert message in result.output


def test_each_run_records_the_trainingjob_it_trained(job_dir):
    """job.yaml: what generate, export, evaluate and report read to rebuild the run's model."""
    from kubetune_cli.runs import resolve
    from kubetune_cli.trained import choose_run, read_job

    job = read_job("generate", choose_run("generate", resolve(str(job_dir), None), 0))
    assert job.metadata.name == "tiny" and job.spec.training.max_steps == 4
    assert job.spec.model.family == "sd15"


def test_an_empty_or_unknown_location_is_reported(tmp_path):
    result = kubetune("checkpoints", "ls", str(tmp_path / "nothing"))
    assert result.exit_code == 2 and "nothing was written there yet" in result.output
