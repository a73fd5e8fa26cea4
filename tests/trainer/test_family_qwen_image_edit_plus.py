"""Qwen-Image-Edit-2509/2511 on its tiny model (2511's zero_cond_t) and edit pairs with one or two
control images each: it trains from a filled embedding cache without a miss, validates through
QwenImageEditPlusPipeline with the held-out pairs' references, and its LoRA loads whole into that
pipeline; training feeds the transformer what the pipeline feeds it; batches hold one number of
references; FSDP over two processes trains; a sample with more references than a family takes is
refused naming its files, before anything is written."""
from __future__ import annotations

import pytest
import torch

from kubetune_api.manifest import parse_manifest
from kubetune_api.spec import TrainingJob
from kubetune_trainer.data.edit_pairs import EditPairsDataset, read_edit_pairs
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.layouts import LAYOUTS
from kubetune_trainer.data.sampler import epoch_steps, shard_for_encoding
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families import family_for
from kubetune_trainer.process.start import launch_local
from kubetune_trainer.training.randomness import SampleRandom
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure
from tests.trainer.qwen_checks import assert_lora_loads_whole
from tests.trainer.test_family_qwen_image import cache_counts

pytestmark = pytest.mark.slow

FAMILY = "qwen-image-edit-plus"


@pytest.fixture(scope="module")
def mixed_pairs(tmp_path_factory):
    """8 pairs of 32 pixels, alternately with one control image (NAME.jpg) and two (NAME_0, NAME_1)."""
    return write_tiny_data("edit-pairs", tmp_path_factory.mktemp("mixed"), count=8, size=32, references=(1, 2))


def test_trains_from_a_filled_cache_validates_with_the_references_and_its_lora_loads_whole(
        tiny_model, mixed_pairs, tmp_path):
    from diffusers import QwenImageEditPlusPipeline

    model = tiny_model(FAMILY)
    manifest = family_job(
        FAMILY, "edit-pairs", model, mixed_pairs, tmp_path / "out", training={"epochs": 2, "maxSteps": None},
        data={"captionDropout": 0.5, "randomFlip": True, "cache": {"enabled": True, "uri": str(tmp_path / "cache")}},
        validation={"everySteps": 1000, "heldOutFraction": 0.25, "numSamples": 2, "numInferenceSteps": 2},
    )
    # The cache stage batches within a number of references too (a batch of 1 and 2 would not stack).
    assert launch_local(parse_manifest(manifest), trainer_args=("--cache-only",)) == 0
    result = run_trainer(manifest, tmp_path)
    hits, misses = cache_counts(result.stderr)
    assert misses == 0 and hits > 0, "every latent and (instruction, references) embedding, flips and dropped captions too"
    run = run_dir(tmp_path / "out")
    drawn = {folder.name: sorted(path.name for path in folder.glob("[0-9].png")) for folder in run.glob("samples/step-*")}
    assert len(drawn) == 2 and all(names == ["0.png", "1.png"] for names in drawn.values()), \
        ("the first held-out pairs edited by QwenImageEditPlusPipeline, at step 0 (the base) and at the end", drawn)
    assert_lora_loads_whole(QwenImageEditPlusPipeline.from_pretrained(model), run, references=2)


def transformer_calls(family, run) -> list[dict]:
    """The keyword arguments of every transformer forward while `run()` runs."""
    calls = []
    handle = family.transformer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs),
                                                          with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return calls


@pytest.mark.parametrize("size, tokens", [(32, (2, 2)), ([64, 32], (2, 4))])  # (height, width) in tokens
def test_training_feeds_the_transformer_what_the_pipeline_feeds_it(size, tokens, tiny_model, mixed_pairs, tmp_path):
    """For a sample with two references: the instruction's embedding (read with both references), the
    reference tokens after the target's, and img_shapes listing the target then each reference."""
    spec = TrainingJob.model_validate(family_job(FAMILY, "edit-pairs", tiny_model(FAMILY), mixed_pairs,
                                                 tmp_path / "out", data={"resolution": size},
                                                 validation={"numInferenceSteps": 2})).spec
    family = family_for(FAMILY)(spec, torch.device("cpu"), torch.float32)
    dataset, _ = family.build_datasets()
    key = next((0, i) for i, sample in enumerate(dataset.samples) if len(sample.controls) == 2)
    batch = family.collate([dataset[key]])
    [trained] = transformer_calls(family, lambda: family.compute_loss(
        family.trainable_module, batch, SampleRandom.for_keys(0, [key], 0)))
    sampled = transformer_calls(family, lambda: family.sample_images(
        family.trainable_module, [batch], Draw.for_validation(spec)))[0]  # the first step's conditional call
    assert trained["img_shapes"] == sampled["img_shapes"] == [[(1, *tokens)] * 3]
    assert trained["encoder_hidden_states_mask"] is None and sampled["encoder_hidden_states_mask"] is None
    assert torch.allclose(trained["encoder_hidden_states"], sampled["encoder_hidden_states"], atol=1e-6)
    target_tokens = tokens[0] * tokens[1]
    assert torch.allclose(trained["hidden_states"][:, target_tokens:], sampled["hidden_states"][:, target_tokens:],
                          atol=1e-5), "the references' clean latents (VAE mode, normalised, packed)"
    assert trained["guidance"] is None and family.transformer.config.zero_cond_t


def test_batches_hold_one_number_of_references_and_control_dropout_blanks_them_all(mixed_pairs):
    pairs = read_edit_pairs(mixed_pairs, Screen(skip_bad=False), max_references=3)
    assert [len(pair.controls) for pair in pairs] == [1, 2] * 4
    assert [path.name for path in pairs[1].controls] == ["0001_0.jpg", "0001_1.jpg"], "in index order"
    for bucketing in (False, True):
        dataset = EditPairsDataset(pairs, ImageTransform(32), 0.0, 0.0, seed=0, bucketing=bucketing)
        batches = [*epoch_steps(len(pairs), 2, seed=0, epoch=0, groups=dataset.groups),
                   *shard_for_encoding(len(pairs), 2, 1, 0, dataset.groups)]
        assert len({len(pairs[i].controls) for _, i in batches[0]}) == 1
        assert all(len({len(pairs[i].controls) for _, i in batch}) == 1 for batch in batches)
    dropped = EditPairsDataset(pairs, ImageTransform(32), 0.0, 1.0, seed=0)[(0, 1)]
    assert dropped["control_values"].shape == (2, 3, 32, 32) and not dropped["control_values"].any()


def test_two_processes_fsdp_train_two_steps_on_mixed_references(tiny_model, mixed_pairs, tmp_path):
    manifest = family_job(FAMILY, "edit-pairs", tiny_model(FAMILY), mixed_pairs, tmp_path / "out",
                          training={"batchSize": 1}, distributed={"strategy": "fsdp"})
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    assert (run_dir(tmp_path / "out") / "checkpoint-2" / "manifest.json").is_file()


def read(family: str, data, skip_bad: bool = False) -> list:
    spec = TrainingJob.model_validate(family_job(family, "edit-pairs", data, data, data / "out")).spec
    return LAYOUTS["edit-pairs"].read(spec, Screen(skip_bad))


@pytest.mark.parametrize("family", ["qwen-image-edit", "flux-kontext"])
def test_a_family_taking_one_control_image_refuses_a_sample_with_two_naming_its_files(family, mixed_pairs):
    with pytest.raises(ConfigError, match=r"0001.png: has 2 control images \(control_images/0001_0.jpg, "
                                          rf"control_images/0001_1.jpg\); spec.model.family {family} takes one "
                                          r"control image \(control_images/NAME.\*\) per sample"):
        read(family, mixed_pairs)
    assert len(read(family, mixed_pairs, skip_bad=True)) == 4, "or skips them with spec.data.skipBad"


def test_more_than_three_references_are_refused_naming_the_files_before_anything_is_written(tiny_model, tmp_path):
    data = write_tiny_data("edit-pairs", tmp_path / "data", count=2, size=32, references=4)
    stderr = run_trainer_expecting_failure(
        family_job(FAMILY, "edit-pairs", tiny_model(FAMILY), data, tmp_path / "out"), tmp_path)
    assert ("0000.png: has 4 control images (control_images/0000_0.jpg, control_images/0000_1.jpg, "
            "control_images/0000_2.jpg, control_images/0000_3.jpg); spec.model.family qwen-image-edit-plus takes "
            "at most 3 control images per sample") in stderr, stderr[-2000:]
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


def test_one_control_image_beside_numbered_ones_is_refused_as_ambiguous(mixed_pairs, tmp_path):
    data = write_tiny_data("edit-pairs", tmp_path / "data", count=2, size=32, references=(1, 2))
    (data / "control_images" / "0001_0.jpg").rename(data / "control_images" / "0001.jpg")
    with pytest.raises(ConfigError, match="0001.png: has both control_images/0001.jpg and control_images/0001_1.jpg"):
        read(FAMILY, data)
