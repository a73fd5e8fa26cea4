"""Metrics that say which LoRA is better (validation.py, evaluation.py): the held-out loss draws the
same noise for a sample at every validation; CLIP score (text-to-image) and CLIP directional
similarity (editing) are what their definitions say, repeat for the same weights and move with
them; they reach the validation log line, keepBest and refuse a CLIP model that is not one.

Validations run in process on the tiny models (kubetune_trainer.models.tiny_models), one run end to end."""
from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from kubetune_api.spec import TrainingJob
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.results.evaluation import ClipScorer
from kubetune_trainer.families import family_for
from kubetune_trainer.results.validation import Validator
from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure

pytestmark = pytest.mark.slow


def validator_for(manifest: dict, out):
    """The job's family on the CPU and a Validator over its held-out samples, writing under OUT."""
    spec = TrainingJob.model_validate(manifest).spec
    torch.manual_seed(0)
    family = family_for(spec.model.family)(spec, torch.device("cpu"), torch.float32)
    _, held_out = family.build_datasets()
    assert held_out is not None and len(held_out) > 0, "the test needs held-out samples"
    return family, Validator(spec, family, held_out, out, is_main=True)


def validate(family, validator, step: int) -> dict[str, float]:
    return validator.run(family.trainable_module, step, trained_state=dict)


def nudge(family) -> None:
    """Move every trained weight a little, as a training step would."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in family.trainable_parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)


def held_out_validation(**validation) -> dict:
    return {"everySteps": 1, "heldOutFraction": 0.25, **validation}


def test_the_held_out_split_is_the_same_wherever_the_data_set_lies(tiny_sd15, captions_data, tmp_path):
    # Each node copies or streams s3:// data to a directory of its own, and a restarted pod may get
    # another: a split that hashed absolute paths would differ between ranks and between restarts.
    def held_out_files(data) -> list[str]:
        manifest = family_job("sd15", "captions", tiny_sd15, data, tmp_path / "out", validation=held_out_validation())
        held_out = validator_for(manifest, tmp_path / "out")[1].held_out
        return sorted(sample.path.relative_to(data).as_posix() for sample in held_out.samples)

    elsewhere = tmp_path / "another" / "node" / "copy"
    shutil.copytree(captions_data, elsewhere)
    assert held_out_files(captions_data) == held_out_files(elsewhere)


def test_the_validation_loss_draws_the_same_noise_every_time_so_only_the_weights_move_it(
        tiny_sd15, captions_data, tmp_path):
    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          validation=held_out_validation())
    family, validator = validator_for(manifest, tmp_path / "out")
    first = validate(family, validator, 1)["loss"]
    torch.randn(1000)  # training moves the global random stream on between two validations
    assert validate(family, validator, 2)["loss"] == first, "the same weights, the same noise: the same loss"
    nudge(family)
    assert validate(family, validator, 3)["loss"] != first, "other weights, another loss"


# ---- the definitions ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shapes():
    """Two pairs of images: a shape, and the same shape in another colour (an edit)."""
    import random

    from kubetune_trainer.data.tiny_drawing import draw_shape

    def drawn(colour, shape, seed):
        return draw_shape(colour, shape, 32, random.Random(seed))
    return ([drawn("red", "circle", 0), drawn("blue", "square", 1)],
            [drawn("green", "circle", 0), drawn("yellow", "square", 1)])


def test_clip_score_is_100_times_the_clamped_cosine_of_image_and_prompt(tiny_clip, shapes):
    from transformers import CLIPModel, CLIPProcessor

    images, prompts = shapes[0], ["a red circle", "a blue square"]
    model, processor = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)
    with torch.no_grad():
        out = model(**processor(text=prompts, images=images, return_tensors="pt", padding=True))
    cosine = (out.image_embeds * out.text_embeds).sum(-1)  # CLIPModel's embeddings are unit vectors
    expected = (100 * cosine.clamp(min=0)).mean().item()
    score = ClipScorer(str(tiny_clip), torch.device("cpu")).clip_score(images, prompts)
    assert score == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert 0 <= score <= 100


def test_clip_directional_compares_the_image_change_with_the_instructions_direction(tiny_clip, shapes):
    from transformers import CLIPModel, CLIPProcessor

    controls, edited = shapes
    instructions = ["make the circle green", "make the square yellow"]
    model, processor = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)
    with torch.no_grad():
        before = model(**processor(text=[*instructions, ""], images=controls, return_tensors="pt", padding=True))
        after = model(**processor(text=[""], images=edited, return_tensors="pt", padding=True))
    text_direction = before.text_embeds[:2] - before.text_embeds[2:]
    expected = F.cosine_similarity(after.image_embeds - before.image_embeds, text_direction, dim=-1).mean().item()

    scorer = ClipScorer(str(tiny_clip), torch.device("cpu"))
    score = scorer.clip_directional(controls, edited, instructions)
    assert score == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert -1 <= score <= 1
    assert scorer.clip_directional(edited, controls, instructions) == pytest.approx(-score, abs=1e-6), \
        "undoing the edit goes the other way"
    assert scorer.clip_directional(controls, controls, instructions) == 0, "no change, no direction"


def test_kubetune_dev_tiny_clip_writes_a_clip_model_the_scorer_loads(tmp_path, shapes):
    from click.testing import CliRunner

    from kubetune_cli.main import cli

    result = CliRunner().invoke(cli, ["dev", "tiny-clip", "--out", str(tmp_path / "clip")])
    assert result.exit_code == 0, result.output
    score = ClipScorer(str(tmp_path / "clip"), torch.device("cpu")).clip_score(shapes[0][:1], ["a red circle"])
    assert 0 <= score <= 100


def test_a_clip_model_that_is_not_one_is_refused_naming_the_field(tiny_sd15):
    with pytest.raises(ConfigError, match=r"spec.validation.clipModel: cannot load a CLIP model from .*give a "
                                          r"transformers CLIP folder"):
        ClipScorer(str(tiny_sd15), torch.device("cpu"))  # a diffusers pipeline, not a CLIP model


def test_a_missing_local_clip_model_is_refused_before_training(tiny_sd15, captions_data, tmp_path):
    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          validation=held_out_validation(clipModel=str(tmp_path / "no-clip")))
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert f"spec.validation.clipModel: {tmp_path / 'no-clip'} does not exist" in stderr, stderr


# ---- at validation --------------------------------------------------------------------------------

def test_sd15_scores_its_held_out_captions_the_same_for_the_same_weights(captions_data, tiny_clip, tmp_path, caplog):
    # A model of its own, from a fixed seed: the shared tiny model's weights depend on which tests
    # drew from the global random state before it was written, and with some of them the tiny CLIP
    # scores the images 0 (a clamped negative cosine), which would hide what this test checks.
    from kubetune_trainer.models.tiny_models import write_tiny_model

    torch.manual_seed(0)
    tiny_sd15 = write_tiny_model("sd15", tmp_path / "sd15")
    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          validation=held_out_validation(clipModel=str(tiny_clip), numSamples=2,
                                                         numInferenceSteps=2))
    family, validator = validator_for(manifest, tmp_path / "out")
    with caplog.at_level(logging.INFO, logger="kubetune.trainer"):
        first = validate(family, validator, 1)
    assert 0 < first["clip_score"] <= 100, "the tiny CLIP happens to score above 0 (else nothing below shows)"
    assert re.search(r"validation at step 1: loss [\d.]+, clip_score [\d.]+", caplog.text), caplog.text
    assert sorted(p.name for p in (tmp_path / "out" / "samples" / "step-0000001").iterdir()) == ["0.png", "1.png", "grid.png"], \
        "the scored images are kept beside the checkpoints"
    assert validate(family, validator, 2)["clip_score"] == first["clip_score"], "the same seed, the same images"
    nudge(family)
    assert validate(family, validator, 3)["clip_score"] != first["clip_score"], "other weights, other images"


def test_flux_kontext_scores_its_held_out_edits_the_same_for_the_same_weights(tiny_model, tiny_dataset, tiny_clip,
                                                                             tmp_path):
    manifest = family_job("flux-kontext", "edit-pairs", tiny_model("flux-kontext"), tiny_dataset("edit-pairs"),
                          tmp_path / "out", validation=held_out_validation(clipModel=str(tiny_clip), numSamples=2,
                                                                           numInferenceSteps=2))
    family, validator = validator_for(manifest, tmp_path / "out")
    first = validate(family, validator, 1)
    assert set(first) == {"loss", "clip_directional"}
    assert -1 <= first["clip_directional"] <= 1 and first["clip_directional"] != 0
    assert validate(family, validator, 2)["clip_directional"] == first["clip_directional"]
    nudge(family)
    assert validate(family, validator, 3)["clip_directional"] != first["clip_directional"]


def test_a_run_monitoring_clip_score_logs_it_at_each_validation_and_keeps_the_best(tiny_sd15, captions_data,
                                                                                   tiny_clip, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          validation={"everySteps": 1, "prompts": ["a red circle", "a blue square"],
                                      "numInferenceSteps": 2, "clipModel": str(tiny_clip),
                                      "monitor": "clip_score", "keepBest": 1})
    result = run_trainer(manifest, tmp_path)
    scores = {int(step): float(score) for step, score in
              re.findall(r"validation at step (\d+): clip_score ([\d.]+)", result.stderr)}
    # No held-out data: the prompts' score alone; at step 0 the base model's, before the first step.
    assert set(scores) == {0, 1, 2}, result.stderr[-3000:]
    out = run_dir(tmp_path / "out")
    [best] = [json.loads(p.read_text()) for p in (out / "best").glob("step-*/metric.json")]
    assert best["metric"] == "clip_score" and best["step"] in (1, 2), "the base is no result of the run"
    assert best["value"] == pytest.approx(max(scores[1], scores[2]), abs=1e-5)
    events = EventAccumulator(str(out / "logs")).Reload()
    assert [e.step for e in events.Scalars("validation/clip_score")] == [0, 1, 2]
    saved = json.loads((out / "checkpoint-2" / "manifest.json").read_text())["validation"]  # the checkpoint says too
    assert saved["step"] == 2 and saved["metrics"]["clip_score"] == pytest.approx(scores[2], abs=1e-5)
    assert {tag.split("/")[0] for tag in events.Tags()["images"]} == {"samples"}
    assert [e.step for e in events.Images("samples/grid")] == [0, 1, 2]  # one grid of the fixed prompts per step
    grid = Image.open(out / "samples" / "step-0000002" / "grid.png")
    single = Image.open(out / "samples" / "step-0000002" / "0.png")
    assert grid.size == (2 * single.size[0], single.size[1])


def test_every_process_of_a_sharded_run_decides_by_the_main_processs_clip_score(tiny_sd15, captions_data, tiny_clip,
                                                                                tmp_path):
    """Only the main process scores; keepBest's gathering of the sharded weights is a collective that
    every process must then join alike (else the run hangs)."""
    from tests.trainer.test_distributed import train

    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          training={"maxSteps": 2, "batchSize": 1}, distributed={"strategy": "fsdp"},
                          validation={"everySteps": 1, "prompts": ["a red circle"], "numInferenceSteps": 2,
                                      "clipModel": str(tiny_clip), "monitor": "clip_score", "keepBest": 1})
    stderr = train(manifest, tmp_path, nproc=2)
    assert len(re.findall(r"validation at step \d: clip_score [\d.]+", stderr)) == 3, stderr[-3000:]  # 0, 1, 2
    assert len(list((run_dir(tmp_path / "out") / "best").glob("step-*/metric.json"))) == 1


# ---- kubetune evaluate's image metrics -------------------------------------------------------------

def noisy(image, strength: float, seed: int = 0):
    import numpy as np

    pixels = np.asarray(image, dtype=np.float32)
    noise = np.random.default_rng(seed).normal(0, 255 * strength, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def test_ssim_is_one_for_the_same_image_and_falls_as_noise_grows(shapes):
    from kubetune_trainer.results.evaluation import ssim

    image = shapes[0][0]
    scores = ssim([image, noisy(image, 0.05), noisy(image, 0.3)], [image] * 3).per_image
    assert scores[0] == pytest.approx(1)
    assert 1 > scores[1] > scores[2] > -1, scores
    assert ssim([image], [noisy(image, 0.05)]).per_image == pytest.approx(scores[1:2]), "symmetric"


def test_ssim_resizes_the_reference_to_the_generated_size(shapes):
    from kubetune_trainer.results.evaluation import ssim

    image = shapes[0][0]
    larger = image.resize((64, 64), Image.BICUBIC)
    assert ssim([image], [larger]).per_image[0] > 0.9, "the same picture at another size"
    assert ssim([image], [shapes[0][1]]).per_image[0] < 0.9, "another picture"


def test_ssim_of_constant_images_follows_the_definition():
    """Two flat images: the structure terms are 1, the luminance term is (2ab + C1) / (a^2 + b^2 + C1)."""
    from kubetune_trainer.results.evaluation import SSIM_K1, ssim

    a, b = 0.2, 0.6
    flat = [Image.new("RGB", (16, 16), (round(255 * v),) * 3) for v in (a, b)]
    a, b = round(255 * a) / 255, round(255 * b) / 255
    expected = (2 * a * b + SSIM_K1 ** 2) / (a * a + b * b + SSIM_K1 ** 2)
    assert ssim(flat[:1], flat[1:]).per_image[0] == pytest.approx(expected, rel=1e-6)


def test_clip_image_similarity_is_a_symmetric_cosine_and_one_for_the_same_image(tiny_clip, shapes):
    scorer = ClipScorer(str(tiny_clip), torch.device("cpu"))
    first, second = shapes
    same = scorer.image_similarity(first, first)
    assert same.per_image == pytest.approx([1, 1], abs=1e-5) and same.mean == pytest.approx(1, abs=1e-5)
    there = scorer.image_similarity(first, second).per_image
    assert scorer.image_similarity(second, first).per_image == pytest.approx(there, abs=1e-6)
    assert all(-1 <= value < 1 - 1e-4 for value in there), there


def test_clip_text_similarity_is_the_cosine_clip_score_scales_and_clamps(tiny_clip, shapes):
    scorer = ClipScorer(str(tiny_clip), torch.device("cpu"))
    images, prompts = shapes[0], ["a red circle", "a blue square"]
    found = scorer.text_similarity(images, prompts)
    assert all(-1 <= value <= 1 for value in found.per_image)
    assert found.mean == pytest.approx(sum(found.per_image) / 2)
    assert scorer.clip_score(images, prompts) == pytest.approx(
        sum(100 * max(value, 0) for value in found.per_image) / 2, rel=1e-5, abs=1e-5)
    assert scorer.text_similarity(images, prompts[::-1]).per_image != pytest.approx(found.per_image), \
        "another prompt, another score"
    with pytest.raises(ValueError, match="as many images as texts"):
        scorer.text_similarity(images, prompts[:1])
