"""Qwen-Image-Edit-2509 / -2511: an image-editing LoRA on the transformer, trained by flow matching on
edit pairs with one to three control (reference) images each.

As in diffusers' QwenImageEditPlusPipeline: the instruction goes through the Qwen2.5-VL encoder with
every reference image ("Picture 1: <image> Picture 2: <image> ..." before it, each reference resized
to about 384x384 pixels as the pipeline does), template prefix dropped; each reference's clean latent
tokens follow the noisy target's, in order, `img_shapes` listing the target then each reference (with
2511's zero_cond_t the transformer modulates the reference tokens as clean, t = 0); the loss is the
velocity noise - target on the target's tokens only (families.qwen_parts).

Batching: the pipeline's prompt encoder takes one prompt with its references, so prompts are encoded
one sample at a time (then padded and masked together); the transformer's RoPE reads the first
sample's geometry for the whole batch, so a batch holds samples of one size and one number of
references (data.keyed groups them). The references enter the VAE at the training image's size and
crop; the pipeline resizes them to about 1024x1024 pixels, the same thing at the usual training
resolution of 1024 (validation samples encode them at the training size too, as training does).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import cached_property, partial
from pathlib import Path

import torch

from kubetune_api.families import FAMILIES
from kubetune_trainer.training import diffusion
from kubetune_trainer.data.cache import Encoder, stack_padded
from kubetune_trainer.families import editing, qwen_parts
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.results.lora_keys import DIFFUSION_MODEL
from kubetune_trainer.families.planning_forwards import QWEN_PROMPT_TOKENS, QWEN_TEMPLATE_TOKENS, qwen_image_tokens

PIPELINE = "QwenImageEditPlusPipeline"
CONDITION_SIDE = 384        # the pipeline's CONDITION_IMAGE_SIZE is 384 * 384 pixels per reference for the VL encoder
PICTURE_LABEL_TOKENS = 6    # "Picture N: " and the vision start/end tokens around each reference's


class QwenImageEditPlus(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.qwen = qwen_parts.QwenImageParts(spec, device, weight_dtype, PIPELINE, processor=True)
        self.transformer = self.qwen.transformer
        self.trainable = self.qwen.trainable

    def frozen_models(self):
        return self.qwen.frozen_models()

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE

        text = self.qwen.text_identity(
            self._prompt_pipeline, [self.qwen.processor.image_processor.to_json_string(), CONDITION_IMAGE_SIZE])
        return {"latents": self.qwen.latents_encoder(),
                "text": Encoder("text", text + "qwen-image-edit-plus", self.encode_prompts)}

    @cached_property
    def _prompt_pipeline(self):
        """The pipeline whose own prompt encoding (template, picture labels, processor, dropped prefix) we call."""
        return self.qwen.pipeline()

    @torch.no_grad()
    def encode_prompts(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The VL encoder's last hidden states of (instruction, control images [R, 3, H, W]), template
        prefix dropped, one sample at a time (as the pipeline encodes); rows zero-padded to the
        longest, `mask` marking the real tokens."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

        from kubetune_trainer.data.images import to_pil

        pipeline = self._prompt_pipeline
        embeds, masks = [], []
        for caption, controls in items:
            images = []
            for image in (to_pil(pixels) for pixels in controls):
                width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
                images.append(pipeline.image_processor.resize(image, height, width))
            embed, mask = pipeline._get_qwen_prompt_embeds([caption], images, self.qwen.text_encoder.device,
                                                           self.weight_dtype)
            embeds.append(embed[0])
            masks.append(mask[0])
        return {"prompt_embeds": stack_padded(embeds), "mask": stack_padded(masks)}

    def encode_batch(self, batch):
        targets, controls = list(batch["pixel_values"]), batch["control_values"]  # [B, R, 3, H, W]
        references = list(controls.flatten(0, 1))
        items = list(zip(batch["captions"], controls))
        return {"target": self.encode("latents", targets, self.mirror_variants(targets)),
                "references": self.encode("latents", references, self.mirror_variants(references)),
                "text": self.encode("text", items, editing.instruction_variants(self, items, batch["full_captions"]))}

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        encoded = self.encode_batch(batch)
        target = self.qwen.normalised(diffusion.sample_latents(encoded["target"]["moments"], random))
        references = self.qwen.normalised(self.qwen.mode(encoded["references"]["moments"]))  # as at inference
        per_sample = references.unflatten(0, batch["control_values"].shape[:2])  # [B, R, C, h, w]
        return self.qwen.loss(model, target, list(per_sample.unbind(1)), encoded["text"], random)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        return self.qwen.pipeline()

    @torch.no_grad()
    def sample_images(self, model, held_out, draw):
        """Each of the first held-out pairs edited from all its references (the pipeline takes one
        prompt at a time), with true classifier-free guidance (the row's 4.0, as the model card
        samples, or the draw's guidance) against a blank negative prompt."""
        from kubetune_trainer.data.images import to_pil

        pairs = draw.pairs(held_out)
        if not pairs:
            return []
        pipeline, generator = self.qwen.sampling_pipeline(), draw.generator()
        width, height = self.spec.size
        with references_for_the_vae_at(width * height):
            return [pipeline(image=[to_pil(pixels) for pixels in controls], prompt=caption, negative_prompt=" ",
                             true_cfg_scale=draw.guidance, height=height, width=width,
                             num_inference_steps=draw.steps, generator=generator).images[0]
                    for controls, caption in pairs]

    def image_metrics(self, images, held_out, draw, clip):
        return editing.clip_directional(images, draw.pairs(held_out), clip)


@contextmanager
def references_for_the_vae_at(area: int):
    """QwenImageEditPlusPipeline resizes each reference for the VAE to about VAE_IMAGE_SIZE pixels (a
    module constant, 1024 * 1024): here to `area`, the training images' (the same at 1024 px)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    published = module.VAE_IMAGE_SIZE
    module.VAE_IMAGE_SIZE = area
    try:
        yield
    finally:
        module.VAE_IMAGE_SIZE = published


# --- declarations: reference architecture, folders, tiny model, planning (families.qwen_parts) -----

def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call with as many references as the family takes (its row's
    max_references, the most costly sample): target then reference tokens, the VL encoder's
    embeddings of the instruction and every reference."""
    references = FAMILIES["qwen-image-edit-plus"].max_references
    text_tokens = (references * (qwen_image_tokens(CONDITION_SIDE) + PICTURE_LABEL_TOKENS)
                   + QWEN_PROMPT_TOKENS + QWEN_TEMPLATE_TOKENS)
    return qwen_parts.planning_forward(models, spec, make, autocast, dtype, references=references,
                                       text_tokens=text_tokens)


def write_tiny_qwen_image_edit_plus(out_dir: Path, seed: int = 0) -> Path:
    """Qwen-Image-Edit-2511's pipeline: the tiny Qwen-Image models (families.qwen_parts.write_tiny) with
    zero_cond_t, and the processor."""
    return qwen_parts.write_tiny(out_dir, PIPELINE, seed, zero_cond_t=True)


DEFINITION = FamilyDefinition(
    family=QwenImageEditPlus,
    # Qwen-Image-Edit-2511 (2509 is the same without zero_cond_t: the same parameters).
    architecture=qwen_parts.architecture(zero_cond_t=True),
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_qwen_image_edit_plus,
    pipeline=PIPELINE,
    scheduler=qwen_parts.scheduler,
    write_tokenizers=partial(qwen_parts.write_tokenizers, processor=True),
    meta_trainable=qwen_parts.meta_trainable,
    kohya=DIFFUSION_MODEL,
)
