"""Every family trains two steps on its tiny model and data, and its weights load back and change
the output of its diffusers / transformers model. Plus the cache, switches and refusals end to end."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure, saved_keys

pytestmark = pytest.mark.slow


def sdxl_unet_output(pipeline) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 16, 16, generator=generator)
    context = torch.randn(1, 77, 64, generator=generator)
    added = {"text_embeds": torch.randn(1, 32, generator=generator), "time_ids": torch.tensor([[32, 32, 0, 0, 32, 32.]])}
    with torch.no_grad():
        return pipeline.unet(sample, torch.tensor([500]), context, added_cond_kwargs=added).sample


def test_sdxl_lora_loads_in_the_sdxl_pipeline_and_changes_the_unet(tiny_model, sdxl_run):
    from diffusers import StableDiffusionXLPipeline

    pipeline = StableDiffusionXLPipeline.from_pretrained(tiny_model("sdxl"))
    before = sdxl_unet_output(pipeline)
    pipeline.load_lora_weights(run_dir(sdxl_run))  # the session's run: flips, no center crop, caption dropout
    assert (sdxl_unet_output(pipeline) - before).abs().max() > 1e-4


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_classifier_weights_load_in_transformers_and_change_the_logits(adapter, tiny_model, tiny_dataset, tmp_path):
    from transformers import AutoModelForImageClassification

    model = tiny_model("classifier")
    run_trainer(family_job("classifier", "image-folder", model, tiny_dataset("image-folder"), tmp_path / "out",
                           adapter={"type": adapter}, training={"learningRate": 1e-2 if adapter == "lora" else 1e-3}),
                tmp_path)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    base = AutoModelForImageClassification.from_pretrained(model).eval()
    with torch.no_grad():
        before = base(pixel_values=pixels).logits
    if adapter == "lora":
        base.load_adapter(str(run_dir(tmp_path / "out")))
        trained = base
    else:
        trained = AutoModelForImageClassification.from_pretrained(run_dir(tmp_path / "out")).eval()
        assert trained.config.id2label == {0: "circle", 1: "square"}, "labels are the class folders"
    with torch.no_grad():
        assert (trained(pixel_values=pixels).logits - before).abs().max() > 1e-4


def test_classifier_validates_stops_early_and_keeps_the_best_k(tiny_model, tiny_dataset, tmp_path):
    manifest = family_job(
        "classifier", "image-folder", tiny_model("classifier"), tiny_dataset("image-folder"), tmp_path / "out",
        training={"maxSteps": 30, "learningRate": 0.5, "optimizer": "sgd"},  # diverges: no improvement
        validation={"everySteps": 1, "heldOutFraction": 0.25, "monitor": "loss", "earlyStoppingPatience": 2,
                    "keepBest": 2},
    )
    result = run_trainer(manifest, tmp_path)
    assert "early stop: loss did not improve in 2 validations" in result.stderr
    steps = [int(s) for s in re.findall(r"validation at step (\d+): loss [\d.]+, accuracy [\d.]+, precision [\d.]+, "
                                        r"recall [\d.]+, f1 [\d.]+", result.stderr)]
    assert steps and max(steps) < 30
    best = sorted((run_dir(tmp_path / "out") / "best").glob("step-*/metric.json"))
    assert len(best) == 2
    assert (run_dir(tmp_path / "out") / f"checkpoint-{max(steps)}" / "manifest.json").is_file(), "the stop is checkpointed"


def cache_counts(stderr: str) -> tuple[int, int]:
    hits, misses = re.search(r"embedding cache: (\d+) hits, (\d+) misses", stderr).groups()
    return int(hits), int(misses)


def final_loss(out) -> float:
    return json.loads((run_dir(out) / "checkpoint-8" / "trainer_state.json").read_text())["position"]["loss"]


def test_cached_run_matches_the_uncached_loss_and_the_second_epoch_hits(tiny_sd15, captions_data, tmp_path):
    def run(name, cache):
        return run_trainer(family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / name,
                                      training={"epochs": 2, "maxSteps": None},
                                      data={"cache": {"enabled": cache, "uri": str(tmp_path / "cache")}},
                                      checkpoints={"everySteps": 8}), tmp_path)

    run("plain", cache=False)
    first = run("cached", cache=True)
    # Equal up to float rounding: a cached embedding may have been computed in a batch of another
    # size than the uncached run used, and CPU matrix kernels round differently per shape.
    assert final_loss(tmp_path / "cached") == pytest.approx(final_loss(tmp_path / "plain"), rel=1e-5)
    hits, misses = cache_counts(first.stderr)
    # Epoch 1 encodes 8 images (and the distinct captions); epoch 2 finds all 16 entries.
    assert misses <= 16 and hits >= 16
    again = run("again", cache=True)
    assert cache_counts(again.stderr)[1] == 0, "a later run reuses the cache"
    assert final_loss(tmp_path / "again") == pytest.approx(final_loss(tmp_path / "plain"), rel=1e-5)


def test_cache_only_fills_the_cache_without_training(tiny_sd15, captions_data, tmp_path):
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.process.start import launch_local

    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          data={"cache": {"enabled": True}})
    assert launch_local(parse_manifest(manifest), trainer_args=("--cache-only",)) == 0
    assert len(list((tmp_path / "out" / "cache").rglob("*.safetensors"))) >= 8, "the cache is shared by runs"
    assert not (tmp_path / "out" / "default").exists(), "a cache stage starts no run"


def test_debug_mode_ema_checkpointing_profiling_and_samples_together(tiny_sd15, captions_data, tmp_path):
    manifest = family_job(
        "sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
        training={"maxSteps": 3, "debugOverfitBatch": True, "emaDecay": 0.5, "gradientCheckpointing": True,
                  "profileSteps": 1, "optimizer": "schedulefree-adamw"},
        validation={"everySteps": 3, "prompts": ["a red square"], "numInferenceSteps": 2},
        data={"bucketing": True},
    )
    run_trainer(manifest, tmp_path)
    out = run_dir(tmp_path / "out")
    assert list((out / "profile").glob("*.pt.trace.json*")), "a profiler trace was written"
    assert any(name.startswith("ema.") for name in saved_keys(out / "checkpoint-3")), "the EMA is checkpointed"
    assert (out / "samples" / "step-0000003" / "0.png").is_file()


def test_lora_init_from_existing_weights_needs_the_same_rank(sd15_run, tiny_sd15, captions_data, tmp_path):
    first = run_dir(sd15_run[1])  # the session's finished rank-4 run, read only
    same = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "second",
                      adapter={"initFrom": str(first)}, training={"maxSteps": 1})
    run_trainer(same, tmp_path)
    other_rank = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "third",
                            adapter={"rank": 8, "initFrom": str(first)})
    stderr = run_trainer_expecting_failure(other_rank, tmp_path)
    assert "spec.adapter.initFrom" in stderr and "rank 4 but spec.adapter.rank is 8" in stderr


@pytest.mark.parametrize("quantization", ["nf4", "fp8"])
def test_quantization_on_a_cpu_job_is_refused_before_training_naming_the_option(quantization, tiny_sd15,
                                                                                 captions_data, tmp_path):
    """The manifest check refuses it (the runtime refusal, quantization.check_supported, is unit-tested)."""
    manifest = family_job("sd15", "captions", tiny_sd15, captions_data, tmp_path / "out",
                          model={"quantization": quantization})
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert (f"spec.model.quantization {quantization} needs a CUDA GPU: this job has spec.resources.gpusPerNode 0"
            in stderr), stderr
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


def flux_transformer_output(transformer) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens, text = 32, 8
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, tokens, 16, generator=generator), timestep=torch.tensor([0.5]),
            guidance=torch.tensor([2.5]), pooled_projections=torch.randn(1, 32, generator=generator),
            encoder_hidden_states=torch.randn(1, text, 32, generator=generator), txt_ids=torch.zeros(text, 3),
            img_ids=torch.zeros(tokens, 3), return_dict=False,
        )[0]


def test_flux_kontext_edit_lora_loads_in_the_kontext_pipeline_and_changes_the_transformer(
        tiny_model, tiny_dataset, tmp_path):
    from diffusers import FluxKontextPipeline

    model = tiny_model("flux-kontext")
    run_trainer(family_job("flux-kontext", "edit-pairs", model, tiny_dataset("edit-pairs"), tmp_path / "out",
                           data={"controlDropout": 0.5, "captionDropout": 0.5, "randomFlip": True},
                           validation={"everySteps": 2, "heldOutFraction": 0.25, "numSamples": 1,
                                       "numInferenceSteps": 2}), tmp_path)
    assert (run_dir(tmp_path / "out") / "samples" / "step-0000002" / "0.png").is_file(), "an edited held-out sample"
    pipeline = FluxKontextPipeline.from_pretrained(model)
    before = flux_transformer_output(pipeline.transformer)
    pipeline.load_lora_weights(run_dir(tmp_path / "out"))
    assert (flux_transformer_output(pipeline.transformer) - before).abs().max() > 1e-4



def qwen_transformer_output(transformer) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return transformer(  # 2x2 target tokens followed by 2x2 control-image tokens, 6 text tokens
            hidden_states=torch.randn(1, 8, 16, generator=generator), timestep=torch.tensor([0.5]),
            encoder_hidden_states=torch.randn(1, 6, 32, generator=generator),
            img_shapes=[[(1, 2, 2), (1, 2, 2)]], return_dict=False,
        )[0]


def test_qwen_image_edit_lora_loads_in_the_edit_pipeline_and_changes_the_transformer(
        tiny_model, tiny_dataset, tmp_path):
    from diffusers import QwenImageEditPipeline

    model = tiny_model("qwen-image-edit")
    result = run_trainer(family_job(
        "qwen-image-edit", "edit-pairs", model, tiny_dataset("edit-pairs"), tmp_path / "out",
        data={"controlDropout": 0.5, "captionDropout": 0.5, "randomFlip": True, "cache": {"enabled": True}},
        validation={"everySteps": 2, "heldOutFraction": 0.25, "numSamples": 1, "numInferenceSteps": 2},
    ), tmp_path)
    assert cache_counts(result.stderr)[1] > 0, "latents and (instruction, control) embeddings went through the cache"
    assert (run_dir(tmp_path / "out") / "samples" / "step-0000002" / "0.png").is_file(), "an edited held-out sample"
    pipeline = QwenImageEditPipeline.from_pretrained(model)
    before = qwen_transformer_output(pipeline.transformer)
    pipeline.load_lora_weights(run_dir(tmp_path / "out"))
    assert (qwen_transformer_output(pipeline.transformer) - before).abs().max() > 1e-4

@pytest.mark.parametrize("projection, parts", [
    (False, {"image_prompt", "prefix", "mapping"}),
    (True, {"image_prompt", "prefix_tokens", "prefix_encoder", "mapping"}),
])
def test_pmg_trains_every_soft_prompt_part_and_its_tokens_steer_the_sd_unet(projection, parts, tiny_model,
                                                                             tiny_dataset, tmp_path):
    from diffusers import StableDiffusionPipeline

    from kubetune_trainer.families.pmg import load_language_model, load_pmg_adapter

    model = tiny_model("pmg")
    run_trainer(family_job("pmg", "pmg", model, tiny_dataset("pmg"), tmp_path / "out",
                           pmg={"numImagePrompt": 2, "numPrefixPrompt": 3, "maxSequenceLength": 16,
                                "prefixProjection": projection},
                           checkpoints={"everySteps": 1}), tmp_path)
    tokenizer, language_model = load_language_model(str(model / "language_model"), torch.float32)
    adapters = [load_pmg_adapter(run_dir(tmp_path / "out") / f"checkpoint-{step}", language_model) for step in (1, 2)]
    first, second = (a.state_dict() for a in adapters)
    assert {key.split(".")[0] for key in first} == parts
    for part in parts:
        assert any(not torch.equal(first[k], second[k]) for k in first if k.startswith(part)), f"{part} trained"

    pipeline = StableDiffusionPipeline.from_pretrained(model)
    tokens = tokenizer(["red shirt\nred mug"], return_tensors="pt")
    caption = pipeline.encode_prompt("a red square", "cpu", 1, False)[0]
    outputs = []
    for adapter in adapters:
        with torch.no_grad():
            personal = adapter(language_model, tokens.input_ids, tokens.attention_mask)
            context = torch.cat([caption, personal], dim=1)
            outputs.append(pipeline.unet(torch.zeros(1, 4, 16, 16), torch.tensor([500]), context).sample)
    assert (outputs[0] - outputs[1]).abs().max() > 1e-6
