"""`kubetune evaluate` on one tiny classifier run (shared by the module): the held-out split the run
trained without, or another folder of the job's layout; predictions.csv, metrics.json and
confusion_matrix.png agree with each other and with the model; bad input is one line, nothing written.
Generating families: everything up to the generation call (generate_for), which is not wired yet."""
from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from PIL import Image

from kubetune_cli.main import cli
from tests.trainer.conftest import family_job, run_dir, run_trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory, tiny_model, tiny_dataset):
    """A finished 4-step LoRA classifier run (checkpoints at 2 and 4) holding out a quarter of its data,
    keeping its best validation by recall: (its job directory, the trainer's log)."""
    tmp = tmp_path_factory.mktemp("classifier-run")
    manifest = family_job("classifier", "image-folder", tiny_model("classifier"), tiny_dataset("image-folder"),
                          tmp / "out", training={"maxSteps": 4},
                          validation={"everySteps": 2, "heldOutFraction": 0.25, "monitor": "recall", "keepBest": 1})
    result = run_trainer(manifest, tmp)
    return tmp / "out" / "default" / "tiny", result.stderr


@pytest.fixture(scope="module")
def classifier_job(classifier_run):
    return classifier_run[0]


def kubetune(*args: str):
    return CliRunner().invoke(cli, ["evaluate", *args], catch_exceptions=False)


def read_predictions(out) -> list[dict]:
    with open(out / "predictions.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_evaluate_scores_the_held_out_split_the_run_trained_without(classifier_job, tmp_path):
    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.families import family_for
    from kubetune_trainer.families.base import training_and_held_out

    out = tmp_path / "eval"
    result = kubetune(str(classifier_job), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "evaluated final weights of" in result.output and "accuracy" in result.output

    rows = read_predictions(out)
    spec = TrainingJob.model_validate(yaml.safe_load((run_dir(classifier_job.parent.parent) / "job.yaml")
                                                     .read_text())).spec
    family = family_for("classifier")(spec, torch.device("cpu"), torch.float32)
    _, held_out = training_and_held_out(spec, family.read_samples(), family.screen)
    assert sorted(row["path"] for row in rows) == sorted(family.sample_name(s) for s in held_out), \
        "exactly the held-out images, named as the split names them"
    assert {row["label"] for row in rows} <= {"circle", "square"}
    assert all(row["label"] == row["path"].split("/")[0] for row in rows), "the label is the class folder"
    assert all(0.5 <= float(row["confidence"]) <= 1 for row in rows), "two classes: the top one has >= 1/2"

    metrics = json.loads((out / "metrics.json").read_text())
    right = sum(row["label"] == row["prediction"] for row in rows)
    assert metrics["accuracy"] == pytest.approx(right / len(rows))
    assert metrics["samples"] == len(rows)
    counts = metrics["confusion_matrix"]["counts"]
    assert sum(map(sum, counts)) == len(rows) and counts[0][0] + counts[1][1] == right
    assert all(0 <= metrics[name] <= 1 for name in ("precision", "recall", "f1"))
    assert set(metrics["per_class"]) == {"circle", "square"}
    assert Image.open(out / "confusion_matrix.png").size[0] > 100


def test_the_confidences_are_the_trained_models_own(classifier_job, tmp_path, tiny_model):
    """What transformers computes with the base model and the run's adapter (its own load_adapter)."""
    import numpy as np
    from transformers import AutoModelForImageClassification

    out = tmp_path / "eval"
    assert kubetune(str(classifier_job), "--out", str(out)).exit_code == 0
    rows = read_predictions(out)
    model = AutoModelForImageClassification.from_pretrained(tiny_model("classifier")).eval()
    model.load_adapter(str(run_dir(classifier_job.parent.parent)))
    root = yaml.safe_load((run_dir(classifier_job.parent.parent) / "job.yaml").read_text())["spec"]["data"]["uri"]
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(f"{root}/{row['path']}").convert("RGB"),
                                                      dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
                          for row in rows])  # 32-pixel images, the model's size; its mean and std are 0.5
    with torch.no_grad():
        probabilities = model(pixel_values=pixels).logits.softmax(-1)
    classes = ["circle", "square"]  # the class folders, sorted
    assert [classes[int(i)] for i in probabilities.argmax(-1)] == [row["prediction"] for row in rows]
    assert probabilities.max(-1).values.tolist() == pytest.approx([float(r["confidence"]) for r in rows], abs=1e-5)


def test_the_predictions_are_the_trained_models_and_move_with_the_step(classifier_job, tmp_path, tiny_dataset):
    """--data: every image of another folder; checkpoint-2 and the final weights predict differently."""
    data = tiny_dataset("image-folder")
    confidences = {}
    for step in ("2", "final"):
        out = tmp_path / step
        result = kubetune(str(classifier_job), "--data", str(data), "--step", step, "--out", str(out))
        assert result.exit_code == 0, result.output
        rows = read_predictions(out)
        assert len(rows) == len(list(data.glob("*/*.png")))
        confidences[step] = [float(row["confidence"]) for row in rows]
    assert confidences["2"] != confidences["final"], "other weights, other predictions"


def test_precision_and_recall_are_macro_averages_of_one_definition():
    from kubetune_trainer.results.classification_metrics import classification_metrics, report

    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    predicted = torch.tensor([0, 0, 1, 1, 2, 2])
    # class 0: P 2/2 R 2/3; class 1: P 1/2 R 1/2; class 2: P 1/2 R 1/1; class 3 absent: left out
    metrics = classification_metrics(predicted, labels, 4)
    assert metrics["precision"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert metrics["recall"] == pytest.approx((2 / 3 + 0.5 + 1) / 3)
    assert metrics["f1"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert metrics["accuracy"] == pytest.approx(4 / 6)
    described = report(predicted, labels, ["a", "b", "c", "d"])
    assert described["per_class"]["a"] == pytest.approx({"precision": 1, "recall": 2 / 3, "f1": 0.8, "support": 3})
    assert described["confusion_matrix"]["counts"][0] == [2, 1, 0, 0]


def test_a_classifier_may_monitor_precision_or_recall(classifier_run):
    import re

    job_dir, log = classifier_run
    assert re.search(r"validation at step 2: loss [\d.]+, accuracy [\d.]+, precision [\d.]+, recall [\d.]+, f1",
                     log), log[-2000:]
    [best] = [json.loads(p.read_text()) for p in (job_dir / "v0" / "best").glob("step-*/metric.json")]
    assert best["metric"] == "recall"


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--step", "3"], "--step 3: {run} has no complete checkpoint-3; it has checkpoints at steps 2, 4 and final weights"),
    (["--step", "soon"], "--step 'soon': use a step number, latest or final"),
    (["--version", "2"], "--version 2: no such run; there are v0"),
])
def test_a_step_or_run_that_does_not_exist_is_one_line(classifier_job, tmp_path, args, message):
    result = kubetune(str(classifier_job), *args, "--out", str(tmp_path / "x"))
    assert result.exit_code == 2
    assert result.output.strip() == f"kubetune evaluate: {message.format(run=classifier_job / 'v0')}"
    assert not (tmp_path / "x").exists()


def test_a_run_with_no_final_weights_names_the_steps_it_has(classifier_job, tmp_path):
    unfinished = tmp_path / "job"
    shutil.copytree(classifier_job, unfinished)
    (unfinished / "v0" / "adapter_model.safetensors").unlink()
    (unfinished / "v0" / "run.json").write_text('{"runId": null, "steps": 4, "finished": false}')
    result = kubetune(str(unfinished), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2
    assert "has no final weights (the run has not finished); it has checkpoints at steps 2, 4" in result.output


def test_data_not_in_the_jobs_layout_is_refused_naming_data(classifier_job, tmp_path, tiny_dataset):
    result = kubetune(str(classifier_job), "--data", str(tiny_dataset("captions")), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2
    assert f"--data {tiny_dataset('captions')}: not a folder in the job's layout image-folder" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x").exists()

    other = tmp_path / "other"
    for name in ("circle", "triangle"):
        (other / name).mkdir(parents=True)
        shutil.copy(next(tiny_dataset("image-folder").glob("circle/*.png")), other / name / "a.png")
    result = kubetune(str(classifier_job), "--data", str(other), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "class folders ['triangle'] are not classes the model was trained on" \
        in result.output


def test_an_out_that_is_a_file_or_not_empty_is_refused_and_left_alone(classifier_job, tmp_path):
    a_file = tmp_path / "results"
    a_file.write_text("keep")
    result = kubetune(str(classifier_job), "--out", str(a_file))
    assert result.exit_code == 2 and f"--out {a_file} exists as a file" in result.output
    assert a_file.read_text() == "keep"

    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.json").write_text("keep")
    result = kubetune(str(classifier_job), "--out", str(full))
    assert result.exit_code == 2 and "is not empty: give a new folder, or pass --force" in result.output
    assert (full / "metrics.json").read_text() == "keep"

    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    (full / "predictions.csv").symlink_to(outside)
    result = kubetune(str(classifier_job), "--out", str(full), "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((full / "metrics.json").read_text())["samples"] > 0, "--force replaces what evaluate writes"
    assert outside.read_text() == "keep", "a link is replaced, never written through"
    assert not (full / "predictions.csv").is_symlink()


# ---- generating families ------------------------------------------------------------------------

@pytest.fixture
def sd15_job(sd15_run):
    """The session's finished 2-step sd15 run (a quarter of its captions held out): its job folder."""
    return run_dir(sd15_run[1]).parent


def test_a_generating_family_is_scored_on_images_its_trained_weights_draw(sd15_job, tmp_path):
    """Through kubetune generate's module: each held-out caption drawn once, with a seed of its own, the
    same figures every time (SSIM alone without a CLIP model)."""
    scored = []
    for attempt in ("a", "b"):
        result = kubetune(str(sd15_job), "--out", str(tmp_path / attempt))
        assert result.exit_code == 0, result.output
        with open(tmp_path / attempt / "scores.csv", newline="") as file:
            scored.append(list(csv.DictReader(file)))
    assert len(scored[0]) == 2, "a quarter of the 8 captioned images is held out"
    assert scored[0] == scored[1], "the same weights, the same seeds: the same images and scores"
    assert all(-1 <= float(row["ssim"]) < 0.999 for row in scored[0]), "a drawn image is not its reference"
    images = [Image.open(tmp_path / "a" / "images" / f"{i:04d}.png") for i in range(2)]
    assert images[0].tobytes() != images[1].tobytes(), "each sample its own caption and seed"


def test_a_model_that_is_not_clip_is_refused_before_anything_is_generated(sd15_job, tiny_sd15, tmp_path):
    result = kubetune(str(sd15_job), "--out", str(tmp_path / "x"), "--clip-model", str(tiny_sd15))
    assert result.exit_code == 2
    assert result.output.startswith(f"kubetune evaluate: --clip-model: cannot load a CLIP model from {tiny_sd15}")
    assert not (tmp_path / "x").exists()


def test_a_generating_family_scores_each_generated_image_against_its_held_out_image(sd15_job, tiny_clip, tmp_path,
                                                                                   monkeypatch):
    """With a stand-in generation: the held-out images themselves, the first one blurred."""
    from PIL import ImageFilter

    from kubetune_trainer.results import run_evaluation
    from kubetune_trainer.families.base import reference_path

    given = {}

    def stand_in(job, weights, samples, device):
        given.update(family=job.spec.model.family, weights=sorted(p.name for p in weights.iterdir()),
                     samples=samples)
        images = [Image.open(reference_path(sample)).convert("RGB") for sample in samples]
        return [images[0].filter(ImageFilter.GaussianBlur(2)), *images[1:]]

    monkeypatch.setattr(run_evaluation, "generate_for", stand_in)
    out = tmp_path / "scored"
    result = kubetune(str(sd15_job), "--out", str(out), "--clip-model", str(tiny_clip))
    assert result.exit_code == 0, result.output
    assert given["family"] == "sd15" and given["weights"] == ["pytorch_lora_weights.safetensors"]
    assert len(given["samples"]) == 2, "a quarter of the 8 captioned images is held out"

    with open(out / "scores.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["prompt"] for row in rows] == [sample.caption for sample in given["samples"]]
    assert float(rows[0]["ssim"]) < 0.99 and float(rows[1]["ssim"]) == pytest.approx(1), "blurred, the same"
    assert float(rows[1]["clip_image"]) == pytest.approx(1, abs=1e-5), "an image is its own CLIP twin"
    assert all(-1 <= float(row["clip_text"]) <= 1 for row in rows)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["ssim"] == pytest.approx((float(rows[0]["ssim"]) + float(rows[1]["ssim"])) / 2, abs=1e-5)
    assert metrics["samples"] == 2 and metrics["clip_model"] == str(tiny_clip)
    assert sorted(p.name for p in (out / "images").iterdir()) == ["0000.png", "0001.png"]


def test_an_edit_is_scored_by_validations_clip_directional_against_its_control(tiny_clip, tmp_path):
    """Edit pairs gain clip_directional per pair, the same figure validation logs (its mean); an edit that
    returns the control image unchanged has no direction (0)."""
    from kubetune_trainer.data.edit_pairs import read_edit_pairs
    from kubetune_trainer.data.screening import Screen
    from kubetune_trainer.results.evaluation import ClipScorer
    from kubetune_trainer.results.run_evaluation import score_generated
    from kubetune_trainer.data.tiny_data import write_tiny_data

    pairs = read_edit_pairs(write_tiny_data("edit-pairs", tmp_path / "pairs", count=2, size=32), Screen(False))
    controls = [Image.open(pair.controls[0]).convert("RGB") for pair in pairs]
    edited = [Image.open(pairs[0].target).convert("RGB"), controls[1]]
    clip = ClipScorer(str(tiny_clip), torch.device("cpu"))
    files = score_generated(edited, pairs, clip, {})
    rows = list(csv.DictReader(files["scores.csv"].decode().splitlines()))
    assert float(rows[1]["clip_directional"]) == pytest.approx(0, abs=1e-6), "no edit, no direction"
    assert -1 <= float(rows[0]["clip_directional"]) <= 1 and float(rows[0]["clip_directional"]) != 0
    validation = clip.clip_directional(controls, edited, [pair.instruction for pair in pairs])
    assert json.loads(files["metrics.json"])["clip_directional"] == pytest.approx(validation, abs=1e-6)


def test_a_video_familys_clips_are_scored_frame_by_frame_against_the_held_out_clips(tiny_model, tiny_dataset,
                                                                                     tiny_clip, tmp_path):
    """Wan draws one clip per held-out clip with saved weights (evaluate's own generation), each scored
    against its held-out clip's frames and written as an .mp4; the held-out clip itself scores SSIM 1."""
    import av

    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.results import run_evaluation
    from kubetune_trainer.results.clip_evaluation import reference_frames
    from kubetune_trainer.results.evaluation import ClipScorer
    from kubetune_trainer.results.generation import Generator
    from kubetune_trainer.results.sample_clips import Clip

    job = TrainingJob.model_validate(family_job(
        "wan", "video-captions", tiny_model("wan"), tiny_dataset("video-captions"), tmp_path / "out",
        data={"frames": 5}, validation={"heldOutFraction": 0.25, "numInferenceSteps": 1}))
    samples = run_evaluation.generation_samples(job.spec, None)
    assert len(samples) == 2, "a quarter of the 8 clips is held out"
    trained = Generator(job, "cpu").family
    noise = torch.Generator().manual_seed(1)
    trained.save_weights(tmp_path / "weights", {name: param.detach() + 0.1 * torch.randn(param.shape, generator=noise)
                                                for name, param in trained.trainable_module.named_parameters()
                                                if param.requires_grad})
    generated = run_evaluation.generate_for(job, tmp_path / "weights", samples, torch.device("cpu"))
    assert [len(made.frames) for made in generated] == [5, 5] and all(isinstance(made, Clip) for made in generated)

    clip = ClipScorer(str(tiny_clip), torch.device("cpu"))
    files = run_evaluation.score_generated(generated, samples, clip, {}, job.spec.data.fps)
    rows = list(csv.DictReader(files["scores.csv"].decode().splitlines()))
    assert [row["prompt"] for row in rows] == [sample.caption for sample in samples]
    assert all(row["frames"] == "5" and -1 <= float(row["ssim"]) < 0.999 for row in rows), "drawn, not copied"
    assert all(-1 <= float(row[metric]) <= 1 for row in rows for metric in ("clip_image", "clip_text"))
    assert sorted(name for name in files if name.startswith("clips/")) == [
        "clips/0000.gif", "clips/0000.mp4", "clips/0001.gif", "clips/0001.mp4"]
    (tmp_path / "0.mp4").write_bytes(files["clips/0000.mp4"])
    with av.open(str(tmp_path / "0.mp4")) as container:
        assert len(list(container.decode(video=0))) == 5

    itself = Clip(reference_frames(samples[0].path, 5, job.spec.data.fps))
    metrics = json.loads(run_evaluation.score_generated([itself], samples[:1], clip, {}, None)["metrics.json"])
    assert metrics["ssim"] == pytest.approx(1) and metrics["clip_image"] == pytest.approx(1, abs=1e-5)


def test_a_checkpoint_without_ready_weights_loads_from_its_sharded_state(classifier_job, tmp_path):
    """A full fine-tune's checkpoint holds only its sharded state: the same weights as the adapter beside it."""
    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.families import family_for

    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(classifier_job / "v0" / "checkpoint-2", checkpoint)
    spec = TrainingJob.model_validate(yaml.safe_load((classifier_job / "v0" / "job.yaml").read_text())).spec
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def confidence(weights):
        family = family_for("classifier")(spec, torch.device("cpu"), torch.float32)
        return family.predict(family.load_trained(weights), pixels)[1]

    from_adapter = confidence(checkpoint)
    (checkpoint / "adapter_model.safetensors").unlink()
    assert torch.allclose(confidence(checkpoint), from_adapter)
    untrained = family_for("classifier")(spec, torch.device("cpu"), torch.float32)
    assert not torch.allclose(untrained.predict(untrained.trainable.module.eval(), pixels)[1], from_adapter), \
        "the weights were loaded, not left as they started"


def test_files_are_written_beside_their_place_and_renamed_never_through_a_link(tmp_path):
    from kubetune_trainer.results.run_evaluation import write_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "images").symlink_to(elsewhere, target_is_directory=True)
    write_files(out, {"images/0000.png": b"new", "metrics.json": b"{}"})
    assert (out / "images" / "0000.png").read_bytes() == b"new" and not (out / "images").is_symlink()
    assert list(elsewhere.iterdir()) == [], "nothing written through the link"
    assert sorted(p.name for p in out.iterdir()) == ["images", "metrics.json"], "no partial file left"
