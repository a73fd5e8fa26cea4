"""`kubetune generate` on a real tiny SD1.5 run (final weights, base, --compare, a middle checkpoint, its
refusals), and validation at step 0: the base model first, recorded but never ranked. Every family's
drawing: test_generate_families.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file

from kubetune_cli.main import cli
from tests.trainer.conftest import VALIDATION_PROMPT as PROMPT
from tests.trainer.conftest import each_step_manifest as manifest
from tests.trainer.conftest import run_dir, run_trainer

pytestmark = pytest.mark.slow


@pytest.fixture
def trained(validated_sd15_run) -> Path:
    """Two steps, a checkpoint and a validation at each (the base's at step 0), the 3 best kept: the run's folder."""
    return validated_sd15_run


def kubetune(*args: str):
    return CliRunner().invoke(cli, ["generate", *map(str, args)], catch_exceptions=False)


def png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float32)


def test_validation_starts_with_the_base_model_and_does_not_rank_it(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert (trained / "samples" / "step-0000000" / "grid.png").is_file()
    events = EventAccumulator(str(trained / "logs")).Reload()
    assert [e.step for e in events.Scalars("validation/loss")] == [0, 1, 2]
    assert [e.step for e in events.Images("samples/grid")] == [0, 1, 2]
    kept = sorted(json.loads(p.read_text())["step"] for p in (trained / "best").glob("step-*/metric.json"))
    assert kept == [1, 2], "keepBest 3 keeps the run's validations, not the base's"


def test_validation_at_step_0_changes_no_trained_weight(trained, sd15_run, tiny_sd15, captions_data):
    """The session's shared run is this run never validated (and checkpointed at step 2 only)."""
    shared, out = sd15_run
    never_validated = manifest(tiny_sd15, captions_data, out)
    never_validated["spec"]["checkpoints"]["everySteps"] = 2
    assert shared["spec"] == never_validated["spec"], "the same model, data, split, seed and steps"
    assert not (run_dir(out) / "samples").exists()
    quiet = load_file(run_dir(out) / "pytorch_lora_weights.safetensors")
    validated = load_file(trained / "pytorch_lora_weights.safetensors")
    assert quiet.keys() == validated.keys()
    assert all((quiet[key] == validated[key]).all() for key in quiet), "bitwise the same training"


def test_a_resumed_run_does_not_validate_the_base_again(trained, tiny_sd15, captions_data, tmp_path):
    """A run that starts from a checkpoint (a restarted pod, or resumeFrom as here) starts past step 0."""
    resumed = manifest(tiny_sd15, captions_data, tmp_path / "out", everySteps=1, prompts=[PROMPT], numInferenceSteps=2)
    resumed["spec"]["checkpoints"]["resumeFrom"] = str(trained / "checkpoint-1")
    result = run_trainer(resumed, tmp_path)
    assert f"resumed from {trained / 'checkpoint-1'} at step 1" in result.stderr
    assert "validation at step 0" not in result.stderr
    assert sorted(p.name for p in (run_dir(tmp_path / "out") / "samples").iterdir()) == ["step-0000002"]


def test_generate_draws_the_final_weights_the_base_and_both_side_by_side(trained, tmp_path):
    result = kubetune(trained, "--steps", 2, "--out", tmp_path / "final")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["final-0.png", "grid.png"]
    with Image.open(tmp_path / "final" / "final-0.png") as image:
        assert image.text == {"prompt": PROMPT, "seed": "3", "index": "0", "step": "final", "family": "sd15",
                              "job": "tiny"}, "the job's validation prompt and seed by default"

    result = kubetune(trained, "--base", "--steps", 2, "--out", tmp_path / "base")
    assert result.exit_code == 0, result.output
    base = png(tmp_path / "base" / "base-0.png")
    assert np.abs(base - png(tmp_path / "final" / "final-0.png")).max() > 0, "the LoRA changes the image"
    assert np.abs(base - png(trained / "samples" / "step-0000000" / "0.png")).max() <= 2, \
        "the base is what validation drew at step 0 (same prompt, seed and steps)"

    result = kubetune(trained, "--compare", "--step", 1, "--prompt", PROMPT, "--prompt", "a blue square",
                      "--steps", 2, "--out", tmp_path / "compare")
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "compare").iterdir())
    assert names == ["base-0.png", "base-1.png", "grid.png", "step-1-0.png", "step-1-1.png"]
    assert np.array_equal(png(tmp_path / "compare" / "base-0.png"), base), "one base, whatever is compared"
    middle = png(tmp_path / "compare" / "step-1-0.png")
    assert np.abs(middle - base).max() > 0 and np.abs(middle - png(tmp_path / "final" / "final-0.png")).max() > 0
    with Image.open(tmp_path / "compare" / "grid.png") as grid, Image.open(tmp_path / "compare" / "base-0.png") as one:
        assert grid.height == 2 * one.height and grid.width > 2 * one.width, "two labelled rows of two"
        assert (png(tmp_path / "compare" / "grid.png")[:, grid.width - 2 * one.width:][one.height:]
                == np.concatenate([middle, png(tmp_path / "compare" / "step-1-1.png")], 1)).all()


def without_final_weights(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run as if it had died after its checkpoints."""
    copy = tmp_path / "unfinished" / "default" / "tiny" / "v0"
    shutil.copytree(trained, copy)
    (copy / "pytorch_lora_weights.safetensors").unlink()
    record = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**record, "finished": False}))
    return copy


@pytest.mark.parametrize("case, message", [
    ("step", "--step 7: "),
    ("unfinished", "has no final weights (the run has not finished); it has checkpoints at steps 1, 2"),
    ("control", "--control: sd15 generates from text alone, not from control images; drop --control"),
    ("file", "exists as a file: give a folder path"),
    ("full", "is not empty: give a new folder, or pass --force"),
    ("link", "is a symbolic link: kubetune never writes through one"),
])
def test_generate_refuses_in_one_line_and_writes_nothing(case, message, trained, tmp_path):
    out, args = tmp_path / "out", []
    job = trained
    if case == "step":
        args = ["--step", "7"]
    elif case == "unfinished":
        job = without_final_weights(trained, tmp_path)
    elif case == "control":
        (tmp_path / "c.png").write_bytes((trained / "samples" / "step-0000000" / "0.png").read_bytes())
        args = ["--prompt", "x", "--control", tmp_path / "c.png"]
    elif case == "file":
        out.write_text("keep me")
    elif case == "full":
        out.mkdir()
        (out / "final-0.png").write_text("keep me")
    elif case == "link":
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to(tmp_path / "elsewhere")
    before = sorted(p.name for p in tmp_path.rglob("*") if "unfinished" not in p.parts)
    result = kubetune(job, *args, "--out", out)
    assert result.exit_code == 2
    assert message in result.output and result.output.count("\n") == 1, result.output
    assert sorted(p.name for p in tmp_path.rglob("*") if "unfinished" not in p.parts) == before, "nothing written"
    if case in ("file", "full"):
        assert "keep me" in (out.read_text() if case == "file" else (out / "final-0.png").read_text())


def test_a_missing_or_unreadable_control_image_is_refused_before_loading(tmp_path):
    from kubetune_trainer.results.generation import GenerationError, Request, check_request

    (tmp_path / "broken.png").write_text("not an image")
    for path, said in [(tmp_path / "missing.png", "no such file"), (tmp_path / "broken.png", "not a readable image")]:
        with pytest.raises(GenerationError, match=f"--control {path}: {said}"):
            check_request("flux-kontext", Request(prompts=("make it blue",), controls=(path,)))
    with pytest.raises(GenerationError, match="give each --prompt its --control IMAGE"):
        check_request("qwen-image-edit", Request(prompts=("make it blue",)))
    with pytest.raises(GenerationError, match="classifier draws no images"):
        check_request("classifier", Request())


def test_the_pod_of_generate_on_cluster_draws_what_generate_draws_here(trained, tmp_path):
    """`python -m kubetune_trainer.results.generation_pod` (what the operator's generation Job runs) on the same run:
    the same images, named and labelled the same, in a new --out folder."""
    import os
    import subprocess
    import sys

    args = ["--step", "1", "--compare", "--prompt", PROMPT, "--prompt", "a blue square", "--steps", "2"]
    result = kubetune(trained, *args, "--out", tmp_path / "here")
    assert result.exit_code == 0, result.output
    pod = subprocess.run([sys.executable, "-m", "kubetune_trainer.results.generation_pod", "--run", str(trained), *args,
                          "--out", str(tmp_path / "pod")], capture_output=True, text=True, env=dict(os.environ))
    assert pod.returncode == 0, pod.stderr[-3000:]
    assert f"wrote 4 image(s) and grid.png into {tmp_path / 'pod'}" in pod.stdout
    names = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert sorted(p.name for p in (tmp_path / "pod").iterdir()) == names
    for name in names:
        assert np.array_equal(png(tmp_path / "pod" / name), png(tmp_path / "here" / name)), name
        with Image.open(tmp_path / "pod" / name) as drawn, Image.open(tmp_path / "here" / name) as here:
            assert drawn.text == here.text, name
    with Image.open(tmp_path / "pod" / "step-1-1.png") as image:
        assert (image.text["prompt"], image.text["step"], image.text["seed"]) == ("a blue square", "1", "3")


@pytest.mark.parametrize("args, message", [
    (["--step", "7"], "--step 7: "),
    (["--step", "latest"], "--step 'latest': use a step number, final or base"),
    (["--step", "final", "--prompt", "x"], "already holds files: give a new folder (nothing was overwritten)"),
])
def test_the_generation_pod_refuses_in_one_line_and_overwrites_nothing(args, message, trained, tmp_path, capsys):
    from kubetune_trainer.results.generation_pod import main

    out = tmp_path / "out"
    if "already" in message:
        out.mkdir()
        (out / "final-0.png").write_text("keep me")
    assert main(["--run", str(trained), *args, "--out", str(out), "--steps", "1"]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and message in said[0] and said[0].startswith("kubetune generate: "), said
    assert not out.exists() or [p.name for p in out.iterdir()] == ["final-0.png"]
    assert not out.exists() or (out / "final-0.png").read_text() == "keep me"
