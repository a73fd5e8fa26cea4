"""Stable Diffusion 1.5: LoRA (or full) fine-tuning of the UNet on captioned images."""
from __future__ import annotations

from pathlib import Path

import torch

from kubetune_trainer import diffusion
from kubetune_trainer.data.captions import CaptionsDataset, collate
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.families.base import ModelFamily

# The attention projections the diffusers LoRA recipes adapt by default.
DEFAULT_LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


class StableDiffusion15(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        root = spec.model.pretrained
        # Frozen weights load in the training precision; trained weights stay in fp32.
        frozen_dtype = weight_dtype if spec.adapter.type == "lora" else torch.float32
        self.noise_scheduler = DDPMScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.vae = AutoencoderKL.from_pretrained(root, subfolder="vae", torch_dtype=weight_dtype)
        self.unet = UNet2DConditionModel.from_pretrained(root, subfolder="unet", torch_dtype=frozen_dtype)
        for frozen in (self.text_encoder, self.vae):
            frozen.requires_grad_(False).to(device).eval()
        self._attach_trainable_weights()
        self.unet.to(device)
        self.unet.train()

    def _attach_trainable_weights(self) -> None:
        adapter = self.spec.adapter
        if adapter.type == "full":
            self.unet.requires_grad_(True)
            return
        from peft import LoraConfig

        self.unet.requires_grad_(False)
        self.unet.add_adapter(LoraConfig(
            r=adapter.rank,
            lora_alpha=adapter.alpha or adapter.rank,
            lora_dropout=adapter.dropout,
            init_lora_weights="gaussian",
            target_modules=adapter.target_modules or DEFAULT_LORA_TARGETS,
        ))
        for param in self.unet.parameters():
            if param.requires_grad:
                param.data = param.data.float()

    @property
    def trainable_module(self) -> torch.nn.Module:
        return self.unet

    def build_dataset(self):
        data = self.spec.data
        transform = ImageTransform(data.resolution, data.center_crop, data.random_flip)
        return CaptionsDataset(Path(data.uri), transform, data.caption_dropout, self.spec.training.seed)

    def collate(self, items):
        return collate(items)

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(
            captions, padding="max_length", truncation=True,
            max_length=self.tokenizer.model_max_length, return_tensors="pt",
        )
        return self.text_encoder(tokens.input_ids.to(self.device))[0]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        pixels = pixels.to(self.device, dtype=self.weight_dtype)
        latents = self.vae.encode(pixels).latent_dist.sample(generator=generator)
        return latents * self.vae.config.scaling_factor

    def compute_loss(self, model, batch, generator):
        training = self.spec.training
        latents = self.encode_images(batch["pixel_values"], generator)
        prompt_embeds = self.encode_prompts(batch["captions"])
        noise = diffusion.sample_noise(latents, generator, training.noise_offset)
        timesteps = diffusion.sample_timesteps(
            latents.shape[0], self.noise_scheduler.config.num_train_timesteps, generator, latents.device
        )
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = model(noisy, timesteps, prompt_embeds).sample
        target = diffusion.training_target(self.noise_scheduler, latents, noise, timesteps)
        weights = None
        if training.snr_gamma:
            snr = diffusion.snr(self.noise_scheduler.alphas_cumprod, timesteps)
            weights = diffusion.min_snr_weights(snr, training.snr_gamma, self.noise_scheduler.config.prediction_type)
        return diffusion.denoising_loss(prediction, target, weights)

    def save_weights(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.adapter.type == "full":
            self.unet.save_pretrained(out_dir / "unet")
            return sorted((out_dir / "unet").iterdir())
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(self.unet))
        StableDiffusionPipeline.save_lora_weights(
            out_dir, unet_lora_layers=layers, safe_serialization=True,
            unet_lora_adapter_metadata=self.unet.peft_config["default"].to_dict(),
        )
        return [out_dir / "pytorch_lora_weights.safetensors"]
