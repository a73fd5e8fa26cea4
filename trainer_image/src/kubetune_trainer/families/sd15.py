"""Stable Diffusion 1.5: LoRA (or full) fine-tuning of the UNet on captioned images."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from kubetune_trainer import diffusion, quantization
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.data.captions import CaptionsDataset, collate, read_captions
from kubetune_trainer.families.base import ModelFamily, save_diffusers_model
from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS, attach_lora, load_lora_init, lora_layers
from kubetune_trainer.randomness import SampleRandom



class StableDiffusion15(ModelFamily):
    """A UNet denoiser conditioned on CLIP text embeddings; SDXL extends it."""

    pipeline_class = "StableDiffusionPipeline"

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

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
        self.attach_trainable_weights()
        self.unet.to(device)
        self.unet.train()

    def attach_trainable_weights(self) -> None:
        adapter = self.spec.adapter
        if adapter.type == "full":
            self.unet.requires_grad_(True)
            return
        attach_lora(self.unet, adapter, DIFFUSERS_ATTENTION_TARGETS)
        if adapter.init_from:
            load_lora_init(self.unet, adapter.init_from, "unet")

    def load_text_encoders(self, root: str) -> None:
        from transformers import CLIPTextModel, CLIPTokenizer

        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder",
                                                          torch_dtype=self.weight_dtype)
        self.text_encoders = [self.text_encoder]

    @property
    def trainable_module(self) -> torch.nn.Module:
        return self.unet

    # --- data ---------------------------------------------------------------------------------

    def read_samples(self):
        return read_captions(Path(self.spec.data.uri), self.screen)

    def make_dataset(self, samples, training):
        data = self.spec.data
        transform = self.image_transform(training)
        return CaptionsDataset(samples, transform, data.caption_dropout if training else 0.0,
                               self.spec.training.seed, data.bucketing)

    def collate(self, items):
        return collate(items)

    # --- encoders -----------------------------------------------------------------------------

    @cached_property
    def _encoders(self) -> dict[str, Encoder]:
        root = self.spec.model.pretrained
        text_identity = "".join(model_identity(m, m.name_or_path, self.weight_dtype)
                                for m in self.text_encoders)
        return {
            "latents": Encoder("latents", model_identity(self.vae, f"{root}/vae", self.weight_dtype), self._vae_moments),
            "text": Encoder("text", text_identity + type(self).__name__, self.encode_prompts),
        }

    def encoders(self):
        return self._encoders

    @torch.no_grad()
    def _vae_moments(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean and log-variance of each latent, not a sample: the noise is drawn at training time."""
        stacked = torch.stack(pixels).to(self.device, dtype=self.weight_dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(
            captions, padding="max_length", truncation=True,
            max_length=self.tokenizer.model_max_length, return_tensors="pt",
        )
        return {"prompt_embeds": self.text_encoder(tokens.input_ids.to(self.device))[0]}

    def encode_batch(self, batch):
        pixels = list(batch["pixel_values"])
        return {"latents": self.encode("latents", pixels, self.mirror_variants(pixels)),
                "text": self.encode("text", batch["captions"],
                                    self.caption_variants(batch["captions"],
                                                          batch.get("full_captions", batch["captions"])))}

    def sample_latents(self, moments: torch.Tensor, random: SampleRandom) -> torch.Tensor:
        latents = diffusion.sample_latents(moments, random)
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return (latents - shift) * self.vae.config.scaling_factor

    def denoiser(self, model: torch.nn.Module) -> torch.nn.Module:
        """The UNet to call: the prepared trainable module itself (PMG trains something else)."""
        return model

    def conditioning(self, model: torch.nn.Module, batch: dict, text: dict[str, torch.Tensor]) -> dict:
        """Keyword arguments of the UNet besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": text["prompt_embeds"]}

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        training = self.spec.training
        encoded = self.encode_batch(batch)
        latents = self.sample_latents(encoded["latents"]["moments"], random)
        noise = diffusion.sample_noise(latents, random, training.noise_offset)
        timesteps = diffusion.sample_timesteps(random, self.noise_scheduler.config.num_train_timesteps, latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = self.denoiser(model)(noisy, timesteps, **self.conditioning(model, batch, encoded["text"])).sample
        target = diffusion.training_target(self.noise_scheduler, latents, noise, timesteps)
        weights = None
        if training.snr_gamma:
            snr = diffusion.snr(self.noise_scheduler.alphas_cumprod, timesteps)
            weights = diffusion.min_snr_weights(snr, training.snr_gamma, self.noise_scheduler.config.prediction_type)
        return diffusion.denoising_loss(prediction, target, weights)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        """The family's diffusers pipeline around the models being trained (for samples and saving)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class).from_pretrained(
            self.spec.model.pretrained, unet=self.unet, vae=self.vae, dtype=self.weight_dtype,
            **{f"text_encoder{'_' + str(i + 1) if i else ''}": m for i, m in enumerate(self.text_encoders)},
            **({"safety_checker": None, "requires_safety_checker": False}
               if self.pipeline_class == "StableDiffusionPipeline" else {}),
        )

    def validation_prompts(self, held_out: list[dict]) -> list[str]:
        """What sample_images draws: spec.validation.prompts, else, when a CLIP model will score them,
        the first spec.validation.numSamples held-out captions (the same ones at every validation)."""
        validation = self.spec.validation
        if validation.prompts:
            return list(validation.prompts)
        if not validation.clip_model:
            return []
        return [caption for batch in held_out for caption in batch["captions"]][:validation.num_samples]

    def image_metrics(self, images, held_out, clip):
        return {"clip_score": clip.clip_score(images, self.validation_prompts(held_out))} if images else {}

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

    @torch.no_grad()
    def sample_images(self, model, held_out, generator):
        prompts = self.validation_prompts(held_out)
        if not prompts:
            return []
        return self.sampling_pipeline()(prompts, **self.sampling_options(generator)).images

    def save_weights(self, out_dir: Path, trained: dict[str, torch.Tensor]) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.adapter.type == "full":
            return save_diffusers_model(self.unet, trained, out_dir / "unet")
        import diffusers

        getattr(diffusers, self.pipeline_class).save_lora_weights(
            out_dir, unet_lora_layers=lora_layers(self.unet, trained), safe_serialization=True,
            unet_lora_adapter_metadata=self.unet.peft_config["default"].to_dict(),
        )
        return [out_dir / "pytorch_lora_weights.safetensors"]
