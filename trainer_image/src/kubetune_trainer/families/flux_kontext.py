"""FLUX.1 Kontext: an image-editing LoRA on the transformer, trained by flow matching on edit pairs.

The control image's latent tokens follow the noisy target's in one sequence (position ids with a
leading 1 mark them as context); the transformer predicts the velocity noise - target for the
target tokens only.
"""
from __future__ import annotations

import torch

from pathlib import Path

from kubetune_trainer.training import diffusion, flow_matching, quantization

from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families import editing
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import load_denoiser, train_denoiser
from kubetune_trainer.results.lora_keys import FLUX_KOHYA
from kubetune_trainer.families.planning_forwards import mse, vae_scale
from kubetune_trainer.families.components import CLIP_L_TEXT, T5_XXL_ENCODER, Component

PIPELINE = "FluxKontextPipeline"
GUIDANCE = 2.5  # the distilled guidance trained with: what FLUX.1 Kontext [dev] samples with by default
MAX_TEXT_TOKENS = 512


class FluxKontext(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        root = spec.model.pretrained
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.tokenizer_2 = T5TokenizerFast.from_pretrained(root, subfolder="tokenizer_2")
        self.text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.text_encoder_2 = T5EncoderModel.from_pretrained(root, subfolder="text_encoder_2", torch_dtype=weight_dtype)
        self.vae = load_vae(spec, AutoencoderKL, weight_dtype)
        self.transformer = load_denoiser(spec, FluxTransformer2DModel, "transformer", weight_dtype)
        self.trainable = train_denoiser(self.transformer, spec, "transformer", PIPELINE, device)

    def frozen_models(self):
        return {"text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2, "vae": self.vae}

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        vae = model_identity(self.vae, vae_name(self.spec), self.vae.dtype)
        text = model_identity(self.text_encoder, f"{root}/text_encoder", dtype) + model_identity(
            self.text_encoder_2, f"{root}/text_encoder_2", dtype)
        return {"latents": Encoder("latents", vae, self._vae_moments),
                "text": Encoder("text", text + "flux-kontext", self.encode_prompts)}

    @torch.no_grad()
    def _vae_moments(self, pixels):
        stacked = to_device(torch.stack(pixels), self.vae.device, self.vae.dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """T5 token embeddings (the sequence) and CLIP's pooled embedding (the global vector)."""
        clip = self.tokenizer(captions, padding="max_length", truncation=True,
                              max_length=self.tokenizer.model_max_length, return_tensors="pt")
        pooled = self.text_encoder(to_device(clip.input_ids, self.text_encoder.device)).pooler_output
        max_length = min(MAX_TEXT_TOKENS, self.tokenizer_2.model_max_length)
        t5 = self.tokenizer_2(captions, padding="max_length", truncation=True, max_length=max_length,
                              return_tensors="pt")
        return {"prompt_embeds": self.text_encoder_2(to_device(t5.input_ids, self.text_encoder_2.device))[0],
                "pooled": pooled}

    def encode_batch(self, batch):
        targets, controls = list(batch["pixel_values"]), list(batch["control_values"][:, 0])  # its one control image
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
    def sample_images(self, model, held_out, draw):
        from kubetune_trainer.data.images import to_pil

        pairs = draw.pairs(held_out)
        if not pairs:
            return []
        pipeline, generator = self.pipeline(), draw.generator()
        pipeline.set_progress_bar_config(disable=True)
        width, height = self.spec.size
        return [pipeline(image=to_pil(control), prompt=caption, height=height, width=width,
                         num_inference_steps=draw.steps,
                         guidance_scale=draw.guidance,
                         generator=generator, max_area=width * height, _auto_resize=False,
                         max_sequence_length=min(MAX_TEXT_TOKENS, self.tokenizer_2.model_max_length)).images[0]
                for [control], caption in pairs]

    def image_metrics(self, images, held_out, draw, clip):
        return editing.clip_directional(images, draw.pairs(held_out), clip)


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

# FLUX.1: 19 double-stream + 38 single-stream blocks, 24 heads x 128, T5 context of width 4096.
FLUX_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), sample_size=1024, use_quant_conv=False, use_post_quant_conv=False,
    shift_factor=0.1159, scaling_factor=0.3611,
)
ARCHITECTURE = {
    "transformer": Component("transformer", "diffusers", "FluxTransformer2DModel", FLUX_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
    "text_encoder_2": Component("text_encoder_2", "transformers", "T5EncoderModel", T5_XXL_ENCODER),
    "vae": Component("vae", "diffusers", "AutoencoderKL", FLUX_VAE),
}


def scheduler():
    """FLUX.1 Kontext [dev]'s flow-matching scheduler, with its resolution-dependent shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def write_tokenizers(out_dir: Path) -> None:
    tiny_models.tiny_clip_tokenizer().save_pretrained(out_dir / "tokenizer")
    tiny_models.tiny_t5_tokenizer(max_length=MAX_TEXT_TOKENS).save_pretrained(out_dir / "tokenizer_2")


def write_tiny_flux_kontext(out_dir: Path, seed: int = 0) -> Path:
    """FLUX.1 Kontext's pipeline: a 1+1-block FluxTransformer2DModel, a 2-level 4-channel VAE, CLIP + T5."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    clip_tokenizer, t5_tokenizer = tiny_models.tiny_clip_tokenizer(), tiny_models.tiny_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0))
    pipeline = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=vae,
        text_encoder=tiny_models.tiny_clip_text_encoder(len(clip_tokenizer), seed=seed), tokenizer=clip_tokenizer,
        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: the noisy target's tokens then the control's, T5's and CLIP's embeddings."""
    transformer, vae = models["transformer"], models["vae"]
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae)
    tokens = (side // 2) ** 2                                   # 2x2 latent patches per token
    width = vae.config.latent_channels * 4
    image = make((batch, 2 * tokens, width), dtype)             # noisy target tokens, then the control's
    text_tokens = MAX_TEXT_TOKENS
    with autocast():
        prediction = transformer(
            hidden_states=image, timestep=make((batch,), dtype),
            guidance=make((batch,), torch.float32) if transformer.config.guidance_embeds else None,
            pooled_projections=make((batch, transformer.config.pooled_projection_dim), dtype),
            encoder_hidden_states=make((batch, text_tokens, transformer.config.joint_attention_dim), dtype),
            txt_ids=make((text_tokens, 3), dtype), img_ids=make((2 * tokens, 3), dtype), return_dict=False,
        )[0][:, :tokens]
    return mse(prediction, make((batch, tokens, width), dtype))


DEFINITION = FamilyDefinition(
    family=FluxKontext,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_flux_kontext,
    pipeline=PIPELINE,
    scheduler=scheduler,
    write_tokenizers=write_tokenizers,
    kohya=FLUX_KOHYA,
)
