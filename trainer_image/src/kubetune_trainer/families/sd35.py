"""Stable Diffusion 3.5 (medium and large): a LoRA (or full fine-tune) of the MMDiT transformer,
trained by flow matching on captioned images.

As diffusers' StableDiffusion3Pipeline does it, through its own encode_prompt:
- The caption goes to three encoders. CLIP-L's and CLIP-G's penultimate hidden states (77 tokens
  each) side by side, zero-padded to T5's width, then T5-XXL's last hidden states, form the sequence
  [B, 77 + 256, 4096]; the two CLIPs' projected pooled outputs side by side form the global vector
  [B, 2048]. T5 reads T5_TOKENS = 256 tokens, the pipeline's default, so the LoRA trains on the
  sequence it will be sampled with (diffusers' SD3 LoRA example and SimpleTuner train at 77, which
  is cheaper but leaves the 179 further padding tokens of inference unseen). No attention mask
  exists for T5 or the transformer: padding positions keep what T5 gives its pad tokens and are not
  zeroed (SimpleTuner's "zero" T5 padding would train on inputs the pipeline never gives); an empty
  caption (caption dropout) is encoded like the pipeline's default negative prompt "".
- Latents: (z - shift_factor) * scaling_factor of the 16-channel VAE, left unpacked [B, 16, h, w]:
  the transformer cuts its own 2x2 patches.
- The noise level sigma is drawn logit-normal, then shifted by the scheduler's static shift (3.0):
  diffusers' SD3 example draws from the scheduler's shifted training table too. The transformer
  takes sigma * 1000 as its timestep and predicts the velocity noise - z0.

LoRA targets: the shared default (to_q, to_k, to_v, to_out.0: families.lora) names both of
SD 3.5 medium's image attentions, `attn` (joint) and `attn2` (the second, image-only self-attention
of its blocks 0-12, "MMDiT-X"), as well as large's one. The text stream's projections (add_q_proj,
add_k_proj, add_v_proj, to_add_out), which diffusers' example adapts too, are one
spec.adapter.targetModules away. Every target is used in every step (the last block's text stream
has no to_add_out to leave idle), so DDP finds no unused LoRA weight.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from kubetune_trainer.training import diffusion, flow_matching, quantization

from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import load_denoiser, train_denoiser
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families.planning_forwards import CLIP_TOKENS, mse, vae_scale
from kubetune_trainer.families.components import CLIP_BIGG_TEXT, CLIP_L_TEXT, SD_VAE, T5_XXL_ENCODER, Component

PIPELINE = "StableDiffusion3Pipeline"
T5_TOKENS = 256  # StableDiffusion3Pipeline's max_sequence_length default (see above)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # CLIP-L, CLIP-G, T5-XXL


class StableDiffusion3(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        root = spec.model.pretrained
        check_image_sizes(spec, SD3Transformer2DModel.load_config(root, subfolder="transformer"),
                          AutoencoderKL.load_config(root, subfolder="vae"))
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.tokenizer_2 = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer_2")
        self.tokenizer_3 = T5TokenizerFast.from_pretrained(root, subfolder="tokenizer_3")
        self.text_encoder = CLIPTextModelWithProjection.from_pretrained(
            root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(
            root, subfolder="text_encoder_2", torch_dtype=weight_dtype)
        self.text_encoder_3 = T5EncoderModel.from_pretrained(root, subfolder="text_encoder_3", torch_dtype=weight_dtype)
        self.vae = load_vae(spec, AutoencoderKL, weight_dtype)  # the model's own, or spec.model.vae
        self.transformer = load_denoiser(spec, SD3Transformer2DModel, "transformer", weight_dtype)
        self.trainable = train_denoiser(self.transformer, spec, "transformer", PIPELINE, device)

    def frozen_models(self):
        return {name: getattr(self, name) for name in (*TEXT_ENCODERS, "vae")}

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        text = "".join(model_identity(getattr(self, name), f"{root}/{name}", dtype) for name in TEXT_ENCODERS)
        vae = model_identity(self.vae, vae_name(self.spec), self.vae.dtype)
        return {"latents": Encoder("latents", vae, self._vae_moments),
                "text": Encoder("text", text + f"sd35 t5 {T5_TOKENS}", self.encode_prompts)}

    @cached_property
    def _prompt_pipeline(self):
        """The pipeline whose own encode_prompt we call (tokenizers, layers, padding, concatenation)."""
        return self.pipeline()

    @torch.no_grad()
    def _vae_moments(self, pixels):
        stacked = to_device(torch.stack(pixels), self.vae.device, self.vae.dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The joint sequence [B, 77 + T5_TOKENS, 4096] and the pooled vector [B, 2048] (see above), computed
        where the encoders are (spec.model.encoderDevice keeps all three together)."""
        embeds, _, pooled, _ = self._prompt_pipeline.encode_prompt(
            captions, None, None, device=self.text_encoder.device, do_classifier_free_guidance=False,
            max_sequence_length=T5_TOKENS)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        encoded = self.encode_batch(batch)
        config = self.vae.config
        latents = (diffusion.sample_latents(encoded["latents"]["moments"], random) - config.shift_factor
                   ) * config.scaling_factor
        noise, sigmas, noisy = flow_matching.noisy_latents(latents, random, shift=self.scheduler.config.shift)
        text = encoded["text"]
        prediction = model(
            hidden_states=noisy, timestep=sigmas * self.scheduler.config.num_train_timesteps,
            encoder_hidden_states=text["prompt_embeds"], pooled_projections=text["pooled"], return_dict=False,
        )[0]
        return flow_matching.loss(prediction, noise - latents)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(
            transformer=self.transformer, scheduler=self.scheduler, vae=self.vae,
            text_encoder=self.text_encoder, tokenizer=self.tokenizer, text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2, text_encoder_3=self.text_encoder_3, tokenizer_3=self.tokenizer_3,
        )

    @torch.no_grad()
    def sample_images(self, model, held_out, draw):
        prompts = draw.captions(held_out)
        if not prompts:
            return []
        pipeline = self.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        width, height = self.spec.size
        # A fully trained transformer stays in fp32 beside encoders in the training precision.
        with torch.autocast(self.device.type, dtype=self.weight_dtype, enabled=self.weight_dtype != torch.float32):
            return pipeline(prompts, height=height, width=width,
                            num_inference_steps=draw.steps,
                            guidance_scale=draw.guidance, generator=draw.generator(),
                            max_sequence_length=T5_TOKENS).images

    def image_metrics(self, images, held_out, draw, clip):
        return {"clip_score": clip.clip_score(images, draw.captions(held_out))} if images else {}


def check_image_sizes(spec, transformer: dict, vae: dict) -> None:
    """Refuse, before loading weights, the training sizes beyond the transformer's learned position
    embeddings (pos_embed_max_size patches: 3072 px a side for large, 6144 px for medium), buckets
    included. (Sides that 2x2 latent patches do not divide, the API refuses: the row's resolution_multiple.)"""
    from kubetune_trainer.data.buckets import bucket_sizes

    step = 2 ** (len(vae["block_out_channels"]) - 1) * transformer["patch_size"]  # pixels per patch side
    largest = step * (transformer.get("pos_embed_max_size") or 0)
    sizes = bucket_sizes(spec.resolution) if spec.data.bucketing else [spec.size]
    longest = max(side for size in sizes for side in size)
    if largest and longest > largest:
        where = f"bucketing makes sides up to {longest} px" if spec.data.bucketing else f"a side of {longest} px"
        raise ConfigError(f"spec.data.resolution: {where}, beyond the {largest} px this transformer's position "
                          "embeddings cover (pos_embed_max_size); lower it"
                          + (" or turn spec.data.bucketing off" if spec.data.bucketing else ""))


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

# SD 3.5 large (8.06B): 38 joint blocks of 38 heads x 64, no dual attention. SD 3.5 medium (2.24B) differs
# only here: num_layers=24, num_attention_heads=24, caption_projection_dim=1536, pos_embed_max_size=384 and
# dual_attention_layers=(0, ..., 12) (a second, image-only self-attention `attn2` in blocks 0-12). A folder's
# own configs are what `kubetune plan` reads, so either plans as published.
SD35_LARGE_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
    pos_embed_max_size=192, qk_norm="rms_norm",
)
# The 16-channel 8x autoencoder (FLUX.1's architecture, SD3's own normalisation).
SD35_VAE = {**SD_VAE, "latent_channels": 16, "sample_size": 1024, "use_quant_conv": False,
            "use_post_quant_conv": False, "scaling_factor": 1.5305, "shift_factor": 0.0609}
ARCHITECTURE = {
    "transformer": Component("transformer", "diffusers", "SD3Transformer2DModel", SD35_LARGE_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "CLIPTextModelWithProjection", CLIP_L_TEXT),
    "text_encoder_2": Component("text_encoder_2", "transformers", "CLIPTextModelWithProjection", CLIP_BIGG_TEXT),
    "text_encoder_3": Component("text_encoder_3", "transformers", "T5EncoderModel", T5_XXL_ENCODER),
    "vae": Component("vae", "diffusers", "AutoencoderKL", SD35_VAE),
}
# What StableDiffusion3Pipeline.save_pretrained records of the IP-adapter parts we leave out.
MODEL_INDEX = {"image_encoder": [None, None], "feature_extractor": [None, None]}


def scheduler():
    """The flow-matching scheduler all SD 3.5 models ship: a static shift of 3.0."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def write_tokenizers(out_dir: Path) -> None:
    """Stand-ins for the two CLIP tokenizers and T5's (hub vocabularies cannot be fetched)."""
    for name in ("tokenizer", "tokenizer_2"):
        tiny_models.tiny_clip_tokenizer().save_pretrained(out_dir / name)
    tiny_models.tiny_t5_tokenizer(max_length=512).save_pretrained(out_dir / "tokenizer_3")


def _tiny_clip(vocab_size: int, act: str):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=16, hidden_act=act, bos_token_id=0, eos_token_id=1,
        pad_token_id=1))


def write_tiny_sd35(out_dir: Path, seed: int = 0) -> Path:
    """SD 3.5 medium's layout at toy width: a 2-block SD3Transformer2DModel whose block 0 has the second
    attention (attn2), an 8x 16-channel VAE, two 16-wide CLIPs with projections and a 32-wide T5.

    The widths follow the pipeline's rules: CLIP-L + CLIP-G hidden (16 + 16) <= T5's d_model ==
    joint_attention_dim (32); pooled_projection_dim == the two projections (16 + 16)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import T5Config, T5EncoderModel

    clip_tokenizer, t5_tokenizer = tiny_models.tiny_clip_tokenizer(), tiny_models.tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0,),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(16,) * 4, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609,
    )
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler(), vae=vae,
        text_encoder=_tiny_clip(len(clip_tokenizer), "quick_gelu"), tokenizer=clip_tokenizer,  # CLIP-L
        text_encoder_2=_tiny_clip(len(clip_tokenizer), "gelu"), tokenizer_2=clip_tokenizer,  # CLIP-G
        text_encoder_3=t5, tokenizer_3=t5_tokenizer,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: unpacked latents, sigma * 1000, the joint text sequence and pooled vector."""
    transformer, vae = models["transformer"], models["vae"]
    config = transformer.config
    # A [width, height] size counts as the square of its area (families.planning_forwards), in whole patches.
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae) // config.patch_size * config.patch_size
    latents = make((batch, config.in_channels, side, side), dtype)
    with autocast():
        prediction = transformer(
            hidden_states=latents, timestep=make((batch,), torch.float32),
            encoder_hidden_states=make((batch, CLIP_TOKENS + T5_TOKENS, config.joint_attention_dim), dtype),
            pooled_projections=make((batch, config.pooled_projection_dim), dtype), return_dict=False,
        )[0]
    return mse(prediction, latents)


DEFINITION = FamilyDefinition(
    family=StableDiffusion3,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_sd35,
    pipeline=PIPELINE,
    scheduler=scheduler,
    write_tokenizers=write_tokenizers,
    model_index=MODEL_INDEX,
)
