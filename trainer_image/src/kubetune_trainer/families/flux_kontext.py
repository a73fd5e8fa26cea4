"""FLUX.1 Kontext: an image-editing LoRA on the transformer, trained by flow matching on edit pairs.

The control image's latent tokens follow the noisy target's in one sequence (position ids with a
leading 1 mark them as context); the transformer predicts the velocity noise - target for the
target tokens only.
"""
from __future__ import annotations

import torch

from kubetune_trainer import diffusion, flow_matching
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.device_copy import to_device
from kubetune_trainer.families.editing import EditingFamily

GUIDANCE = 2.5  # the distilled guidance FLUX.1 Kontext [dev] samples with by default
MAX_TEXT_TOKENS = 512


class FluxKontext(EditingFamily):
    PIPELINE = "FluxKontextPipeline"

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        root = spec.model.pretrained
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.tokenizer_2 = T5TokenizerFast.from_pretrained(root, subfolder="tokenizer_2")
        self.text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.text_encoder_2 = T5EncoderModel.from_pretrained(root, subfolder="text_encoder_2", torch_dtype=weight_dtype)
        self.vae = AutoencoderKL.from_pretrained(root, subfolder="vae", torch_dtype=weight_dtype)
        self.transformer = self._load_transformer(FluxTransformer2DModel)
        for frozen in (self.text_encoder, self.text_encoder_2, self.vae):
            frozen.requires_grad_(False).to(device).eval()
        self._prepare_transformer()

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        vae = model_identity(self.vae, f"{root}/vae", dtype)
        text = model_identity(self.text_encoder, f"{root}/text_encoder", dtype) + model_identity(
            self.text_encoder_2, f"{root}/text_encoder_2", dtype)
        return {"latents": Encoder("latents", vae, self._vae_moments),
                "text": Encoder("text", text + "flux-kontext", self.encode_prompts)}

    @torch.no_grad()
    def _vae_moments(self, pixels):
        stacked = to_device(torch.stack(pixels), self.device, self.weight_dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """T5 token embeddings (the sequence) and CLIP's pooled embedding (the global vector)."""
        clip = self.tokenizer(captions, padding="max_length", truncation=True,
                              max_length=self.tokenizer.model_max_length, return_tensors="pt")
        pooled = self.text_encoder(to_device(clip.input_ids, self.device)).pooler_output
        max_length = min(MAX_TEXT_TOKENS, self.tokenizer_2.model_max_length)
        t5 = self.tokenizer_2(captions, padding="max_length", truncation=True, max_length=max_length,
                              return_tensors="pt")
        return {"prompt_embeds": self.text_encoder_2(to_device(t5.input_ids, self.device))[0], "pooled": pooled}

    def encode_batch(self, batch):
        targets, controls = list(batch["pixel_values"]), list(batch["control_values"])
        return {"target": self.encode("latents", targets, self.mirror_variants(targets)),
                "control": self.encode("latents", controls, self.mirror_variants(controls)),
                "text": self.encode("text", batch["captions"],
                                    self.caption_variants(batch["captions"], batch["full_captions"]))}

    def _scaled(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        from diffusers import FluxKontextPipeline

        encoded = self.encode_batch(batch)
        target = self._scaled(diffusion.sample_latents(encoded["target"]["moments"], random))
        control = self._scaled(encoded["control"]["moments"].chunk(2, dim=1)[0])  # the mean, as at inference
        batch_size, channels, height, width = target.shape
        noise, sigmas, noisy = flow_matching.noisy_latents(target, random)

        pack = FluxKontextPipeline._pack_latents
        tokens = pack(noisy, batch_size, channels, height, width)
        ids = FluxKontextPipeline._prepare_latent_image_ids(batch_size, height // 2, width // 2, self.device, target.dtype)
        control_ids = ids.clone()
        control_ids[:, 0] = 1  # the context image sits in a separate position "frame"
        text = encoded["text"]
        guidance = (torch.full((batch_size,), GUIDANCE, device=self.device)
                    if self.transformer.config.guidance_embeds else None)
        prediction = model(
            hidden_states=torch.cat([tokens, pack(control, batch_size, channels, height, width)], dim=1),
            timestep=sigmas.to(target.dtype), guidance=guidance,
            pooled_projections=text["pooled"], encoder_hidden_states=text["prompt_embeds"],
            txt_ids=torch.zeros(text["prompt_embeds"].shape[1], 3, device=self.device, dtype=target.dtype),
            img_ids=torch.cat([ids, control_ids], dim=0), return_dict=False,
        )[0][:, :tokens.shape[1]]
        velocity = pack(noise - target, batch_size, channels, height, width)
        return flow_matching.loss(prediction, velocity)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline(
            scheduler=self.scheduler, vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
            text_encoder_2=self.text_encoder_2, tokenizer_2=self.tokenizer_2, transformer=self.transformer,
        )

    @torch.no_grad()
    def sample_images(self, model, held_out, generator):
        from kubetune_trainer.data.images import to_pil

        pairs = self.held_out_pairs(held_out)
        if not pairs:
            return []
        pipeline = self.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        size = self.spec.resolution
        return [pipeline(image=to_pil(control), prompt=caption, height=size, width=size,
                         num_inference_steps=self.spec.validation.num_inference_steps, guidance_scale=GUIDANCE,
                         generator=generator, max_area=size * size, _auto_resize=False,
                         max_sequence_length=min(MAX_TEXT_TOKENS, self.tokenizer_2.model_max_length)).images[0]
                for control, caption in pairs]
