"""FLUX.2 [klein] (4B, 9B): LoRA (or full) fine-tuning of its transformer by flow matching, text to
image, with the edit pairs' control images as reference images when the layout is edit-pairs.

Built from FLUX.2's parts (families.flux2_diffusion), which [dev] shares; what is [klein]'s own is its
text part: a Qwen3 causal LM reading the prompt in Qwen3's chat template (no system prompt, thinking
off), whose hidden layers 9, 18 and 27 make the prompt embedding; and a transformer without a guidance
input (guidance None). Train the undistilled base checkpoints (FLUX.2-klein-base-4B / -9B, sampled with
real classifier-free guidance); the step-distilled ones (model_index.json is_distilled: true) sample
in a few steps without it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kubetune_trainer.models import tiny_models
from kubetune_trainer.families import flux2_diffusion as flux
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.results.lora_keys import FLUX2_KOHYA
from kubetune_trainer.families.components import QWEN3_4B, Component

PIPELINE = "Flux2KleinPipeline"
LAYERS = (9, 18, 27)  # the text encoder's hidden states stacked per token (of 36 layers; 0 is the embeddings)


class Qwen3Text:
    """[klein]'s text part: Qwen3 reads the prompt as a user turn of its chat template with thinking off;
    hidden layers 9/18/27 of every token, side by side, are the [B, 512, 3 x hidden] embedding."""

    pipeline = PIPELINE
    layers = LAYERS
    guidance = None  # [klein]'s transformer has no guidance embedding

    def __init__(self, root: str, device: torch.device, weight_dtype: torch.dtype):
        from transformers import Qwen2Tokenizer, Qwen3ForCausalLM

        self.weight_dtype = weight_dtype
        self.tokenizer = Qwen2Tokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = Qwen3ForCausalLM.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)

    def settings(self) -> str:
        """What decides the embedding besides the encoder's weights (part of its cache identity)."""
        return json.dumps([self.tokenizer.chat_template, LAYERS, flux.MAX_TEXT_TOKENS])

    @torch.no_grad()
    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        from diffusers import Flux2KleinPipeline

        return {"prompt_embeds": Flux2KleinPipeline._get_qwen3_prompt_embeds(
            self.text_encoder, self.tokenizer, captions, dtype=self.weight_dtype, device=self.text_encoder.device,
            max_sequence_length=flux.MAX_TEXT_TOKENS, hidden_states_layers=LAYERS)}

    @staticmethod
    def sample_guidance(pipeline, asked: float | None) -> float | None:
        """The classifier-free guidance validation samples with (against the empty prompt; None: the
        pipeline's 4.0); a step-distilled model samples without any (the pipeline would ignore it, warning)."""
        return 1.0 if pipeline.config.is_distilled else asked


class Flux2Klein(flux.Flux2Family):
    """Trains FLUX.2 [klein]'s transformer, whole or as a LoRA on every block's attention."""

    TEXT = Qwen3Text


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

# FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-base-4B): 5 double-stream + 20 single-stream blocks,
# 24 heads x 128, context of 3 x 2560 from Qwen3-4B (3.9B). The 9B variant differs in its config files
# only, which `kubetune plan` reads from the model's folder: 8 + 24 blocks, 32 heads (inner 4096),
# joint_attention_dim 12288, and Qwen3-8B as its text encoder (hidden 4096, intermediate 12288,
# 36 layers, untied embeddings): 9.1B + 8.2B.
KLEIN_4B_TRANSFORMER = flux.transformer_config(num_layers=5, num_single_layers=20, num_attention_heads=24,
                                               joint_attention_dim=7680, guidance_embeds=False)
ARCHITECTURE = {
    **flux.image_components(KLEIN_4B_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "Qwen3ForCausalLM", QWEN3_4B),
}
MODEL_INDEX = {"is_distilled": False}  # the base model, the one to train


def write_tokenizers(out_dir: Path) -> None:
    """The Qwen3 tokenizer stand-in (byte-level, with Qwen3's chat template)."""
    tiny_models.tiny_qwen3_tokenizer().save_pretrained(out_dir / "tokenizer")


def write_tiny_flux2_klein(out_dir: Path, seed: int = 0) -> Path:
    """FLUX.2 [klein]'s (base) pipeline: FLUX.2's tiny image side without a guidance embedding
    (flux2_diffusion.tiny_image_models) and a 28-layer Qwen3 of width 16 (so the layers 9/18/27 exist)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer, width = tiny_models.tiny_qwen3_tokenizer(), 16
    image_side = flux.tiny_image_models(width, guidance_embeds=False, seed=seed)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32, num_hidden_layers=28,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        tie_word_embeddings=True, pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ))
    Flux2KleinPipeline(text_encoder=text_encoder, tokenizer=tokenizer, is_distilled=False,
                       **image_side).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


DEFINITION = FamilyDefinition(
    family=Flux2Klein,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=flux.planning_forward(guidance=False),
    write_tiny=write_tiny_flux2_klein,
    pipeline=PIPELINE,
    scheduler=flux.scheduler,
    write_tokenizers=write_tokenizers,
    model_index=MODEL_INDEX,
    meta_trainable=flux.meta_trainable,
    kohya=FLUX2_KOHYA,
)
