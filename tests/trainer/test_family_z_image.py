"""Z-Image trains on its tiny model: its LoRA loads whole into ZImagePipeline and changes the
transformer, a cached run hits its cache in the second epoch, FSDP over two processes trains and
publishes the same kind of LoRA; a size the model cannot patchify is refused naming the field."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure

pytestmark = pytest.mark.slow

FAMILY, LAYOUT = "z-image", "captions"


def transformer_output(transformer) -> torch.Tensor:
    """One 16x16-latent sample and a 7-token caption through the tiny transformer (width-16 text)."""
    generator = torch.Generator().manual_seed(0)
    latents = [torch.randn(16, 1, 16, 16, generator=generator)]
    caption = [torch.randn(7, 16, generator=generator)]
    with torch.no_grad():
        return transformer(latents, torch.tensor([0.5]), caption, return_dict=False)[0][0]


def assert_lora_loads_whole_and_changes_the_transformer(model, run):
    """Every saved tensor lands in ZImagePipeline's transformer, equal, and nothing is left out."""
    from diffusers import ZImagePipeline
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.utils import get_peft_model_state_dict

    # The file holds diffusers' lora.down / lora.up names, which the loader maps to PEFT's lora_A / lora_B.
    saved = convert_unet_state_dict_to_peft({key.removeprefix("transformer."): value for key, value
                                             in load_file(run / "pytorch_lora_weights.safetensors").items()})
    assert saved and all(key.startswith(("layers.", "noise_refiner.", "context_refiner.")) for key in saved)
    pipeline = ZImagePipeline.from_pretrained(model)
    before = transformer_output(pipeline.transformer)
    pipeline.load_lora_weights(run)
    [adapter] = pipeline.get_active_adapters()
    loaded = get_peft_model_state_dict(pipeline.transformer, adapter_name=adapter)
    assert loaded.keys() == saved.keys(), sorted(loaded.keys() ^ saved.keys())[:4]
    assert all(torch.equal(loaded[key], saved[key].to(loaded[key].dtype)) for key in saved)
    assert (transformer_output(pipeline.transformer) - before).abs().max() > 1e-4


def test_a_cached_run_hits_in_its_second_epoch_samples_its_prompt_and_its_lora_loads_whole_into_the_pipeline(
        tiny_model, tiny_dataset, tmp_path):
    model = tiny_model(FAMILY)
    manifest = family_job(FAMILY, LAYOUT, model, tiny_dataset(LAYOUT), tmp_path / "out",
                          training={"epochs": 2, "maxSteps": None, "batchSize": 4},
                          data={"captionDropout": 0.5, "cache": {"enabled": True, "uri": str(tmp_path / "cache")}},
                          validation={"everySteps": 4, "prompts": ["a red cube"], "numInferenceSteps": 2},
                          checkpoints={"everySteps": 4})
    result = run_trainer(manifest, tmp_path)
    hits, misses = (int(n) for n in re.search(r"embedding cache: (\d+) hits, (\d+) misses", result.stderr).groups())
    # Epoch 1 encodes 8 images and their captions (each stored with its dropped form); epoch 2 finds all 16.
    assert misses <= 16 and hits >= 16, (hits, misses)
    out = run_dir(tmp_path / "out")
    assert (out / "samples" / "step-0000004" / "0.png").is_file(), "the validation prompt, sampled"
    assert_lora_loads_whole_and_changes_the_transformer(model, out)


def test_fsdp_over_two_processes_trains_two_steps_and_publishes_a_lora_that_loads_whole(
        tiny_model, tiny_dataset, tmp_path, capfd):
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.process.start import launch_local

    model = tiny_model(FAMILY)
    manifest = family_job(FAMILY, LAYOUT, model, tiny_dataset(LAYOUT), tmp_path / "out",
                          distributed={"strategy": "fsdp"})
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    assert "2 process(es) (fsdp)" in capfd.readouterr().err
    out = run_dir(tmp_path / "out")
    assert (out / "checkpoint-2" / "manifest.json").is_file()
    assert_lora_loads_whole_and_changes_the_transformer(model, out)


@pytest.mark.parametrize("patch, resolution, refused", [(2, 1024, False), (2, 528, False), (4, 544, False),
                                                      (4, 528, True)])
def test_the_model_s_own_patch_size_sets_the_multiple_beyond_the_row_s_16(patch, resolution, refused):
    """The row refuses what the published model cannot take (16); a checkpoint with bigger patches
    needs a bigger multiple, which only its own configs tell: check_resolution reads them."""
    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families.z_image import Z_IMAGE_TRANSFORMER, Z_IMAGE_VAE, check_resolution

    spec = TrainingJobSpec.model_validate({
        "model": {"family": FAMILY, "pretrained": "/models/z-image"}, "training": {"maxSteps": 1},
        "data": {"layout": LAYOUT, "uri": "/data", "resolution": resolution}, "checkpoints": {"uri": "/ck"}})
    transformer = {**Z_IMAGE_TRANSFORMER, "all_patch_size": [patch]}
    if refused:
        with pytest.raises(ConfigError, match="spec.data.resolution: 528 is not a multiple of 32.*use 512 or 544"):
            check_resolution(spec, Z_IMAGE_VAE, transformer)
    else:
        check_resolution(spec, Z_IMAGE_VAE, transformer)


def test_a_resolution_the_model_cannot_patchify_is_refused_naming_the_field_before_anything_is_written(
        tiny_dataset, tmp_path):
    """The published architecture's configs (no weights: the refusal comes before any is read)."""
    from kubetune_trainer.models.reference_models import write_config_only

    configs = write_config_only(FAMILY, tmp_path / "configs")
    manifest = family_job(FAMILY, LAYOUT, configs, tiny_dataset(LAYOUT), tmp_path / "out",
                          data={"resolution": 1000})
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert "spec.data.resolution must be a multiple of 16 for family z-image" in stderr, stderr[-2000:]
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


@pytest.mark.parametrize("component, published", [
    ("transformer", 6.15e9),     # ZImageTransformer2DModel (Z-Image Turbo / base)
    ("text_encoder", 4.02e9),    # Qwen3-4B without its LM head (tied embeddings)
    ("vae", 0.084e9),            # the FLUX.1 autoencoder
])
def test_the_reference_architecture_has_the_published_sizes(component, published):
    from kubetune_trainer.families.components import build
    from kubetune_trainer.models.reference_models import architecture

    with torch.device("meta"):
        model = build(architecture(FAMILY)[component])
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(published, rel=0.01)
