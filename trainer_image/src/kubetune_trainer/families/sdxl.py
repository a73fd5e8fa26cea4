"""SDXL: LoRA (or full) fine-tuning of the UNet; two text encoders, size and crop conditioning.

Built from Stable Diffusion's parts (families.stable_diffusion.UNetDiffusion) with SDXL's own text
part, XLText.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.families import stable_diffusion as sd
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import train_denoiser
from kubetune_trainer.results.lora_keys import KOHYA_UNET
from kubetune_trainer.families.planning_forwards import CLIP_TOKENS, mse, vae_scale
from kubetune_trainer.families.components import CLIP_BIGG_TEXT, CLIP_L_TEXT, SD_VAE, Component

PIPELINE = "StableDiffusionXLPipeline"


def time_ids(crops, height: int, width: int) -> torch.Tensor:
    """SDXL's micro-conditioning per sample: original size, crop top-left, target size."""
    return torch.tensor([[*c.original_size, *c.top_left, height, width] for c in crops], dtype=torch.float32)


class XLText:
    """SDXL's text part: two CLIP text encoders side by side, the second's pooled output, and size
    and crop conditioning (time_ids)."""

    def __init__(self, root: str, device: torch.device, weight_dtype: torch.dtype):
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.device = device
        self.tokenizers = [CLIPTokenizer.from_pretrained(root, subfolder="tokenizer"),
                           CLIPTokenizer.from_pretrained(root, subfolder="tokenizer_2")]
        self.text_encoders = [
            CLIPTextModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype),
            CLIPTextModelWithProjection.from_pretrained(root, subfolder="text_encoder_2", torch_dtype=weight_dtype),
        ]

    def models(self) -> dict[str, torch.nn.Module]:
        return dict(zip(("text_encoder", "text_encoder_2"), self.text_encoders))

    @torch.no_grad()
    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Both encoders' penultimate hidden states side by side, plus the second one's pooled output."""
        hidden = []
        for tokenizer, encoder in zip(self.tokenizers, self.text_encoders):
            tokens = tokenizer(captions, padding="max_length", truncation=True,
                               max_length=tokenizer.model_max_length, return_tensors="pt")
            output = encoder(to_device(tokens.input_ids, encoder.device), output_hidden_states=True)
            hidden.append(output.hidden_states[-2])
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled": output[0]}

    def conditioning(self, batch: dict, text: dict[str, torch.Tensor]) -> dict:
        height, width = batch["pixel_values"].shape[-2:]
        ids = to_device(time_ids(batch["crops"], height, width), self.device, text["prompt_embeds"].dtype)
        return {"encoder_hidden_states": text["prompt_embeds"],
                "added_cond_kwargs": {"text_embeds": text["pooled"], "time_ids": ids}}


class StableDiffusionXL(ModelFamily):
    """Trains SDXL's UNet, whole or as a LoRA."""

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.sd = sd.UNetDiffusion(spec, device, weight_dtype, XLText, PIPELINE)
        self.trainable = train_denoiser(self.sd.unet, spec, "unet", PIPELINE, device)

    def frozen_models(self):
        return self.sd.frozen_models()

    def build_encoders(self) -> dict[str, Encoder]:
        return self.sd.encoders("StableDiffusionXL")  # part of every cached text entry's identity: keep it

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    def compute_loss(self, model, batch, random):
        return self.sd.loss(model, batch, self.encode_batch(batch), random)

    def sample_images(self, model, held_out, draw):
        return self.sd.sample_images(held_out, draw)

    def image_metrics(self, images, held_out, draw, clip):
        return self.sd.clip_metrics(images, held_out, draw, clip)


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
    cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
ARCHITECTURE = {
    "unet": Component("unet", "diffusers", "UNet2DConditionModel", SDXL_UNET),
    "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
    "text_encoder_2": Component("text_encoder_2", "transformers", "CLIPTextModelWithProjection", CLIP_BIGG_TEXT),
    "vae": Component("vae", "diffusers", "AutoencoderKL", {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025}),
}


def scheduler():
    """The Euler scheduler SDXL base ships with."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
    )


def write_tokenizers(out_dir: Path) -> None:
    for name in ("tokenizer", "tokenizer_2"):
        tiny_models.tiny_clip_tokenizer().save_pretrained(out_dir / name)


def tiny_sdxl_unet(seed: int = 0):
    """The SDXL UNet (text_time additional conditioning, linear projections) at toy width."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64, norm_num_groups=32,
    )


def write_tiny_sdxl(out_dir: Path, seed: int = 0) -> Path:
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = tiny_models.tiny_clip_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    pipeline = StableDiffusionXLPipeline(
        vae=tiny_models.tiny_vae(seed), text_encoder=tiny_models.tiny_clip_text_encoder(len(tokenizer), seed=seed),
        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer, unet=tiny_sdxl_unet(seed),
        scheduler=scheduler(),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's UNet call: both encoders' embeddings, the pooled one and the size conditioning."""
    unet, side = models["unet"], spec.resolution // vae_scale(models["vae"])
    batch = spec.training.batch_size
    noisy = make((batch, unet.config.in_channels, side, side), dtype)
    text = make((batch, CLIP_TOKENS, unet.config.cross_attention_dim), dtype)
    pooled = make((batch, models["text_encoder_2"].config.projection_dim), dtype)
    with autocast():
        prediction = unet(noisy, make((batch,), torch.long), encoder_hidden_states=text,
                          added_cond_kwargs={"text_embeds": pooled, "time_ids": make((batch, 6), dtype)}).sample
    return mse(prediction, noisy)


DEFINITION = FamilyDefinition(
    family=StableDiffusionXL,
    architecture=ARCHITECTURE,
    trained="unet",
    quantized="unet",
    forward=planning_forward,
    write_tiny=write_tiny_sdxl,
    pipeline=PIPELINE,
    scheduler=scheduler,
    write_tokenizers=write_tokenizers,
    kohya=KOHYA_UNET,
)
