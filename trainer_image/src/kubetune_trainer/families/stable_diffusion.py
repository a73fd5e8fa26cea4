"""Stable Diffusion's parts, composed by the families built on its UNet (sd15, sdxl, pmg).

`UNetDiffusion` is Stable Diffusion itself: its models (scheduler, text encoder(s), VAE, UNet) and
what they do (encode, the denoising loss, pipelines to sample with). What SD1.5 and SDXL do
differently is their text part, passed in: `ClipText` here (one CLIP text encoder), `sdxl.XLText`
(two, with size and crop conditioning). The family decides what trains: sd15 and sdxl train the
UNet; PMG keeps it frozen and trains tokens it appends to the caption's.

Stable Diffusion 1.5's own facts are here too, as PMG is built on SD1.5 as much as sd15 is: its
reference architecture, the scheduler and tokenizer of its config-only folder, its tiny and
full-size random-weight models.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kubetune_trainer.training import diffusion, quantization

from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families.denoiser import load_denoiser
from kubetune_trainer.training.randomness import SampleRandom
from kubetune_trainer.families.components import CLIP_L_TEXT, SD_VAE, Component

# --- Stable Diffusion 1.5's reference architecture and folders -------------------------------------

SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768, attention_head_dim=8,
)
SD15_ARCHITECTURE = {
    "unet": Component("unet", "diffusers", "UNet2DConditionModel", SD15_UNET),
    "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
    "vae": Component("vae", "diffusers", "AutoencoderKL", SD_VAE),
}
SD15_PIPELINE = "StableDiffusionPipeline"
# What StableDiffusionPipeline.save_pretrained records of the safety checker we leave out.
SD15_MODEL_INDEX = {"safety_checker": [None, None], "feature_extractor": [None, None], "requires_safety_checker": False}


def sd15_scheduler():
    """The DDPM training scheduler SD1.5 ships with."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", clip_sample=False, steps_offset=1,
    )


def write_clip_tokenizer(out_dir: Path) -> None:
    """The CLIP tokenizer stand-in (byte-level; hub vocabularies cannot be fetched) of a config-only folder."""
    tiny_models.tiny_clip_tokenizer().save_pretrained(out_dir / "tokenizer")


def write_tiny_sd15(out_dir: Path, seed: int = 0) -> Path:
    from diffusers import StableDiffusionPipeline

    tokenizer = tiny_models.tiny_clip_tokenizer()
    pipeline = StableDiffusionPipeline(
        vae=tiny_models.tiny_vae(seed),
        text_encoder=tiny_models.tiny_clip_text_encoder(len(tokenizer), seed=seed),
        tokenizer=tokenizer,
        unet=tiny_models.tiny_sd_unet(seed=seed),
        scheduler=sd15_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_full_size_sd15(out_dir: Path, seed: int = 0) -> Path:
    """The real SD1.5 architecture (860M-parameter UNet, ViT-L/14 text encoder) with random weights.

    For GPU benchmarks: throughput does not depend on the weights' values.
    """
    from diffusers import StableDiffusionPipeline

    from kubetune_trainer.families.components import build

    torch.manual_seed(seed)
    models = {name: build(component) for name, component in SD15_ARCHITECTURE.items()}
    pipeline = StableDiffusionPipeline(
        **models, tokenizer=tiny_models.tiny_clip_tokenizer(), scheduler=sd15_scheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# --- the parts ----------------------------------------------------------------------------------

class ClipText:
    """SD1.5's text part: one CLIP text encoder, whose last hidden states the UNet cross-attends to."""

    def __init__(self, root: str, device: torch.device, weight_dtype: torch.dtype):
        from transformers import CLIPTextModel, CLIPTokenizer

        self.device = device
        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)

    def models(self) -> dict[str, torch.nn.Module]:
        """The text encoders by their pipeline names, in the order their cache identity reads them."""
        return {"text_encoder": self.text_encoder}

    @torch.no_grad()
    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(
            captions, padding="max_length", truncation=True,
            max_length=self.tokenizer.model_max_length, return_tensors="pt",
        )
        return {"prompt_embeds": self.text_encoder(to_device(tokens.input_ids, self.text_encoder.device))[0]}

    def conditioning(self, batch: dict, text: dict[str, torch.Tensor]) -> dict:
        """Keyword arguments of the UNet besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": text["prompt_embeds"]}


class UNetDiffusion:
    """A UNet denoiser conditioned on a text part's embeddings (`text`: ClipText, sdxl.XLText), with
    its frozen VAE and text encoders (frozen_models(): the family's ModelFamily.frozen_models, which
    the base places). The UNet is loaded but neither made trainable nor moved to the device: the
    family decides what trains."""

    def __init__(self, spec, device: torch.device, weight_dtype: torch.dtype, text: type, pipeline_class: str):
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

        self.spec, self.device, self.weight_dtype = spec, device, weight_dtype
        self.pipeline_class = pipeline_class
        root = spec.model.pretrained
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        self.noise_scheduler = DDPMScheduler.from_pretrained(root, subfolder="scheduler")
        self.text = text(root, device, weight_dtype)
        self.vae = load_vae(spec, AutoencoderKL, weight_dtype)
        self.unet = load_denoiser(spec, UNet2DConditionModel, "unet", weight_dtype)

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        return {**self.text.models(), "vae": self.vae}

    # --- encoders -----------------------------------------------------------------------------

    def encoders(self, owner: str) -> dict[str, Encoder]:
        """The VAE and the text encoder(s) as cacheable encoders; `owner` (the family's name) ends
        the text encoder's identity, so families that read the same captions differently never
        share cache entries."""
        text_identity = "".join(model_identity(m, m.name_or_path, self.weight_dtype)
                                for m in self.text.models().values())
        return {
            "latents": Encoder("latents", model_identity(self.vae, vae_name(self.spec), self.vae.dtype), self.vae_moments),
            "text": Encoder("text", text_identity + owner, self.encode_prompts),
        }

    @torch.no_grad()
    def vae_moments(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean and log-variance of each latent, not a sample: the noise is drawn at training time."""
        stacked = to_device(torch.stack(pixels), self.vae.device, self.vae.dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return self.text.encode(captions)

    def sample_latents(self, moments: torch.Tensor, random: SampleRandom) -> torch.Tensor:
        latents = diffusion.sample_latents(moments, random)
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return (latents - shift) * self.vae.config.scaling_factor

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
        prediction = unet(noisy, timesteps, **self.text.conditioning(batch, text)).sample
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
            self.spec.model.pretrained, unet=self.unet, vae=self.vae, dtype=self.weight_dtype, **self.text.models(),
            **({"safety_checker": None, "requires_safety_checker": False}
               if self.pipeline_class == SD15_PIPELINE else {}),
        )

    def sampling_pipeline(self):
        """pipeline() with a few-step solver, quiet."""
        from diffusers import DPMSolverMultistepScheduler

        pipeline = self.pipeline()
        pipeline.scheduler = DPMSolverMultistepScheduler.from_config(pipeline.scheduler.config)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def sampling_options(self, draw: Draw) -> dict:
        (width, height), guidance = self.spec.size, draw.guidance
        return {"num_inference_steps": draw.steps, "height": height, "width": width,
                "generator": draw.generator(), "output_type": "pil",
                **({"guidance_scale": guidance} if guidance is not None else {})}

    @torch.no_grad()
    def sample_images(self, held_out: list[dict], draw: Draw) -> list:
        """The draw's captions drawn with the UNet as it is being trained."""
        prompts = draw.captions(held_out)
        if not prompts:
            return []
        return self.sampling_pipeline()(prompts, **self.sampling_options(draw)).images

    def clip_metrics(self, images: list, held_out: list[dict], draw: Draw, clip) -> dict[str, float]:
        """clip_score of images drawn from draw.captions(held_out)."""
        return {"clip_score": clip.clip_score(images, draw.captions(held_out))} if images else {}
