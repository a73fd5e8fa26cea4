"""Stable Diffusion 3.5 (sd35): it trains on its tiny model (SD 3.5 medium's layout: block 0 has the second
attention, attn2), its LoRA loads whole into StableDiffusion3Pipeline and changes the transformer, the
embedding cache serves the second epoch, two FSDP processes train it, and sizes its transformer cannot
take are refused before anything is written."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure

pytestmark = pytest.mark.slow

FAMILY, LAYOUT = "sd35", "captions"


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def transformer_output(transformer) -> torch.Tensor:
    """The tiny transformer on fixed inputs: 32 px latents, CLIP's 77 + T5's 256 text tokens."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, 16, 4, 4, generator=generator), timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, 333, 32, generator=generator),
            pooled_projections=torch.randn(1, 32, generator=generator), return_dict=False,
        )[0]


def assert_loads_whole(model, run) -> None:
    """Every saved tensor lands in the transformer of a fresh StableDiffusion3Pipeline, nothing is
    missing or unexpected, and the transformer's output changes."""
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.utils import get_peft_model_state_dict

    # The file holds diffusers' names (lora.down / lora.up); the loader turns them into PEFT's (lora_A / lora_B).
    saved = convert_unet_state_dict_to_peft({key.removeprefix("transformer."): value for key, value
                                             in load_file(run / "pytorch_lora_weights.safetensors").items()})
    assert saved and all(key.startswith("transformer_blocks.") for key in saved)
    assert any(".attn2." in key for key in saved) and any(".attn.to_q." in key for key in saved), \
        "the default targets adapt both of medium's image attentions"
    pipeline = StableDiffusion3Pipeline.from_pretrained(model)
    before = transformer_output(pipeline.transformer)
    warnings = Warnings()
    logging.getLogger("diffusers").addHandler(warnings)
    try:
        pipeline.load_lora_weights(run)
    finally:
        logging.getLogger("diffusers").removeHandler(warnings)
    # SD3LoraLoaderMixin also looks for CLIP LoRAs: "No LoRA keys associated to CLIPTextModelWithProjection
    # found with the prefix='text_encoder'" is harmless; any other word of keys (missing, unexpected) is not.
    harmless = "No LoRA keys associated to CLIPTextModelWithProjection found with the prefix='text_encoder"
    assert not [m for m in warnings.messages if "keys" in m and not m.startswith(harmless)], warnings.messages
    adapter = pipeline.get_active_adapters()[0]
    loaded = get_peft_model_state_dict(pipeline.transformer, adapter_name=adapter)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[key], saved[key].to(loaded[key].dtype)) for key in saved)
    assert (transformer_output(pipeline.transformer) - before).abs().max() > 1e-4


def test_sd35_trains_from_its_cache_in_the_second_epoch_and_its_lora_loads_whole_into_the_sd3_pipeline(
        tiny_model, tiny_dataset, tmp_path):
    model = tiny_model(FAMILY)
    result = run_trainer(family_job(
        FAMILY, LAYOUT, model, tiny_dataset(LAYOUT), tmp_path / "out",
        training={"epochs": 2, "maxSteps": None},
        data={"resolution": [48, 32], "randomFlip": True, "captionDropout": 0.5,  # a non-square size
              "cache": {"enabled": True, "uri": str(tmp_path / "cache")}},
        validation={"everySteps": 100, "prompts": ["a red square"], "numInferenceSteps": 2},
        checkpoints={"everySteps": 8},
    ), tmp_path)
    hits, misses = map(int, re.search(r"embedding cache: (\d+) hits, (\d+) misses", result.stderr).groups())
    # Epoch 1 encodes the 8 images and their captions (with their flips and dropped captions); epoch 2 finds them.
    assert misses > 0 and hits >= 16, result.stderr[-2000:]
    run = run_dir(tmp_path / "out")
    with Image.open(run / "samples" / "step-0000008" / "0.png") as sample:
        assert sample.size == (48, 32), "a validation prompt drawn at the end, at the training size"
    assert_loads_whole(model, run)


def test_sd35_trains_sharded_over_two_fsdp_processes_into_a_whole_lora(tiny_model, tiny_dataset, tmp_path):
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.process.start import launch_local

    model = tiny_model(FAMILY)
    manifest = family_job(FAMILY, LAYOUT, model, tiny_dataset(LAYOUT), tmp_path / "out",
                          training={"batchSize": 1}, distributed={"strategy": "fsdp"})
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    assert_loads_whole(model, run_dir(tmp_path / "out"))


def refusal(data: dict, model, data_dir, tmp_path) -> str | None:
    """What check_image_sizes says of a job with these spec.data fields on the tiny model (None: it takes them)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families.sd35 import check_image_sizes

    spec = TrainingJob.model_validate(family_job(FAMILY, LAYOUT, model, data_dir, tmp_path / "out", data=data)).spec
    try:
        check_image_sizes(spec, SD3Transformer2DModel.load_config(model, subfolder="transformer"),
                          AutoencoderKL.load_config(model, subfolder="vae"))
    except ConfigError as err:
        return str(err)
    return None


BEYOND = "beyond the 512 px this transformer's position embeddings cover (pos_embed_max_size); lower it"


# The tiny transformer's position embeddings cover 32 patches of 16 px: 512 px a side.
@pytest.mark.parametrize("data, message", [
    ({"resolution": 528}, f"spec.data.resolution: a side of 528 px, {BEYOND}"),
    ({"resolution": [512, 528]}, f"spec.data.resolution: a side of 528 px, {BEYOND}"),
    ({"resolution": 512, "bucketing": True},
     f"spec.data.resolution: bucketing makes sides up to 704 px, {BEYOND} or turn spec.data.bucketing off"),
    ({"resolution": 512}, None),
    ({"resolution": [512, 256]}, None),
    ({"resolution": 256, "bucketing": True}, None),
])
def test_sizes_beyond_the_position_embeddings_are_refused_naming_the_field(data, message, tiny_model, tiny_dataset,
                                                                           tmp_path):
    assert refusal(data, tiny_model(FAMILY), tiny_dataset(LAYOUT), tmp_path) == message


def test_sides_the_patches_do_not_divide_are_refused_by_the_spec():
    from kubetune_api.manifest import ManifestError, parse_manifest

    manifest = family_job(FAMILY, LAYOUT, "/models/sd35", "/data", "/out", data={"resolution": [832, 584]})
    with pytest.raises(ManifestError, match="spec.data.resolution must be a multiple of 16 for family sd35"):
        parse_manifest(manifest)


def test_the_trainer_refuses_such_a_size_before_anything_is_written(tiny_model, tiny_dataset, tmp_path):
    manifest = family_job(FAMILY, LAYOUT, tiny_model(FAMILY), tiny_dataset(LAYOUT), tmp_path / "out",
                          data={"resolution": 528})
    assert f"spec.data.resolution: a side of 528 px, {BEYOND}" in run_trainer_expecting_failure(manifest, tmp_path)
    assert not (tmp_path / "out").exists()
