"""Z-Image (Turbo and base): a text-to-image LoRA (or full fine-tune) on the transformer, by flow matching.

As in diffusers' ZImagePipeline: each caption goes through Qwen3's chat template into a Qwen3-4B
base model (`Qwen3Model`, no LM head), whose second-to-last hidden states, padding dropped, are
the caption's tokens (a list of [L_i, 2560] tensors, one length per sample); the FLUX.1-style
VAE's latents are normalised by its shift and scaling factors. The transformer takes lists of
per-sample latents [C, 1, h, w] and caption tokens, patchifies and pads them itself, and builds
its own attention mask, so it would take samples of different sizes in one batch; the trainer
still batches equal sizes (one aspect-ratio bucket per batch), and stacks the outputs.

Two conventions differ from the other flow-matching families (see compute_loss): the transformer's
timestep is 1 - sigma (1 = clean), and it predicts x0 - noise, the negated velocity.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import torch

from kubetune_trainer.training import diffusion, flow_matching, quantization

from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import load_denoiser, train_denoiser
from kubetune_trainer.results.lora_keys import DIFFUSION_MODEL
from kubetune_trainer.families.planning_forwards import mse, vae_scale
from kubetune_trainer.families.components import QWEN3_4B, Component

PIPELINE = "ZImagePipeline"
MAX_TEXT_TOKENS = 512  # the pipeline's max_sequence_length: longer captions are truncated


def check_resolution(spec, vae_config: dict, transformer_config: dict) -> None:
    """Refuse a training size whose latents the transformer cannot cut into whole patches (the
    pipeline refuses such sizes too): sides must be multiples of the VAE's factor times the patch."""
    scale, patch = 2 ** (len(vae_config["block_out_channels"]) - 1), max(transformer_config["all_patch_size"])
    factor = scale * patch
    for side in spec.size:
        if side % factor:
            lower = side // factor * factor
            raise ConfigError(f"spec.data.resolution: {side} is not a multiple of {factor}, which this z-image "
                              f"model needs (VAE {scale}x, {patch}x{patch} patches); use {lower} or {lower + factor}")


class ZImage(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import Qwen2Tokenizer, Qwen3Model

        root = spec.model.pretrained
        check_resolution(spec, AutoencoderKL.load_config(root, subfolder="vae"),
                         ZImageTransformer2DModel.load_config(root, subfolder="transformer"))
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = Qwen2Tokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = Qwen3Model.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.vae = load_vae(spec, AutoencoderKL, weight_dtype)
        self.transformer = load_denoiser(spec, ZImageTransformer2DModel, "transformer", weight_dtype)
        self.trainable = train_denoiser(self.transformer, spec, "transformer", PIPELINE, device)

    def frozen_models(self):
        return {"text_encoder": self.text_encoder, "vae": self.vae}

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        vae = model_identity(self.vae, vae_name(self.spec), self.vae.dtype)
        # The chat template and the token limit shape the embedding as much as the weights do.
        text = model_identity(self.text_encoder, f"{root}/text_encoder", dtype,
                              extra=json.dumps([self.tokenizer.chat_template, MAX_TEXT_TOKENS]))
        return {"latents": Encoder("latents", vae, self._vae_moments),
                "text": Encoder("text", text + "z-image", self.encode_prompts)}

    @cached_property
    def _prompt_pipeline(self):
        """The pipeline whose own prompt encoding (chat template, hidden_states[-2], padding dropped) we call."""
        return self.pipeline()

    @torch.no_grad()
    def _vae_moments(self, pixels):
        stacked = to_device(torch.stack(pixels), self.vae.device, self.vae.dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Each caption's tokens as the pipeline encodes them, zero-padded to the batch's longest;
        `mask` marks the real ones (the cache stores rows, the transformer takes a list)."""
        embeds, _ = self._prompt_pipeline.encode_prompt(
            list(captions),  # a copy: the pipeline writes the templated prompts into the list it is given
            device=self.text_encoder.device, do_classifier_free_guidance=False, max_sequence_length=MAX_TEXT_TOKENS)
        lengths = torch.tensor([len(e) for e in embeds])
        mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
        return {"prompt_embeds": torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True), "mask": mask}

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    def _normalised(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents as the transformer sees them (the pipeline's decode undoes exactly this)."""
        return (latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, batch, random):
        encoded = self.encode_batch(batch)
        latents = self._normalised(diffusion.sample_latents(encoded["latents"]["moments"], random))
        noise, sigmas, noisy = flow_matching.noisy_latents(latents, random)
        text = encoded["text"]
        captions = [embeds[mask.bool()] for embeds, mask in zip(text["prompt_embeds"], text["mask"])]
        # ZImagePipeline's loop: the transformer gets (1000 - t) / 1000 in fp32 for the scheduler's
        # t = 1000 sigma, i.e. 1 - sigma, and its output is negated before the Euler step, which moves
        # along v = noise - x0. So the transformer predicts x0 - noise: the loss is MSE(-output, noise - x0).
        output = model(list(noisy.unsqueeze(2).unbind(0)), 1 - sigmas, captions, return_dict=False)[0]
        prediction = -torch.stack(output).squeeze(2)
        return flow_matching.loss(prediction, noise - latents)

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import ZImagePipeline

        return ZImagePipeline(scheduler=self.scheduler, vae=self.vae, text_encoder=self.text_encoder,
                              tokenizer=self.tokenizer, transformer=self.transformer)

    @torch.no_grad()
    def sample_images(self, model, held_out, draw):
        prompts = draw.captions(held_out)
        if not prompts:
            return []
        pipeline = self.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        width, height = self.spec.size
        return pipeline(prompts, height=height, width=width, num_inference_steps=draw.steps,
                        guidance_scale=draw.guidance, generator=draw.generator(), max_sequence_length=MAX_TEXT_TOKENS).images

    def image_metrics(self, images, held_out, draw, clip):
        return {"clip_score": clip.clip_score(images, draw.captions(held_out))} if images else {}


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

# Tongyi-MAI/Z-Image-Turbo (Z-Image base has the same architecture): 2 noise-refiner, 2 context-refiner
# and 30 main single-stream blocks of width 3840 (30 heads x 128); 6.16B parameters.
Z_IMAGE_TRANSFORMER = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
    n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512),  # the published axes_lens[0]; the class default is 1024
)
# The FLUX.1 autoencoder (16 latent channels, 8x) with Z-Image's published factors.
Z_IMAGE_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), norm_num_groups=32, sample_size=1024, force_upcast=True,
    use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611,
)
ARCHITECTURE = {
    "transformer": Component("transformer", "diffusers", "ZImageTransformer2DModel", Z_IMAGE_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "Qwen3Model", QWEN3_4B),  # as the base model, no LM head
    "vae": Component("vae", "diffusers", "AutoencoderKL", Z_IMAGE_VAE),
}


def scheduler():
    """Z-Image's flow-matching scheduler: a static shift of 3 (the pipeline's sigmas are linear before it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def write_tokenizers(out_dir: Path) -> None:
    tiny_models.tiny_qwen3_tokenizer().save_pretrained(out_dir / "tokenizer")


def write_tiny_z_image(out_dir: Path, seed: int = 0) -> Path:
    """Z-Image's pipeline: a 1+1+1-block ZImageTransformer2DModel of width 32, a 2-layer Qwen3Model
    of width 16 (hidden_states[-2] needs two), a 2-level 16-channel VAE."""
    from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_models.tiny_qwen3_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ))
    transformer = ZImageTransformer2DModel(  # head dim 16 = sum(axes_dims); cap_feat_dim = the text width
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=1, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[1536, 512, 512],
    )
    with torch.no_grad():  # learned padding tokens: give them values a trained model would not have as zero
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(16, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611,
    )
    pipeline = ZImagePipeline(scheduler=scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: per-sample latents [C, 1, h, w] and caption tokens, at the
    longest caption the pipeline keeps (MAX_TEXT_TOKENS: an upper bound on memory)."""
    transformer, vae = models["transformer"], models["vae"]
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae)
    channels = transformer.config.in_channels
    latents = [make((channels, 1, side, side), dtype) for _ in range(batch)]
    captions = [make((MAX_TEXT_TOKENS, transformer.config.cap_feat_dim), dtype) for _ in range(batch)]
    with autocast():
        output = transformer(latents, make((batch,), torch.float32), captions, return_dict=False)[0]
    return mse(-torch.stack(output).squeeze(2), make((batch, channels, side, side), dtype))


DEFINITION = FamilyDefinition(
    family=ZImage,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_z_image,
    pipeline=PIPELINE,
    scheduler=scheduler,
    write_tokenizers=write_tokenizers,
    kohya=DIFFUSION_MODEL,
)
