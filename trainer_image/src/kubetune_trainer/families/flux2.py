"""FLUX.2 [dev]: LoRA (or full) fine-tuning of its 32B transformer by flow matching, text to image,
with the edit pairs' control images as reference images when the layout is edit-pairs.

Built from FLUX.2's parts (families.flux2_diffusion: transformer, VAE, packing, position ids,
references, loss, sampling), which [klein] shares; what is [dev]'s own is its text part: a
Mistral-Small-3.x encoder (Mistral3ForConditionalGeneration, with a PixtralProcessor in the pipeline's
`tokenizer` slot) reading the prompt after FLUX.2's system message, whose hidden layers 10, 20 and 30
make the prompt embedding; and its guidance-distilled transformer's guidance input.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kubetune_trainer.models import tiny_models
from kubetune_trainer.families import flux2_diffusion as flux
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.results.lora_keys import FLUX2_KOHYA
from kubetune_trainer.families.components import Component

PIPELINE = "Flux2Pipeline"
LAYERS = (10, 20, 30)  # the text encoder's hidden states stacked per token (of 40 layers; 0 is the embeddings)
# [dev] is guidance-distilled: the guidance scale is an input of the transformer, not a second pass.
# The loss's target, noise - latents, is the plain conditional velocity, which is what the model
# gives at guidance 1.0; a higher value asks it for the amplified prediction of a stronger guidance,
# so training there teaches it to give the plain velocity at that setting. musubi-tuner ("use 1.0 as
# guidance scale for FLUX.2 non-base training"), ai-toolkit (cfg_scale 1.0) and SimpleTuner
# (flux_guidance_value 1.0) train at 1.0; samples take spec.validation.guidanceScale, else the row's 4.0
# (Flux2Pipeline's default).
TRAINING_GUIDANCE = 1.0


class MistralText:
    """[dev]'s text part: Mistral-Small-3.x reads the prompt in its chat template after FLUX.2's system
    message; hidden layers 10/20/30 of every token, side by side, are the [B, 512, 3 x 5120] embedding."""

    pipeline = PIPELINE
    layers = LAYERS
    guidance = TRAINING_GUIDANCE

    def __init__(self, root: str, device: torch.device, weight_dtype: torch.dtype):
        from transformers import AutoProcessor, Mistral3ForConditionalGeneration

        self.weight_dtype = weight_dtype
        self.tokenizer = AutoProcessor.from_pretrained(root, subfolder="tokenizer")  # a PixtralProcessor
        self.text_encoder = Mistral3ForConditionalGeneration.from_pretrained(
            root, subfolder="text_encoder", torch_dtype=weight_dtype)

    def settings(self) -> str:
        """What decides the embedding besides the encoder's weights (part of its cache identity)."""
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        return json.dumps([SYSTEM_MESSAGE, self.tokenizer.chat_template, LAYERS, flux.MAX_TEXT_TOKENS])

    @torch.no_grad()
    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        from diffusers import Flux2Pipeline
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        return {"prompt_embeds": Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            self.text_encoder, self.tokenizer, captions, dtype=self.weight_dtype, device=self.text_encoder.device,
            max_sequence_length=flux.MAX_TEXT_TOKENS, system_message=SYSTEM_MESSAGE, hidden_states_layers=LAYERS)}

    @staticmethod
    def sample_guidance(pipeline, asked: float | None) -> float | None:
        """The embedded guidance validation samples with (None: the pipeline's default)."""
        return asked


class Flux2(flux.Flux2Family):
    """Trains FLUX.2 [dev]'s transformer, whole or as a LoRA on every block's attention."""

    TEXT = MistralText


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

# FLUX.2 [dev] (black-forest-labs/FLUX.2-dev): 8 double-stream + 48 single-stream blocks, 48 heads x 128,
# context of 3 x 5120 (32.2B).
FLUX2_DEV_TRANSFORMER = flux.transformer_config(num_layers=8, num_single_layers=48, num_attention_heads=48,
                                                joint_attention_dim=15360, guidance_embeds=True)
# Mistral-Small-3.2-24B-Instruct-2506 (23.3B): a 40-layer Mistral text model and a 24-layer Pixtral vision tower.
MISTRAL_SMALL_3_2 = dict(
    text_config={
        "model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e9}, "bos_token_id": 1, "eos_token_id": 2,
    },
    vision_config={
        "model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "head_dim": 64, "image_size": 1540, "patch_size": 14, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    },
    image_token_index=10, spatial_merge_size=2, vision_feature_layer=-1, projector_hidden_act="gelu",
    multimodal_projector_bias=False,
)
ARCHITECTURE = {
    **flux.image_components(FLUX2_DEV_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "Mistral3ForConditionalGeneration", MISTRAL_SMALL_3_2),
}


def write_tokenizers(out_dir: Path) -> None:
    """The PixtralProcessor stand-in (byte-level; Mistral's Tekken vocabulary cannot be fetched)."""
    tiny_models.tiny_pixtral_processor().save_pretrained(out_dir / "tokenizer")


def write_tiny_flux2(out_dir: Path, seed: int = 0) -> Path:
    """FLUX.2 [dev]'s pipeline: FLUX.2's tiny image side (flux2_diffusion.tiny_image_models) and a
    30-layer Mistral3 of width 16 (so the layers 10/20/30 exist) with a 1-layer Pixtral tower."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = tiny_models.tiny_pixtral_processor()
    tokenizer, width = processor.tokenizer, 16
    image_side = flux.tiny_image_models(width, guidance_embeds=True, seed=seed)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={
            "model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": 32,
            "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "sliding_window": None,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 64, "patch_size": 8},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1,
        projector_hidden_act="gelu", multimodal_projector_bias=False,
    ))
    Flux2Pipeline(text_encoder=text_encoder, tokenizer=processor, **image_side).save_pretrained(
        out_dir, safe_serialization=True)
    return out_dir


DEFINITION = FamilyDefinition(
    family=Flux2,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=flux.planning_forward(guidance=True),
    write_tiny=write_tiny_flux2,
    pipeline=PIPELINE,
    scheduler=flux.scheduler,
    write_tokenizers=write_tokenizers,
    meta_trainable=flux.meta_trainable,
    kohya=FLUX2_KOHYA,
)
