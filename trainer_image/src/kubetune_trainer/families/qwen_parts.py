"""What the Qwen-Image families share, as one part each composes: qwen-image (text to image),
qwen-image-edit (one control image) and qwen-image-edit-plus (2509/2511, one to three).

All three are one transformer class (QwenImageTransformer2DModel), one VAE (AutoencoderKLQwenImage),
one text encoder (Qwen2.5-VL) and one scheduler; their pipelines differ in the prompt template, what
the VL encoder also sees (the control images) and how many images follow the target. Shared here:
  * loading: scheduler, tokenizer, (processor), text encoder, VAE, and the transformer loaded and
    trained as every diffusion family's (families.denoiser), without LoRA on the last block's
    modules whose output never reaches the image (unused_lora_modules);
  * the VAE: video-shaped input (one frame), latents normalised by latents_mean / latents_std;
  * the flow-matching loss: the noisy target's 2x2-packed tokens, then each reference image's (clean),
    `img_shapes` listing them in that order, the timestep sigma in [0, 1], no guidance embedding
    (none of the published models has one, and diffusers 0.42.1's guidance path fails), the velocity
    noise - target predicted for the target's tokens only; the text mask passed only where a sample
    is padded (the pipelines pass None otherwise, which lets the attention run unmasked kernels);
  * the published scheduler, the reference architecture, the tiny model and the planning forward.

Every sample of a batch must have the same image geometry: the transformer's RoPE reads the first
sample's `img_shapes` for the whole batch (the sampler batches one aspect bucket and, for edit pairs,
one number of control images at a time: data.keyed).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kubetune_trainer.training import flow_matching, quantization

from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.families.denoiser import load_denoiser, train_denoiser
from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS
from kubetune_trainer.families.trainable import diffusers_denoiser
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families.planning_forwards import mse, vae_scale
from kubetune_trainer.training.randomness import SampleRandom
from kubetune_trainer.families.components import QWEN25_VL_7B, QWEN_IMAGE_TRANSFORMER, QWEN_IMAGE_VAE, Component

# The last block's text stream feeds nothing (the transformer returns the image stream only): these
# get no gradient (to_add_out, txt_mlp: DDP would wait for theirs forever) or a zero one (add_q_proj:
# text queries only make text outputs). verified on the tiny model by tests/trainer/test_family_qwen_image.py.
UNUSED_IN_LAST_BLOCK = ("attn.to_add_out", "attn.add_q_proj", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def unused_lora_modules(transformer: torch.nn.Module, targets: list[str] | None) -> list[str]:
    """The last block's modules in UNUSED_IN_LAST_BLOCK that `targets` (peft's rule: a name or a
    dotted suffix; None: the default attention targets) would give a LoRA."""
    last = len(transformer.transformer_blocks) - 1
    names = [f"transformer_blocks.{last}.{module}" for module in UNUSED_IN_LAST_BLOCK]
    targets = targets or DIFFUSERS_ATTENTION_TARGETS
    return [name for name in names if any(name == target or name.endswith(f".{target}") for target in targets)]


class QwenImageParts:
    """Qwen-Image's models loaded from spec.model.pretrained, the transformer trainable, and what the
    three families do with them alike. `pipeline`: the family's diffusers pipeline class (its LoRA
    is saved for it); `processor`: whether the pipeline has a Qwen2-VL processor (the edit ones)."""

    def __init__(self, spec, device: torch.device, weight_dtype: torch.dtype, pipeline: str, processor: bool):
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLProcessor

        self.spec, self.device, self.weight_dtype, self.pipeline_class = spec, device, weight_dtype, pipeline
        root = spec.model.pretrained
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.tokenizer = Qwen2Tokenizer.from_pretrained(root, subfolder="tokenizer")
        self.processor = Qwen2VLProcessor.from_pretrained(root, subfolder="processor") if processor else None
        self.text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.vae = load_vae(spec, AutoencoderKLQwenImage, weight_dtype)  # the model's own, or spec.model.vae
        self.transformer = load_denoiser(spec, QwenImageTransformer2DModel, "transformer", weight_dtype)
        self.trainable = train_denoiser(self.transformer, spec, "transformer", pipeline, device,
                                        exclude=unused_lora_modules(self.transformer, spec.adapter.target_modules))
        config = self.vae.config
        self.latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(device)
        self.latents_std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(device)

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.text_encoder, "vae": self.vae}

    def pipeline(self):
        """The family's diffusers pipeline around these models (the transformer as it is being trained)."""
        import diffusers

        extra = {"processor": self.processor} if self.processor is not None else {}
        return getattr(diffusers, self.pipeline_class)(
            scheduler=self.scheduler, vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
            transformer=self.transformer, **extra)

    def sampling_pipeline(self):
        pipeline = self.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    # --- encoders -----------------------------------------------------------------------------

    def latents_encoder(self) -> Encoder:
        """The VAE's moments of [3, H, W] pixels; the same cache entries for all three families."""
        return Encoder("latents", model_identity(self.vae, vae_name(self.spec), self.vae.dtype), self.vae_moments)

    def text_identity(self, prompts, extra: list | None = None) -> str:
        """The text encoder's identity with what else decides its output: the pipeline's template and
        dropped prefix (`prompts`, the pipeline whose encoding the family calls) and `extra`."""
        root = self.spec.model.pretrained
        return model_identity(self.text_encoder, f"{root}/text_encoder", self.weight_dtype, extra=json.dumps(
            [prompts.prompt_template_encode, prompts.prompt_template_encode_start_idx, *(extra or [])]))

    @torch.no_grad()
    def vae_moments(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        stacked = to_device(torch.stack(pixels).unsqueeze(2), self.vae.device, self.vae.dtype)  # one video frame
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    def normalised(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, 1, H, W] VAE latents -> [B, C, H, W], normalised as the pipelines do."""
        return ((latents - self.latents_mean.to(latents.dtype)) / self.latents_std.to(latents.dtype))[:, :, 0]

    @staticmethod
    def mode(moments: torch.Tensor) -> torch.Tensor:
        """The VAE distribution's mode (its mean), as the pipelines encode reference images."""
        return moments.chunk(2, dim=1)[0]

    # --- loss ---------------------------------------------------------------------------------

    def loss(self, model: torch.nn.Module, target: torch.Tensor, references: list[torch.Tensor],
             text: dict[str, torch.Tensor], random: SampleRandom) -> torch.Tensor:
        """Flow matching on normalised target latents [B, C, H, W], each reference's [B, C, h, w]
        after the target's tokens (clean, no loss), and the text embeddings with their mask."""
        from diffusers import QwenImagePipeline

        pack = QwenImagePipeline._pack_latents
        batch_size, channels, height, width = target.shape
        noise, sigmas, noisy = flow_matching.noisy_latents(target, random)
        tokens = pack(noisy, batch_size, channels, height, width)
        sequence, shapes = [tokens], [(1, height // 2, width // 2)]
        for reference in references:
            reference_height, reference_width = reference.shape[2:]
            sequence.append(pack(reference, batch_size, channels, reference_height, reference_width))
            shapes.append((1, reference_height // 2, reference_width // 2))
        embeds, mask = text_inputs(text)
        prediction = model(
            hidden_states=torch.cat(sequence, dim=1), timestep=sigmas.to(target.dtype), guidance=None,
            encoder_hidden_states=embeds, encoder_hidden_states_mask=mask, img_shapes=[shapes] * batch_size,
            return_dict=False,
        )[0][:, :tokens.shape[1]]
        return flow_matching.loss(prediction, pack(noise - target, batch_size, channels, height, width))


def text_inputs(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(embeddings, mask or None): the padding columns no sample of the batch uses dropped (cached
    rows may carry extra), and no mask where no sample is padded, as the pipelines pass it."""
    mask = text["mask"]
    length = int(mask.sum(dim=1).max())
    mask = mask[:, :length]
    return text["prompt_embeds"][:, :length], None if bool(mask.all()) else mask


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

def architecture(**transformer: object) -> dict[str, Component]:
    """Qwen-Image's published components; `transformer`: config values of a later version (2511's zero_cond_t)."""
    return {
        "transformer": Component("transformer", "diffusers", "QwenImageTransformer2DModel",
                                 {**QWEN_IMAGE_TRANSFORMER, **transformer}),
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


def write_tokenizers(out_dir: Path, processor: bool = True) -> None:
    """The Qwen2 tokenizer stand-in and, for the edit pipelines, the Qwen2-VL processor (the published
    preprocessing's defaults)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = tiny_models.tiny_qwen2_tokenizer()
    tokenizer.save_pretrained(out_dir / "tokenizer")
    if processor:
        Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                         video_processor=Qwen2VLVideoProcessor()).save_pretrained(out_dir / "processor")


def write_tiny(out_dir: Path, pipeline: str, seed: int = 0, processor: bool = True, **transformer: object) -> Path:
    """A tiny Qwen-Image pipeline of class `pipeline`: a 1-block QwenImageTransformer2DModel (plus
    `transformer` config values), an 8x AutoencoderKLQwenImage, a 2-layer Qwen2.5-VL text encoder with a
    2-block vision tower and, with `processor`, the Qwen2-VL processor capped at 112x112 pixels."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
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
    components = {}
    if processor:  # the vision tower sees at most 112x112 pixels: 16 patches, 4 tokens after the 2x2 merge
        pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
        components["processor"] = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels),
                                                   tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(**pixels))
    transformer_model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), **transformer,
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    getattr(diffusers, pipeline)(scheduler=scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer_model, **components).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def meta_trainable(spec, models) -> None:
    """The planner's meta transformer made trainable as QwenImageParts does (the same LoRA modules)."""
    transformer = models["transformer"]
    diffusers_denoiser(transformer, spec.adapter, "transformer", pipeline=None, load_init=False,
                       exclude=unused_lora_modules(transformer, spec.adapter.target_modules))


def planning_forward(models, spec, make, autocast, dtype: torch.dtype, references: int, text_tokens: int
                     ) -> torch.Tensor:
    """QwenImageParts.loss's transformer call: the target's tokens then `references` reference images'
    at the training resolution, `text_tokens` of text embeddings with their mask."""
    transformer, vae = models["transformer"], models["vae"]
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae)
    tokens, width = (side // 2) ** 2, vae.config.z_dim * 4
    with autocast():
        prediction = transformer(
            hidden_states=make((batch, (1 + references) * tokens, width), dtype), timestep=make((batch,), dtype),
            guidance=None, encoder_hidden_states=make((batch, text_tokens, transformer.config.joint_attention_dim), dtype),
            encoder_hidden_states_mask=make((batch, text_tokens), torch.long),
            img_shapes=[[(1, side // 2, side // 2)] * (1 + references)] * batch, return_dict=False,
        )[0][:, :tokens]
    return mse(prediction, make((batch, tokens, width), dtype))
