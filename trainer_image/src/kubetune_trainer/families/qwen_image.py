"""Qwen-Image: a text-to-image LoRA (or full fine-tune) on the transformer, trained by flow matching
on captioned images.

As in diffusers' QwenImagePipeline: the caption goes through the Qwen2.5-VL encoder (its language
model; the vision tower stays idle) inside the pipeline's chat template, whose system-prompt tokens
are dropped; what Qwen-Image-Edit does besides (control images after the target) does not apply.
The VAE, the latents' normalisation and packing, the loss and the LoRA are families.qwen_parts'.
"""
from __future__ import annotations

from functools import cached_property, partial
from pathlib import Path

import torch

from kubetune_trainer.training import diffusion
from kubetune_trainer.data.cache import Encoder
from kubetune_trainer.families import qwen_parts
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.results.lora_keys import DIFFUSION_MODEL
from kubetune_trainer.families.planning_forwards import QWEN_PROMPT_TOKENS, QWEN_TEMPLATE_TOKENS

PIPELINE = "QwenImagePipeline"


class QwenImage(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.qwen = qwen_parts.QwenImageParts(spec, device, weight_dtype, PIPELINE, processor=False)
        self.transformer = self.qwen.transformer
        self.trainable = self.qwen.trainable

    def frozen_models(self):
        return self.qwen.frozen_models()

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        prompts = self._prompt_pipeline
        text = self.qwen.text_identity(prompts, [prompts.tokenizer_max_length]) + "qwen-image"
        return {"latents": self.qwen.latents_encoder(), "text": Encoder("text", text, self.encode_prompts)}

    @cached_property
    def _prompt_pipeline(self):
        """The pipeline whose own prompt encoding (template, dropped prefix, length) we call."""
        return self.qwen.pipeline()

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The VL encoder's last hidden states of each caption, template prefix dropped, at most
        1024 tokens; rows padded with zeros to the longest, `mask` marking the real tokens."""
        embeds, mask = self._prompt_pipeline._get_qwen_prompt_embeds(captions, self.qwen.text_encoder.device,
                                                                       self.weight_dtype)
        return {"prompt_embeds": embeds, "mask": mask}

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        encoded = self.encode_batch(batch)
        target = self.qwen.normalised(diffusion.sample_latents(encoded["latents"]["moments"], random))
        return self.qwen.loss(model, target, [], encoded["text"], random)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        return self.qwen.pipeline()

    @torch.no_grad()
    def sample_images(self, model, held_out, draw):
        """Each validation prompt drawn on its own (the pipeline's negative prompt is one for the
        batch), with true classifier-free guidance (the row's 4.0, as the model card samples, or
        the draw's guidance) against a blank negative prompt."""
        prompts = draw.captions(held_out)
        if not prompts:
            return []
        pipeline, generator = self.qwen.sampling_pipeline(), draw.generator()
        width, height = self.spec.size
        return [pipeline(prompt=prompt, negative_prompt=" ", true_cfg_scale=draw.guidance, height=height,
                         width=width, num_inference_steps=draw.steps,
                         generator=generator).images[0]
                for prompt in prompts]

    def image_metrics(self, images, held_out, draw, clip):
        return {"clip_score": clip.clip_score(images, draw.captions(held_out))} if images else {}


# --- declarations: reference architecture, folders, tiny model, planning (families.qwen_parts) -----

def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: the target's tokens alone, a caption's embeddings and mask."""
    return qwen_parts.planning_forward(models, spec, make, autocast, dtype, references=0,
                                       text_tokens=QWEN_PROMPT_TOKENS + QWEN_TEMPLATE_TOKENS)


def write_tiny_qwen_image(out_dir: Path, seed: int = 0) -> Path:
    """Qwen-Image's pipeline: the tiny Qwen-Image models (families.qwen_parts.write_tiny), no processor."""
    return qwen_parts.write_tiny(out_dir, PIPELINE, seed, processor=False)


DEFINITION = FamilyDefinition(
    family=QwenImage,
    architecture=qwen_parts.architecture(),
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_qwen_image,
    pipeline=PIPELINE,
    scheduler=qwen_parts.scheduler,
    write_tokenizers=partial(qwen_parts.write_tokenizers, processor=False),
    meta_trainable=qwen_parts.meta_trainable,
    kohya=DIFFUSION_MODEL,
)
