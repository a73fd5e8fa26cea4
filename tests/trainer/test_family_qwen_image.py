"""Qwen-Image (text to image) on its tiny model and captions: it trains and its LoRA loads whole into
QwenImagePipeline, the embedding cache hits on the second epoch, FSDP over two processes trains, and
the LoRA leaves out the last block's modules whose output never reaches the image (DDP would
otherwise wait for their gradients)."""
from __future__ import annotations

import re

import pytest
import torch

from kubetune_api.manifest import ManifestError, parse_manifest
from kubetune_api.spec import TrainingJob
from kubetune_trainer.families import family_for
from kubetune_trainer.families.qwen_parts import UNUSED_IN_LAST_BLOCK, text_inputs
from kubetune_trainer.process.start import launch_local
from kubetune_trainer.training.randomness import SampleRandom
from tests.trainer.conftest import family_job, run_dir, run_trainer
from tests.trainer.qwen_checks import assert_lora_loads_whole

pytestmark = pytest.mark.slow

# Every Linear of a Qwen-Image block, text stream included.
EVERY_BLOCK_LINEAR = ["img_mod.1", "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                      "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mod.1", "txt_mlp.net.0.proj",
                      "txt_mlp.net.2"]


def cache_counts(stderr: str) -> tuple[int, int]:
    hits, misses = re.search(r"embedding cache: (\d+) hits, (\d+) misses", stderr).groups()
    return int(hits), int(misses)


def test_trains_from_the_cache_in_its_second_epoch_draws_validation_images_and_its_lora_loads_whole(
        tiny_model, tiny_dataset, tmp_path):
    from diffusers import QwenImagePipeline

    model = tiny_model("qwen-image")
    result = run_trainer(family_job(
        "qwen-image", "captions", model, tiny_dataset("captions"), tmp_path / "out",
        training={"epochs": 2, "maxSteps": None},  # 8 samples, 4 steps of 2 an epoch
        data={"captionDropout": 0.5, "randomFlip": True, "cache": {"enabled": True, "uri": str(tmp_path / "cache")}},
        validation={"everySteps": 8, "prompts": ["a red square"], "numInferenceSteps": 2},
        checkpoints={"everySteps": 8},
    ), tmp_path)
    hits, misses = cache_counts(result.stderr)
    # Epoch 1 encodes the 8 images and the captions drawn; epoch 2 finds every latent and caption.
    assert misses <= 16 and hits >= 16, (hits, misses)
    run = run_dir(tmp_path / "out")
    assert (run / "samples" / "step-0000008" / "0.png").is_file(), "a validation prompt drawn by QwenImagePipeline"
    assert_lora_loads_whole(QwenImagePipeline.from_pretrained(model), run)


def test_the_lora_leaves_out_the_last_blocks_unused_modules_and_every_other_one_gets_a_gradient(
        tiny_model, tiny_dataset, tmp_path):
    manifest = family_job("qwen-image", "captions", tiny_model("qwen-image"), tiny_dataset("captions"),
                          tmp_path / "out", adapter={"targetModules": EVERY_BLOCK_LINEAR})
    spec = TrainingJob.model_validate(manifest).spec
    family = family_for("qwen-image")(spec, torch.device("cpu"), torch.float32)
    dataset, _ = family.build_datasets()
    keys = [(0, 0), (0, 1)]
    batch = family.collate([dataset[key] for key in keys])
    family.compute_loss(family.trainable_module, batch, SampleRandom.for_keys(0, keys, 0)).backward()
    lora = {name: p for name, p in family.trainable_module.named_parameters() if p.requires_grad}
    last = len(family.transformer.transformer_blocks) - 1
    adapted = {name.split(".lora_")[0] for name in lora}
    assert not {f"transformer_blocks.{last}.{module}" for module in UNUSED_IN_LAST_BLOCK} & adapted
    assert f"transformer_blocks.{last}.txt_mod.1" in adapted, "the text modulation reaches the image (k, v)"
    # lora_B starts at zero, so lora_A's first gradient is zero: the B side shows the path is there.
    without = [name for name, p in lora.items() if "lora_B" in name and (p.grad is None or not p.grad.any())]
    assert not without, f"LoRA parameters that never train: {without}"


@pytest.mark.parametrize("family, layout", [("qwen-image", "captions"), ("qwen-image-edit-plus", "edit-pairs")])
def test_a_size_the_latents_cannot_pack_is_refused_naming_the_field(family, layout, tmp_path):
    manifest = family_job(family, layout, tmp_path, tmp_path, tmp_path / "out", data={"resolution": [832, 520]})
    with pytest.raises(ManifestError, match=f"spec.data.resolution must be a multiple of 16 for family {family}"):
        parse_manifest(manifest)


def test_text_is_masked_only_where_a_sample_is_padded():
    embeds = torch.ones(2, 5, 3)
    _, mask = text_inputs({"prompt_embeds": embeds, "mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])})
    assert mask is None, "padding no sample uses is dropped, then nothing is masked"
    trimmed, mask = text_inputs({"prompt_embeds": embeds, "mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])})
    assert trimmed.shape == (2, 4, 3) and mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_processes_train_two_steps_with_every_block_linear_adapted(strategy, tiny_model, tiny_dataset, tmp_path):
    """FSDP shards the transformer; DDP would fail at the second step on a parameter without a gradient."""
    manifest = family_job("qwen-image", "captions", tiny_model("qwen-image"), tiny_dataset("captions"),
                          tmp_path / "out", adapter={"targetModules": EVERY_BLOCK_LINEAR},
                          training={"batchSize": 1}, distributed={"strategy": strategy})
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    assert (run_dir(tmp_path / "out") / "checkpoint-2" / "manifest.json").is_file()
