"""FLUX.2 [dev] (flux2) and [klein] (flux2-klein) train on their tiny models, on captions and on edit
pairs whose control images are reference images; from the embedding cache; sharded over two
processes; and their LoRA loads whole into Flux2Pipeline / Flux2KleinPipeline, adapting every
block's attention. A batch's references by position, and bad input refused before anything is written."""
from __future__ import annotations

import re

import pytest
import torch

from tests.trainer.conftest import family_job, run_dir, run_trainer

pytestmark = pytest.mark.slow

PIPELINES = {"flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline"}
# The tiny transformers' one double-stream and one single-stream block, every attention projection
# the default targets adapt (flux2_diffusion.lora_targets).
ADAPTED = {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
           "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
           "single_transformer_blocks.0.attn.to_out"}


def transformer_output(transformer) -> torch.Tensor:
    """The tiny transformer on 2x2 target tokens, 2x2 reference tokens (t = 10) and 8 text tokens."""
    from diffusers import Flux2Pipeline

    generator = torch.Generator().manual_seed(0)
    latents = torch.zeros(1, 16, 2, 2)
    img_ids = torch.cat([Flux2Pipeline._prepare_latent_ids(latents), Flux2Pipeline._prepare_image_ids([latents])], 1)
    text = torch.randn(1, 8, 48, generator=generator)
    guidance = torch.tensor([4.0]) if transformer.config.guidance_embeds else None
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, 8, 16, generator=generator), encoder_hidden_states=text,
                           timestep=torch.tensor([0.5]), guidance=guidance, img_ids=img_ids,
                           txt_ids=Flux2Pipeline._prepare_text_ids(text), return_dict=False)[0]


def assert_lora_loads_whole(family: str, model, out) -> None:
    """Every saved tensor lands in the family's own pipeline's transformer, no key left over or
    missing, every block's attention is adapted, and the transformer's output changes."""
    import diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    pipeline = getattr(diffusers, PIPELINES[family]).from_pretrained(model)
    before = transformer_output(pipeline.transformer)
    pipeline.load_lora_weights(out)
    saved = load_file(out / "pytorch_lora_weights.safetensors")
    [adapter] = pipeline.get_active_adapters()
    loaded = get_peft_model_state_dict(pipeline.transformer, adapter_name=adapter)
    assert set(saved) == {f"transformer.{key}" for key in loaded}, "no missing or unexpected keys"
    assert all(torch.equal(saved[f"transformer.{key}"], value) for key, value in loaded.items())
    assert {key.rsplit(".lora_", 1)[0] for key in loaded} == ADAPTED
    assert (transformer_output(pipeline.transformer) - before).abs().max() > 1e-4


def epoch_cache_counts(stderr: str) -> list[tuple[int, int]]:
    return [(int(hits), int(misses)) for hits, misses in
            re.findall(r"epoch \d+: embedding cache (\d+) hits, (\d+) misses", stderr)]


@pytest.mark.parametrize("family, layout, references, validation", [
    # edit pairs with two reference images each (control_images/NAME_0.jpg, NAME_1.jpg); held-out pairs
    # drawn with their references and scored by CLIP
    ("flux2", "edit-pairs", 2, {"heldOutFraction": 0.25, "numSamples": 2}),
    ("flux2-klein", "captions", None, {"prompts": ["a red circle"]}),
])
def test_trains_from_the_cache_samples_and_its_lora_loads_whole_into_its_pipeline(
        family, layout, references, validation, tiny_model, tiny_dataset, tiny_clip, tmp_path):
    from kubetune_trainer.data.tiny_data import write_tiny_data

    model = tiny_model(family)
    data = (write_tiny_data(layout, tmp_path / "data", count=8, size=32, references=references) if references
            else tiny_dataset(layout))
    result = run_trainer(family_job(
        family, layout, model, data, tmp_path / "out",
        data={"cache": {"enabled": True, "uri": str(tmp_path / "cache")}, "captionDropout": 0.5},
        training={"epochs": 2, "maxSteps": None},
        validation={"everySteps": 3, "numInferenceSteps": 2, "clipModel": str(tiny_clip), **validation},
        checkpoints={"everySteps": 100}), tmp_path)
    (_, first_misses), (second_hits, second_misses) = epoch_cache_counts(result.stderr)
    assert first_misses > 0 and second_hits > 0 and second_misses == 0, "the second epoch reads the cache only"
    assert re.search(r"validation at step 3: .*clip_score [\d.]+", result.stderr), "the samples, scored by CLIP"
    assert (run_dir(tmp_path / "out") / "samples" / "step-0000003" / "0.png").is_file()
    assert_lora_loads_whole(family, model, run_dir(tmp_path / "out"))


@pytest.mark.parametrize("family, layout", [("flux2", "captions"), ("flux2-klein", "edit-pairs")])
def test_fsdp_over_two_processes_trains_a_lora_that_loads_whole(family, layout, tiny_model, tiny_dataset, tmp_path):
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.process.start import launch_local

    model = tiny_model(family)
    manifest = family_job(family, layout, model, tiny_dataset(layout), tmp_path / "out",
                          distributed={"strategy": "fsdp"}, data={"bucketing": True})
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    assert_lora_loads_whole(family, model, run_dir(tmp_path / "out"))


@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_a_size_flux2_cannot_cut_into_patches_is_refused_naming_the_field(family, tmp_path):
    from kubetune_api.manifest import ManifestError, parse_manifest

    manifest = family_job(family, "captions", tmp_path / "model", tmp_path / "data", tmp_path / "out",
                          data={"resolution": [48, 40]})
    with pytest.raises(ManifestError, match=f"spec.data.resolution must be a multiple of 16 for family {family}"):
        parse_manifest(manifest)


def test_a_batchs_references_go_by_position_and_must_match_in_number():
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families.flux2_diffusion import batch_references, image_ids

    a, b = torch.zeros(3, 32, 32), torch.ones(3, 32, 32)
    one_each = {"captions": ["x", "y"], "control_values": torch.stack([a, b]).unsqueeze(1)}  # [B, 1, 3, H, W]
    assert [stack.shape for stack in batch_references(one_each)] == [(2, 3, 32, 32)]
    two_each = {"captions": ["x", "y"], "control_values": torch.stack([torch.stack([a, b]), torch.stack([b, a])])}
    first, second = batch_references(two_each)
    assert torch.equal(first, torch.stack([a, b])) and torch.equal(second, torch.stack([b, a]))
    assert batch_references({"captions": ["x", "y"]}) == [], "captions: plain text to image"
    with pytest.raises(ConfigError, match="spec.training.batchSize: a FLUX.2 batch needs the same number"):
        batch_references({"captions": ["x", "y"], "control_values": [[a], [a, b]]})

    target, references = torch.zeros(2, 16, 2, 2), [torch.zeros(2, 16, 2, 2), torch.zeros(2, 16, 1, 1)]
    ids = image_ids(target, references)
    assert ids.shape == (2, 4 + 4 + 1, 4)
    assert ids[0, :, 0].tolist() == [0] * 4 + [10] * 4 + [20], "the target at t = 0, reference i at 10 (i + 1)"


def test_validation_on_edit_pairs_draws_the_held_out_pairs_without_a_clip_model(tiny_model, tiny_dataset, tmp_path):
    """As every edit family does (spec.validation.numSamples); on captions, held-out captions are drawn
    only for a CLIP model to score."""
    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.results.drawing import Draw
    from kubetune_trainer.families import family_for

    drawn = {}
    for layout in ("edit-pairs", "captions"):
        spec = TrainingJob.model_validate(family_job("flux2-klein", layout, tiny_model("flux2-klein"),
                                                     tiny_dataset(layout), tmp_path / layout,
                                                     validation={"numInferenceSteps": 1, "numSamples": 2})).spec
        family = family_for("flux2-klein")(spec, torch.device("cpu"), torch.float32)
        dataset, _ = family.build_datasets()
        batch = family.collate([dataset[(0, i)] for i in range(3)])
        drawn[layout] = family.sample_images(family.trainable_module, [batch], Draw.for_validation(spec))
    assert len(drawn["edit-pairs"]) == 2 and drawn["captions"] == []
