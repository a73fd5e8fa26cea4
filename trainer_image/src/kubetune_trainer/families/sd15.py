"""Stable Diffusion 1.5: LoRA (or full) fine-tuning of the UNet on captioned images.

Built from Stable Diffusion's parts (families.stable_diffusion: UNetDiffusion with one CLIP text
encoder), which also hold SD1.5's reference architecture and tiny model: PMG shares them.
"""
from __future__ import annotations

import torch

from kubetune_trainer.data.cache import Encoder
from kubetune_trainer.families import stable_diffusion as sd
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import train_denoiser
from kubetune_trainer.results.lora_keys import KOHYA_UNET
from kubetune_trainer.families.planning_forwards import CLIP_TOKENS, mse, vae_scale


class StableDiffusion15(ModelFamily):
    """Trains Stable Diffusion 1.5's UNet, whole or as a LoRA."""

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.sd = sd.UNetDiffusion(spec, device, weight_dtype, sd.ClipText, sd.SD15_PIPELINE)
        self.trainable = train_denoiser(self.sd.unet, spec, "unet", sd.SD15_PIPELINE, device)

    def frozen_models(self):
        return self.sd.frozen_models()

    def build_encoders(self) -> dict[str, Encoder]:
        return self.sd.encoders("StableDiffusion15")  # part of every cached text entry's identity: keep it

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    def compute_loss(self, model, batch, random):
        return self.sd.loss(model, batch, self.encode_batch(batch), random)

    def sample_images(self, model, held_out, draw):
        return self.sd.sample_images(held_out, draw)

    def image_metrics(self, images, held_out, draw, clip):
        return self.sd.clip_metrics(images, held_out, draw, clip)


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's UNet call on the latents and CLIP embeddings the encoders would give."""
    unet, side = models["unet"], spec.resolution // vae_scale(models["vae"])
    batch = spec.training.batch_size
    noisy = make((batch, unet.config.in_channels, side, side), dtype)
    text = make((batch, CLIP_TOKENS, unet.config.cross_attention_dim), dtype)
    with autocast():
        prediction = unet(noisy, make((batch,), torch.long), encoder_hidden_states=text).sample
    return mse(prediction, noisy)


DEFINITION = FamilyDefinition(
    family=StableDiffusion15,
    architecture=sd.SD15_ARCHITECTURE,
    trained="unet",
    quantized="unet",
    forward=planning_forward,
    write_tiny=sd.write_tiny_sd15,
    write_full_size=sd.write_full_size_sd15,
    pipeline=sd.SD15_PIPELINE,
    scheduler=sd.sd15_scheduler,
    write_tokenizers=sd.write_clip_tokenizer,
    model_index=sd.SD15_MODEL_INDEX,
    kohya=KOHYA_UNET,
)
