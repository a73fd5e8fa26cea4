"""Stable Diffusion 1.5: LoRA (or full) fine-tuning of the UNet on captioned images.

`UNetDiffusion` is Stable Diffusion itself: its models (scheduler, text encoder, VAE, UNet) and
what they do (encode, the denoising loss, pipelines to sample with). The SD1.5 family trains its
UNet; SDXL (families.sdxl) swaps in its two text encoders and size conditioning; PMG (families.pmg)
keeps the UNet frozen and trains tokens it appends to the caption's, through the same parts.
"""
from __future__ import annotations

import torch

from kubetune_trainer import diffusion, quantization
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.device_copy import to_device
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.trainable import diffusers_denoiser
from kubetune_trainer.randomness import SampleRandom


class UNetDiffusion:
    """A UNet denoiser conditioned on CLIP text embeddings, with its frozen encoders; the UNet is
    loaded but neither made trainable nor moved to the device (the family decides what trains)."""

    pipeline_class = "StableDiffusionPipeline"

    def __init__(self, spec, device: torch.device, weight_dtype: torch.dtype):
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

        self.spec, self.device, self.weight_dtype = spec, device, weight_dtype
        root = spec.model.pretrained
        quant = spec.model.quantization
        quantization.check_supported(quant)
        # Frozen weights load in the training precision; trained weights stay in fp32.
        frozen_dtype = weight_dtype if spec.adapter.type == "lora" else torch.float32
        self.noise_scheduler = DDPMScheduler.from_pretrained(root, subfolder="scheduler")
        self.load_text_encoders(root)
        self.vae = AutoencoderKL.from_pretrained(root, subfolder="vae", torch_dtype=weight_dtype)
        self.unet = UNet2DConditionModel.from_pretrained(root, subfolder="unet", torch_dtype=frozen_dtype,
                                                         **quantization.load_kwargs(quant, weight_dtype))
        quantization.apply_after_load(quant, self.unet, weight_dtype)
        for frozen in (*self.text_encoders, self.vae):
            frozen.requires_grad_(False).to(device).eval()

    def load_text_encoders(self, root: str) -> None:
        from transformers import CLIPTextModel, CLIPTokenizer

        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder",
                                                          torch_dtype=self.weight_dtype)
        self.text_encoders = [self.text_encoder]

    # --- encoders -----------------------------------------------------------------------------

    def encoders(self, owner: str) -> dict[str, Encoder]:
        """The VAE and the text encoder(s) as cacheable encoders; `owner` (the family's name) ends
        the text encoder's identity, so families that read the same captions differently never
        share cache entries."""
        root = self.spec.model.pretrained
        text_identity = "".join(model_identity(m, m.name_or_path, self.weight_dtype)
                                for m in self.text_encoders)
        return {
            "latents": Encoder("latents", model_identity(self.vae, f"{root}/vae", self.weight_dtype), self.vae_moments),
            "text": Encoder("text", text_identity + owner, self.encode_prompts),
        }

    @torch.no_grad()
    def vae_moments(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean and log-variance of each latent, not a sample: the noise is drawn at training time."""
        stacked = to_device(torch.stack(pixels), self.device, self.weight_dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(
            captions, padding="max_length", truncation=True,
            max_length=self.tokenizer.model_max_length, return_tensors="pt",
        )
        return {"prompt_embeds": self.text_encoder(to_device(tokens.input_ids, self.device))[0]}

    def sample_latents(self, moments: torch.Tensor, random: SampleRandom) -> torch.Tensor:
        latents = diffusion.sample_latents(moments, random)
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return (latents - shift) * self.vae.config.scaling_factor

    def conditioning(self, batch: dict, text: dict[str, torch.Tensor]) -> dict:
        """Keyword arguments of the UNet besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": text["prompt_embeds"]}

    # --- loss ---------------------------------------------------------------------------------

    def loss(self, unet: torch.nn.Module, batch: dict, encoded: dict, random: SampleRandom,
             extra_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The noise-prediction loss (min-SNR weighted with spec.training.snrGamma) of `unet` on the
        batch's encoded latents and text; `extra_tokens` follow the caption's tokens (PMG's)."""
        training = self.spec.training
        text = encoded["text"]
        if extra_tokens is not None:
            embeds = text["prompt_embeds"]
            text = {**text, "prompt_embeds": torch.cat([embeds, extra_tokens.to(embeds.dtype)], 1)}
        latents = self.sample_latents(encoded["latents"]["moments"], random)
        noise = diffusion.sample_noise(latents, random, training.noise_offset)
        timesteps = diffusion.sample_timesteps(random, self.noise_scheduler.config.num_train_timesteps, latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, **self.conditioning(batch, text)).sample
        target = diffusion.training_target(self.noise_scheduler, latents, noise, timesteps)
        weights = None
        if training.snr_gamma:
            snr = diffusion.snr(self.noise_scheduler.alphas_cumprod, timesteps)
            weights = diffusion.min_snr_weights(snr, training.snr_gamma, self.noise_scheduler.config.prediction_type)
        return diffusion.denoising_loss(prediction, target, weights)

    # --- sampling -----------------------------------------------------------------------------

    def pipeline(self):
        """The diffusers pipeline around these models (the UNet as it is being trained)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class).from_pretrained(
            self.spec.model.pretrained, unet=self.unet, vae=self.vae, dtype=self.weight_dtype,
            **{f"text_encoder{'_' + str(i + 1) if i else ''}": m for i, m in enumerate(self.text_encoders)},
            **({"safety_checker": None, "requires_safety_checker": False}
               if self.pipeline_class == "StableDiffusionPipeline" else {}),
        )

    def sampling_pipeline(self):
        """pipeline() with a few-step solver, quiet."""
        from diffusers import DPMSolverMultistepScheduler

        pipeline = self.pipeline()
        pipeline.scheduler = DPMSolverMultistepScheduler.from_config(pipeline.scheduler.config)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def sampling_options(self, generator: torch.Generator) -> dict:
        size = self.spec.resolution
        return {"num_inference_steps": self.spec.validation.num_inference_steps, "height": size, "width": size,
                "generator": generator, "output_type": "pil"}

    def validation_prompts(self, held_out: list[dict]) -> list[str]:
        """What validation draws: spec.validation.prompts, else, when a CLIP model will score them,
        the first spec.validation.numSamples held-out captions (the same ones at every validation)."""
        validation = self.spec.validation
        if validation.prompts:
            return list(validation.prompts)
        if not validation.clip_model:
            return []
        return [caption for batch in held_out for caption in batch["captions"]][:validation.num_samples]

    def clip_metrics(self, images: list, held_out: list[dict], clip) -> dict[str, float]:
        """clip_score of images drawn from validation_prompts(held_out)."""
        return {"clip_score": clip.clip_score(images, self.validation_prompts(held_out))} if images else {}


class StableDiffusion15(ModelFamily):
    """Trains Stable Diffusion's UNet, whole or as a LoRA; SDXL extends it with its own DIFFUSION."""

    DIFFUSION = UNetDiffusion

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.sd = self.DIFFUSION(spec, device, weight_dtype)
        self.trainable = diffusers_denoiser(self.sd.unet, spec.adapter, "unet", self.sd.pipeline_class)
        self.sd.unet.to(device).train()

    def build_encoders(self) -> dict[str, Encoder]:
        return self.sd.encoders(type(self).__name__)

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    def compute_loss(self, model, batch, random):
        return self.sd.loss(model, batch, self.encode_batch(batch), random)

    @torch.no_grad()
    def sample_images(self, model, held_out, generator):
        prompts = self.sd.validation_prompts(held_out)
        if not prompts:
            return []
        return self.sd.sampling_pipeline()(prompts, **self.sd.sampling_options(generator)).images

    def image_metrics(self, images, held_out, clip):
        return self.sd.clip_metrics(images, held_out, clip)
