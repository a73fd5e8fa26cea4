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

import json
from functools import cached_property
from pathlib import Path

import torch

from kubetune_trainer import diffusion, flow_matching, quantization, tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.device_copy import to_device
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families import editing
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import load_denoiser, train_denoiser
from kubetune_trainer.planning.forwards import mse, qwen_text_tokens, vae_scale
from kubetune_trainer.reference_models import QWEN25_VL_7B, QWEN_IMAGE_TRANSFORMER, QWEN_IMAGE_VAE, Component

PIPELINE = "QwenImageEditPipeline"


class QwenImageEdit(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLProcessor

        root = spec.model.pretrained
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = Qwen2Tokenizer.from_pretrained(root, subfolder="tokenizer")
        self.processor = Qwen2VLProcessor.from_pretrained(root, subfolder="processor")
        self.text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.vae = load_vae(spec, AutoencoderKLQwenImage, weight_dtype)
        self.transformer = load_denoiser(spec, QwenImageTransformer2DModel, "transformer", weight_dtype)
        self.trainable = train_denoiser(self.transformer, spec, "transformer", PIPELINE, device)
        config = self.vae.config
        self.latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(device)
        self.latents_std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(device)

    def frozen_models(self):
        return {"text_encoder": self.text_encoder, "vae": self.vae}

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        vae = model_identity(self.vae, vae_name(self.spec), self.vae.dtype)
        prompts = self._prompt_pipeline  # the template, its dropped prefix and the image preprocessing
        text = model_identity(self.text_encoder, f"{root}/text_encoder", dtype, extra=json.dumps(
            [prompts.prompt_template_encode, prompts.prompt_template_encode_start_idx,
             self.processor.image_processor.to_json_string()]))
        return {"latents": Encoder("latents", vae, self._vae_moments),
                "text": Encoder("text", text + "qwen-image-edit", self.encode_prompts)}

    @cached_property
    def _prompt_pipeline(self):
        """The pipeline whose own prompt encoding (template, processor, dropped prefix) we call."""
        return self.pipeline()

    @torch.no_grad()
    def _vae_moments(self, pixels):
        stacked = to_device(torch.stack(pixels).unsqueeze(2), self.vae.device, self.vae.dtype)  # one video frame
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

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
                "text": self.encode("text", pairs, self._text_variants(pairs, batch["full_captions"]))}

    def _text_variants(self, pairs: list[tuple[str, torch.Tensor]], full: list[str]) -> list[list[tuple]]:
        """The instruction reads the control image too: its mirror, and the caption dropout did not
        draw, are the other forms an epoch may draw (a dropped control image is not among them)."""
        captions = self.caption_variants([caption for caption, _ in pairs], full)
        mirrors = self.mirror_variants([control for _, control in pairs])
        variants = []
        for (caption, control), other_captions, other_controls in zip(pairs, captions, mirrors):
            forms = [(c, image) for c in [caption, *other_captions] for image in [control, *other_controls]]
            variants.append(forms[1:])  # the first is the pair itself
        return variants

    def _normalised(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, 1, H, W] VAE latents -> [B, C, H, W], normalised as the pipeline does."""
        return ((latents - self.latents_mean.to(latents.dtype)) / self.latents_std.to(latents.dtype))[:, :, 0]

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        from diffusers import QwenImageEditPipeline

        encoded = self.encode_batch(batch)
        target = self._normalised(diffusion.sample_latents(encoded["target"]["moments"], random))
        control = self._normalised(encoded["control"]["moments"].chunk(2, dim=1)[0])  # the mode, as at inference
        batch_size, channels, height, width = target.shape
        noise, sigmas, noisy = flow_matching.noisy_latents(target, random)

        pack = QwenImageEditPipeline._pack_latents
        tokens = pack(noisy, batch_size, channels, height, width)
        control_height, control_width = control.shape[2:]
        img_shapes = [[(1, height // 2, width // 2), (1, control_height // 2, control_width // 2)]] * batch_size
        embeds, mask = self._trimmed_text(encoded["text"])
        guidance = (torch.full((batch_size,), 1.0, device=self.device)
                    if self.transformer.config.guidance_embeds else None)
        prediction = model(
            hidden_states=torch.cat([tokens, pack(control, batch_size, channels, control_height, control_width)], dim=1),
            timestep=sigmas.to(target.dtype), guidance=guidance, encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False,
        )[0][:, :tokens.shape[1]]
        velocity = pack(noise - target, batch_size, channels, height, width)
        return flow_matching.loss(prediction, velocity)

    @staticmethod
    def _trimmed_text(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop the padding columns no sample of the batch uses (cached rows may carry extra)."""
        mask = text["mask"]
        length = int(mask.sum(dim=1).max())
        return text["prompt_embeds"][:, :length], mask[:, :length]

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import QwenImageEditPipeline

        return QwenImageEditPipeline(
            scheduler=self.scheduler, vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
            processor=self.processor, transformer=self.transformer,
        )

    @torch.no_grad()
    def sample_images(self, model, held_out, generator):
        from kubetune_trainer.data.images import to_pil

        pairs = editing.held_out_pairs(self.spec, held_out)
        if not pairs:
            return []
        pipeline = self.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        width, height = self.spec.size
        return [pipeline(image=to_pil(control), prompt=caption, negative_prompt=" ", true_cfg_scale=self.spec.sample_guidance,
                         height=height, width=width, num_inference_steps=self.spec.validation.num_inference_steps,
                         generator=generator).images[0]
                for [control], caption in pairs]

    def image_metrics(self, images, held_out, clip):
        return editing.clip_directional(images, editing.held_out_pairs(self.spec, held_out), clip)


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

ARCHITECTURE = {
    "transformer": Component("transformer", "diffusers", "QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),
    "vae": Component("vae", "diffusers", "AutoencoderKLQwenImage", QWEN_IMAGE_VAE),
}


def scheduler():
    """Qwen-Image's flow-matching scheduler (exponential time shift, shift_terminal 0.02)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )


def write_tokenizers(out_dir: Path) -> None:
    """The Qwen2 tokenizer stand-in and the Qwen2-VL processor (the published preprocessing's defaults)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = tiny_models.tiny_qwen2_tokenizer()
    tokenizer.save_pretrained(out_dir / "tokenizer")
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor()).save_pretrained(out_dir / "processor")


def write_tiny_qwen_image_edit(out_dir: Path, seed: int = 0) -> Path:
    """Qwen-Image-Edit's pipeline: a 1-block QwenImageTransformer2DModel, an 8x AutoencoderKLQwenImage,
    a 2-layer Qwen2.5-VL text encoder with a 2-block vision tower, and the Qwen2-VL processor."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    tokenizer = tiny_models.tiny_qwen2_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tiny_models.QWEN_SPECIAL_TOKENS}
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    ))
    # The vision tower sees at most 112x112 pixels: 16 patches, 4 tokens after the 2x2 merge.
    pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(**pixels))
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    pipeline = QwenImageEditPipeline(scheduler=scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                     processor=processor, transformer=transformer)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: target then control tokens, the VL encoder's embeddings and mask."""
    transformer, vae = models["transformer"], models["vae"]
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae)
    tokens, width = (side // 2) ** 2, vae.config.z_dim * 4
    text_tokens = qwen_text_tokens(spec.resolution)
    with autocast():
        prediction = transformer(
            hidden_states=make((batch, 2 * tokens, width), dtype), timestep=make((batch,), dtype),
            guidance=make((batch,), torch.float32) if transformer.config.guidance_embeds else None,
            encoder_hidden_states=make((batch, text_tokens, transformer.config.joint_attention_dim), dtype),
            encoder_hidden_states_mask=make((batch, text_tokens), torch.long),
            img_shapes=[[(1, side // 2, side // 2), (1, side // 2, side // 2)]] * batch, return_dict=False,
        )[0][:, :tokens]
    return mse(prediction, make((batch, tokens, width), dtype))


DEFINITION = FamilyDefinition(
    family=QwenImageEdit,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_qwen_image_edit,
    pipeline=PIPELINE,
    scheduler=scheduler,
    write_tokenizers=write_tokenizers,
)
