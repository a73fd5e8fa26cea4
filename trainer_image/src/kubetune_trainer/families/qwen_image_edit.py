"""Qwen-Image-Edit: an image-editing LoRA on the transformer, trained by flow matching on edit pairs.

As in diffusers' QwenImageEditPipeline: the instruction and the control image go through the
Qwen2.5-VL encoder inside the pipeline's chat template, whose system-prompt tokens are dropped; the
VAE's (video-shaped, one-frame) latents are normalised by latents_mean / latents_std and packed in
2x2 patches; the control image's tokens follow the noisy target's in one sequence (`img_shapes`
lists both), and the transformer predicts the velocity noise - target for the target tokens only.

The text embedding depends on the control pixels too, so its cache entry is keyed on both. The
control image enters both encoders at the training resolution; the pipeline first resizes it to
about 1024x1024 pixels, the same thing at the usual training resolution of 1024.
"""
from __future__ import annotations

from functools import cached_property, partial
from pathlib import Path

import torch

from kubetune_trainer.training import diffusion
from kubetune_trainer.data.cache import Encoder
from kubetune_trainer.families import editing, qwen_parts
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.results.lora_keys import DIFFUSION_MODEL
from kubetune_trainer.families.planning_forwards import qwen_text_tokens

PIPELINE = "QwenImageEditPipeline"


class QwenImageEdit(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.qwen = qwen_parts.QwenImageParts(spec, device, weight_dtype, PIPELINE, processor=True)
        self.transformer, self.text_encoder = self.qwen.transformer, self.qwen.text_encoder
        self.trainable = self.qwen.trainable

    def frozen_models(self):
        return self.qwen.frozen_models()

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        # the template, its dropped prefix and the image preprocessing; "qwen-image-edit" is part of
        # every cached text entry's identity: keep it
        text = self.qwen.text_identity(self._prompt_pipeline, [self.qwen.processor.image_processor.to_json_string()])
        return {"latents": self.qwen.latents_encoder(),
                "text": Encoder("text", text + "qwen-image-edit", self.encode_prompts)}

    @cached_property
    def _prompt_pipeline(self):
        """The pipeline whose own prompt encoding (template, processor, dropped prefix) we call."""
        return self.qwen.pipeline()

    @torch.no_grad()
    def encode_prompts(self, pairs: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The VL encoder's last hidden states of (instruction, control image), template prefix dropped.

        Rows are padded with zeros to the longest in the batch; `mask` marks the real tokens.
        """
        from kubetune_trainer.data.images import to_pil

        captions = [caption for caption, _ in pairs]
        images = [to_pil(pixels) for _, pixels in pairs]
        embeds, mask = self._prompt_pipeline._get_qwen_prompt_embeds(captions, images, self.text_encoder.device,
                                                                       self.weight_dtype)
        return {"prompt_embeds": embeds, "mask": mask}

    def encode_batch(self, batch):
        targets, controls = list(batch["pixel_values"]), list(batch["control_values"][:, 0])  # its one control image
        pairs = list(zip(batch["captions"], controls))
        return {"target": self.encode("latents", targets, self.mirror_variants(targets)),
                "control": self.encode("latents", controls, self.mirror_variants(controls)),
                "text": self.encode("text", pairs, editing.instruction_variants(self, pairs, batch["full_captions"]))}

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        encoded = self.encode_batch(batch)
        target = self.qwen.normalised(diffusion.sample_latents(encoded["target"]["moments"], random))
        control = self.qwen.normalised(self.qwen.mode(encoded["control"]["moments"]))  # as at inference
        return self.qwen.loss(model, target, [control], encoded["text"], random)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        return self.qwen.pipeline()

    @torch.no_grad()
    def sample_images(self, model, held_out, draw):
        from kubetune_trainer.data.images import to_pil

        pairs = draw.pairs(held_out)
        if not pairs:
            return []
        pipeline, generator = self.qwen.sampling_pipeline(), draw.generator()
        width, height = self.spec.size
        return [pipeline(image=to_pil(control), prompt=caption, negative_prompt=" ",
                         true_cfg_scale=draw.guidance, height=height, width=width,
                         num_inference_steps=draw.steps, generator=generator).images[0]
                for [control], caption in pairs]

    def image_metrics(self, images, held_out, draw, clip):
        return editing.clip_directional(images, draw.pairs(held_out), clip)


# --- declarations: reference architecture, folders, tiny model, planning (families.qwen_parts) -----

def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: target then control tokens, the VL encoder's embeddings and mask."""
    return qwen_parts.planning_forward(models, spec, make, autocast, dtype, references=1,
                                       text_tokens=qwen_text_tokens(spec.resolution))


def write_tiny_qwen_image_edit(out_dir: Path, seed: int = 0) -> Path:
    """Qwen-Image-Edit's pipeline: the tiny Qwen-Image models (families.qwen_parts.write_tiny) and the processor."""
    return qwen_parts.write_tiny(out_dir, PIPELINE, seed)


DEFINITION = FamilyDefinition(
    family=QwenImageEdit,
    architecture=qwen_parts.architecture(),
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_qwen_image_edit,
    pipeline=PIPELINE,
    scheduler=qwen_parts.scheduler,
    write_tokenizers=partial(qwen_parts.write_tokenizers, processor=True),
    meta_trainable=qwen_parts.meta_trainable,
    kohya=DIFFUSION_MODEL,
)
